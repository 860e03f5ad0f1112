"""A tf.data dataset holds nothing of its stream between iterations.

``from_generator`` keeps its generators (and so their stream) for the life of
the process; a training loop that makes a dataset per epoch must not gain read
threads, buffers or chunk views per epoch.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import yogastore as y  # noqa: E402
from tests.backends.s3_support import SPEC, moto_bucket, records  # noqa: E402

BUCKET = "yoga-release"


def read_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("yoga-get", "yoga-ahead"))]


def ids_of(ds: object) -> list[int]:
    return [int(i) for batch in ds for i in batch["id"].numpy()]  # type: ignore[attr-defined]


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_bucket(monkeypatch, BUCKET) as name:
        yield name


@pytest.mark.s3
def test_object_store_datasets_leave_no_read_threads(bucket: str, tmp_path: Path) -> None:
    store = y.Store(
        f"s3://{bucket}/c", chunk_bytes=16 << 10, cache_dir=tmp_path / "rc", lock_settle=0.0
    )
    ref = store.cache("d", "1", lambda: records(300), spec=SPEC, progress=y.NullProgress())
    kept = []  # as from_generator keeps them anyway
    first = []
    for epoch in range(4):
        streams = [ref.stream(r, 2, shuffle=True, seed=1, epoch=epoch) for r in range(2)]
        datasets = [s.to_tf_dataset(16) for s in streams]
        got = [ids_of(ds) for ds in datasets]
        assert sorted(got[0] + got[1]) == list(range(300))
        assert read_threads() == []  # every pool of the epoch stopped with its iteration
        kept += datasets
        first = first or got[0]
    assert ids_of(kept[0]) == first  # a kept dataset reads its records again, in order
    assert read_threads() == []
    for _ in range(3):  # iterations left early stop their threads too
        assert len(ids_of(kept[1].take(2))) == 32
        gc.collect()
        assert read_threads() == []


def test_a_dataset_releases_its_source_after_each_iteration(tmp_path: Path) -> None:
    spec = {
        "id": y.ComponentSpec(shape=(), dtype="int64"),
        "s": y.ComponentSpec(shape=(), dtype="string"),
    }
    rows = [{"id": np.int64(i), "s": bytes([i % 251]) * (i % 700)} for i in range(500)]
    ref = y.Store(tmp_path, chunk_bytes=8 << 10).cache("d", "1", lambda: iter(rows), spec=spec)
    stream = ref.stream(0, 2, shuffle=True, seed=3, num_epochs=1)
    ds = stream.to_tf_dataset(32)
    first = ids_of(ds)
    assert stream._source is None  # released with the iteration that used it
    counted = stream.stats()["records"]
    assert counted == len(first) and stream.stats()["bytes_fetched"] > 0
    # Another stream of the same reference, read in numpy meanwhile, shares nothing that
    # the kept dataset pins: its source goes when it does.
    other = ref.stream(1, 2, shuffle=True, seed=3)
    batches = list(other.batches(64))
    gone = weakref.ref(other.source)
    del other, batches
    gc.collect()
    assert gone() is None
    # The dataset reads the same records again (through the views its last source left for
    # the next: nothing fetched again), and the counters run on.
    fetched = stream.stats()["bytes_fetched"]
    assert ids_of(ds) == first
    assert stream.stats()["records"] == 2 * counted
    assert stream.stats()["bytes_fetched"] == fetched  # the views were shared, not fetched
    for batch in ds.take(2):
        assert all(
            s == bytes([i % 251]) * (i % 700)
            for i, s in zip(batch["id"].numpy().tolist(), batch["s"].numpy().tolist(), strict=True)
        )
    assert stream._source is None  # an iteration left early releases it too


def test_a_delete_frees_the_file_a_released_dataset_read(tmp_path: Path) -> None:
    spec = {"x": y.ComponentSpec(shape=(512,), dtype="uint8")}
    rows = [{"x": np.full(512, i % 256, np.uint8)} for i in range(2000)]
    store = y.Store(tmp_path, chunk_bytes=64 << 10)
    ref = store.cache("d", "1", lambda: iter(rows), spec=spec)
    ds = ref.stream(0, 1).to_tf_dataset(100)
    assert sum(int(b["x"].shape[0]) for b in ds) == 2000
    del ds, ref
    gc.collect()
    store.delete("d", "1")
    gc.collect()
    with open("/proc/self/maps") as maps:
        deleted = [line for line in maps if str(tmp_path) in line and "(deleted)" in line]
    assert deleted == []  # no view kept for the next source pins the deleted file


def test_block_memos_go_with_deleted_and_rebuilt_versions(tmp_path: Path) -> None:
    """A process that builds, reads and deletes versions in a loop does not keep their memos."""
    from yogastore.read import verified

    store = y.Store(tmp_path, chunk_bytes=4096)
    values = np.arange(2000, dtype=np.int64)

    def read(name: str) -> int:
        ref = store.cache(name, "1", lambda: tf.data.Dataset.from_tensor_slices(values))
        return sum(int(v) for v in ref.stream(shuffle=False))

    before = len(verified._MEMOS)
    for i in range(6):
        assert read(f"d{i}") == int(values.sum())
        store.delete(f"d{i}", "1")
    assert len(verified._MEMOS) == before
    for _ in range(4):  # rebuilt in place: the memo of the build before goes
        ref = store.cache("same", "1", lambda: tf.data.Dataset.from_tensor_slices(values))
        assert sum(int(v) for v in ref.stream(shuffle=False)) == int(values.sum())
        store.cache("same", "1", lambda: tf.data.Dataset.from_tensor_slices(values), rebuild=True)
    assert len(verified._MEMOS) <= before + 1
