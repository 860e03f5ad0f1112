"""Several processes against one S3 endpoint (moto server on 127.0.0.1).

Build once across processes, take over from a builder killed mid-build, and
per-rank bytes fetched when ranks read at the same time through a shared disk
cache.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import yogastore as y
from tests.backends.s3_support import (
    SPEC,
    blob,
    build_worker,
    check_batch,
    counted_records,
    read_worker,
    records,
    shared_moto_bucket,
    slow_builder,
)
from yogastore.format.blocks import block_size

pytestmark = [pytest.mark.s3, pytest.mark.multiprocess, pytest.mark.timeout(180)]

CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> str:
    return shared_moto_bucket(monkeypatch, "mp")


def collect(queue: Any, processes: list[Any], timeout: float = 120) -> list[Any]:
    """Return each child's result; fail on a child error or a hang."""
    results = []
    deadline = time.monotonic() + timeout
    try:
        for _ in processes:
            status, value = queue.get(timeout=max(deadline - time.monotonic(), 1))
            assert status == "ok", value
            results.append(value)
        for p in processes:
            p.join(max(deadline - time.monotonic(), 1))
            assert p.exitcode == 0
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
    return results


def test_four_processes_build_once(bucket: str, tmp_path: Path) -> None:
    counter = tmp_path / "calls.txt"
    n = 200
    queue = CTX.Queue()
    barrier = CTX.Barrier(4)
    url = f"s3://{bucket}/shared"
    processes = [
        CTX.Process(target=build_worker, args=(queue, barrier, url, str(counter), n))
        for _ in range(4)
    ]
    for p in processes:
        p.start()
    results = collect(queue, processes)
    assert len(counter.read_text().splitlines()) == 1  # the dataset function ran once
    assert len({r["build_id"] for r in results}) == 1
    assert all(r["ids_ok"] for r in results)
    store = y.Store(url)
    assert not any(k.endswith(".lock") for k in store.backend.list(""))


def test_killed_builder_is_taken_over(bucket: str, tmp_path: Path) -> None:
    counter = tmp_path / "calls.txt"
    url = f"s3://{bucket}/crash"
    n = 300
    builder = CTX.Process(target=slow_builder, args=(url, str(counter), n))
    builder.start()
    store = y.Store(url, chunk_bytes=32 << 10, lock_settle=0.0)
    try:
        deadline = time.monotonic() + 60
        # Wait until the doomed build holds the lock and has uploaded chunks.
        while not [k for k in store.backend.list("ds/1/") if "/c-" in k]:
            assert time.monotonic() < deadline, "the builder never uploaded a chunk"
            assert builder.is_alive()
            time.sleep(0.05)
        assert store.backend.exists("ds/1.lock")
        os.kill(builder.pid, signal.SIGKILL)  # type: ignore[arg-type]
        builder.join(10)
    finally:
        if builder.is_alive():
            builder.kill()
    orphans = [k for k in store.backend.list("ds/1/") if "/c-" in k]
    started = time.monotonic()
    ref = store.cache("ds", "1", lambda: counted_records(str(counter), n), spec=SPEC)
    waited = time.monotonic() - started
    assert waited >= 1.0  # the dead builder's 1.5 s lease had to run out first
    assert len(counter.read_text().splitlines()) == 2
    ids: list[int] = []
    for batch in ref.stream(shuffle=True).batches(50):
        ids += check_batch(batch)
    assert sorted(ids) == list(range(n))
    keys = store.backend.list("")
    assert not set(orphans) & set(keys)  # the dead build's chunks are gone, never read
    assert all(ref.manifest.build_id in k for k in keys if "/c-" in k)
    assert "ds/1.lock" not in keys


def test_ranks_read_their_share_concurrently(bucket: str, tmp_path: Path) -> None:
    n, num_shards = 800, 4
    url = f"s3://{bucket}/read"
    ref = y.Store(url, chunk_bytes=64 << 10, lock_settle=0.0).cache(
        "ds", "1", lambda: records(n), spec=SPEC, progress=y.NullProgress()
    )
    share = ref.nbytes / num_shards
    min_record_bytes = min(len(blob(i)) for i in range(n)) + 16
    queue = CTX.Queue()
    barrier = CTX.Barrier(num_shards)
    cache_root = str(tmp_path / "shared-cache")
    processes = [
        CTX.Process(target=read_worker, args=(queue, barrier, url, rank, num_shards, cache_root))
        for rank in range(num_shards)
    ]
    for p in processes:
        p.start()
    results = collect(queue, processes)
    for shuffle in ("block", "global"):
        first = [r[f"{shuffle}-0"] for r in results]
        again = [r[f"{shuffle}-1"] for r in results]
        ratios = [s["bytes_fetched"] / share for s in first]
        print(f"{shuffle}: epoch 0 bytes fetched / share per rank {[round(x, 4) for x in ratios]}")
        # A global shuffle reads records one by one: each range widens to whole
        # checksum blocks, on average about one block per record.
        widen = 0.0 if shuffle == "block" else block_size(64 << 10) / min_record_bytes
        assert max(ratios) <= 1.1 + widen
        for epoch in (first, again):
            ids = sorted(i for s in epoch for i in s["ids"])
            assert ids == list(range(n))  # no record lost or read twice
        # Epoch 1 reads other ranks' records of epoch 0: the shared cache has them.
        assert all(s["bytes_fetched"] <= 0.02 * share for s in again)
        assert all(s["cache_hits"] > 0 for s in again)
    # A rank reading again in this process hits the disk cache only.
    stream = y.Store(url, cache_dir=os.path.join(cache_root, "global")).open("ds", "1")
    again_stream = stream.stream(2, num_shards, shuffle=y.Shuffle.GLOBAL, seed=11, epoch=1)
    for batch in again_stream.batches(32):
        check_batch(batch)
    assert again_stream.stats()["bytes_fetched"] == 0
