"""Small fixed-shape batches are gathered several at a time: same batches as one by one."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import yogastore
from yogastore.read.stream import Stream

N = 1000
SPEC = {
    "x": yogastore.ComponentSpec(shape=(3,), dtype="int32"),
    "y": yogastore.ComponentSpec(shape=(), dtype="int64"),
}


def _records() -> Iterator[dict[str, np.ndarray]]:
    for i in range(N):
        yield {"x": np.array([i, -i, 7], dtype=np.int32), "y": np.int64(i)}


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> yogastore.DatasetRef:
    store = yogastore.Store(tmp_path_factory.mktemp("groups"), chunk_bytes=4096)
    return store.cache("small", "1", _records, spec=SPEC)


class OneByOne(Stream):
    """A subclass with its own column_batches: never grouped."""

    def column_batches(self, batch_size: int, drop_remainder: bool = False) -> Iterator[object]:
        yield from super().column_batches(batch_size, drop_remainder)


class Reversed(Stream):
    """A subclass with an order of its own (each batch's records reversed)."""

    def record_indices(self, batch_size: int) -> Iterator[np.ndarray]:
        for records in super().record_indices(batch_size):
            yield records[::-1].copy()


def test_grouped_batches_follow_a_subclass_order(ref: yogastore.DatasetRef) -> None:
    stream = ref.stream(0, 2, shuffle=True, seed=6, num_epochs=2)
    stream.__class__ = Reversed
    assert stream.group_factor(7, 1 << 20, 64) > 1, "the case must exercise grouping"
    order = np.concatenate(list(stream.record_indices(7)))
    got = np.concatenate([b["y"] for b in stream.batches(7)])
    np.testing.assert_array_equal(got, order)


@pytest.mark.parametrize("batch_size", [1, 7, 64, 333])
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_grouped_batches_equal_single_batches(
    ref: yogastore.DatasetRef, batch_size: int, drop_remainder: bool
) -> None:
    stream = ref.stream(1, 3, shuffle=True, seed=5, num_epochs=3, start_offset=11)
    assert stream.group_factor(batch_size, 1 << 20, 64) > 1, "the case must exercise grouping"
    grouped = list(stream.batches(batch_size, drop_remainder))
    single = ref.stream(1, 3, shuffle=True, seed=5, num_epochs=3, start_offset=11)
    single.__class__ = OneByOne
    assert single.group_factor(batch_size, 1 << 20, 64) == 1
    plain = list(single.batches(batch_size, drop_remainder))
    assert [len(b["y"]) for b in grouped] == [len(b["y"]) for b in plain]
    for g, p in zip(grouped, plain, strict=True):
        np.testing.assert_array_equal(g["y"], p["y"])
        np.testing.assert_array_equal(g["x"][:, 0], g["y"])  # record contents match labels
    if drop_remainder:
        assert all(len(b["y"]) == batch_size for b in grouped)
    total = sum(len(b["y"]) for b in grouped)
    expected = len(stream) - (len(stream) % batch_size if drop_remainder else 0)
    assert total == expected


def test_variable_shape_schema_is_not_grouped(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path / "s")
    spec = yogastore.ComponentSpec(shape=(None,), dtype="int64")
    ref = store.cache("var", "1", lambda: (np.arange(i % 4) for i in range(50)), spec=spec)
    assert ref.stream().group_factor(1, 1 << 20, 64) == 1
    sizes = [b.shape for b in ref.stream(shuffle=False).batches(1)]
    assert sizes == [(1, i % 4) for i in range(50)]


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_large_batches_cut_from_groups_in_tf_data_are_the_same_records(
    tmp_path: Path, drop_remainder: bool
) -> None:
    import tensorflow as tf

    from yogastore.train import tf_read

    rows = 301
    x = np.random.default_rng(3).integers(0, 256, (rows, 4096), dtype=np.uint8)
    ds = tf.data.Dataset.from_tensor_slices({"x": x, "y": np.arange(rows, dtype=np.int64)})
    ref = yogastore.Store(tmp_path / "s").cache("big", "1", lambda: ds)
    batch = 140  # 560 KiB batches, several per call, cut as views of the group in tf.data
    stream = ref.stream(0, 2, shuffle=True, seed=4, num_epochs=2)
    assert stream.group_factor(batch, tf_read._GROUP_BYTES, tf_read._MAX_GROUP) > 1
    order = np.concatenate(
        list(ref.stream(0, 2, shuffle=True, seed=4, num_epochs=2).record_indices(1))
    )
    got = list(stream.to_tf_dataset(batch, drop_remainder))
    sizes = [int(b["y"].shape[0]) for b in got]
    full = len(order) // batch * batch
    assert 0 < full < len(order), "the case must have a short last batch"
    assert sizes == [batch] * (full // batch) + ([] if drop_remainder else [len(order) - full])
    ys = np.concatenate([b["y"].numpy() for b in got])
    np.testing.assert_array_equal(ys, order[: len(ys)])
    np.testing.assert_array_equal(np.concatenate([b["x"].numpy() for b in got]), x[ys])
    spec = stream.to_tf_dataset(batch, drop_remainder).element_spec
    assert spec["x"].shape.as_list() == [batch if drop_remainder else None, 4096]


def test_records_one_by_one_from_groups_over_the_prefetch_budget_are_read_ahead_as_records(
    ref: yogastore.DatasetRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batch_size=None``: a group too large to hold two of is not read ahead whole."""
    import time

    from yogastore.train import tf_read

    # A group of this schema's records is far over a 4 KiB budget, as 256 records over 64 KiB
    # are over the real one: at 1 MiB per record, two groups ahead would be 512 MiB.
    monkeypatch.setattr(tf_read, "_PREFETCH_BYTES", 4096)
    stream = ref.stream(0, 1, shuffle=True, seed=1, num_epochs=40)  # several groups
    produced: list[int] = []
    inner = stream.column_batches

    def counting(batch_size: int, drop_remainder: bool = False) -> Iterator[object]:
        for item in inner(batch_size, drop_remainder):
            produced.append(len(item[0]))
            yield item

    stream.column_batches = counting  # type: ignore[method-assign]
    it = iter(stream.to_tf_dataset(None))
    ys = [int(r["y"]) for r in itertools.islice(it, 300)]
    time.sleep(1.0)  # time for tf.data to read ahead as far as it will
    assert len(produced) == 1 and produced[0] < 40 * N, produced  # only the group being cut
    assert set(ys) <= set(range(N)) and len(ys) == 300


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_strings_are_handed_to_tf_data_in_groups_growing_from_one_batch(
    tmp_path: Path, drop_remainder: bool
) -> None:
    """The first batch waits for one batch's read; later groups double up to the full group."""
    import tensorflow as tf

    from yogastore.train import tf_read

    rows, batch = 20_011, 16
    texts = [b"t%d" % i * (i % 7) for i in range(rows)]
    ds = tf.data.Dataset.from_tensor_slices({"s": texts, "y": np.arange(rows, dtype=np.int64)})
    ref = yogastore.Store(tmp_path / "s").cache("texts", "1", lambda: ds)
    stream = ref.stream(0, 2, shuffle=True, seed=9)
    handed: list[int] = []
    gathered = stream._gathered

    def counted(indices: Iterator[np.ndarray], in_place: bool = False) -> Iterator[object]:
        for records, cols in gathered(indices, in_place):
            handed.append(len(records))
            yield records, cols

    stream._gathered = counted  # type: ignore[method-assign]
    got = list(stream.to_tf_dataset(batch, drop_remainder))
    order = np.concatenate(list(ref.stream(0, 2, shuffle=True, seed=9).record_indices(1)))
    k = tf_read._VAR_MAX_GROUP
    full = len(order) // batch
    assert full > 2 * k, "the case must reach full groups"
    doubling = [batch << i for i in range(k.bit_length() - 1)]  # 1, 2, 4, ... k / 2 batches
    assert handed[: len(doubling)] == doubling
    assert set(handed[len(doubling) : -1]) == {batch * k}
    assert sum(handed) == len(order)
    ys = np.concatenate([b["y"].numpy() for b in got])
    kept = full * batch if drop_remainder else len(order)
    np.testing.assert_array_equal(ys, order[:kept])
    assert [len(b["y"]) for b in got[:-1]] == [batch] * (len(got) - 1)
    assert [v for b in got for v in b["s"].numpy().tolist()] == [texts[i] for i in ys]
