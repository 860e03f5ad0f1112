"""A local store shared by live processes: no leaked readers, no stale views, fork children."""

from __future__ import annotations

import multiprocessing
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
from storage_backends import lmdb_env

SPEC = {"x": yogastore.ComponentSpec(shape=(3,), dtype="int64")}

pytestmark = pytest.mark.multiprocess


def records(n: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"x": np.array([i, i + offset, 7], np.int64)} for i in range(n)]


def values(ref: yogastore.DatasetRef) -> list[int]:
    return [int(e["x"][1]) for e in ref.stream(shuffle=False)]


def own_readers(env_dir: Path) -> int:
    """Count reader slots of the environment held by live transactions of this process."""
    entry = lmdb_env.lookup(str(env_dir), str(env_dir / "data.mdb"))
    assert entry is not None
    rows = [line.split() for line in entry.env.readers().splitlines()[1:]]
    return sum(1 for row in rows if len(row) == 3 and row[0] == str(os.getpid()) and row[2] != "-")


# A process that writes one key into the version's environment per line it reads.
WRITER = textwrap.dedent(
    """
    import sys
    from storage_backends.lmdb_backend import LmdbBackend
    backend = LmdbBackend(sys.argv[1])
    for line in sys.stdin:
        backend.put("d/1/c-leftover-" + line.strip(), b"x" * 100)
        print("ok", flush=True)
    """
)


def test_polling_open_during_a_build_does_not_leak_readers(tmp_path: Path) -> None:
    """600 polls (more than the 512 reader slots), each after another process committed."""
    store = yogastore.Store(tmp_path)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        for i in range(600):
            writer.stdin.write(f"{i}\n")
            writer.stdin.flush()
            assert writer.stdout.readline().strip() == "ok"
            with pytest.raises(yogastore.DatasetNotFoundError):
                store.open("d", "1")
            assert own_readers(tmp_path / "d" / "1") <= 1
    finally:
        writer.stdin.close()
        writer.wait(30)
    assert writer.returncode == 0
    # The build (another process) and its leftover sweep succeed; the poller sees it.
    build = textwrap.dedent(
        """
        import sys, numpy as np, yogastore
        spec = {"x": yogastore.ComponentSpec(shape=(3,), dtype="int64")}
        items = [{"x": np.array([i, i, 7], np.int64)} for i in range(50)]
        yogastore.Store(sys.argv[1], chunk_bytes=256).cache("d", "1", lambda: items, spec=spec)
        """
    )
    subprocess.run([sys.executable, "-c", build, str(tmp_path)], check=True)
    assert values(store.open("d", "1")) == list(range(50))
    assert yogastore.Store(tmp_path).backend.list("d/1/") == sorted(
        ["d/1/manifest.json", *(c.key for c in store.open("d", "1").manifest.chunks)]
    )


def test_views_stay_valid_and_pin_only_their_snapshot(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    ref = store.cache("d", "1", lambda: records(40), spec=SPEC)
    chunk = ref.manifest.chunks[0].key
    view = store.backend.get(chunk)
    held = bytes(view)
    for i in range(20):  # commits after the view was taken
        store.backend.put(f"d/1/other-{i}", b"y" * 10)
        assert store.backend.exists(f"d/1/other-{i}")
    assert bytes(view) == held
    assert own_readers(tmp_path / "d" / "1") >= 1
    del view
    store.backend.put("d/1/one-more", b"z")
    assert store.backend.exists("d/1/one-more")
    assert own_readers(tmp_path / "d" / "1") <= 1


REBUILD = textwrap.dedent(
    """
    import sys, numpy as np, yogastore
    spec = {"x": yogastore.ComponentSpec(shape=(3,), dtype="int64")}
    store = yogastore.Store(sys.argv[1], chunk_bytes=256)
    store.delete("d", "1")
    if sys.argv[2] != "0":
        n = int(sys.argv[2])
        items = [{"x": np.array([i, i + 1000, 7], np.int64)} for i in range(n)]
        store.cache("d", "1", lambda: items, spec=spec)
    """
)


def test_long_lived_process_sees_other_processes_delete_and_rebuild(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    first = store.cache("d", "1", lambda: records(30), spec=SPEC)
    assert values(first) == list(range(30))
    subprocess.run([sys.executable, "-c", REBUILD, str(tmp_path), "45"], check=True)
    again = store.open("d", "1")
    assert again.num_records == 45
    assert values(again) == [i + 1000 for i in range(45)]

    def never() -> list[dict[str, Any]]:
        raise AssertionError("cache() rebuilt although another process had built it")

    assert store.cache("d", "1", never, spec=SPEC).manifest.build_id == again.manifest.build_id
    subprocess.run([sys.executable, "-c", REBUILD, str(tmp_path), "0"], check=True)
    with pytest.raises(yogastore.DatasetNotFoundError):
        store.open("d", "1")
    assert store.list() == []


def _child_reads(args: tuple[str, Any]) -> list[int]:
    root, ref = args
    mine = values(yogastore.Store(root).open("d", "1"))
    inherited = values(ref)  # the parent's DatasetRef, used in the child
    assert mine == inherited
    return mine


def test_fork_children_read_what_the_parent_opened(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    ref = store.cache("d", "1", lambda: records(60), spec=SPEC)
    assert values(ref) == list(range(60))  # the parent holds views and a snapshot
    parent_view = store.backend.get(ref.manifest.chunks[0].key)
    before = bytes(parent_view)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        results = pool.map(_child_reads, [(str(tmp_path), ref)] * 24)
    assert results == [list(range(60))] * 24
    # The parent's views, snapshot and reader slot survived its children.
    assert bytes(parent_view) == before
    assert values(store.open("d", "1")) == list(range(60))
    assert own_readers(tmp_path / "d" / "1") >= 1


def test_fork_child_may_write_and_the_parent_sees_it(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    store.cache("d", "1", lambda: records(10), spec=SPEC)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(
        target=lambda: yogastore.Store(tmp_path, chunk_bytes=256).cache(
            "d", "2", lambda: records(5, 3), spec=SPEC
        )
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert values(store.open("d", "2")) == [i + 3 for i in range(5)]
    with pytest.raises(lmdb.Error, match="already open"):
        lmdb.open(str(tmp_path / "d" / "1"))  # py-lmdb's own guard still holds here
