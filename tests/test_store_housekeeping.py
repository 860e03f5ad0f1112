"""Housekeeping: list, du, gc and delete see only yogastore's own versions, survive a damaged
one, and the command line reports every failure as one error line with exit code 1."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

import yogastore
from yogastore.cli import main

SPEC = {
    "x": yogastore.ComponentSpec(shape=(16,), dtype="int32"),
    "y": yogastore.ComponentSpec(shape=(), dtype="int64"),
}


def records(n: int) -> list[dict[str, Any]]:
    return [{"x": np.full(16, i, np.int32), "y": np.int64(i)} for i in range(n)]


def build(root: Path, dataset_id: str = "d", version: str = "1", n: int = 30) -> None:
    store = yogastore.Store(root, chunk_bytes=512)
    store.cache(dataset_id, version, lambda: records(n), spec=SPEC)
    store.backend.close()


def read_all(root: Path, dataset_id: str = "d", version: str = "1") -> list[int]:
    ref = yogastore.Store(root).open(dataset_id, version)
    return [int(e["y"]) for e in ref.stream(shuffle=False)]


def foreign_env(path: Path, items: dict[bytes, bytes]) -> None:
    """Another program's LMDB environment (plain py-lmdb, nothing of yogastore)."""
    path.mkdir(parents=True)
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:
        for key, value in items.items():
            txn.put(key, value)
    env.close()


def foreign_items(path: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        items = {bytes(k): bytes(v) for k, v in txn.cursor()}
    env.close()
    return items


def test_other_programs_lmdb_files_are_never_listed_collected_or_deleted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    build(root)
    # Two levels down, as a version would be: an app's database, and one whose
    # keys look partly like ours (a manifest beside keys we never write).
    foreign_env(root / "app" / "db", {b"user": b"precious"})
    foreign_env(root / "mixed" / "1", {b"manifest.json": b"{}", b"notes": b"mine"})
    foreign_env(root / "d" / "2" / "sub", {b"c-abc-000001": b"deeper than a version"})
    store = yogastore.Store(root)
    assert store.versions() == [("d", "1")]
    assert [(e.dataset_id, e.version) for e in store.list()] == [("d", "1")]
    assert store.gc() == []
    with pytest.raises(yogastore.InvalidArgumentError, match="did not write"):
        store.delete("app", "db")
    with pytest.raises(yogastore.InvalidArgumentError, match="did not write"):
        store.delete("mixed", "1")
    assert main(["--store", str(root), "gc"]) == 0
    assert "0 versions cleaned" in capsys.readouterr().out
    assert main(["--store", str(root), "du"]) == 0
    assert "app/db" not in capsys.readouterr().out
    store.backend.close()  # py-lmdb opens a file once per process
    assert foreign_items(root / "app" / "db") == {b"user": b"precious"}
    assert foreign_items(root / "mixed" / "1") == {b"manifest.json": b"{}", b"notes": b"mine"}
    assert foreign_items(root / "d" / "2" / "sub") == {b"c-abc-000001": b"deeper than a version"}
    assert read_all(root) == list(range(30))


def replace_with_damaged_copy(data_file: Path) -> None:
    """Zero both meta pages, as a new file (the way a bad copy or restore lands)."""
    damaged = bytearray(data_file.read_bytes())
    damaged[: 2 * 4096] = bytes(2 * 4096)
    tmp = data_file.with_name("data.tmp")
    tmp.write_bytes(damaged)
    os.replace(tmp, data_file)


def test_a_damaged_version_is_skipped_by_list_du_gc_and_removed_by_delete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    build(root, version="1")
    build(root, version="2")
    yogastore.Store(root).backend.put("e/1/c-dead0000-000000", b"z" * 100)  # a dead build
    damaged = root / "d" / "1" / "data.mdb"
    replace_with_damaged_copy(damaged)
    store = yogastore.Store(root)
    with caplog.at_level(logging.WARNING):
        assert [e.version for e in store.list()] == ["2"]
    assert str(damaged) in caplog.text and "damaged" in caplog.text
    assert store.versions() == [("d", "2"), ("e", "1")]
    assert [(e.dataset_id, e.committed) for e in store.gc()] == [("e", False)]
    for command in ("list", "du", "gc"):
        assert main(["--store", str(root), command]) == 0, command
    assert "d\t2\t30 records" in capsys.readouterr().out
    assert main(["--store", str(root), "verify", "d", "1"]) == 1
    assert str(damaged) in capsys.readouterr().err
    # The remedy the messages give works: delete removes it without opening it.
    assert main(["--store", str(root), "delete", "d", "1"]) == 0
    assert not (root / "d" / "1").exists() and not (root / "d" / "1.lock").exists()
    assert read_all(root, version="2") == list(range(30))
    with pytest.raises(yogastore.DatasetNotFoundError):
        store.delete("d", "1")


def test_gc_and_delete_remove_the_empty_dataset_folder(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=512)
    store.backend.put("e/1/c-dead0000-000000", b"z" * 100)  # a dead build's chunk
    store.cache("e", "2", lambda: records(5), spec=SPEC)
    store.delete("e", "2")
    assert (tmp_path / "e").is_dir()  # version 1 is still there
    assert [(e.dataset_id, e.version) for e in store.gc()] == [("e", "1")]
    assert not (tmp_path / "e").exists()
    assert store.versions() == [] and store.gc() == []
    # Asking whether a version is being built leaves nothing behind either.
    assert not store.building("f", "1")
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize(
    ("dataset_id", "version"),
    [("é" * 101, "1"), ("d", "é" * 101), ("d", "x" * 201), ("😀" * 51, "1")],
    ids=["id-202-bytes", "version-202-bytes", "ascii-201", "emoji-204-bytes"],
)
def test_names_are_limited_in_utf8_bytes(tmp_path: Path, dataset_id: str, version: str) -> None:
    store = yogastore.Store(tmp_path)
    calls = {
        "cache": lambda: store.cache(dataset_id, version, lambda: records(3), spec=SPEC),
        "open": lambda: store.open(dataset_id, version),
        "delete": lambda: store.delete(dataset_id, version),
        "building": lambda: store.building(dataset_id, version),
    }
    for what, call in calls.items():
        with pytest.raises(yogastore.InvalidArgumentError, match="bytes in UTF-8"):
            call()
        assert not tmp_path.exists() or os.listdir(tmp_path) == [], what


def test_longest_names_fit_a_file_system_path_component(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=512)
    name, version = "é" * 100, "ü" * 100  # 200 bytes each; the lock file adds ".lock"
    store.cache(name, version, lambda: records(4), spec=SPEC)
    assert [int(e["y"]) for e in store.open(name, version).stream(shuffle=False)] == [0, 1, 2, 3]
    assert store.versions() == [(name, version)]
    store.delete(name, version)
    assert store.versions() == []


def test_duplicated_component_index_is_named_in_the_error(tmp_path: Path) -> None:
    build(tmp_path)
    store = yogastore.Store(tmp_path)
    manifest = json.loads(bytes(store.backend.get("d/1/manifest.json")))
    leaves = manifest["schema"]["structure"]["items"]
    leaves[1]["index"] = leaves[0]["index"]
    store.backend.put("d/1/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(yogastore.CorruptCacheError, match="twice"):
        store.open("d", "1")


# Holds a version's build lock, as a builder that has not committed yet does.
HOLDER = textwrap.dedent(
    """
    import sys
    from storage_backends.lmdb_backend import LmdbBackend
    backend = LmdbBackend(sys.argv[1])
    with backend.lock("d/1"):
        backend.put("d/1/c-building0-000000", b"x" * 100)
        print("holding", flush=True)
        sys.stdin.read()
    """
)


def test_info_and_verify_during_a_build_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "holding"
        for command in ("info", "verify"):
            assert main(["--store", str(tmp_path), command, "d", "1"]) == 1
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1, err
            assert "build is in progress" in err, err
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert main(["--store", str(tmp_path), "info", "d", "1"]) == 1
    assert "build is in progress" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "required: command"),
        (["frob"], "invalid choice"),
        (["info", "d"], "required: version"),
        (["list", "extra"], "unrecognized arguments: extra"),
        (["info", "-rf", "1"], "goes after '--'"),
    ],
    ids=["no-command", "unknown-command", "missing-version", "extra-argument", "dash-id"],
)
def test_usage_errors_are_one_error_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(["--store", str(tmp_path), *argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert expected in captured.err and "--help" in captured.err


def test_ids_starting_with_a_dash_after_double_dash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(tmp_path, dataset_id="-rf", n=5)
    assert main(["--store", str(tmp_path), "info", "--", "-rf", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset_id"] == "-rf"
    assert main(["--store", str(tmp_path), "delete", "--", "-rf", "1"]) == 0
    assert not (tmp_path / "-rf").exists()


def test_store_that_is_a_file_or_empty_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0\n")
    for store, expected in ((str(a_file), "not a directory"), ("", "empty")):
        for command in ("list", "gc"):
            assert main(["--store", store, command]) == 1
            captured = capsys.readouterr()
            assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
            assert expected in captured.err
    with pytest.raises(yogastore.InvalidArgumentError, match="not a directory"):
        yogastore.Store(a_file)
    assert a_file.read_text() == "root:x:0:0\n"


def test_console_script_usage_error_exit_code(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "yogastore", "--store", str(tmp_path), "info"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert "usage:" not in proc.stderr
