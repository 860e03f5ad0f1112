"""The TensorFlow kernel of the read bridge: strings cut from bytes + offsets in tf.data."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import yogastore
from yogastore.train import tf_ops

N = 300


def _record(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(1000 + i)
    size = 0 if i % 5 == 0 else int(rng.integers(1, 200)) + (5000 if i % 37 == 3 else 0)
    return {
        "s": rng.bytes(size),
        "pair": [rng.bytes(int(rng.integers(0, 3))), rng.bytes(int(rng.integers(0, 40)))],
        "words": [rng.bytes(int(rng.integers(0, 6))) for _ in range(i % 3)],
        "label": i,
    }


RECORDS = [_record(i) for i in range(N)]


def _source() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(
        {
            "s": tf.constant([r["s"] for r in RECORDS], tf.string),
            "pair": tf.constant([r["pair"] for r in RECORDS], tf.string),
            "words": tf.ragged.constant([r["words"] for r in RECORDS], tf.string),
            "label": tf.constant([r["label"] for r in RECORDS], tf.int64),
        }
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> yogastore.DatasetRef:
    # 1 KiB chunks: batches span many chunks and some records are larger than a chunk.
    store = yogastore.Store(tmp_path_factory.mktemp("ops"), chunk_bytes=1024)
    ref = store.cache("ops", "1", _source)
    assert ref.num_records == N and len(ref.manifest.chunks) > 20
    return ref


def test_the_kernel_is_built() -> None:
    # make demo / make test build it; without it strings cross as object arrays.
    assert tf_ops.load() is not None, "run: python -m yogastore.train.tf_ops"
    assert tf_ops.build() == tf_ops.library_path()  # built already: nothing to do


@pytest.mark.parametrize("seed", range(4))
def test_split_bytes_cuts_exact_strings(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 600))
    lengths = rng.integers(0, 3000, n) * (rng.random(n) < 0.8)  # a fifth are empty
    first = int(rng.integers(0, 50))
    offsets = first + np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = rng.integers(0, 256, int(offsets[-1]) + int(rng.integers(0, 9)), dtype=np.uint8)
    got = tf_ops.split_bytes(values, offsets).numpy().tolist()
    assert got == [values[a:b].tobytes() for a, b in itertools.pairwise(offsets)]


def test_split_bytes_of_no_strings() -> None:
    out = tf_ops.split_bytes(np.zeros(0, np.uint8), np.zeros(1, np.int64))
    assert out.shape == (0,) and out.dtype == tf.string


@pytest.mark.parametrize(
    ("values", "offsets", "message"),
    [
        (np.zeros(10, np.uint8), [0, 4, 3], r"offsets\[2\] = 3 is below offsets\[1\] = 4"),
        (np.zeros(10, np.uint8), [0, 11], r"offsets\[1\] = 11 .* past the 10 bytes"),
        (np.zeros(10, np.uint8), [-1, 2], r"offsets\[0\] = -1 is outside the 10 bytes"),
        (np.zeros(10, np.uint8), [11], r"offsets\[0\] = 11 is outside"),
        (np.zeros(10, np.uint8), [], "at least one element"),
        (np.zeros((2, 5), np.uint8), [0, 1], "rank 1|must be a vector"),
    ],
)
def test_split_bytes_refuses_bad_offsets(
    values: np.ndarray, offsets: list[int], message: str
) -> None:
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
        tf_ops.split_bytes(values, np.array(offsets, np.int64))


def _elements(ds: tf.data.Dataset) -> list[dict[str, Any]]:
    out = []
    for batch in ds:
        out.append(
            {
                "s": batch["s"].numpy().tolist(),
                "pair": batch["pair"].numpy().tolist(),
                "words": batch["words"].to_list(),
                "label": batch["label"].numpy().tolist(),
            }
        )
    return out


@pytest.mark.parametrize(("batch_size", "drop"), [(32, False), (7, True), (256, False)])
def test_to_tf_dataset_agrees_with_and_without_the_kernel(
    ref: yogastore.DatasetRef, monkeypatch: pytest.MonkeyPatch, batch_size: int, drop: bool
) -> None:
    def read() -> tuple[Any, list[dict[str, Any]]]:
        stream = ref.stream(shuffle=True, seed=11, num_shards=2, shard_rank=1)
        ds = stream.to_tf_dataset(batch_size=batch_size, drop_remainder=drop)
        return ds.element_spec, _elements(ds)

    spec, with_kernel = read()
    monkeypatch.setenv("YOGASTORE_TF_OPS", "0")
    assert tf_ops.load() is None
    spec_off, without = read()
    assert spec == spec_off == _source().batch(batch_size, drop_remainder=drop).element_spec
    assert with_kernel == without
    labels = [i for b in with_kernel for i in b["label"]]
    expected = N // 2 // batch_size * batch_size if drop else N // 2
    assert len(labels) == expected and len(set(labels)) == expected
    for b in with_kernel:
        assert b["s"] == [RECORDS[i]["s"] for i in b["label"]]
        assert b["pair"] == [RECORDS[i]["pair"] for i in b["label"]]
        assert b["words"] == [RECORDS[i]["words"] for i in b["label"]]


def test_build_writes_the_library_once(tmp_path: Path) -> None:
    path = tf_ops.library_path()
    assert path.name.startswith(f"_tfops-{tf.__version__}-") and path.suffix == ".so"
    before = path.stat().st_mtime_ns
    assert tf_ops.build() == path and path.stat().st_mtime_ns == before
    leftovers = [p for p in path.parent.iterdir() if p.name.startswith(".tfops-")]
    assert leftovers == []
