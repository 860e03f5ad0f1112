"""Exact round-trip of every supported element kind through the cache and back."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import yogastore

Point = collections.namedtuple("Point", ["x", "y"])

NUMERIC = [
    tf.bool,
    tf.int8,
    tf.int16,
    tf.int32,
    tf.int64,
    tf.uint8,
    tf.uint16,
    tf.uint32,
    tf.uint64,
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.complex64,
    tf.complex128,
]


def _values(dtype: tf.DType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(-100, 100, size=shape)
    if dtype == tf.bool:
        return raw > 0
    if dtype.is_unsigned:
        raw = np.abs(raw)
    if dtype.is_complex:
        return (raw + 1j * rng.integers(-5, 5, size=shape)).astype(dtype.as_numpy_dtype)
    return raw.astype(dtype.as_numpy_dtype)


def assert_same(a: Any, b: Any) -> None:
    """Compare two tf.data elements exactly (values, dtypes, static structure)."""
    tf.nest.assert_same_structure(a, b, expand_composites=True)
    for x, y in zip(
        tf.nest.flatten(a, expand_composites=True),
        tf.nest.flatten(b, expand_composites=True),
        strict=True,
    ):
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert np.array_equal(x.numpy(), y.numpy())


def roundtrip(
    tmp_path: Path, ds: tf.data.Dataset, batch_size: int | None = None
) -> tuple[list[Any], list[Any]]:
    store = yogastore.Store(tmp_path / "s", chunk_bytes=512)
    ref = store.cache("rt", "1", lambda: ds)
    reopened = yogastore.Store(tmp_path / "s").open("rt", "1")
    assert reopened.element_spec == ds.element_spec
    out = reopened.stream(shuffle=False).to_tf_dataset(batch_size=batch_size)
    expected = ds if batch_size is None else ds.batch(batch_size)
    assert out.element_spec == expected.element_spec
    assert ref.num_records == len(list(ds))
    return list(expected), list(out)


@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: d.name)
def test_every_numeric_dtype(tmp_path: Path, dtype: tf.DType) -> None:
    data = _values(dtype, (20, 3, 2), seed=1)
    ds = tf.data.Dataset.from_tensor_slices(tf.constant(data, dtype=dtype))
    expected, got = roundtrip(tmp_path, ds, batch_size=6)
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_nested_structures_and_strings(tmp_path: Path) -> None:
    n = 40
    ds = tf.data.Dataset.from_tensor_slices(
        {
            "image": np.arange(n * 6, dtype=np.uint8).reshape(n, 2, 3),
            "meta": (
                np.arange(n, dtype=np.int32),
                np.array([f"name-{i}".encode() * (i % 4) for i in range(n)]),
            ),
            "point": Point(np.linspace(0, 1, n, dtype=np.float32), np.arange(n, dtype=np.int64)),
            "flag": np.arange(n) % 3 == 0,
        }
    )
    for batch_size in (None, 7):
        expected, got = roundtrip(tmp_path / str(batch_size), ds, batch_size)
        assert len(expected) == len(got)
        for a, b in zip(expected, got, strict=True):
            assert_same(a, b)
            assert type(b["point"]).__name__ == "Point" and b["point"]._fields == ("x", "y")


def _varied() -> tf.data.Dataset:
    def gen() -> Any:
        for i in range(23):
            yield {
                "var": np.full((i % 5, 3), i, dtype=np.float32),
                "strings": np.array([b"x" * j for j in range(i % 4)], dtype=object),
                "ragged": tf.ragged.constant([[i] * (i % 3), [], [i, i + 1]], dtype=tf.int64),
                "ragged2": tf.RaggedTensor.from_nested_row_splits(
                    tf.constant([float(i)] * 4),
                    [tf.constant([0, 1, 2], tf.int64), tf.constant([0, 3, 4], tf.int64)],
                ),
                "sparse": tf.sparse.SparseTensor(
                    [[0, i % 7], [1, 2]], [str(i).encode(), b"s"], [2, 7]
                ),
                "sparse_num": tf.sparse.SparseTensor(
                    np.array([[j] for j in range(i % 4)], dtype=np.int64).reshape(-1, 1),
                    np.arange(i % 4, dtype=np.float64),
                    [10],
                ),
            }

    sig = {
        "var": tf.TensorSpec([None, 3], tf.float32),
        "strings": tf.TensorSpec([None], tf.string),
        "ragged": tf.RaggedTensorSpec([3, None], tf.int64, ragged_rank=1),
        "ragged2": tf.RaggedTensorSpec([2, None, None], tf.float32, ragged_rank=2),
        "sparse": tf.SparseTensorSpec([2, 7], tf.string),
        "sparse_num": tf.SparseTensorSpec([10], tf.float64),
    }
    return tf.data.Dataset.from_generator(gen, output_signature=sig)


def test_ragged_sparse_and_variable_shapes(tmp_path: Path) -> None:
    expected, got = roundtrip(tmp_path, _varied())
    assert len(got) == 23
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_ragged_and_sparse_batches(tmp_path: Path) -> None:
    ds = _varied().map(
        lambda e: {"ragged": e["ragged"], "ragged2": e["ragged2"], "sparse": e["sparse"]}
    )
    expected, got = roundtrip(tmp_path, ds, batch_size=5)
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_numpy_iterable_with_component_specs(tmp_path: Path) -> None:
    spec = {
        "x": yogastore.ComponentSpec(shape=(2,), dtype="float32"),
        "label": yogastore.ComponentSpec(shape=(), dtype="string"),
        "tokens": yogastore.ComponentSpec(shape=(None,), dtype="int32", kind=yogastore.Kind.RAGGED),
        "rows": yogastore.ComponentSpec(
            shape=(None, None), dtype="int64", kind=yogastore.Kind.RAGGED, ragged_rank=1
        ),
        "sp": yogastore.ComponentSpec(shape=(4,), dtype="float32", kind=yogastore.Kind.SPARSE),
    }

    def items() -> Any:
        for i in range(30):
            yield {
                "x": np.array([i, -i], dtype=np.float32),
                "label": f"item {i}",
                "tokens": np.arange(i % 6, dtype=np.int32),
                "rows": yogastore.RaggedValue(
                    np.arange(i % 5, dtype=np.int64), (np.array([0, i % 5 // 2, i % 5]),)
                ),
                "sp": yogastore.SparseValue(
                    np.array([[i % 4]]), np.array([float(i)], np.float32), np.array([4])
                ),
            }

    store = yogastore.Store(tmp_path)
    ref = store.cache("np", "1", items, spec=spec)
    got = list(ref.stream(shuffle=False))
    for i, e in enumerate(got):
        assert np.array_equal(e["x"], [i, -i]) and e["x"].dtype == np.float32
        assert e["label"] == f"item {i}".encode()
        assert np.array_equal(e["tokens"], np.arange(i % 6))
        assert e["rows"].to_list() == [list(range(i % 5 // 2)), list(range(i % 5 // 2, i % 5))]
        assert e["sp"].indices.tolist() == [[i % 4]] and e["sp"].values.tolist() == [float(i)]
    batch = next(iter(ref.stream(shuffle=False).batches(4)))
    assert batch["x"].shape == (4, 2)
    assert batch["rows"].to_list()[1] == [[], [0]]
    assert batch["sp"].dense_shape.tolist() == [4, 4]
    tf_batch = next(iter(ref.stream(shuffle=False).to_tf_dataset(batch_size=4)))
    assert tf_batch["rows"].to_list() == [[[], []], [[], [0]], [[0], [1]], [[0], [1, 2]]]


def test_unsupported_elements_name_the_component(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path)
    windows = tf.data.Dataset.range(6).window(2).map(lambda w: {"w": w})
    with pytest.raises(yogastore.UnsupportedElementError, match="'w'"):
        store.cache("bad", "1", lambda: windows)
    with pytest.raises(yogastore.UnsupportedElementError, match="object"):
        yogastore.ComponentSpec(shape=(), dtype="object")
    variant = (
        tf.data.Dataset.from_tensors({"v": tf.constant(1, tf.qint8)})
        if hasattr(tf, "qint8")
        else None
    )
    if variant is not None:
        with pytest.raises(yogastore.UnsupportedElementError, match="qint8"):
            store.cache("bad2", "1", lambda: variant)
    assert store.list() == []


def test_numpy_batches_of_unequal_dense_shapes_fail_like_tf(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path)
    ref = store.cache("var", "1", lambda: _varied().map(lambda e: e["var"]))
    with pytest.raises(yogastore.UnsupportedElementError, match="different shapes"):
        list(ref.stream(shuffle=False).batches(4))
