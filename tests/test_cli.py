"""The command line lists, describes, verifies and deletes datasets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import yogastore
from yogastore.cli import main

SPEC = yogastore.ComponentSpec(shape=(8,), dtype="int16")


def test_cli_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    store.cache("d", "1", lambda: (np.full(8, i, np.int16) for i in range(100)), spec=SPEC)
    assert main(["--store", str(tmp_path), "list"]) == 0
    assert "d\t1\t100 records" in capsys.readouterr().out
    assert main(["--store", str(tmp_path), "info", "d", "1"]) == 0
    assert '"num_records": 100' in capsys.readouterr().out
    assert main(["--store", str(tmp_path), "verify", "d", "1"]) == 0
    assert "100 records OK" in capsys.readouterr().out
    assert main(["--store", str(tmp_path), "delete", "d", "1"]) == 0
    assert main(["--store", str(tmp_path), "info", "d", "1"]) == 1
    assert "no dataset 'd'" in capsys.readouterr().err


def test_verify_checks_chunks_this_process_already_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    ref = store.cache("d", "1", lambda: (np.full(8, i, np.int16) for i in range(100)), spec=SPEC)
    assert len(list(ref.stream(shuffle=False))) == 100  # every chunk verified and remembered
    info = ref.manifest.chunks[1]
    data = bytearray(store.backend.get(info.key))
    data[-1] ^= 0xFF
    store.backend.put(info.key, bytes(data))
    assert main(["--store", str(tmp_path), "verify", "d", "1"]) == 1
    err = capsys.readouterr().err
    assert "chunk 1 " in err and "checksum mismatch" in err and "1 of" in err


def test_verify_checks_what_reads_check_first_the_index_checksum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest whose index checksum of a chunk lies fails verify as it fails reads."""
    import json

    store = yogastore.Store(tmp_path, chunk_bytes=256)
    ref = store.cache("d", "1", lambda: (np.full(8, i, np.int16) for i in range(100)), spec=SPEC)
    manifest = json.loads(ref.manifest.to_json())
    rows = manifest["chunks"]
    row = rows[3] if isinstance(rows[3], dict) else None
    assert row is not None and "index_checksum" in row
    good = row["index_checksum"]
    row["index_checksum"] = good[:-1] + ("0" if good[-1] != "0" else "1")  # still well formed
    store.backend.put("d/1/manifest.json", json.dumps(manifest).encode())
    assert main(["--store", str(tmp_path), "verify", "d", "1"]) == 1
    err = capsys.readouterr().err
    assert "chunk 3 " in err and "index checksum" in err
    with pytest.raises(yogastore.CorruptCacheError, match="index"):
        list(yogastore.Store(tmp_path).open("d", "1").stream(shuffle=False))


def test_coordination_option_is_for_object_stores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    store.cache("d", "1", lambda: (np.full(8, i, np.int16) for i in range(10)), spec=SPEC)
    for argv in (["gc"], ["delete", "d", "1"]):
        assert main(["--store", str(tmp_path), *argv, "--coordination", "single-writer"]) == 1
        assert "--coordination is an option of object stores" in capsys.readouterr().err
    assert main(["--store", str(tmp_path), "info", "d", "1", "--coordination", "probe"]) == 1
    assert "unrecognized arguments: --coordination" in capsys.readouterr().err
    assert [(i.dataset_id, i.version) for i in store.list()] == [("d", "1")]
