"""A remote chunk source used on both sides of ``os.fork``."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore as y
from tests.backends.s3_support import SPEC, blob, moto_bucket, records
from yogastore.format import ColumnBatch
from yogastore.read.remote import RemoteChunkSource

pytestmark = [pytest.mark.s3, pytest.mark.multiprocess, pytest.mark.timeout(90)]

BUCKET = "fork-test"
N = 400


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_bucket(monkeypatch, BUCKET) as name:
        yield name


def decode(ref: y.DatasetRef, columns: list[ColumnBatch]) -> list[tuple[int, bytes]]:
    """Return (id, img) of every gathered record."""
    paths = list(ref.schema.paths)
    ids, imgs = columns[paths.index("id")], columns[paths.index("img")]
    return [(int(ids.record(i)), bytes(imgs.record(i))) for i in range(len(ids))]


def expected(indices: list[int]) -> list[tuple[int, bytes]]:
    return [(i, blob(i)) for i in indices]


def _child(ref: y.DatasetRef, source: RemoteChunkSource, indices: list[int], conn: Any) -> None:
    try:
        columns = source.gather(np.array(indices, dtype=np.int64))
        conn.send(("ok", decode(ref, columns), source.stats.requests))
    except BaseException as err:
        conn.send(("error", repr(err), 0))


def test_source_used_after_fork(bucket: str, tmp_path: Path) -> None:
    """The child reads correctly (no inherited pool, lock or LMDB handle); the parent too."""
    store = y.Store(
        f"s3://{BUCKET}/p", chunk_bytes=64 << 10, lock_settle=0.0, cache_dir=tmp_path / "cache"
    )
    ref = store.cache("ds", "1", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    source = ref.make_source()
    assert isinstance(source, RemoteChunkSource)
    assert source.cache is not None
    first = list(range(0, 50))
    assert decode(ref, source.gather(np.array(first, dtype=np.int64))) == expected(first)
    indices = [N - 1, 7, N // 2, 123, 124]  # chunks the parent holds and ones it does not
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    # A parent thread is inside the source when the fork happens.
    with source._lock:
        child = ctx.Process(target=_child, args=(ref, source, indices, child_end))
        child.start()
    try:
        assert parent_end.poll(30), "the child hung"
        status, got, requests = parent_end.recv()
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    assert status == "ok", got
    assert got == expected(indices)
    assert requests > 0  # the child fetched what it needed itself
    assert child.exitcode == 0
    # The parent's pools, chunks and disk cache still work, and the cache has its entries.
    assert decode(ref, source.gather(np.array(indices, dtype=np.int64))) == expected(indices)
    again = store.open("ds", "1").make_source()
    before = again.stats.bytes_fetched
    assert decode(ref, again.gather(np.array(first, dtype=np.int64))) == expected(first)
    assert again.stats.bytes_fetched == before and again.stats.cache_hits > 0
    source.close()
    again.close()
