"""Leftovers of failed or killed builds: delete removes every trace, gc every dead build."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore
from yogastore.cli import main

SPEC = {"x": yogastore.ComponentSpec(shape=(256,), dtype="uint8")}


def records(n: int) -> list[dict[str, Any]]:
    return [{"x": np.full(256, i % 256, np.uint8)} for i in range(n)]


# Builds a version and is killed (SIGKILL) after writing a few chunks, as a
# crashed builder would: chunks on disk, no manifest, nothing cleaned up.
KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import yogastore
    def records():
        for i in range(10_000):
            if i == 300:
                os.kill(os.getpid(), signal.SIGKILL)
            yield {"x": np.full(256, i % 256, np.uint8)}
    spec = {"x": yogastore.ComponentSpec(shape=(256,), dtype="uint8")}
    store = yogastore.Store(sys.argv[1], chunk_bytes=4096)
    store.cache(sys.argv[2], sys.argv[3], records, spec=spec, progress=yogastore.NullProgress())
    """
)


def killed_build(root: str | Path, dataset_id: str, version: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, str(root), dataset_id, version],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr


# Holds a version's build lock (as a builder does) until its stdin closes.
HOLDER = textwrap.dedent(
    """
    import sys
    from storage_backends.lmdb_backend import LmdbBackend
    backend = LmdbBackend(sys.argv[1])
    with backend.lock("d/3"):
        backend.put("d/3/c-inprogress-000000", b"x" * 1000)
        print("holding", flush=True)
        sys.stdin.read()
    """
)


def test_delete_removes_a_killed_build(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=4096)
    killed_build(tmp_path, "d", "1")
    assert store.backend.list("d/1/"), "the killed build left chunks"
    assert store.list() == []
    store.delete("d", "1")
    assert not (tmp_path / "d" / "1").exists()
    assert not (tmp_path / "d" / "1.lock").exists()
    with pytest.raises(yogastore.DatasetNotFoundError):
        store.delete("d", "1")
    assert not (tmp_path / "d" / "1.lock").exists()
    # A committed version: manifest, chunks, directory and lock all go.
    store.cache("d", "2", lambda: records(50), spec=SPEC)
    assert (tmp_path / "d" / "2.lock").exists()
    store.delete("d", "2")
    assert not (tmp_path / "d").exists()  # the dataset's folder went with its last version


def test_gc_removes_dead_builds_and_leaves_live_ones(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=4096)
    killed_build(tmp_path, "d", "2")  # dead build, no manifest
    good = store.cache("d", "1", lambda: records(40), spec=SPEC)
    store.backend.put("d/1/c-dead-build-000000", b"y" * 5000)  # a dead build's chunk
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert store.building("d", "3") and not store.building("d", "1")
        removed = store.gc()
        assert store.backend.list("d/3/") == ["d/3/c-inprogress-000000"]  # a build in progress
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert {(e.dataset_id, e.version, e.committed) for e in removed} == {
        ("d", "2", False),
        ("d", "1", True),
    }
    one = next(e for e in removed if e.version == "1")
    assert one.keys == 1 and one.bytes == 5000
    assert not (tmp_path / "d" / "2").exists() and not (tmp_path / "d" / "2.lock").exists()
    assert store.backend.list("d/1/") == sorted(
        ["d/1/manifest.json", *(c.key for c in good.manifest.chunks)]
    )
    assert [int(e["x"][0]) for e in store.open("d", "1").stream(shuffle=False)] == [
        i % 256 for i in range(40)
    ]
    # Once the builder is gone, its leftovers are a dead build too.
    assert [(e.version, e.committed) for e in store.gc()] == [("3", False)]
    assert store.gc() == []


def test_cli_store_after_command_du_gc_info_delete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path / "s")
    store = yogastore.Store(root, chunk_bytes=4096)
    store.cache("d", "1", lambda: records(60), spec=SPEC)
    killed_build(root, "d", "2")
    assert main(["list", "--store", root]) == 0
    assert capsys.readouterr().out.startswith("d\t1\t60 records")
    assert main(["info", "d", "1", "--store", root]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["location"] == str(Path(root).resolve() / "d" / "1")
    assert info["bytes_on_disk"] >= info["bytes"] > 60 * 256
    assert info["built_at"].startswith("20") and info["build_in_progress"] is False
    assert main(["du", "--store", root]) == 0
    out = capsys.readouterr().out
    assert "d/1" in out and "d/2" in out and "total" in out
    assert main(["gc", "--store", root]) == 0
    assert "uncommitted build of d/2" in capsys.readouterr().out
    assert main(["--store", root, "delete", "d", "1"]) == 0
    assert not (Path(root) / "d" / "1").exists() and not (Path(root) / "d" / "1.lock").exists()
    missing = str(tmp_path / "nowhere")
    assert main(["list", "--store", missing]) == 0
    assert f"no store at {missing}" in capsys.readouterr().out
    assert not Path(missing).exists()


def test_console_script(tmp_path: Path) -> None:
    script = shutil.which("yogastore", path=str(Path(sys.executable).parent))
    assert script is not None, "the yogastore console script is not installed (pip install -e .)"
    proc = subprocess.run(
        [script, "list", "--store", str(tmp_path / "none")], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "no store at" in proc.stdout
    proc = subprocess.run(
        [script, "info", "d", "1", "--store", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 1 and proc.stderr.startswith("error: no dataset")
    assert "Traceback" not in proc.stderr
