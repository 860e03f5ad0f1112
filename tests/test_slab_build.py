"""First pass of variable-length tf.data sources batch by batch (slabs): exact records, chunking."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import yogastore
from storage_backends.errors import BuildLimitError, UnsupportedElementError
from yogastore.format.encode import ChunkBuilder, Slab
from yogastore.format.layout import ColumnSpec

N = 700


def _records() -> list[dict[str, Any]]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(N):
        n = int(rng.integers(0, 40)) if i % 7 else 0  # zero-length rows too
        out.append(
            {
                "s": b"" if i % 11 == 0 else rng.bytes(int(rng.integers(1, 3000))),
                "m": np.array([[b"a" * (i % 5), b"b"], [b"", bytes([i % 256]) * 3]], dtype=object),
                "t": rng.integers(0, 50_000, size=n).astype(np.int32),
                "f": rng.normal(size=(n % 5, 3)).astype(np.float32),
                "r": np.array([rng.bytes(int(k)) for k in rng.integers(0, 20, size=n % 4)], object),
                "y": np.int64(i),
            }
        )
    return out


def _ragged(rows: list[np.ndarray], dtype: tf.DType) -> tf.RaggedTensor:
    flat = np.concatenate(rows) if dtype != tf.string else [v for r in rows for v in r]
    lengths = [len(r) for r in rows]
    return tf.RaggedTensor.from_row_lengths(tf.constant(flat, dtype), lengths)


def _dataset(records: list[dict[str, Any]]) -> tf.data.Dataset:
    """In-memory tensors: the ragged columns are rank-0 ragged components (dense rows)."""
    ds = tf.data.Dataset.from_tensor_slices(
        {
            "s": tf.constant([r["s"] for r in records], tf.string),
            "m": tf.constant(np.stack([r["m"] for r in records]), tf.string),
            "t": _ragged([r["t"] for r in records], tf.int32),
            "f": _ragged([r["f"] for r in records], tf.float32),
            "r": _ragged([r["r"] for r in records], tf.string),
            "y": tf.constant([r["y"] for r in records], tf.int64),
        }
    )
    spec = ds.element_spec
    assert isinstance(spec["t"], tf.RaggedTensorSpec) and spec["t"].ragged_rank == 0
    return ds


def _check(ref: yogastore.DatasetRef, records: list[dict[str, Any]]) -> None:
    seen = 0
    for element in ref.stream(shuffle=False):
        want = records[int(element["y"])]
        assert element["s"] == want["s"]
        assert np.array_equal(np.asarray(element["m"], object), want["m"])
        assert np.array_equal(np.asarray(element["t"]), want["t"])
        assert np.array_equal(np.asarray(element["f"]).reshape(-1, 3), want["f"])
        assert [bytes(v) for v in np.asarray(element["r"], object).reshape(-1)] == list(want["r"])
        assert int(element["y"]) == seen
        seen += 1
    assert seen == len(records)


@pytest.mark.parametrize("chunk_bytes", [1 << 10, 64 << 10, 4 << 20])
def test_variable_length_tf_source_round_trips_across_chunk_sizes(
    tmp_path: Path, chunk_bytes: int
) -> None:
    """Records larger than a chunk, slabs cut across chunks, one chunk for everything."""
    records = _records()
    store = yogastore.Store(tmp_path, chunk_bytes=chunk_bytes)
    ref = store.cache("v", "1", lambda: _dataset(records), progress=yogastore.NullProgress())
    assert ref.num_records == N
    if chunk_bytes == 1 << 10:
        assert len(ref.manifest.chunks) > N // 4  # many records per slab, split into chunks
    _check(ref, records)


def test_the_byte_guard_counts_slabs(tmp_path: Path) -> None:
    records = _records()
    store = yogastore.Store(tmp_path)
    with pytest.raises(BuildLimitError, match="max_bytes"):
        store.cache("v", "1", lambda: _dataset(records), max_bytes=100_000)
    assert store.list() == []


def test_slab_sizes_match_what_the_builder_counts() -> None:
    """Chunks are cut by ``record_bytes``: it must agree with the builder's own count."""
    columns = [
        ColumnSpec("bytes", "string", ()),
        ColumnSpec("var", "int32", (None,)),
        ColumnSpec("bytes", "string", (None,)),
        ColumnSpec("fixed", "int64", ()),
    ]
    shapes1 = np.array([[0], [3], [1]], np.int64)
    slab = Slab(
        3,
        (
            (np.zeros((3, 0), np.int64), np.array([b"", b"xy", b"z" * 9], object)),
            (shapes1, np.arange(4, dtype=np.int32)),
            (np.array([[2], [0], [1]], np.int64), [b"a", b"bc", b"def"]),
            np.arange(3, dtype=np.int64),
        ),
    )
    sizes = slab.record_bytes(columns)
    for start, stop in [(0, 3), (0, 1), (1, 2), (1, 3), (2, 3)]:
        builder = ChunkBuilder(columns)
        builder.add_slab(slab.take(columns, start, stop))
        assert builder.nbytes == int(sizes[start:stop].sum())
        assert builder.count == stop - start


def test_a_slab_that_does_not_fit_its_columns_is_refused() -> None:
    columns = [ColumnSpec("var", "int32", (None, 3))]
    builder = ChunkBuilder(columns)
    with pytest.raises(UnsupportedElementError, match="does not match"):
        builder.add_slab(Slab(1, ((np.array([[2, 4]], np.int64), np.zeros(8, np.int32)),)))
    with pytest.raises(UnsupportedElementError, match="values for records"):
        builder.add_slab(Slab(1, ((np.array([[2, 3]], np.int64), np.zeros(5, np.int32)),)))


def test_large_data_areas_are_laid_out_on_pages_of_the_stored_value() -> None:
    """A value stored PAGE_PHASE bytes into a page: its data regions start on pages."""
    from yogastore.format.decode import parse_header
    from yogastore.format.encode import PAGE_PHASE

    columns = [ColumnSpec("fixed", "uint8", (16384,)), ColumnSpec("fixed", "int64", ())]
    for n, paged in [(64, True), (2, False)]:
        builder = ChunkBuilder(columns)
        builder.add_slab(Slab(n, (np.full((n, 16384), 7, np.uint8), np.arange(n, dtype=np.int64))))
        data = builder.encode()
        header = parse_header(data, len(data), "test")
        starts = [col["data"][0] for col in header["cols"]]
        base = header["blocks"][2]
        on_pages = [(s + PAGE_PHASE) % 4096 == 0 for s in [*starts, base]]
        assert all(on_pages) if paged else not all(on_pages)
        first = starts[0]
        assert data[first : first + 16384 * n] == bytes([7]) * (16384 * n)


@pytest.mark.parametrize(("record", "paged"), [(5000, True), (4096, True), (4095, False)])
def test_records_of_a_page_or_more_start_the_block_grid_on_a_page(record: int, paged: bool) -> None:
    """Blocks follow the pages, so a record is verified in the pages it spans."""
    from yogastore.format.decode import parse_header
    from yogastore.format.encode import PAGE_PHASE

    columns = [ColumnSpec("fixed", "int64", ()), ColumnSpec("fixed", "uint8", (record,))]
    n = 40
    builder = ChunkBuilder(columns)
    rows = np.arange(n * record, dtype=np.int64).astype(np.uint8).reshape(n, record)
    builder.add_slab(Slab(n, (np.arange(n, dtype=np.int64), rows)))
    data = builder.encode()
    header = parse_header(data, len(data), "test")
    start = header["cols"][1]["data"][0]
    base, block = header["blocks"][2], header["blocks"][3]
    assert block <= 4096 and 4096 % block == 0
    assert ((start + PAGE_PHASE) % 4096 == 0) is paged
    assert ((base + PAGE_PHASE) % 4096 == 0) is paged
    assert data[start : start + rows.nbytes] == rows.tobytes()


def test_an_empty_source_of_strings_and_ragged_rows_reads_as_no_batches(tmp_path: Path) -> None:
    ds = _dataset(_records()).take(0)
    ref = yogastore.Store(tmp_path).cache("e", "1", lambda: ds, progress=yogastore.NullProgress())
    assert ref.num_records == 0
    assert list(ref.stream(shuffle=False).batches(4)) == []


def test_ragged_rows_with_a_zero_inner_dimension_batch(tmp_path: Path) -> None:
    rows = [np.zeros((n, 0), np.float32) for n in (2, 0, 3)]
    ds = tf.data.Dataset.from_tensor_slices(
        tf.RaggedTensor.from_row_lengths(tf.zeros((5, 0), tf.float32), [2, 0, 3])
    )
    ref = yogastore.Store(tmp_path).cache("z", "1", lambda: ds, progress=yogastore.NullProgress())
    (batch,) = list(ref.stream(shuffle=False).batches(3))
    assert batch.flat_values.shape == (5, 0)
    assert batch.nested_row_splits[0].tolist() == [0, 2, 2, 5]
    shapes = [tuple(b.shape) for b in ref.stream(shuffle=False).to_tf_dataset(2)]
    assert shapes == [(2, None, 0), (1, None, 0)]
    assert [np.asarray(r).shape for r in ref.stream(shuffle=False)] == [r.shape for r in rows]


def test_ragged_rows_of_different_inner_widths_are_cached_record_by_record(
    tmp_path: Path,
) -> None:
    """tf.data cannot batch them; the first pass reads them one by one instead."""
    rows = [np.arange(2, dtype=np.float32).reshape(1, 2), np.arange(9, dtype=np.float32)]
    rows[1] = rows[1].reshape(3, 3)
    parts = [(r, np.array([len(r)], np.int64)) for r in rows]  # one row per part
    source = tf.data.Dataset.from_generator(
        lambda: iter(parts),
        output_signature=(
            tf.TensorSpec([None, None], tf.float32),
            tf.TensorSpec([None], tf.int64),
        ),
    )
    ds = source.map(tf.RaggedTensor.from_row_lengths).unbatch()
    assert ds.element_spec.shape.as_list() == [None, None]
    ref = yogastore.Store(tmp_path).cache("w", "1", lambda: ds, progress=yogastore.NullProgress())
    got = [np.asarray(r).reshape(-1, len(r[0]) if len(r) else 0) for r in ref.stream(shuffle=False)]
    assert [g.tolist() for g in got] == [r.tolist() for r in rows]


def test_string_chunks_are_cut_by_their_bytes(tmp_path: Path) -> None:
    """Fixed-shape strings only: chunks near chunk_bytes, not 8 bytes per string."""
    ds = tf.data.Dataset.from_tensor_slices(tf.constant([b"x" * 10_000] * 60))
    ref = yogastore.Store(tmp_path, chunk_bytes=65536).cache(
        "s", "1", lambda: ds, progress=yogastore.NullProgress()
    )
    assert max(c.nbytes for c in ref.manifest.chunks) < 65536 + 12_000
    assert [bytes(r) for r in ref.stream(shuffle=False)] == [b"x" * 10_000] * 60


# Dense strings reach the chunk writer packed: one buffer and row splits per batch.


def test_packed_strings_are_checked_and_slice_in_order() -> None:
    from yogastore.format.encode import PackedStrings

    packed = PackedStrings.of(b"abcdef", [0, 2, 0, 4])
    assert len(packed) == 4 and packed.nbytes == 6
    assert packed.offsets.tolist() == [0, 0, 2, 2, 6]
    part = packed[1:3]
    assert len(part) == 2 and part.lengths().tolist() == [2, 0]
    assert part.piece().tobytes() == b"ab"
    assert len(packed[3:1]) == 0 and packed[3:1].nbytes == 0
    with pytest.raises(UnsupportedElementError, match="add up to 5 bytes, the buffer has 6"):
        PackedStrings.of(b"abcdef", [1, 4])
    with pytest.raises(UnsupportedElementError, match="negative"):
        PackedStrings.of(b"ab", [3, -1])
    with pytest.raises(UnsupportedElementError, match="flat uint8"):
        PackedStrings.of(np.zeros(2, np.int16), [1, 1])
    with pytest.raises(IndexError, match="in order"):
        packed[::2]


def test_packed_and_listed_strings_of_one_column_encode_in_order() -> None:
    """Slabs of packed strings, cut anywhere, beside listed strings: the same chunk bytes."""
    from yogastore.format.encode import PackedStrings

    rng = np.random.default_rng(3)
    strings = [rng.bytes(int(k)) for k in rng.integers(0, 40, size=60)]
    strings[7] = strings[8] = b""
    columns = [ColumnSpec("bytes", "string", ()), ColumnSpec("fixed", "int64", ())]

    def slab(lo: int, hi: int, values: Any) -> Slab:
        return Slab(hi - lo, ((np.zeros((hi - lo, 0), np.int64), values), np.arange(lo, hi)))

    packed = slab(0, 50, PackedStrings.of(b"".join(strings[:50]), [len(s) for s in strings[:50]]))
    sizes = packed.record_bytes(columns)
    mixed = ChunkBuilder(columns)
    for start, stop in [(0, 7), (7, 9), (9, 9), (9, 50)]:
        before = mixed.nbytes
        mixed.add_slab(packed.take(columns, start, stop))
        assert mixed.nbytes - before == int(sizes[start:stop].sum())
    mixed.add_slab(slab(50, 60, strings[50:]))
    listed = ChunkBuilder(columns)
    listed.add_slab(slab(0, 60, strings))
    assert mixed.count == listed.count == 60 and mixed.nbytes == listed.nbytes
    assert mixed.encode() == listed.encode()


@pytest.mark.parametrize("high", [40, 2000, 30000], ids=["short", "mixed", "long"])
def test_listed_strings_encode_alike_as_their_own_pieces_or_joined(
    monkeypatch: pytest.MonkeyPatch, high: int
) -> None:
    """Long strings go into the chunk's one join as they are; the chunk bytes are the same."""
    import yogastore.format.encode as encode

    rng = np.random.default_rng(high)
    strings = [rng.bytes(int(k)) for k in rng.integers(0, high, size=90)]
    strings[0] = strings[45] = strings[89] = b""
    columns = [ColumnSpec("bytes", "string", ()), ColumnSpec("fixed", "int64", ())]
    slabs = [(0, 30), (30, 31), (31, 90)]

    def encoded() -> bytearray:
        builder = ChunkBuilder(columns)
        for lo, hi in slabs:
            shapes = np.zeros((hi - lo, 0), np.int64)
            builder.add_slab(Slab(hi - lo, ((shapes, strings[lo:hi]), np.arange(lo, hi))))
        return builder.encode()

    monkeypatch.setattr(encode, "_OWN_PIECE_BYTES", 0)  # every run as its own pieces
    pieces = encoded()
    monkeypatch.setattr(encode, "_OWN_PIECE_BYTES", 1 << 62)  # every run joined first
    joined = encoded()
    assert pieces == joined and len(pieces) > sum(map(len, strings))


def test_a_packed_slab_with_the_wrong_number_of_strings_is_refused() -> None:
    from yogastore.format.encode import PackedStrings

    builder = ChunkBuilder([ColumnSpec("bytes", "string", ())])
    packed = PackedStrings.of(b"abc", [1, 2])
    with pytest.raises(UnsupportedElementError, match="2 strings for records of 3 elements"):
        builder.add_slab(Slab(3, ((np.zeros((3, 0), np.int64), packed),)))


@pytest.mark.parametrize("form", ["tuple", "namedtuple", "single", "dict"])
def test_dense_strings_of_any_element_structure_round_trip(tmp_path: Path, form: str) -> None:
    """tf.data passes a tuple element's items as arguments; other structures as one."""
    import collections

    texts = ["", "héllo", "a\x00b", "日本語のテキスト" * 40, "x" * 3000] * 130
    grid = [[t, t[:3]] for t in texts]
    labels = np.arange(len(texts), dtype=np.int64)
    pair = collections.namedtuple("pair", ["text", "label"])
    make: dict[str, Any] = {
        "tuple": lambda: (texts, grid, labels),
        "namedtuple": lambda: pair(texts, labels),
        "single": lambda: texts,
        "dict": lambda: {"text": texts, "grid": grid, "label": labels},
    }
    ds = tf.data.Dataset.from_tensor_slices(make[form]())
    store = yogastore.Store(tmp_path, chunk_bytes=16 << 10)
    ref = store.cache("s", "1", lambda: ds, progress=yogastore.NullProgress())
    assert ref.num_records == len(texts) and len(ref.manifest.chunks) > 10
    got = list(ref.stream(shuffle=False))
    want = [t.encode() for t in texts]
    if form == "single":
        assert [bytes(g) for g in got] == want
        return
    if form == "dict":
        assert [bytes(g["text"]) for g in got] == want
        assert [[bytes(v) for v in g["grid"]] for g in got] == [
            [t.encode(), t[:3].encode()] for t in texts
        ]
        assert [int(g["label"]) for g in got] == labels.tolist()
        return
    assert [bytes(g[0]) for g in got] == want
    if form == "tuple":
        assert [[bytes(v) for v in g[1]] for g in got] == [
            [t.encode(), t[:3].encode()] for t in texts
        ]
    assert [int(g[-1]) for g in got] == labels.tolist()


@pytest.mark.parametrize("batch_size", [1, 5, 512, None])
def test_components_with_no_elements_reach_tf_data(tmp_path: Path, batch_size: int | None) -> None:
    """TensorFlow's unbatch crashes on tensors with no elements: such records are not split."""
    n = 1300
    texts = np.array([b"r%d" % i for i in range(n)], dtype=object)
    source = {
        "none": np.zeros((n, 0), np.int32),
        "grid": np.empty((n, 2, 0), dtype=object),
        "text": texts,
    }
    ds = tf.data.Dataset.from_tensor_slices(source)
    ref = yogastore.Store(tmp_path).cache("z", "1", lambda: ds, progress=yogastore.NullProgress())
    got: list[bytes] = []
    for batch in ref.stream(shuffle=False).to_tf_dataset(batch_size):
        lead = [] if batch_size is None else [int(batch["text"].shape[0])]
        assert batch["none"].shape == [*lead, 0] and batch["grid"].shape == [*lead, 2, 0]
        got += [bytes(t) for t in np.asarray(batch["text"]).reshape(-1)]
    assert got == list(texts)


def test_records_with_no_elements_and_ragged_rows_need_a_batch_size(tmp_path: Path) -> None:
    rows = tf.RaggedTensor.from_row_lengths(tf.range(6), [2, 0, 4])
    ds = tf.data.Dataset.from_tensor_slices({"none": np.zeros((3, 0), np.int32), "rows": rows})
    ref = yogastore.Store(tmp_path).cache("z", "1", lambda: ds, progress=yogastore.NullProgress())
    with pytest.raises(UnsupportedElementError, match="give a batch_size"):
        ref.stream(shuffle=False).to_tf_dataset(None)
    (batch,) = list(ref.stream(shuffle=False).to_tf_dataset(3))
    assert batch["none"].shape == [3, 0] and batch["rows"].to_list() == [[0, 1], [], [2, 3, 4, 5]]


def test_batches_of_long_and_short_strings_alternate_in_one_first_pass(tmp_path: Path) -> None:
    """Short strings reach the writer joined, long ones as they are: both in one build."""
    rng = np.random.default_rng(9)
    sizes = [*rng.integers(2500, 9000, 512), *rng.integers(0, 40, 512), *rng.integers(0, 9000, 700)]
    texts = [rng.bytes(int(k)) for k in sizes]
    grid = np.array([[t, t[:7]] for t in texts], dtype=object)
    ds = tf.data.Dataset.from_tensor_slices({"t": np.array(texts, dtype=object), "g": grid})
    store = yogastore.Store(tmp_path, chunk_bytes=256 << 10)
    ref = store.cache("s", "1", lambda: ds, progress=yogastore.NullProgress())
    got = list(ref.stream(shuffle=False))
    assert [bytes(g["t"]) for g in got] == texts
    assert [[bytes(v) for v in g["g"]] for g in got] == grid.tolist()


def test_a_scalar_string_given_as_a_bytearray_is_one_string(tmp_path: Path) -> None:
    spec = {"a": yogastore.ComponentSpec(shape=(), dtype="string")}
    values = [bytearray(b"hello"), b"", bytearray()]
    ref = yogastore.Store(tmp_path).cache(
        "s", "1", lambda: iter([{"a": v} for v in values]), spec=spec
    )
    got = [bytes(e["a"]) for e in ref.stream(shuffle=False)]
    assert got == [b"hello", b"", b""]


def test_strings_of_a_shaped_component_given_as_bytearrays_are_strings(tmp_path: Path) -> None:
    """Lists of bytearrays of equal length are strings, not rows of ints."""
    cases = {
        (2,): [[bytearray(b"ab"), bytearray(b"cd")], (bytearray(b"x"), "y")],
        (None,): [[bytearray(b"ab"), bytearray(b"cd"), b"ef"], [], [bytearray()]],
        (2, 2): [[[bytearray(b"ab"), bytearray(b"cd")], (bytearray(b"ef"), b"gh")]],
    }
    for i, (shape, values) in enumerate(cases.items()):
        spec = {"a": yogastore.ComponentSpec(shape=shape, dtype="string")}
        ref = yogastore.Store(tmp_path).cache(
            f"s{i}", "1", lambda values=values: iter([{"a": v} for v in values]), spec=spec
        )
        got = [np.asarray(e["a"], object).tolist() for e in ref.stream(shuffle=False)]

        def want(v: object) -> object:
            if isinstance(v, list | tuple):
                return [want(x) for x in v]
            return v.encode() if isinstance(v, str) else bytes(v)  # type: ignore[call-overload]

        assert got == [want(v) for v in values], shape


@pytest.mark.parametrize("kernel", ["1", "0"])
@pytest.mark.parametrize(("real", "said"), [(1, 2), (3, 2)])
def test_strings_whose_shape_is_not_the_element_spec_are_refused_not_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str, real: int, said: int
) -> None:
    """``tf.py_function`` plus ``set_shape`` can claim any shape; strings joined in tf.data
    are checked against it, or records would be cut from the wrong strings (and lost)."""
    monkeypatch.setenv("YOGASTORE_TF_OPS", kernel)

    def strings(i: Any) -> np.ndarray:
        return np.array([b"%d:%d" % (int(i), j) for j in range(real)], dtype=object)

    def element(i: Any) -> dict[str, Any]:
        s = tf.py_function(strings, [i], tf.string)
        s.set_shape([said])
        return {"s": s, "i": i}

    store = yogastore.Store(tmp_path)
    with pytest.raises(UnsupportedElementError, match=rf"'s'.*shape \({real},\).*says \({said},\)"):
        store.cache(
            "lie",
            "1",
            lambda: tf.data.Dataset.range(1000).map(element),
            progress=yogastore.NullProgress(),
        )
    assert store.versions() == []
