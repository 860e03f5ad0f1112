"""Iterable sources of batches (``yogastore.Batches``): the same records as one by one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore as y
from tests.parallel_support import two_ranks

SPEC = {
    "id": y.ComponentSpec(shape=(), dtype="int64"),
    "v": y.ComponentSpec(shape=(3,), dtype="float32"),
    "s": y.ComponentSpec(shape=(), dtype="string"),
}


def rows(start: int, stop: int) -> dict[str, Any]:
    """Records ``[start, stop)`` as one batch: strings of 0 to 2,999 bytes, some empty."""
    ids = np.arange(start, stop, dtype=np.int64)
    return {
        "id": ids,
        "v": np.stack([ids, -ids, ids * 0.5], axis=1).astype(np.float32),
        "s": np.array([b"%d" % i * (i % 7 * 100) for i in ids.tolist()], dtype=object),
    }


def batches(n: int, sizes: list[int]) -> Any:
    """Batches covering ``[0, n)`` cycling through ``sizes`` (0: an empty batch)."""
    start, k = 0, 0
    while start < n:
        size = sizes[k % len(sizes)]
        k += 1
        yield rows(start, min(n, start + size))
        start += size


def read_back(ref: y.DatasetRef) -> dict[str, list[Any]]:
    got: dict[str, list[Any]] = {"id": [], "v": [], "s": []}
    for e in ref.stream(shuffle=False):
        got["id"].append(int(e["id"]))
        got["v"].append(np.asarray(e["v"]).tolist())
        got["s"].append(bytes(e["s"]))
    return got


@pytest.mark.parametrize("chunk_bytes", [2048, 64 << 10, 4 << 20])
def test_batches_store_the_records_of_one_by_one(tmp_path: Path, chunk_bytes: int) -> None:
    """Same records, same order as a record-by-record build, across chunk edges."""
    n = 700
    store = y.Store(tmp_path)
    ref = store.cache(
        "b", "1", lambda: y.Batches(batches(n, [1, 0, 37, 200, 5])), spec=SPEC,
        chunk_bytes=chunk_bytes, progress=y.NullProgress(),
    )  # fmt: skip

    def one_by_one() -> Any:
        whole = rows(0, n)
        for i in range(n):
            yield {key: whole[key][i] for key in whole}

    plain = store.cache(
        "r", "1", one_by_one, spec=SPEC, chunk_bytes=chunk_bytes, progress=y.NullProgress()
    )
    assert ref.num_records == plain.num_records == n
    assert read_back(ref) == read_back(plain)
    assert read_back(ref)["id"] == list(range(n))
    assert len(ref.manifest.chunks) > 1 or chunk_bytes > 1 << 20
    assert y.Store(tmp_path).open("b", "1").num_records == n


def test_fixed_numeric_batches_round_trip_at_scale(tmp_path: Path) -> None:
    """A million records in batches of 2**17 (and a ragged last one), read back exactly."""
    n = 1_000_003
    spec = {"id": y.ComponentSpec(shape=(), dtype="int64")}

    def make() -> Any:
        for start in range(0, n, 1 << 17):
            yield {"id": np.arange(start, min(n, start + (1 << 17)))}

    ref = y.Store(tmp_path).cache(
        "ids", "1", lambda: y.Batches(make()), spec=spec, progress=y.NullProgress()
    )
    got = np.concatenate([b["id"] for b in ref.stream(shuffle=False).batches(1 << 16)])
    assert got.dtype == np.int64 and np.array_equal(got, np.arange(n))


def test_batches_of_lists_and_narrower_dtypes_are_cast_losslessly(tmp_path: Path) -> None:
    spec = {"x": y.ComponentSpec(shape=(2,), dtype="float64"), "t": y.ComponentSpec(
        shape=(), dtype="string")}  # fmt: skip
    source = [
        {"x": [[1, 2], [3, 4]], "t": ["é", "b"]},
        {"x": np.array([[5, 6]], np.int16), "t": np.array([b"c"], dtype="S1")},
    ]
    ref = y.Store(tmp_path).cache("c", "1", lambda: y.Batches(source), spec=spec)
    got = [(np.asarray(e["x"]).tolist(), bytes(e["t"])) for e in ref.stream(shuffle=False)]
    assert got == [([1.0, 2.0], "é".encode()), ([3.0, 4.0], b"b"), ([5.0, 6.0], b"c")]


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"id": np.arange(3), "v": np.zeros((3, 4), np.float32)}, r"'v' has shape \(3, 4\)"),
        ({"id": np.arange(3), "v": np.zeros((2, 3), np.float32)}, r"different numbers.*'v': 2"),
        ({"id": np.int64(5), "v": np.zeros((1, 3), np.float32)}, r"'id' is int64.*first dim"),
        ({"id": np.arange(3) + 0.5, "v": np.zeros((3, 3))}, r"'id'.*float64.*lose"),
        ({"id": np.arange(3)}, r"does not match the spec"),
    ],
)
def test_a_batch_that_does_not_fit_the_spec_is_named_and_nothing_is_left(
    tmp_path: Path, batch: dict[str, Any], message: str
) -> None:
    spec = {"id": SPEC["id"], "v": SPEC["v"]}
    good = {"id": np.arange(2), "v": np.zeros((2, 3), np.float32)}
    store = y.Store(tmp_path)
    with pytest.raises(y.UnsupportedElementError, match=r"batch 1: .*" + message):
        store.cache("bad", "1", lambda: y.Batches([good, batch]), spec=spec)
    assert store.list() == []
    assert not store.building("bad", "1")


def test_components_that_cannot_come_in_batches_are_refused_before_reading(
    tmp_path: Path,
) -> None:
    read = []

    def make() -> Any:
        read.append(1)
        yield {"t": np.zeros((1, 2), np.int32)}

    spec = {"t": y.ComponentSpec(shape=(None,), dtype="int32", kind=y.Kind.RAGGED)}
    with pytest.raises(y.InvalidArgumentError, match=r"'t' \(ragged.*one by one"):
        y.Store(tmp_path).cache("r", "1", lambda: y.Batches(make()), spec=spec)
    assert read == []
    with pytest.raises(y.InvalidArgumentError, match="iterable of batches"):
        y.Batches(5)  # type: ignore[arg-type]


def test_the_guards_count_the_records_of_batches(tmp_path: Path) -> None:
    store = y.Store(tmp_path)
    with pytest.raises(y.BuildLimitError, match="max_records"):
        store.cache(
            "g", "1", lambda: y.Batches(batches(500, [100])), spec=SPEC, max_records=250,
            progress=y.NullProgress(),
        )  # fmt: skip
    assert store.list() == []
    ref = store.cache(
        "g", "1", lambda: y.Batches(batches(500, [100])), spec=SPEC, max_records=500,
        progress=y.NullProgress(),
    )  # fmt: skip
    assert ref.num_records == 500


def test_ranks_of_a_parallel_first_pass_take_every_other_batch(tmp_path: Path) -> None:
    """Two ranks (threads) split the batches by stride; the order depends on the rank count."""
    refs = two_ranks(
        y.Store(tmp_path), lambda: y.Batches(batches(450, [100])), "a", dataset_id="p", spec=SPEC
    )
    assert refs[0].manifest.build_id == refs[1].manifest.build_id
    ids = read_back(refs[0])["id"]
    # Rank 0 holds batches 0, 2, 4; rank 1 batches 1, 3; parts follow rank order.
    part0 = [*range(0, 100), *range(200, 300), *range(400, 450)]
    part1 = [*range(100, 200), *range(300, 400)]
    assert ids == part0 + part1


def test_a_source_that_refills_one_buffer_is_stored_as_it_was_yielded(tmp_path: Path) -> None:
    """Batches and records alike: what is kept until a chunk is written is a copy."""
    spec = {"a": y.ComponentSpec(shape=(64,), dtype="int64")}
    var = {"t": y.ComponentSpec(shape=(None,), dtype="float32")}
    buf = np.zeros((100, 64), np.int64)
    one = np.zeros(64, np.int64)
    row = np.zeros(8, np.float32)

    def in_batches() -> Any:
        for k in range(20):
            buf[:] = np.arange(k * 100, (k + 1) * 100)[:, None]
            yield {"a": buf}

    def one_by_one() -> Any:
        for i in range(2000):
            one[:] = i
            yield {"a": one}

    def var_rows() -> Any:
        for i in range(500):
            row[:] = i
            yield {"t": row[: 1 + i % 8]}

    store = y.Store(tmp_path, chunk_bytes=256 << 10)
    for name, make in (("b", lambda: y.Batches(in_batches())), ("r", one_by_one)):
        ref = store.cache(name, "1", make, spec=spec, progress=y.NullProgress())
        got = np.concatenate([b["a"] for b in ref.stream(shuffle=False).batches(512)])
        assert np.array_equal(got, np.repeat(np.arange(2000)[:, None], 64, axis=1)), name
    ref = store.cache("v", "1", var_rows, spec=var, progress=y.NullProgress())
    got = [np.asarray(e["t"]).tolist() for e in ref.stream(shuffle=False)]
    assert got == [[float(i)] * (1 + i % 8) for i in range(500)]


def test_a_ragged_list_in_a_batch_is_named() -> None:
    spec = {"a": y.ComponentSpec(shape=(2,), dtype="int64")}
    items = iter(y.build.batches.items_of_batches(y.spec.Schema.from_specs(spec), [
        {"a": [[1, 2], [3, 4]]}, {"a": [[1, 2], [3]]}]))  # fmt: skip
    assert next(items)[0] == "batch"
    with pytest.raises(y.UnsupportedElementError, match=r"batch 1: component 'a'"):
        next(items)


def test_empty_batches_as_lists_and_a_spec_without_components(tmp_path: Path) -> None:
    spec = {"img": y.ComponentSpec(shape=(2, 3), dtype="float32"), "label": SPEC["id"]}
    full = {"img": np.ones((2, 2, 3), np.float32).tolist(), "label": [1, 2]}
    store = y.Store(tmp_path)
    ref = store.cache(
        "e", "1", lambda: y.Batches([full, {"img": [], "label": []}, full]), spec=spec
    )
    assert [int(e["label"]) for e in ref.stream(shuffle=False)] == [1, 2, 1, 2]
    with pytest.raises(y.InvalidArgumentError, match="at least one component"):
        store.cache("none", "1", lambda: y.Batches([{}, {}]), spec={})
