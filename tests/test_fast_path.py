"""The fixed-shape fast path: compiled row gather, pooled buffers, batch lifetime, tf.data."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import yogastore
from yogastore._gather import gather_rows, gather_rows_at
from yogastore.format import ALIGN
from yogastore.format.memory import BufferPool
from yogastore.read.reader import chunk_lookup

SMALL, BIG = "small", "big"
# Small records: Stream.batches gathers many batches at once and hands out views.
# Big records: each batch is one gather, into its own pooled buffer.
DATA = {
    SMALL: np.random.default_rng(42).integers(0, 256, size=(20000, 64), dtype=np.uint8),
    BIG: np.random.default_rng(43).integers(0, 256, size=(1200, 16384), dtype=np.uint8),
}
CHUNK_BYTES = {SMALL: 1 << 16, BIG: 1 << 20}


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, yogastore.DatasetRef]:
    """Datasets of ``{"x": uint8[row], "label": int64}`` where ``x == DATA[name][label]``."""
    root = tmp_path_factory.mktemp("fast-path")
    out = {}
    for name, x in DATA.items():
        labels = np.arange(len(x), dtype=np.int64)
        ref = yogastore.Store(root, chunk_bytes=CHUNK_BYTES[name]).cache(
            name,
            "1",
            lambda x=x, labels=labels: tf.data.Dataset.from_tensor_slices(
                {"x": x, "label": labels}
            ),
        )
        assert ref.num_records == len(x)
        assert len(ref.manifest.chunks) > 10
        out[name] = ref
    return out


@pytest.fixture
def ref(refs: dict[str, yogastore.DatasetRef]) -> yogastore.DatasetRef:
    return refs[SMALL]


def address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def check_batch(batch: dict[str, Any], name: str = SMALL) -> None:
    """Each row of ``x`` must still hold the source bytes of its label's record."""
    labels = np.asarray(batch["label"])
    x = DATA[name]
    assert batch["x"].shape == (len(labels), x.shape[1])
    np.testing.assert_array_equal(np.asarray(batch["x"]), x[labels])


def labels_of(batches: Iterator[dict[str, Any]]) -> list[int]:
    return [int(v) for b in batches for v in np.asarray(b["label"])]


# gather_rows ----------------------------------------------------------------------


@pytest.mark.parametrize("row", [1, 7, 8, 16, 24, 64])
def test_gather_rows_matches_fancy_indexing(row: int) -> None:
    rng = np.random.default_rng(row)
    src = rng.integers(0, 256, size=5000, dtype=np.uint8)
    starts = rng.integers(0, len(src) - row + 1, size=300).astype(np.int64)
    starts[:2] = [0, len(src) - row]  # both edges are in range
    dst = np.empty((len(starts), row), np.uint8)
    assert gather_rows(dst, src, starts, row) is None
    np.testing.assert_array_equal(dst, src[starts[:, None] + np.arange(row)])
    # Any bytes-like source and destination work, read-only sources included.
    out = bytearray(len(starts) * row)
    gather_rows(out, src.tobytes(), starts.tobytes(), row)
    assert bytes(out) == dst.tobytes()


@pytest.mark.parametrize("bad", [-1, 5000 - 16 + 1, 10**12])
def test_gather_rows_checks_every_start_before_copying(bad: int) -> None:
    src = np.arange(5000, dtype=np.int64).astype(np.uint8)
    starts = np.array([0, 16, 32, bad, 48], dtype=np.int64)
    dst = np.full((5, 16), 0xAB, np.uint8)
    with pytest.raises(IndexError, match=r"row 3 starts at byte"):
        gather_rows(dst, src, starts, 16)
    assert (dst == 0xAB).all(), "rows before the bad start must not have been copied"


def test_gather_rows_rejects_bad_buffers() -> None:
    src = np.arange(256, dtype=np.uint8)
    starts = np.array([0, 8, 16], dtype=np.int64)
    with pytest.raises(ValueError, match="int64"):
        gather_rows(np.empty(48, np.uint8), src, starts.tobytes()[:-3], 16)
    with pytest.raises(ValueError, match="int64"):
        gather_rows(np.empty(48, np.uint8), src, np.zeros(3, np.int32), 16)
    with pytest.raises(ValueError, match="destination holds 47 bytes"):
        gather_rows(np.empty(47, np.uint8), src, starts, 16)
    with pytest.raises(ValueError, match="row_bytes"):
        gather_rows(np.empty(48, np.uint8), src, starts, -1)
    with pytest.raises(TypeError):
        gather_rows(bytes(48), src, starts, 16)
    frozen = np.zeros(48, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(TypeError):
        gather_rows(frozen, src, starts, 16)
    assert not frozen.any()


def test_gather_rows_of_zero_bytes_is_a_no_op() -> None:
    src = np.arange(100, dtype=np.uint8)
    dst = np.full(10, 7, np.uint8)
    assert gather_rows(dst, src, np.array([0, 50, 100], dtype=np.int64), 0) is None
    assert (dst == 7).all()
    gather_rows(bytearray(), src, np.array([3], dtype=np.int64), 0)  # no room is needed
    gather_rows(dst, src, np.array([], dtype=np.int64), 16)  # no rows at all
    assert (dst == 7).all()


# gather_rows_at ---------------------------------------------------------------------

# The source's first byte is at address LOWEST; chunk c's rows start at ADDRESSES[c].
# Chunk 2 was never added (address 0).
LOWEST = 4096
ADDRESSES = np.array([LOWEST + 3000, LOWEST, 0, LOWEST + 1000], dtype=np.int64)


@pytest.mark.parametrize("row", [1, 8, 16, 100])
def test_gather_rows_at_matches_the_starts_of_fancy_indexing(row: int) -> None:
    rng = np.random.default_rng(row)
    src = rng.integers(0, 256, size=3000 + 40 * row, dtype=np.uint8)
    added = np.array([0, 1, 3])
    chunks = added[rng.integers(0, 3, size=2000)]
    # Chunk 0's rows run to the source's end; the others' to where the next begins.
    room = {0: 40, 1: 1000 // row, 3: 2000 // row}
    local = np.array([rng.integers(0, room[c]) for c in chunks], dtype=np.int64)
    local[:2], chunks[:2] = [0, 39], [1, 0]  # the source's first and last rows
    starts = ADDRESSES[chunks] - LOWEST + local * row
    dst = np.empty((len(local), row), np.uint8)
    assert gather_rows_at(dst, src, ADDRESSES, chunks, local, LOWEST, row) is None
    np.testing.assert_array_equal(dst, src[starts[:, None] + np.arange(row)])
    out = bytearray(len(local) * row)  # any bytes-like buffers work
    gather_rows_at(out, src.tobytes(), ADDRESSES.tobytes(), chunks.tobytes(), local, LOWEST, row)
    assert bytes(out) == dst.tobytes()
    # With a stride of its own, rows overlap: pairs of 8-byte offsets, say.
    wide = np.empty((len(local), row + 8), np.uint8)
    local //= 2  # rows of row + 8 bytes every row bytes stay within the chunks above
    gather_rows_at(wide, src, ADDRESSES, chunks, local, LOWEST, row + 8, row)
    starts = ADDRESSES[chunks] - LOWEST + local * row
    np.testing.assert_array_equal(wide, src[starts[:, None] + np.arange(row + 8)])


@pytest.mark.parametrize(
    ("chunk", "local", "error", "message"),
    [
        (4, 0, IndexError, "row 600 names chunk 4 of 4"),
        (-1, 0, IndexError, "row 600 names chunk -1 of 4"),
        (2, 0, RuntimeError, "row 600 names chunk 2, which was never added"),
        (0, 62, IndexError, r"row 600 starts at byte 3992, outside the 4000-byte source"),
        (0, -1, IndexError, "row 600 is record -1 of its chunk"),
        (0, 2**62, IndexError, f"row 600 is record {2**62} of its chunk"),
    ],
)
def test_gather_rows_at_names_the_bad_row(
    chunk: int, local: int, error: type[Exception], message: str
) -> None:
    src = np.zeros(4000, np.uint8)
    chunks = np.ones(1000, np.int64)
    rows = np.arange(1000, dtype=np.int64) % 60
    chunks[600], rows[600] = chunk, local
    with pytest.raises(error, match=message):
        gather_rows_at(np.empty(16000, np.uint8), src, ADDRESSES, chunks, rows, LOWEST, 16)


def test_gather_rows_at_rejects_bad_buffers() -> None:
    src = np.arange(4000, dtype=np.uint8)
    chunks, local = np.array([0, 1], np.int64), np.array([0, 1], np.int64)
    dst = np.empty(32, np.uint8)
    with pytest.raises(ValueError, match="int64"):
        gather_rows_at(dst, src, ADDRESSES[:3].astype(np.int32), chunks, local, LOWEST, 16)
    with pytest.raises(ValueError, match="int64"):
        gather_rows_at(dst, src, ADDRESSES, chunks.tobytes()[:-1], local, LOWEST, 16)
    with pytest.raises(ValueError, match="chunks holds 1 values, local 2"):
        gather_rows_at(dst, src, ADDRESSES, chunks[:1], local, LOWEST, 16)
    with pytest.raises(ValueError, match="destination holds 31 bytes"):
        gather_rows_at(dst[:31], src, ADDRESSES, chunks, local, LOWEST, 16)
    with pytest.raises(ValueError, match="row_bytes"):
        gather_rows_at(dst, src, ADDRESSES, chunks, local, LOWEST, -1)
    with pytest.raises(ValueError, match="stride"):
        gather_rows_at(dst, src, ADDRESSES, chunks, local, LOWEST, 16, -8)
    with pytest.raises(TypeError):
        gather_rows_at(bytes(32), src, ADDRESSES, chunks, local, LOWEST, 16)
    before = dst.copy()
    assert gather_rows_at(dst, src, ADDRESSES, chunks, local, LOWEST, 0) is None
    np.testing.assert_array_equal(dst, before)  # rows of no bytes copy nothing


# BufferPool -----------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 63, 64, 65, 1000, 1 << 20])
def test_pool_takes_aligned_writable_buffers_of_the_exact_size(nbytes: int) -> None:
    pool = BufferPool()
    arr = pool.take(nbytes)
    assert arr.dtype == np.uint8 and arr.shape == (nbytes,)
    assert arr.flags.writeable and arr.flags.c_contiguous
    assert address(arr) % ALIGN == 0
    arr[:] = 5  # writes reach the whole buffer
    assert int(arr.sum()) == 5 * nbytes
    held = pool.take(nbytes)  # arr is alive: fresh memory, also aligned
    assert address(held) % ALIGN == 0
    assert not np.shares_memory(arr, held)


def test_pool_reuses_a_buffer_only_after_every_view_is_gone() -> None:
    pool = BufferPool()
    nbytes = 4096
    a = pool.take(nbytes)
    a_addr, a_base = address(a), weakref.ref(a.base)
    view = a.view(np.int64).reshape(8, 64)
    del a
    b = pool.take(nbytes)  # `view` still holds a's memory
    assert address(b) != a_addr and not np.shares_memory(b, view)
    b[:] = 0
    view[:] = -1
    assert not b.any(), "writing the held view must not touch the new buffer"
    row = view[3]  # a view of a view keeps it alive too
    del view
    c = pool.take(nbytes)
    assert address(c) not in (a_addr, address(b))
    del row
    d = pool.take(nbytes)  # now only the pool holds a's buffer
    assert address(d) == a_addr
    assert d.base is a_base(), "the very same buffer must be handed out again"
    del b, c, d
    assert address(pool.take(nbytes)) == a_addr


def test_pool_keeps_at_most_max_buffers() -> None:
    pool = BufferPool(max_buffers=2)
    held = [pool.take(1000) for _ in range(5)]
    bases = [weakref.ref(h.base) for h in held]
    assert len({address(h) for h in held}) == 5
    del held
    alive = [w() is not None for w in bases]
    assert alive == [True, True, False, False, False], "the pool keeps only the first two"
    again = [pool.take(1000) for _ in range(2)]
    assert {id(a.base) for a in again} == {id(w()) for w in bases[:2]}


def test_pool_replaces_an_idle_buffer_of_another_size() -> None:
    pool = BufferPool(max_buffers=1)
    small = pool.take(100)
    small_base = weakref.ref(small.base)
    del small
    assert small_base() is not None  # the pool keeps it for reuse
    big = pool.take(5000)
    assert big.shape == (5000,)
    assert small_base() is None, "the idle 100-byte buffer must make room for the new size"
    big_base = weakref.ref(big.base)
    del big
    assert pool.take(5000).base is big_base()
    pool.clear()
    assert big_base() is None


# Stream.batches -------------------------------------------------------------------


@pytest.mark.parametrize("name", [SMALL, BIG])
def test_kept_batches_are_never_overwritten(
    refs: dict[str, yogastore.DatasetRef], name: str
) -> None:
    n = len(DATA[name])
    stream = refs[name].stream(seed=7)
    grouped = stream.group_factor(100, 1 << 20, 64) > 1
    assert grouped == (name == SMALL), "the two datasets must exercise both read paths"
    batches, handed = [], []
    for b in stream.batches(100):
        batches.append(b)
        handed.append(b["label"].copy())  # labels and x could be overwritten together
    assert len(batches) == n // 100
    seen = np.concatenate(handed)
    assert sorted(seen.tolist()) == list(range(n))
    assert seen.tolist() != list(range(n)), "the stream must be shuffled"
    for b, labels in zip(batches, handed, strict=True):
        np.testing.assert_array_equal(b["label"], labels)
        check_batch(b, name)
    xs = [b["x"] for b in batches]
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            assert not np.shares_memory(xs[i], xs[j]), f"batches {i} and {j} share memory"


@pytest.mark.parametrize("name", [SMALL, BIG])
def test_batches_kept_while_others_are_dropped_stay_intact(
    refs: dict[str, yogastore.DatasetRef], name: str
) -> None:
    n, size = len(DATA[name]), 96
    count = -(-n // size)  # the last batch is short
    kept, handed, addresses, lengths = [], [], [], []
    for i, batch in enumerate(refs[name].stream(seed=11).batches(size)):
        check_batch(batch, name)  # each one is right when handed out
        addresses.append(address(batch["x"]))
        lengths.append(len(batch["label"]))
        if i % 2 == 1:
            kept.append(batch)
            handed.append(batch["label"].copy())
    assert len(addresses) == count
    assert len(kept) == count // 2
    assert lengths == [size] * (count - 1) + [n - (count - 1) * size]
    if name == BIG:
        assert len(set(addresses)) < count, "dropped batches' memory must have been reused"
    for batch, labels in zip(kept, handed, strict=True):
        # Still the same records, still right, after the dropped ones' memory was reused.
        np.testing.assert_array_equal(batch["label"], labels)
        check_batch(batch, name)


@pytest.mark.parametrize("name", [SMALL, BIG])
def test_batches_are_freed_without_the_garbage_collector(
    refs: dict[str, yogastore.DatasetRef], name: str
) -> None:
    gc.collect()
    gc.disable()
    try:
        it = refs[name].stream(seed=3).batches(50)
        batch = next(it)
        check_batch(batch, name)
        x_ref = weakref.ref(batch["x"])
        label_ref = weakref.ref(batch["label"])
        del batch
        nxt = next(it)
        check_batch(nxt, name)
        assert x_ref() is None, "the batch's x is still referenced (a cycle?)"
        assert label_ref() is None, "the batch's label is still referenced (a cycle?)"
    finally:
        gc.enable()


# tf.data --------------------------------------------------------------------------


def test_tf_dataset_turns_the_autotuner_off_and_matches_batches(
    ref: yogastore.DatasetRef,
) -> None:
    ds = ref.stream(1, 2, seed=5).to_tf_dataset(batch_size=128)
    assert ds.options().autotune.enabled is False
    expected = list(ref.stream(1, 2, seed=5).batches(128))
    got = [{k: v.numpy() for k, v in b.items()} for b in ds]
    assert len(got) == len(expected) == -(-(len(DATA[SMALL]) // 2) // 128)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g["label"], e["label"])
        np.testing.assert_array_equal(g["x"], e["x"])
        check_batch(g)
    opts = tf.data.Options()
    opts.autotune.enabled = True
    assert ds.with_options(opts).options().autotune.enabled is True


# Prefetch -------------------------------------------------------------------------


def test_prefetch_defaults_to_none_and_does_not_change_records(
    ref: yogastore.DatasetRef,
) -> None:
    default = ref.stream(0, 3, seed=2)
    assert default.prefetch is None
    reads = {}
    for depth in (None, 0, 2):
        stream = ref.stream(0, 3, seed=2, prefetch=depth)
        batches = list(stream.batches(64))
        for b in batches:
            check_batch(b)
        reads[depth] = labels_of(iter(batches))
    assert len(reads[None]) == len(DATA[SMALL]) // 3
    assert reads[None] == reads[0] == reads[2]
    with pytest.raises(yogastore.InvalidArgumentError, match="prefetch"):
        ref.stream(prefetch=-1)


def test_flat_dict_schema_packs_like_the_general_nest_walk() -> None:
    from yogastore.spec import Schema, pack_structure

    leaf = yogastore.ComponentSpec(shape=(), dtype="int64")
    flat = Schema.from_specs({"b": leaf, "a": leaf, "c": leaf})
    nested = Schema.from_specs({"a": leaf, "n": (leaf, {"x": leaf})})
    assert flat._flat_dict is not None and nested._flat_dict is None
    for schema in (flat, nested):
        leaves = [10, 20, 30, 40][: len(schema.components)]
        packed = schema.pack(leaves)
        assert packed == pack_structure(schema.structure, leaves)
        assert list(packed) == schema.structure["keys"]  # key order kept
        assert schema.flatten(packed) == leaves
    # A schema read back from its JSON gets the same fast path.
    again = Schema.from_json(flat.to_json(), "test")
    assert again == flat and again._flat_dict == flat._flat_dict


@pytest.mark.parametrize(
    "counts",
    [
        [5, 5, 5, 1],
        [7, 3, 9, 3, 4],
        [1, 1, 1],
        [3, 8],
        [1000, 999, 1001, 4097, 2],
        [2**12 + 1] * 30 + [7],
    ],
)
def test_chunk_lookup_finds_the_chunk_the_binary_search_finds(counts: list[int]) -> None:
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    n = int(sum(counts))
    lookup = chunk_lookup(starts, n)
    assert lookup is not None
    records = np.random.default_rng(0).permutation(n).astype(np.int64)
    expected = np.searchsorted(starts, records, side="right") - 1
    np.testing.assert_array_equal(lookup.chunks(records), expected)
    assert lookup.chunks(np.array([0, n - 1], np.int64)).tolist() == [0, len(counts) - 1]


def test_chunk_lookup_declines_empty_chunks_and_huge_tables() -> None:
    assert chunk_lookup(np.array([0, 4, 4], np.int64), 9) is None  # an empty chunk
    assert chunk_lookup(np.array([0, 4], np.int64), 4) is None  # an empty last chunk
    assert chunk_lookup(np.array([0], np.int64), 9) is None  # one chunk: nothing to look up
    assert chunk_lookup(np.arange(3_000_000, dtype=np.int64), 3_000_000) is None
