"""Variable-length records: compiled range gather, string buffers, exact bytes everywhere."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import yogastore
import yogastore.format.memory as memory
from yogastore import StringBuffer, StringFormat, StringRanges
from yogastore._gather import gather_ranges, ranges_at, split_bytes
from yogastore.format import ChunkBuilder, ChunkView, ColumnSpec, reshape_values
from yogastore.format.memory import VarRows, _segments

N = 240


def _record(i: int) -> dict[str, Any]:
    """Record ``i``: empty strings, zero-length ragged rows, some records above the chunk size."""
    rng = np.random.default_rng(i)
    size = 0 if i % 7 == 0 else int(rng.integers(1, 300)) + (3000 if i % 31 == 5 else 0)
    words = [rng.bytes(int(rng.integers(0, 9))) for _ in range(i % 4)]  # may hold b""
    return {
        "s": rng.bytes(size),
        "tokens": rng.integers(-(2**31), 2**31 - 1, size=i % 5, dtype=np.int32),
        "words": words,
        "label": i,
    }


RECORDS = [_record(i) for i in range(N)]


def _source() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(
        {
            "s": tf.constant([r["s"] for r in RECORDS], tf.string),
            "tokens": tf.ragged.constant([r["tokens"].tolist() for r in RECORDS], tf.int32),
            "words": tf.ragged.constant([r["words"] for r in RECORDS], tf.string),
            "label": tf.constant([r["label"] for r in RECORDS], tf.int64),
        }
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> yogastore.DatasetRef:
    # 1 KiB chunks: a batch reads many chunks, and some records exceed a chunk's target size.
    store = yogastore.Store(tmp_path_factory.mktemp("var"), chunk_bytes=1024)
    ref = store.cache("var", "1", _source)
    assert ref.num_records == N and len(ref.manifest.chunks) > 20
    return ref


def _check_numpy_batch(batch: dict[str, Any], strings: StringFormat) -> list[int]:
    labels = [int(v) for v in batch["label"]]
    s, words = batch["s"], batch["words"]
    if strings is StringFormat.BUFFERS:
        assert isinstance(s, StringBuffer) and s.shape == (len(labels),)
        assert s.data.dtype == np.uint8 and s.offsets.dtype == np.int64
        assert isinstance(words.flat_values, StringBuffer)
        s_list = [s.data[a:b].tobytes() for a, b in zip(s.offsets[:-1], s.offsets[1:], strict=True)]
        assert s_list == list(s.to_numpy())
        flat_words = list(words.flat_values.to_numpy())
    elif strings is StringFormat.RANGES:
        # Left where they lie: a read-only view of the stored chunks, not a copy.
        assert isinstance(s, StringRanges) and s.shape == (len(labels),)
        assert not s.data.flags.writeable and s.starts.dtype == np.int64
        assert isinstance(words.flat_values, StringRanges)
        s_list = [s.data[a : a + k].tobytes() for a, k in zip(s.starts, s.lengths, strict=True)]
        assert s_list == list(s.to_numpy()) == list(s.to_buffer().to_numpy())
        flat_words = list(words.flat_values.to_numpy())
    else:
        assert s.dtype == object and s.shape == (len(labels),)
        s_list = list(s)
        flat_words = list(words.flat_values)
    splits = words.nested_row_splits[0]
    tok, tok_splits = batch["tokens"].flat_values, batch["tokens"].nested_row_splits[0]
    assert tok.dtype == np.int32
    for j, i in enumerate(labels):
        assert s_list[j] == RECORDS[i]["s"]
        assert flat_words[splits[j] : splits[j + 1]] == RECORDS[i]["words"]
        np.testing.assert_array_equal(tok[tok_splits[j] : tok_splits[j + 1]], RECORDS[i]["tokens"])
    return labels


@pytest.mark.parametrize("strings", list(StringFormat), ids=lambda s: s.value)
@pytest.mark.parametrize("batch_size", [1, 7, 64], ids=lambda b: f"batch{b}")
def test_numpy_batches_hold_the_exact_bytes(
    ref: yogastore.DatasetRef, strings: StringFormat, batch_size: int
) -> None:
    seen: list[int] = []
    for rank in range(3):
        stream = ref.stream(shuffle=True, seed=5, num_shards=3, shard_rank=rank)
        for batch in stream.batches(batch_size, strings=strings):
            seen += _check_numpy_batch(batch, strings)
    assert sorted(seen) == list(range(N))


def test_to_tf_dataset_hands_over_exact_strings_and_ragged_rows(ref: yogastore.DatasetRef) -> None:
    ds = ref.stream(shuffle=True, seed=3).to_tf_dataset(batch_size=32)
    assert ds.element_spec == _source().batch(32).element_spec
    seen = []
    for batch in ds:
        labels = batch["label"].numpy().tolist()
        assert batch["s"].numpy().tolist() == [RECORDS[i]["s"] for i in labels]
        assert batch["words"].to_list() == [RECORDS[i]["words"] for i in labels]
        assert batch["tokens"].to_list() == [RECORDS[i]["tokens"].tolist() for i in labels]
        seen += labels
    assert sorted(seen) == list(range(N))


def test_to_tf_dataset_with_drop_remainder_keeps_the_static_batch(
    ref: yogastore.DatasetRef,
) -> None:
    ds = ref.stream(shuffle=False).to_tf_dataset(batch_size=50, drop_remainder=True)
    assert ds.element_spec == _source().batch(50, drop_remainder=True).element_spec
    batches = list(ds)
    assert len(batches) == N // 50
    assert batches[-1]["s"].numpy().tolist() == [r["s"] for r in RECORDS[150:200]]


def test_stream_refuses_a_string_format_that_is_not_the_enum(ref: yogastore.DatasetRef) -> None:
    with pytest.raises(yogastore.InvalidArgumentError, match="StringFormat"):
        next(ref.stream().batches(4, strings="buffers"))  # type: ignore[arg-type]


# The compiled copies against their numpy definitions --------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_gather_ranges_matches_numpy_segments(seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, size=4000, dtype=np.uint8)
    lengths = rng.integers(0, 50, size=200).astype(np.int64)
    lengths[::9] = 0  # empty ranges anywhere, also at the very end of src
    starts = np.array([rng.integers(0, len(src) - n + 1) for n in lengths], dtype=np.int64)
    starts[-1], lengths[-1] = len(src), 0
    dst = np.full(int(lengths.sum()) + 5, 7, np.uint8)
    assert gather_ranges(dst, src, starts, lengths) == lengths.sum()
    np.testing.assert_array_equal(dst[: lengths.sum()], src[_segments(starts, lengths)])
    assert (dst[lengths.sum() :] == 7).all(), "nothing written past the total"


@pytest.mark.parametrize(
    ("start", "length", "dst_size"),
    [(-1, 1, 10), (0, -1, 10), (9, 2, 10), (11, 0, 10), (0, 10, 9)],
    ids=["negative-start", "negative-length", "past-src-end", "start-past-end", "dst-too-small"],
)
def test_gather_ranges_refuses_out_of_bounds(start: int, length: int, dst_size: int) -> None:
    src = np.arange(10, dtype=np.uint8)
    dst = np.zeros(dst_size, np.uint8)
    with pytest.raises(IndexError, match="outside"):
        gather_ranges(dst, src, np.array([0, start], np.int64), np.array([0, length], np.int64))


@pytest.mark.parametrize("bad_start", [-(2**62), 2**62, 10_001])
def test_gather_ranges_names_a_bad_range_it_read_ahead_of(bad_start: int) -> None:
    # The start of a range some places on is requested early; a bad one must still be
    # refused when reached, under its own number, after the good ranges before it.
    src = np.arange(10_000, dtype=np.int64).view(np.uint8)[:10_000]
    starts = np.arange(0, 2000, 100, dtype=np.int64)
    lengths = np.full(len(starts), 90, np.int64)
    starts[12] = bad_start
    dst = np.zeros(int(lengths.sum()), np.uint8)
    with pytest.raises(IndexError, match=f"range 12 \\(start {bad_start}, length 90\\)"):
        gather_ranges(dst, src, starts, lengths)
    np.testing.assert_array_equal(dst[: 12 * 90], src[_segments(starts[:12], lengths[:12])])


# ranges_at: chunk c's offset pairs (rows[c] + 1 int64s) start at PAIRS[c] and its values
# at DATA[c], addresses of a source whose first byte is at LOWEST; chunk 2 was never added.
LOWEST = 1 << 20


def _offset_tables(
    rng: np.random.Generator, item: int
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Three chunks of offset tables and values: (src, tables, pairs, rows, limits, data)."""
    parts: list[bytes] = []
    pairs, data = np.zeros(4, np.int64), np.zeros(4, np.int64)
    rows, limits = np.zeros(4, np.int64), np.zeros(4, np.int64)
    tables = []
    at = 0
    for c in (1, 0, 3):  # not in chunk order, as chunks lie in a map
        counts = rng.integers(0, 6, size=int(rng.integers(1, 60)))
        counts[::7] = 0  # empty records
        table = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        values = rng.integers(0, 256, size=int(table[-1]) * item, dtype=np.uint8)
        pairs[c], rows[c], limits[c] = LOWEST + at, len(counts), table[-1]
        parts.append(table.tobytes())
        at += table.nbytes
        data[c] = LOWEST + at
        parts.append(values.tobytes() + bytes(int(rng.integers(0, 9))))
        at += len(parts[-1])
        tables.append(table)
    tables = [tables[1], tables[0], np.zeros(1, np.int64), tables[2]]  # by chunk
    return np.frombuffer(b"".join(parts), np.uint8), tables, pairs, rows, limits, data


@pytest.mark.parametrize(("seed", "item"), [(0, 1), (1, 4), (2, 8), (3, 1)])
def test_ranges_at_matches_its_numpy_definition(seed: int, item: int) -> None:
    rng = np.random.default_rng(seed)
    src, tables, pairs, rows, limits, data = _offset_tables(rng, item)
    chunks = rng.choice([0, 1, 3], size=500).astype(np.int64)
    local = np.array([rng.integers(0, rows[c]) for c in chunks], np.int64)
    starts, lengths = np.empty(500, np.int64), np.empty(500, np.int64)
    offsets = np.empty(501, np.int64)
    total, bad = ranges_at(
        starts, lengths, offsets, src, pairs, rows, limits, data, chunks, local, LOWEST, item
    )
    first = np.array([tables[c][j] for c, j in zip(chunks, local, strict=True)])
    last = np.array([tables[c][j + 1] for c, j in zip(chunks, local, strict=True)])
    want = (last - first) * item
    assert bad == -1 and total == want.sum()
    np.testing.assert_array_equal(lengths, want)
    np.testing.assert_array_equal(
        starts, np.where(want > 0, data[chunks] - LOWEST + first * item, 0)
    )
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(last - first)]))
    assert (want == 0).any() and (starts[want == 0] == 0).all()


@pytest.mark.parametrize(
    ("chunk", "local", "error", "message"),
    [
        (4, 0, IndexError, "record 40 names chunk 4 of 4"),
        (-1, 0, IndexError, "record 40 names chunk -1 of 4"),
        (2, 0, RuntimeError, "record 40 names chunk 2, which was never added"),
        (0, -1, IndexError, "record 40 is record -1 of its chunk"),
        (0, "rows", IndexError, "record 40 is record \\d+ of its chunk"),
        (0, 2**62, IndexError, f"record 40 is record {2**62} of its chunk"),
    ],
)
def test_ranges_at_names_the_bad_record(
    chunk: int, local: int | str, error: type[Exception], message: str
) -> None:
    src, _tables, pairs, rows, limits, data = _offset_tables(np.random.default_rng(9), 2)
    chunks, where = np.full(50, 1, np.int64), np.zeros(50, np.int64)
    chunks[40] = chunk
    where[40] = rows[0] if local == "rows" else local
    out = [np.empty(50, np.int64), np.empty(50, np.int64), np.empty(51, np.int64)]
    with pytest.raises(error, match=message):
        ranges_at(*out, src, pairs, rows, limits, data, chunks, where, LOWEST, 2)


@pytest.mark.parametrize(
    ("pair", "limit"),
    [((-1, 2), None), ((3, 2), None), ((0, 10**6), None), ((0, 2**62), 2**62), ((0, 2**40), 2**62)],
    ids=["negative", "backwards", "past-limit", "overflowing", "past-the-source"],
)
def test_ranges_at_names_the_first_record_whose_offsets_are_out_of_bounds(
    pair: tuple[int, int], limit: int | None
) -> None:
    src, tables, pairs, rows, limits, data = _offset_tables(np.random.default_rng(4), 8)
    src = src.copy()
    at = int(pairs[3] - LOWEST)  # chunk 3: every record empty but the one made bad here
    src[at : at + tables[3].nbytes] = np.zeros(tables[3].nbytes, np.uint8)
    src[at : at + 16] = np.array(pair, np.int64).view(np.uint8)
    if limit is not None:  # a chunk that claims that many values
        limits[3] = limit
    chunks, local = np.full(40, 1, np.int64), np.arange(40, dtype=np.int64) % rows[1]
    chunks[17:], local[17:] = 3, 0
    good = local[:17]
    expected = int((tables[1][good + 1] - tables[1][good]).sum()) * 8
    out = [np.empty(40, np.int64), np.empty(40, np.int64), np.empty(41, np.int64)]
    if pair[1] == 2**40:  # within its limit, but the range lies outside the source
        with pytest.raises(IndexError, match="record 17 reads byte"):
            ranges_at(*out, src, pairs, rows, limits, data, chunks, local, LOWEST, 8)
        return
    total, bad = ranges_at(*out, src, pairs, rows, limits, data, chunks, local, LOWEST, 8)
    assert bad == 17, "the first bad record, not a later one"
    assert total == expected > 0


def test_ranges_at_rejects_bad_buffers() -> None:
    src, _tables, pairs, rows, limits, data = _offset_tables(np.random.default_rng(5), 1)
    chunks, local = np.ones(3, np.int64), np.zeros(3, np.int64)
    s, n, o = np.empty(3, np.int64), np.empty(3, np.int64), np.empty(4, np.int64)
    with pytest.raises(ValueError, match="offsets of n \\+ 1"):
        ranges_at(s, n, o[:3], src, pairs, rows, limits, data, chunks, local, LOWEST, 1)
    with pytest.raises(ValueError, match="one per chunk"):
        ranges_at(s, n, o, src, pairs, rows[:3], limits, data, chunks, local, LOWEST, 1)
    with pytest.raises(ValueError, match="int64"):
        ranges_at(
            s, n, o, src, pairs, rows, limits, data, chunks.astype(np.int32), local, LOWEST, 1
        )
    with pytest.raises(ValueError, match="item"):
        ranges_at(s, n, o, src, pairs, rows, limits, data, chunks, local, LOWEST, -1)
    frozen = np.empty(3, np.int64)
    frozen.flags.writeable = False
    with pytest.raises(TypeError):
        ranges_at(frozen, n, o, src, pairs, rows, limits, data, chunks, local, LOWEST, 1)


def test_split_bytes_cuts_and_checks() -> None:
    data = np.frombuffer(b"abc\x00de", np.uint8)
    assert split_bytes(data, np.array([0, 0, 4, 6], np.int64)) == [b"", b"abc\x00", b"de"]
    with pytest.raises(IndexError, match="outside"):
        split_bytes(data, np.array([0, 7], np.int64))
    with pytest.raises(IndexError, match="outside"):
        split_bytes(data, np.array([3, 1], np.int64))


# Corrupt offsets --------------------------------------------------------------------


def _chunk(values: list[Any], spec: ColumnSpec) -> tuple[bytearray, dict[str, Any]]:
    builder = ChunkBuilder([spec])
    for v in values:
        builder.add_record([v])
    raw = bytearray(builder.encode())
    length = struct.unpack_from("<I", raw, 4)[0]
    return raw, json.loads(bytes(raw[8 : 8 + length]))


STRING = ColumnSpec("bytes", "string", ())
TOKENS = ColumnSpec("var", "int32", (None,))


@pytest.mark.parametrize(
    ("spec", "region", "index", "value"),
    [
        (STRING, "offsets", 2, 99),
        (STRING, "boffsets", 1, 10**6),
        (STRING, "boffsets", 2, -3),
        (TOKENS, "offsets", 1, -1),
        (TOKENS, "offsets", 3, 1000),
    ],
    ids=["record-offset", "string-end", "string-negative", "var-negative", "var-past-end"],
)
def test_corrupt_offsets_raise_corrupt_cache_error(
    spec: ColumnSpec, region: str, index: int, value: int
) -> None:
    values = (
        [b"ab", b"", b"cdef", b"g"]
        if spec.layout == "bytes"
        else [np.arange(n, dtype=np.int32) for n in (2, 0, 3, 1)]
    )
    raw, header = _chunk(values, spec)
    start = header["cols"][0][region][0]
    good = ChunkView(bytes(raw), [spec], 4, "good")
    rows = VarRows(spec, 1)
    rows.add(0, good, 0)
    local = np.arange(4, dtype=np.int64)
    assert rows.gather(np.zeros(4, np.int64), local).data.size > 0

    bad = bytearray(raw)
    struct.pack_into("<q", bad, start + 8 * index, value)
    with pytest.raises(yogastore.CorruptCacheError):
        ChunkView(bytes(bad), [spec], 4, "bad chunk")  # caught when the chunk is first read
    # ... and by the gather itself, if the bytes change after that check.
    view = ChunkView(raw, [spec], 4, "mutable chunk")
    rows = VarRows(spec, 1)
    rows.add(0, view, 0)
    before = rows.gather(np.zeros(4, np.int64), local)
    expected = (bytes(before.data), before.offsets.tolist(), before.shapes.tolist())
    raw[start + 8 * index : start + 8 * index + 8] = struct.pack("<q", value)
    if spec is STRING and region == "offsets":
        # One string per record: its record offsets are known from the schema and
        # never read, so the gather gives the same strings.
        after = rows.gather(np.zeros(4, np.int64), local)
        assert (bytes(after.data), after.offsets.tolist(), after.shapes.tolist()) == expected
        assert bytes(after.data) == b"abcdefg"
        return
    with pytest.raises(yogastore.CorruptCacheError, match="mutable chunk"):
        rows.gather(np.zeros(4, np.int64), local)


def _values(spec: ColumnSpec, shape: tuple[int, ...], seed: int) -> Any:
    rng = np.random.default_rng(seed)
    if spec.layout == "bytes":
        flat = [
            bytes(rng.integers(0, 256, int(rng.integers(0, 9)), dtype=np.uint8))
            for _ in range(int(np.prod(shape)))
        ]
        return np.array(flat, dtype=object).reshape(shape)
    return rng.integers(-100, 100, size=shape).astype(spec.np_dtype)


@pytest.mark.parametrize(
    ("spec", "shapes"),
    [
        (ColumnSpec("var", "int32", (None,)), [(3,), (0,), (5,), (1,)]),
        (ColumnSpec("var", "int64", (None, 3)), [(2, 3), (0, 3), (4, 3), (1, 3)]),
        (ColumnSpec("var", "float32", (2, None)), [(2, 1), (2, 0), (2, 4), (2, 2)]),
        (ColumnSpec("var", "int32", (0, None)), [(0, 3), (0, 0), (0, 7), (0, 1)]),
        (ColumnSpec("var", "int32", (None, None)), [(2, 3), (0, 4), (3, 0), (1, 1)]),
        (ColumnSpec("bytes", "string", (None,)), [(2,), (0,), (3,), (1,)]),
        (ColumnSpec("bytes", "string", (2,)), [(2,), (2,), (2,), (2,)]),
        (ColumnSpec("bytes", "string", (2, 0)), [(2, 0)] * 4),
        (ColumnSpec("bytes", "string", (None, 2)), [(1, 2), (0, 2), (3, 2), (2, 2)]),
    ],
    ids=[
        "none",
        "none-3",
        "2-none",
        "0-none",
        "none-none",
        "str-none",
        "str-2",
        "str-2-0",
        "str-none-2",
    ],
)
def test_gathered_shapes_and_values_match_every_layout(
    spec: ColumnSpec, shapes: list[tuple[int, ...]]
) -> None:
    """Dimensions the schema decides are not read back; the batch must not differ."""
    values = [_values(spec, shape, i) for i, shape in enumerate(shapes)]
    raw, _ = _chunk(values, spec)
    rows = VarRows(spec, 1)
    rows.add(0, ChunkView(bytes(raw), [spec], len(values), "chunk"), 0)
    local = np.array([2, 0, 3, 1, 2], np.int64)
    batch = rows.gather(np.zeros(len(local), np.int64), local)
    assert batch.shapes.tolist() == [list(shapes[i]) for i in local]
    for j, i in enumerate(local):
        got = batch.record(j)
        if spec.layout == "bytes":
            assert got.tolist() == values[i].tolist()
        else:
            np.testing.assert_array_equal(got, values[i])
            assert got.dtype == values[i].dtype


@pytest.mark.parametrize(
    "spec",
    [
        STRING,
        TOKENS,
        ColumnSpec("var", "float32", (2, None)),
        ColumnSpec("var", "int64", (None, None)),
        ColumnSpec("bytes", "string", (None,)),
    ],
    ids=["string", "tokens", "2-none", "none-none", "str-none"],
)
@pytest.mark.parametrize("in_place", [False, True])
def test_compiled_locate_gathers_what_the_numpy_definition_gathers(
    spec: ColumnSpec, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records of three chunks lying in one buffer, empty strings and rows among them."""
    rng = np.random.default_rng(7)
    raws, counts = [], [5, 9, 3]
    for c, n in enumerate(counts):
        values = []
        for i in range(n):
            shape = tuple(int(rng.integers(0, 4)) if d is None else d for d in spec.shape)
            values.append(_values(spec, shape, 100 * c + i))
        raws.append(_chunk(values, spec)[0])
    whole = bytearray(b"".join(bytes(r) for r in raws))
    region = (np.frombuffer(whole, np.uint8).__array_interface__["data"][0], len(whole))
    views, at = [], 0
    for c, raw in enumerate(raws):
        views.append(ChunkView(memoryview(whole)[at : at + len(raw)], [spec], counts[c], f"c{c}"))
        at += len(raw)
    chunks = rng.integers(0, 3, size=200).astype(np.int64)
    local = np.array([rng.integers(0, counts[c]) for c in chunks], np.int64)
    got = {}
    for compiled in (True, False):
        monkeypatch.setattr(memory, "_LOCATE_COMPILED", compiled)
        rows = VarRows(spec, 3)
        for c, view in enumerate(views):
            rows.add(c, view, 0)
        batch = rows.gather(chunks, local, region if in_place else None)
        assert (batch.ranges is not None) == (in_place and spec.layout == "bytes")
        got[compiled] = [batch.record(j) for j in range(len(local))], batch.shapes.tolist()
    (new, new_shapes), (old, old_shapes) = got[True], got[False]
    assert new_shapes == old_shapes
    if spec is not STRING:
        assert any(0 in s for s in new_shapes), "a record without values among them"
    for a, b in zip(new, old, strict=True):
        if spec.layout == "bytes":
            assert np.asarray(a, dtype=object).tolist() == np.asarray(b, dtype=object).tolist()
        else:
            np.testing.assert_array_equal(a, b)
    if spec is STRING:
        assert b"" in [bytes(x) for x in new], "an empty string among them"


def test_a_record_size_that_does_not_fit_the_shape_is_corruption() -> None:
    spec = ColumnSpec("var", "int64", (None, 3))
    raw, header = _chunk([np.zeros((2, 3), np.int64), np.ones((1, 3), np.int64)], spec)
    rows = VarRows(spec, 1)
    rows.add(0, ChunkView(raw, [spec], 2, "mutable chunk"), 0)
    start = header["cols"][0]["offsets"][0]
    raw[start + 8 : start + 16] = struct.pack("<q", 5)  # record 0: 5 values, not 3 per row
    with pytest.raises(yogastore.CorruptCacheError, match=r"mutable chunk.*do not fit the shape"):
        rows.gather(np.zeros(2, np.int64), np.array([0, 1], np.int64))


def test_format_gather_for_per_batch_views_matches_the_source() -> None:
    from yogastore.format import gather

    views = []
    for c in range(3):
        raw, _ = _chunk([bytes([c]) * n for n in (0, 5, 1)], STRING)
        views.append(ChunkView(bytes(raw), [STRING], 3, f"chunk {c}"))
    which = np.array([2, 0, 1, 2, 1], np.int64)
    local = np.array([1, 1, 0, 2, 1], np.int64)
    batch = gather(STRING, views, which, local, 0)
    assert list(batch.strings()) == [b"\x02" * 5, b"\x00" * 5, b"", b"\x02", b"\x01" * 5]


def test_string_buffer_checks_its_shape() -> None:
    with pytest.raises(yogastore.UnsupportedElementError):
        StringBuffer(np.zeros(3, np.uint8), np.array([0, 3], np.int64), (2,))
    sb = StringBuffer(np.frombuffer(b"abc", np.uint8), np.array([0, 1, 1, 3], np.int64), (3, 1))
    assert sb.to_numpy().tolist() == [[b"a"], [b""], [b"bc"]]
    assert len(sb) == 3 and sb.lengths().tolist() == [1, 0, 2]


_DATA = np.frombuffer(b"hello world", np.uint8)
_I64 = np.array([0, 6], np.int64)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: StringRanges(_DATA, _I64.astype(np.int32), _I64, (2,)), "starts"),
        (lambda: StringRanges(_DATA, _I64, np.array([5.0, 5.0]), (2,)), "lengths"),
        (lambda: StringRanges(_DATA, [0, 6], _I64, (2,)), "starts"),
        (lambda: StringRanges(_DATA, np.array([0, 9, 6, 9])[::2], _I64, (2,)), "non-contiguous"),
        (lambda: StringRanges(_DATA, _I64.reshape(1, 2), _I64, (2,)), "2-D"),
        (lambda: StringRanges(b"hello world", _I64, _I64, (2,)), "data"),
        (lambda: StringRanges(_DATA.view(np.int8), _I64, _I64, (2,)), "int8"),
        (lambda: StringRanges(_DATA, _I64, _I64, (-2,)), "non-negative"),
        (lambda: StringRanges(_DATA, _I64, _I64, [2]), "tuple"),
        (lambda: StringBuffer(_DATA, np.array([0, 5, 11], np.int32), (2,)), "offsets"),
        (lambda: StringBuffer(_DATA.astype(np.int64), np.array([0, 5, 11]), (2,)), "data"),
        (lambda: StringBuffer(_DATA, np.array([0, 5, 11]), (2.0,)), "shape"),
        # numpy dims whose product wraps around int64 to the count: taken as Python ints
        (
            lambda: StringRanges(_DATA, _I64, _I64, (np.int64(3), np.int64(6148914691236517206))),
            "18446744073709551618 starts",
        ),
        (
            lambda: StringBuffer(
                _DATA, np.array([0, 5, 11]), (np.int64(3), np.int64(6148914691236517206))
            ),
            "18446744073709551619 offsets",
        ),
    ],
)
def test_string_parts_of_the_wrong_kind_are_named(make: Any, named: str) -> None:
    # Hand-built batches with parts the kernels cannot read get an error naming the part,
    # never a copy of the wrong bytes.
    with pytest.raises(yogastore.UnsupportedElementError, match=named):
        make()


@pytest.mark.parametrize(
    ("make", "named"),
    [
        # start + length wraps around int64 to a small number
        (
            lambda: StringRanges(_DATA, np.array([2**63 - 2, 6]), np.array([5, 5]), (2,)),
            "outside the 11 bytes",
        ),
        (
            lambda: StringRanges(_DATA, np.array([0, 6]), np.array([5, 6]), (2,)),
            "outside the 11 bytes",
        ),
        (
            lambda: StringBuffer(_DATA, np.array([0, 11, 5]), (2,)),
            "offset 2 \\(5\\) is below offset 1 \\(11\\)",
        ),
    ],
)
def test_string_parts_out_of_bounds_are_refused_when_made(make: Any, named: str) -> None:
    with pytest.raises(yogastore.CorruptCacheError, match=named):
        make()


def test_string_batches_reshape_only_to_their_count() -> None:
    buf = StringBuffer(_DATA, np.array([0, 5, 5, 11], np.int64), (3,))
    ranges = StringRanges(_DATA, np.array([0, 5, 5]), np.array([5, 0, 6]), (3,))
    for values in (buf, ranges):
        got = reshape_values(values, (np.int64(1), -1))
        assert got.shape == (1, 3) and all(type(d) is int for d in got.shape)
        assert got.to_numpy().tolist() == [[b"hello", b"", b" world"]]
        for wrong in ((2, 2), (4,), (-3, -1)):
            with pytest.raises(yogastore.UnsupportedElementError, match="cannot reshape"):
                reshape_values(values, wrong)


def test_string_parts_of_the_right_kind_read_back() -> None:
    ranges = StringRanges(_DATA, _I64, np.array([5, 5], np.int64), (2,))
    assert ranges.to_numpy().tolist() == [b"hello", b"world"]
    empty = StringRanges(_DATA, _I64[:0], _I64[:0], (0, 3))
    assert empty.to_buffer().to_numpy().shape == (0, 3)
    buf = StringBuffer(_DATA, np.array([0, 5, 11], np.int64), (np.int64(2),))
    assert buf.to_numpy().tolist() == [b"hello", b" world"]
    assert buf.shape == (2,) and type(buf.shape[0]) is int
    edge = StringRanges(_DATA, np.array([0, 11]), np.array([11, 0]), (2,))  # ends at the end
    assert edge.to_numpy().tolist() == [b"hello world", b""]


def test_empty_dataset_region_gathers(tmp_path: Path) -> None:
    # Only empty strings and empty token rows: every data region is empty.
    ds = tf.data.Dataset.from_tensor_slices(
        {"s": tf.constant([b""] * 9), "t": tf.ragged.constant([[]] * 9, tf.int32)}
    )
    ref = yogastore.Store(tmp_path, chunk_bytes=64).cache("empty", "1", lambda: ds)
    got = list(ref.stream(shuffle=True).batches(4, strings=StringFormat.BUFFERS))
    assert sum(len(b["s"]) for b in got) == 9
    assert all(b["s"].to_numpy().tolist() == [b""] * len(b["s"]) for b in got)
    tf_batches = list(ref.stream(shuffle=True).to_tf_dataset(batch_size=4))
    assert [b["s"].numpy().tolist() for b in tf_batches] == [[b""] * 4, [b""] * 4, [b""]]
    assert all(b["t"].to_list() == [[]] * len(b["t"].to_list()) for b in tf_batches)
