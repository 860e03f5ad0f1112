"""Local reads verify what they read: chunk indexes, then the blocks of the records gathered."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore
from yogastore.cli import main as cli_main
from yogastore.format import ChunkView, parse_header

N = 600
SPEC = {
    "x": yogastore.ComponentSpec(shape=(300,), dtype="int32"),  # fixed, 1200-byte rows
    "s": yogastore.ComponentSpec(shape=(), dtype="string"),  # bytes: 0 to 2 KiB
    "r": yogastore.ComponentSpec(
        shape=(None, None), dtype="int64", kind=yogastore.Kind.RAGGED, ragged_rank=1
    ),
}
LAYOUTS = {"fixed": "fixed", "bytes": "bytes", "ragged": "var"}


def _record(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    k = i % 7  # 0: an empty ragged row
    values = rng.integers(-(2**40), 2**40, size=k, dtype=np.int64)
    return {
        "x": np.arange(i, i + 300, dtype=np.int32),
        "s": b"" if i % 5 == 0 else rng.bytes(int(rng.integers(1, 2048))),
        "r": yogastore.RaggedValue(values, (np.array([0, k // 2, k]),)),
    }


RECORDS = [_record(i) for i in range(N)]


def build(root: Path, chunk_bytes: int = 16 << 10) -> yogastore.DatasetRef:
    ref = yogastore.Store(root, chunk_bytes=chunk_bytes).cache(
        "d", "1", lambda: iter(RECORDS), spec=SPEC
    )
    assert len(ref.manifest.chunks) > 20
    return ref


def check_batch(batch: dict[str, Any], records: np.ndarray) -> None:
    """Every value of the batch is the record's own (no wrong byte ever reaches a caller)."""
    ragged = batch["r"].to_list()
    for j, i in enumerate(records.tolist()):
        assert np.array_equal(batch["x"][j], RECORDS[i]["x"])
        assert batch["s"][j] == RECORDS[i]["s"]
        assert ragged[j] == RECORDS[i]["r"].to_list()


def rank_records(ref: yogastore.DatasetRef, rank: int, num_shards: int) -> np.ndarray:
    stream = ref.stream(rank, num_shards, shuffle=True, seed=3)
    return np.concatenate(list(stream.record_indices(64)))


class Chunks:
    """The chunks of a version as the test sees them, parsed independently of the reader."""

    def __init__(self, ref: yogastore.DatasetRef) -> None:
        self.ref = ref
        self.columns = ref.manifest.columns()
        self.starts = ref.manifest.chunk_starts()

    def open(self, c: int) -> tuple[bytes, ChunkView, list[int]]:
        info = self.ref.manifest.chunks[c]
        data = bytes(self.ref.store.backend.get(info.key))
        header = parse_header(data, len(data), "test")
        view = ChunkView(data, self.columns, info.count, "test", header)
        return data, view, header["blocks"]

    def ranges(self, record: int) -> list[tuple[int, str, int, int]]:
        """Return (chunk, layout, start, end) of the record's bytes in every column."""
        c = int(np.searchsorted(self.starts, record, side="right") - 1)
        r = record - int(self.starts[c])
        data, view, _ = self.open(c)
        header = parse_header(data, len(data), "test")
        out = []
        for i, (spec, col) in enumerate(zip(self.columns, view.columns, strict=True)):
            at = header["cols"][i]["data"][0]
            if spec.layout == "fixed":
                row = col.data.nbytes // max(len(col.data), 1)
                a, b = at + r * row, at + (r + 1) * row
            elif spec.layout == "var":
                item = col.data.itemsize
                a, b = at + int(col.offsets[r]) * item, at + int(col.offsets[r + 1]) * item
            else:
                a = at + int(col.boffsets[col.offsets[r]])
                b = at + int(col.boffsets[col.offsets[r + 1]])
            out.append((c, spec.layout, a, b))
        return out

    def blocks(self, records: np.ndarray) -> set[tuple[int, int]]:
        """Return the (chunk, block) pairs holding any byte of ``records``."""
        out: set[tuple[int, int]] = set()
        tables: dict[int, list[int]] = {}
        for record in records.tolist():
            for c, _layout, a, b in self.ranges(record):
                if b <= a:
                    continue
                if c not in tables:
                    tables[c] = self.open(c)[2]
                _at, _n, base, size = tables[c]
                out.update((c, j) for j in range((a - base) // size, (b - 1 - base) // size + 1))
        return out

    def flip(self, root: Path, c: int, offset: int) -> None:
        """Flip one bit of chunk ``c`` at ``offset`` in the LMDB data file, in place."""
        chunk = self.open(c)[0]
        path = root / "d" / "1" / "data.mdb"
        at = path.read_bytes().find(chunk)
        assert at >= 0, "the chunk is not stored contiguously in data.mdb"
        with open(path, "r+b") as f:
            f.seek(at + offset)
            byte = f.read(1)[0]
            f.seek(at + offset)
            f.write(bytes([byte ^ 0x10]))


def read_rank(ref: yogastore.DatasetRef, rank: int, num_shards: int) -> int:
    """Read a rank's epoch, checking every value; return the records read."""
    stream = ref.stream(rank, num_shards, shuffle=True, seed=3)
    order = rank_records(ref, rank, num_shards)
    done = 0
    for batch in stream.batches(64):
        n = len(batch["x"])
        check_batch(batch, order[done : done + n])
        done += n
    return done


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_flip_in_a_block_the_rank_reads_raises_naming_chunk_and_block(
    tmp_path: Path, layout: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not compiled:  # the path without the extension: lookups and hashes in numpy / xxhash
        monkeypatch.setattr("yogastore.read.verified._gather", None)
    ref = build(tmp_path)
    chunks = Chunks(ref)
    mine = rank_records(ref, 3, 8)
    # A record of this rank late in its epoch, with bytes in the column of this layout.
    target = next(
        (c, a, b)
        for record in mine[::-1].tolist()
        for c, lay, a, b in chunks.ranges(record)
        if lay == LAYOUTS[layout] and b - a >= 16
    )
    c, _a, b = target
    _at, _n, base, size = chunks.open(c)[2]
    chunks.flip(tmp_path, c, b - 1)  # the record's last byte
    block = (b - 1 - base) // size
    lo = base + block * size
    with pytest.raises(
        yogastore.CorruptCacheError,
        match=rf"chunk {c} \(.*\): block {block} \(bytes \[{lo}, .*delete and rebuild",
    ):
        read_rank(yogastore.Store(tmp_path).open("d", "1"), 3, 8)


def test_flip_in_a_block_the_rank_does_not_read_leaves_it_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = build(tmp_path)
    chunks = Chunks(ref)
    mine = rank_records(ref, 5, 8)
    read_blocks = chunks.blocks(mine)
    c = int(np.bincount([c for c, _ in read_blocks]).argmax())  # a chunk the rank reads
    _at, nbytes, base, size = chunks.open(c)[2]
    unread = [j for j in range(nbytes // 8) if (c, j) not in read_blocks]
    assert unread, "every block of the chunk is read by the rank"
    chunks.flip(tmp_path, c, base + unread[0] * size + 3)
    ref = yogastore.Store(tmp_path).open("d", "1")
    assert read_rank(ref, 5, 8) == len(mine)
    # Whole-chunk verification still finds the damage, and a reader of that block stops.
    assert cli_main(["--store", str(tmp_path), "verify", "d", "1"]) == 1
    assert f"chunk {c} " in capsys.readouterr().err
    with pytest.raises(yogastore.CorruptCacheError, match=rf"chunk {c} .*block {unread[0]} "):
        read_rank(ref, 0, 1)


def test_records_straddling_blocks_are_checked_in_every_block(tmp_path: Path) -> None:
    ref = build(tmp_path)
    chunks = Chunks(ref)
    # Records whose strings cross a block boundary, each at the start or end of its chunk.
    starts = ref.manifest.chunk_starts()
    edges = sorted({int(s) for s in starts} | {int(s) - 1 for s in starts[1:]})
    picked = []
    for record in edges:
        c, _lay, a, b = next(r for r in chunks.ranges(record) if r[1] == "bytes")
        _at, _n, base, size = chunks.open(c)[2]
        if b - a > 1 and (a - base) // size != (b - 1 - base) // size:
            picked.append((record, c, a, b))
    assert len(picked) >= 4
    (r1, c1, _a1, b1), (r2, c2, a2, _b2) = picked[0], picked[-1]
    chunks.flip(tmp_path, c1, b1 - 1)  # last byte: in the record's last block
    chunks.flip(tmp_path, c2, a2)  # first byte: in its first block
    damaged = {
        (c, (at - chunks.open(c)[2][2]) // chunks.open(c)[2][3])
        for c, at in ((c1, b1 - 1), (c2, a2))
    }
    others = np.array(
        [p[0] for p in picked[1:-1] if not chunks.blocks(np.array([p[0]])) & damaged],
        dtype=np.int64,
    )
    assert len(others) >= 2 and len(set(np.searchsorted(starts, others, side="right"))) >= 2
    source = yogastore.Store(tmp_path).open("d", "1").make_source()
    source.gather(others)  # the other straddling records read fine
    for record, c in ((r1, c1), (r2, c2)):
        with pytest.raises(yogastore.CorruptCacheError, match=rf"chunk {c} .*block \d+ "):
            source.gather(np.array([record], dtype=np.int64))
    # A batch across chunk boundaries holding a damaged record fails as a whole.
    with pytest.raises(yogastore.CorruptCacheError):
        source.gather(np.concatenate([others, [r1]]))


def test_empty_records_verify_no_data_blocks(tmp_path: Path) -> None:
    spec = {
        "s": yogastore.ComponentSpec(shape=(), dtype="string"),
        "v": yogastore.ComponentSpec(shape=(None,), dtype="float32"),
    }

    def items() -> Any:
        for i in range(400):
            n = 0 if i % 2 else 300
            yield {"s": b"z" * n, "v": np.full(n, i, np.float32)}

    ref = yogastore.Store(tmp_path, chunk_bytes=8 << 10).cache("d", "1", items, spec=spec)
    source = ref.make_source()
    empty = np.arange(1, 400, 2, dtype=np.int64)
    cols = source.gather(empty)
    assert [c.data.nbytes for c in cols] == [0, 0]
    stats = source.stats.as_dict()
    assert stats["bytes_verified"] == sum(c.index_bytes for c in ref.manifest.chunks)
    source.gather(np.array([0], dtype=np.int64))
    assert source.stats.bytes_verified > stats["bytes_verified"]


def test_a_rank_verifies_about_its_share(tmp_path: Path) -> None:
    record_bytes, n, shards = 16 << 10, 1024, 8
    spec = {"x": yogastore.ComponentSpec(shape=(record_bytes,), dtype="uint8")}
    store = yogastore.Store(tmp_path, chunk_bytes=1 << 20)
    ref = store.cache(
        "d",
        "1",
        lambda: ({"x": np.full(record_bytes, i % 251, np.uint8)} for i in range(n)),
        spec=spec,
    )
    data = sum(c.nbytes for c in ref.manifest.chunks)
    indexes = sum(c.index_bytes for c in ref.manifest.chunks)
    assert len(ref.manifest.chunks) >= 16
    stream = ref.stream(1, shards, shuffle=True, seed=0)
    records = sum(len(b["x"]) for b in stream.batches(32))
    assert records == n // shards
    verified = stream.stats()["bytes_verified"]
    share = records * record_bytes
    assert share <= verified <= 1.3 * share + indexes
    assert verified < data / 4  # not the whole dataset, as whole-chunk checks did
    # Another stream of this process reads the same blocks: checked once per process.
    # It shares the first stream's chunk views and hashes only their indexes again.
    again = ref.stream(1, shards, shuffle=True, seed=0)
    assert sum(len(b["x"]) for b in again.batches(32)) == records
    assert again.stats()["bytes_verified"] == indexes


def _child_reads_rank(root: str, rank: int, expect_error: bool) -> None:
    ref = yogastore.Store(root).open("d", "1")
    try:
        read_rank(ref, rank, 2)
    except yogastore.CorruptCacheError:
        raise SystemExit(0 if expect_error else 2) from None
    raise SystemExit(1 if expect_error else 0)


@pytest.mark.multiprocess
def test_fork_children_check_blocks_their_parent_did_not(tmp_path: Path) -> None:
    ref = build(tmp_path)
    chunks = Chunks(ref)
    read_rank(ref, 0, 2)  # the parent checks rank 0's blocks
    theirs = chunks.blocks(rank_records(ref, 1, 2)) - chunks.blocks(rank_records(ref, 0, 2))
    c, j = min(theirs)
    _at, _n, base, size = chunks.open(c)[2]
    chunks.flip(tmp_path, c, base + j * size)
    ctx = multiprocessing.get_context("fork")
    for rank, expect_error in ((0, False), (1, True)):
        child = ctx.Process(target=_child_reads_rank, args=(str(tmp_path), rank, expect_error))
        child.start()
        child.join(60)
        assert child.exitcode == 0, (rank, child.exitcode)


def test_a_batch_reading_most_of_a_chunk_skips_damage_it_does_not_read(tmp_path: Path) -> None:
    # Most of a chunk at once is checked by one hash of the whole chunk; when that
    # fails, block by block: damage outside the records read does not stop them.
    ref = build(tmp_path)
    chunks = Chunks(ref)
    starts = ref.manifest.chunk_starts()
    c = 2
    first, count = int(starts[c]), ref.manifest.chunks[c].count
    head = np.arange(first, first + count - 1, dtype=np.int64)
    read = chunks.blocks(head)
    _at, nbytes, base, size = chunks.open(c)[2]
    unread = [j for j in range(nbytes // 8) if (c, j) not in read]
    assert unread and len(read) * 4 >= nbytes // 8  # the whole-chunk hash is tried
    chunks.flip(tmp_path, c, base + unread[0] * size + 1)
    source = yogastore.Store(tmp_path).open("d", "1").make_source()
    cols = source.gather(head)
    assert np.array_equal(cols[-1].data, np.stack([RECORDS[i]["x"] for i in head.tolist()]))
    with pytest.raises(yogastore.CorruptCacheError, match=rf"chunk {c} .*block \d+ \(bytes"):
        source.gather(np.arange(first, first + count, dtype=np.int64))


@pytest.mark.parametrize("where", ["header", "block table"], ids=["header", "table"])
def test_a_damaged_index_is_refused_before_it_is_used(tmp_path: Path, where: str) -> None:
    ref = build(tmp_path)
    chunks = Chunks(ref)
    at, _n, _base, _size = chunks.open(1)[2]
    chunks.flip(tmp_path, 1, 20 if where == "header" else at + 3)
    source = yogastore.Store(tmp_path).open("d", "1").make_source()
    first = int(ref.manifest.chunk_starts()[1])
    with pytest.raises(yogastore.CorruptCacheError, match=r"chunk 1 .*index .*fails its checksum"):
        source.gather(np.array([first], dtype=np.int64))
    assert source.stats.bytes_verified == 0


def test_an_index_changed_after_its_first_check_is_refused_by_the_next_view(
    tmp_path: Path,
) -> None:
    # A view made again in this process hashes the index again: the structural
    # checks it skips are those the same bytes passed before.
    ref = build(tmp_path)
    chunks = Chunks(ref)
    first = int(ref.manifest.chunk_starts()[1])
    record = np.array([first], dtype=np.int64)
    source = ref.make_source()
    assert np.array_equal(source.gather(record)[-1].data[0], RECORDS[first]["x"])
    del source
    again = ref.make_source()  # no stream alive to share views with: parsed again
    assert np.array_equal(again.gather(record)[-1].data[0], RECORDS[first]["x"])
    del again
    at, _n, _base, _size = chunks.open(1)[2]
    chunks.flip(tmp_path, 1, at + 3)  # the block table, under this running process
    third = ref.make_source()
    with pytest.raises(yogastore.CorruptCacheError, match=r"chunk 1 .*index .*fails its checksum"):
        third.gather(record)


def test_a_source_sharing_views_hashes_each_index_again_before_use(tmp_path: Path) -> None:
    # A stream kept alive (as tf.data keeps every from_generator's generator)
    # lends its views to later sources of the reference, which still hash
    # each chunk's index themselves before they first read through it.
    ref = build(tmp_path)
    chunks = Chunks(ref)
    first = int(ref.manifest.chunk_starts()[1])
    record = np.array([first], dtype=np.int64)
    alive = ref.make_source()
    assert np.array_equal(alive.gather(record)[-1].data[0], RECORDS[first]["x"])
    shared = ref.make_source()
    assert shared.stats.requests == 0
    assert np.array_equal(shared.gather(record)[-1].data[0], RECORDS[first]["x"])
    assert shared.stats.requests == 0  # the view was lent, not made again
    assert shared.stats.bytes_verified == ref.manifest.chunks[1].index_bytes
    at, _n, _base, _size = chunks.open(1)[2]
    chunks.flip(tmp_path, 1, at + 3)  # the block table, under this running process
    later = ref.make_source()
    with pytest.raises(yogastore.CorruptCacheError, match=r"chunk 1 .*index .*fails its checksum"):
        later.gather(record)
    del alive, shared


@pytest.mark.parametrize("seed", range(20))
def test_compiled_block_lookup_matches_its_definition(seed: int) -> None:
    from yogastore._gather import blocks_verified

    rng = np.random.default_rng(seed)
    num_chunks = int(rng.integers(1, 6))
    size = rng.choice([256, 1024, 4096], size=num_chunks).astype(np.int64)
    base = rng.integers(64, 512, size=num_chunks).astype(np.int64)
    nblocks = rng.integers(0, 40, size=num_chunks).astype(np.int64)
    slot = np.concatenate([[0], np.cumsum(nblocks)[:-1]]).astype(np.int64)
    bits = np.zeros(-(-int(nblocks.sum()) // 8) + 1, dtype=np.uint8)
    verified = rng.random(int(nblocks.sum())) < rng.choice([0.5, 0.95, 1.0])
    for j in np.flatnonzero(verified):
        bits[j >> 3] |= np.uint8(1 << (j & 7))
    n = int(rng.integers(0, 30))
    chunks = rng.integers(0, num_chunks, size=n).astype(np.int64)
    span = nblocks[chunks] * size[chunks]  # ranges stay inside the blocks, as regions do
    length = np.minimum(rng.integers(0, 3 * size[chunks] + 1) * (rng.random(n) < 0.8), span)
    room = span - length
    starts = base[chunks] + (rng.random(n) * room).astype(np.int64)
    ends = starts + length
    expected = True
    for c, a, b in zip(chunks.tolist(), starts.tolist(), ends.tolist(), strict=True):
        if b <= a:
            continue
        for j in range((a - base[c]) // size[c], (b - 1 - base[c]) // size[c] + 1):
            expected &= bool(verified[slot[c] + j])
    assert blocks_verified(chunks, starts, ends, base, size, slot, bits) is expected
    if n:  # an index out of range answers False, never reads outside
        bad = chunks.copy()
        bad[0] = num_chunks
        got = blocks_verified(bad, starts, ends + 1, base, size, slot, bits)
        assert got is False


@pytest.mark.parametrize("seed", range(10))
def test_compiled_block_hash_equals_xxhash(seed: int) -> None:
    import xxhash

    from yogastore._gather import hash_blocks

    rng = np.random.default_rng(seed)
    views = [memoryview(rng.bytes(int(rng.integers(0, 20000)))) for _ in range(4)]
    views.append(memoryview(bytearray(rng.bytes(300))))  # writable buffers are fine too
    n = int(rng.integers(0, 40))
    which = rng.integers(0, len(views), size=n).astype(np.int64)
    sizes = np.array([len(views[k]) for k in which], dtype=np.int64)
    starts = (rng.random(n) * (sizes + 1)).astype(np.int64)
    ends = starts + (rng.random(n) * (sizes - starts + 1)).astype(np.int64)
    out = np.empty(n, dtype=np.uint64)
    hash_blocks(out, views, which, starts, ends)
    expected = [
        xxhash.xxh3_64_intdigest(views[k][a:b])
        for k, a, b in zip(which.tolist(), starts.tolist(), ends.tolist(), strict=True)
    ]
    assert out.tolist() == expected
    if n:  # a range outside its view, or a view not given, is refused before any hash
        for field, value in (("ends", sizes[0] + 1), ("starts", -1), ("which", len(views))):
            bad = {"which": which.copy(), "starts": starts.copy(), "ends": ends.copy()}
            bad[field][0] = value
            if field == "starts":
                bad["ends"][0] = max(0, int(bad["ends"][0]))
            with pytest.raises(IndexError, match="block 0: bytes"):
                hash_blocks(out, views, bad["which"], bad["starts"], bad["ends"])
        with pytest.raises(ValueError, match="one count each"):
            hash_blocks(out[:-1], views, which, starts, ends)


def test_records_checked_once_skip_their_checks_records_never_read_do_not(
    tmp_path: Path,
) -> None:
    from yogastore.read.verified import block_memo

    ref = build(tmp_path)
    chunks = Chunks(ref)
    memo = block_memo(ref.store.backend.url, ref.manifest)
    ours, theirs = rank_records(ref, 0, 2), rank_records(ref, 1, 2)
    assert read_rank(ref, 0, 2) == len(ours)
    assert memo.records_verified(ours) and not memo.records_verified(theirs)
    # Damage in a block only rank 1 reads: rank 0 reads on, rank 1 stops, every time.
    c, j = min(chunks.blocks(theirs) - chunks.blocks(ours))
    _at, _n, base, size = chunks.open(c)[2]
    chunks.flip(tmp_path, c, base + j * size)
    assert read_rank(ref, 0, 2) == len(ours)
    for _ in range(2):
        with pytest.raises(yogastore.CorruptCacheError, match=rf"chunk {c} .*block {j} "):
            read_rank(ref, 1, 2)
    assert not memo.records_verified(theirs)
    bad = [r for r in theirs.tolist() if (c, j) in chunks.blocks(np.array([r]))]
    source = ref.make_source()
    with pytest.raises(yogastore.CorruptCacheError):
        source.gather(np.array([ours[0], bad[0]], dtype=np.int64))
    assert not memo.records_verified(np.array([bad[0]], dtype=np.int64))


@pytest.mark.parametrize("size", [256, 4096])
@pytest.mark.parametrize("seed", range(4))
def test_digest_blocks_of_pieces_equal_the_blocks_of_their_concatenation(
    size: int, seed: int
) -> None:
    import xxhash

    from yogastore.format.blocks import digest_blocks

    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(0, 12 * size)), dtype=np.uint8).tobytes()
    cuts = np.sort(rng.integers(0, len(data) + 1, int(rng.integers(0, 20))))
    # Pieces of every kind: empty, shorter than a block, exactly one, several, spanning cuts.
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    pieces += [b""]
    expected = [xxhash.xxh3_64_intdigest(data[p : p + size]) for p in range(0, len(data), size)]
    got = digest_blocks([memoryview(p) for p in pieces], size)
    assert got.dtype == np.dtype("<u8")
    assert got.tolist() == expected


@pytest.mark.parametrize("size", [256, 4096])
def test_chunk_digests_agree_compiled_and_in_python(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """The build's block table: one compiled call, or a Python loop without ``_gather``."""
    from yogastore.format import blocks

    rng = np.random.default_rng(size)
    for length in (0, 1, size - 1, size, size + 1, 37 * size + 5):
        data = bytearray(rng.bytes(length))
        compiled = blocks.digest_blocks([memoryview(data)], size)
        parts = [bytes(data[: length // 3]), memoryview(data)[length // 3 :]]
        assert blocks.digest_blocks(parts, size).tolist() == compiled.tolist()
        with monkeypatch.context() as m:
            m.setattr(blocks, "_gather", None)
            python = blocks.digest_blocks([memoryview(data)], size)
        assert compiled.dtype == python.dtype and compiled.tolist() == python.tolist()
        assert len(compiled) == -(-length // size)
