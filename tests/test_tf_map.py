"""to_tf_dataset: early argument checks, exact element_spec, element map, padded/ragged batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import yogastore
from yogastore.tf import Batching


@pytest.fixture
def text_ref(tmp_path: Path) -> yogastore.DatasetRef:
    """Records {"id": i, "text": "i,i+1,...": i % 4 + 1 numbers}."""
    ids = list(range(22))
    texts = [",".join(str(i + k) for k in range(i % 4 + 1)) for i in ids]
    store = yogastore.Store(tmp_path)
    return store.cache(
        "text", "1", lambda: tf.data.Dataset.from_tensor_slices({"id": ids, "text": texts})
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"batch_size": -3}, "batch_size"),
        ({"batch_size": "8"}, "batch_size"),
        ({"batch_size": 2.0}, "batch_size"),
        ({"batch_size": None, "drop_remainder": True}, "drop_remainder=True needs a batch_size"),
        ({"batch_size": 2, "drop_remainder": "yes"}, "drop_remainder must be a bool"),
        ({"batch_size": 2, "map_fn": 3}, "map_fn must be callable"),
        ({"batch_size": 2, "num_parallel_calls": 2}, "num_parallel_calls needs a map_fn"),
        ({"batch_size": 2, "map_fn": abs, "num_parallel_calls": 0}, "num_parallel_calls"),
        ({"batch_size": 2, "batching": "padded"}, "batching must be a Batching"),
        ({"batch_size": None, "batching": Batching.PADDED}, "needs a batch_size"),
    ],
    ids=[
        "zero",
        "negative",
        "str",
        "float",
        "drop-no-batch",
        "drop-str",
        "map-not-callable",
        "calls-no-map",
        "calls-zero",
        "batching-str",
        "padded-no-batch",
    ],
)
def test_arguments_checked_at_call(
    text_ref: yogastore.DatasetRef, kwargs: dict[str, Any], match: str
) -> None:
    stream = text_ref.stream(shuffle=False)
    with pytest.raises(yogastore.InvalidArgumentError, match=match):
        stream.to_tf_dataset(**kwargs)


def test_ragged_rank_0_element_spec_kept(tmp_path: Path) -> None:
    rows = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]
    source = tf.data.Dataset.from_tensor_slices(tf.ragged.constant(rows))
    assert source.element_spec == tf.RaggedTensorSpec([None], tf.int32, ragged_rank=0)
    ref = yogastore.Store(tmp_path).cache("r0", "1", lambda: source)
    ds = ref.stream(shuffle=False).to_tf_dataset()
    assert ds.element_spec == source.element_spec
    # .batch() works as on the source (a dense TensorSpec([None]) would fail here).
    got = [b.to_list() for b in ds.batch(2)]
    want = [b.to_list() for b in source.batch(2)]
    assert got == want == [[[1, 2], [3]], [[4, 5, 6], [7]], [[8, 9]]]
    batched = ref.stream(shuffle=False).to_tf_dataset(2, drop_remainder=True)
    assert batched.element_spec == source.batch(2, drop_remainder=True).element_spec
    assert ref.stream(shuffle=False).to_tf_dataset(2).element_spec == source.batch(2).element_spec


def _parse(element: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    numbers = tf.strings.to_number(tf.strings.split(element["text"], ","), tf.int64)
    return {"id": element["id"], "numbers": numbers}


@pytest.mark.parametrize("batching", list(Batching), ids=lambda b: b.name)
def test_element_map_keeps_batches_aligned(
    text_ref: yogastore.DatasetRef, batching: Batching
) -> None:
    plain = text_ref.stream(shuffle=True, seed=3).to_tf_dataset(4, drop_remainder=True)
    plain_ids = [b["id"].numpy().tolist() for b in plain]
    if batching is Batching.DENSE:
        # Variable-length components cannot be batched densely: map to a fixed shape.
        fn: Any = lambda e: {"id": e["id"], "n": tf.size(_parse(e)["numbers"])}  # noqa: E731
    else:
        fn = _parse
    ds = text_ref.stream(shuffle=True, seed=3).to_tf_dataset(
        4, drop_remainder=True, map_fn=fn, num_parallel_calls=2, batching=batching
    )
    batches = list(ds)
    assert [b["id"].numpy().tolist() for b in batches] == plain_ids, "same records per batch"
    assert len(batches) == 22 // 4
    for batch in batches:
        ids = batch["id"].numpy().tolist()
        if batching is Batching.DENSE:
            assert batch["n"].numpy().tolist() == [i % 4 + 1 for i in ids]
        elif batching is Batching.RAGGED:
            assert isinstance(batch["numbers"], tf.RaggedTensor)
            assert batch["numbers"].to_list() == [[i + k for k in range(i % 4 + 1)] for i in ids]
        else:
            dense = batch["numbers"].numpy()
            width = max(i % 4 + 1 for i in ids)
            assert dense.shape == (4, width)
            want = [[i + k for k in range(i % 4 + 1)] + [0] * (width - i % 4 - 1) for i in ids]
            assert dense.tolist() == want


def test_element_map_unbatched_and_padding_value(text_ref: yogastore.DatasetRef) -> None:
    ds = text_ref.stream(shuffle=False).to_tf_dataset(map_fn=_parse)
    first = [e["numbers"].numpy().tolist() for e in ds.take(3)]
    assert first == [[0], [1, 2], [2, 3, 4]]
    padded = text_ref.stream(shuffle=False).to_tf_dataset(
        3,
        map_fn=_parse,
        batching=Batching.PADDED,
        padding_values={"id": np.int32(0), "numbers": np.int64(-1)},
    )
    head = next(iter(padded))["numbers"].numpy().tolist()
    assert head == [[0, -1, -1], [1, 2, -1], [2, 3, 4]]
    sizes = [len(b["id"]) for b in padded]
    assert sizes == [3] * 7 + [1], "the last, smaller batch is kept without drop_remainder"


def _varlen_source() -> tf.data.Dataset:
    """Records {"id": i, "v": [0, ..., i % 4 - 1]}: a variable-length dense component."""
    return tf.data.Dataset.range(11).map(lambda i: {"id": i, "v": tf.range(i % 4)})


@pytest.fixture
def varlen_ref(tmp_path: Path) -> yogastore.DatasetRef:
    return yogastore.Store(tmp_path).cache("varlen", "1", _varlen_source)


def _values(batch: dict[str, Any]) -> Any:
    v = batch["v"]
    return v.to_list() if isinstance(v, tf.RaggedTensor) else v.numpy().tolist()


@pytest.mark.parametrize("drop_remainder", [False, True], ids=["keep", "drop"])
@pytest.mark.parametrize("identity", [False, True], ids=["no-map", "identity-map"])
@pytest.mark.parametrize("batching", [Batching.PADDED, Batching.RAGGED], ids=lambda b: b.name)
def test_padded_and_ragged_batches_of_cached_variable_length(
    varlen_ref: yogastore.DatasetRef, batching: Batching, identity: bool, drop_remainder: bool
) -> None:
    source = _varlen_source()
    if batching is Batching.PADDED:
        want_ds = source.padded_batch(3, drop_remainder=drop_remainder)
    else:
        want_ds = source.ragged_batch(3, drop_remainder=drop_remainder)
    ds = varlen_ref.stream(shuffle=False).to_tf_dataset(
        3,
        drop_remainder,
        map_fn=(lambda e: e) if identity else None,
        batching=batching,
    )
    assert ds.element_spec == want_ds.element_spec
    got = [(b["id"].numpy().tolist(), _values(b)) for b in ds]
    want = [(b["id"].numpy().tolist(), _values(b)) for b in want_ds]
    assert got == want
    assert len(got) == (3 if drop_remainder else 4)


def test_padded_batches_of_variable_length_keep_position_steps(
    varlen_ref: yogastore.DatasetRef,
) -> None:
    from yogastore.distributed import EpochSize, StreamPosition

    def ids(**options: Any) -> list[list[int]]:
        position = StreamPosition(varlen_ref, seed=4)
        ds = position.dataset(1, 2, 2, epoch_size=EpochSize(steps=4), **options)
        assert int(ds.cardinality()) == 4
        return [b["id"].numpy().tolist() for b in ds]

    pad = {"id": np.int64(0), "v": np.int64(-1)}
    plain = ids(map_fn=lambda e: {"id": e["id"]})
    padded = ids(batching=Batching.PADDED, padding_values=pad)
    assert padded == plain, "the same records in the same steps"
    position = StreamPosition(varlen_ref, seed=4)
    for batch in position.dataset(1, 2, 2, batching=Batching.PADDED, padding_values=pad):
        rows = batch["v"].numpy().tolist()
        for i, row in zip(batch["id"].numpy().tolist(), rows, strict=True):
            assert row == list(range(i % 4)) + [-1] * (len(row) - i % 4)


@pytest.mark.parametrize("name", ["padded_shapes", "padding_values"])
@pytest.mark.parametrize("batching", [None, Batching.DENSE, Batching.RAGGED], ids=str)
def test_padding_options_need_padded_batching(
    varlen_ref: yogastore.DatasetRef, name: str, batching: Batching | None
) -> None:
    with pytest.raises(yogastore.InvalidArgumentError, match=f"{name} is used only with"):
        varlen_ref.stream().to_tf_dataset(3, batching=batching, **{name: {"id": [], "v": [5]}})


def test_padded_batching_of_sparse_refused_at_the_call(tmp_path: Path) -> None:
    def source() -> tf.data.Dataset:
        dense = tf.data.Dataset.range(4).map(
            lambda i: {"id": i, "m": tf.eye(2) * tf.cast(i, tf.float32)}
        )
        return dense.map(lambda e: {"id": e["id"], "m": tf.sparse.from_dense(e["m"])})

    ref = yogastore.Store(tmp_path).cache("sparse", "1", source)
    stream = ref.stream(shuffle=False)
    with pytest.raises(yogastore.InvalidArgumentError, match=r"sparse component\(s\) \['m'\]"):
        stream.to_tf_dataset(2, batching=Batching.PADDED)
    with pytest.raises(yogastore.InvalidArgumentError, match=r"map_fn returns sparse.*\['s'\]"):
        stream.to_tf_dataset(
            2,
            map_fn=lambda e: {"s": tf.sparse.from_dense(e["id"][None])},
            batching=Batching.PADDED,
        )
    dense = stream.to_tf_dataset(
        2, map_fn=lambda e: {"m": tf.sparse.to_dense(e["m"])}, batching=Batching.PADDED
    )
    assert [b["m"].shape.as_list() for b in dense] == [[2, 2, 2], [2, 2, 2]]


def test_padded_shapes_that_do_not_fit_refused_at_the_call(
    varlen_ref: yogastore.DatasetRef,
) -> None:
    with pytest.raises(yogastore.InvalidArgumentError, match=r"padded_shapes=.*do not fit"):
        varlen_ref.stream().to_tf_dataset(3, batching=Batching.PADDED, padded_shapes={"v": [5]})
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Batching.PADDED or Batching.RAGGED"):
        list(varlen_ref.stream(shuffle=False).to_tf_dataset(3))
