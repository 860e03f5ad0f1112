"""Build once across processes; a builder killed mid-build leaves nothing readable."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore

pytestmark = pytest.mark.multiprocess

SPEC = {
    "x": yogastore.ComponentSpec(shape=(64,), dtype="uint8"),
    "i": yogastore.ComponentSpec(shape=(), dtype="int64"),
}
N = 3000


def _records(count_file: str, slow: float, marker: str | None = None) -> Iterator[dict[str, Any]]:
    with open(count_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    for i in range(N):
        if marker is not None and i == N // 2:
            Path(marker).write_text("half")
            time.sleep(600)  # the test kills us here
        if slow and i % 500 == 0:
            time.sleep(slow)
        yield {"x": np.full(64, i % 251, np.uint8), "i": np.int64(i)}


def _build_and_read(root: str, count_file: str, barrier: Any, out: Any) -> None:
    barrier.wait(timeout=60)
    store = yogastore.Store(root, chunk_bytes=16 << 10, lock_timeout=120)
    ref = store.cache("shared", "1", lambda: _records(count_file, slow=0.05), spec=SPEC)
    ids = [int(e["i"]) for e in ref.stream(seed=7)]
    out.put((os.getpid(), ref.manifest.build_id, ids))


def test_four_processes_build_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    count_file = tmp_path / "calls.txt"
    barrier = ctx.Barrier(4)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_build_and_read, args=(str(tmp_path / "store"), str(count_file), barrier, out)
        )
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(count_file.read_text().split()) == 1, "the dataset function ran exactly once"
    assert len({r[1] for r in results}) == 1, "all processes read the same build"
    first = results[0][2]
    assert sorted(first) == list(range(N))
    assert all(r[2] == first for r in results), "all processes read identical data"


def _build_then_hang(root: str, count_file: str, marker: str) -> None:
    store = yogastore.Store(root, chunk_bytes=16 << 10)
    store.cache("crashy", "1", lambda: _records(count_file, slow=0, marker=marker), spec=SPEC)


def test_builder_killed_mid_build_leaves_nothing_and_rebuilds(tmp_path: Path) -> None:
    root = tmp_path / "store"
    marker = tmp_path / "half.txt"
    count_file = tmp_path / "calls.txt"
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_build_then_hang, args=(str(root), str(count_file), str(marker)))
    proc.start()
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.is_alive() and time.monotonic() < deadline, "builder never reached half-way"
        time.sleep(0.05)
    store = yogastore.Store(root, lock_timeout=0.2)
    with pytest.raises(yogastore.LockTimeoutError):
        store.cache("crashy", "1", lambda: _records(str(count_file), slow=0), spec=SPEC)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL
    leftovers = store.backend.list("crashy/1/")
    assert leftovers, "the dead builder had written chunks"
    assert "crashy/1/manifest.json" not in leftovers
    with pytest.raises(yogastore.DatasetNotFoundError):
        store.open("crashy", "1")
    assert store.list() == []

    store = yogastore.Store(root, lock_timeout=30)
    ref = store.cache("crashy", "1", lambda: _records(str(count_file), slow=0), spec=SPEC)
    assert ref.num_records == N
    got = sorted((int(e["i"]), int(e["x"][0])) for e in ref.stream(seed=1))
    assert got == [(i, i % 251) for i in range(N)]
    keys = store.backend.list("crashy/1/")
    assert all(k.endswith("manifest.json") or ref.manifest.build_id in k for k in keys), (
        "no chunk of the dead build survives"
    )
