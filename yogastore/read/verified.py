"""Which bytes of a local dataset version this process has checked: indexes and data blocks.

A local read verifies what it reads, not whole chunks: on its first view of a
chunk, the chunk's length and its index (``index_checksum`` of the manifest
over ``[0, index_bytes)``, which covers the block checksum table,
``yogastore.format.blocks``); then, per batch, the data blocks holding the
bytes of the records gathered, each block once per process. A rank of a
global shuffle thus hashes about its share of the data, not every chunk.

Rules this module keeps:

* One memo per (backend URL, version, build) and process, shared by every
  source reading that version: a block is marked only after its bytes matched
  their digest; a chunk's blocks get their bits when its index is verified.
* The bits live in one bit-packed array for the version, each chunk a slot of
  ``nblocks`` bits assigned at its first view, so a batch's blocks across all
  its chunks are looked up with a handful of numpy operations; memory grows
  with the chunks viewed (an eighth of a byte per block) plus a few integers
  per chunk of the version.
* Ranges never leave the blocks: ``check_regions`` keeps every data region
  of a chunk inside its checksummed data area (``parse_header`` and
  ``ChunkView`` keep offsets inside their regions), once per chunk view.
* A batch needing a quarter or more of a chunk's blocks hashes the chunk
  whole (one call beats hundreds for tiny records, whose batches touch most
  blocks); a mismatch there falls back to block by block.
* A chunk whose blocks are all verified is *complete*; a batch of complete
  chunks costs one lookup, and a version all of whose chunks are complete
  costs nothing. A batch whose blocks were all verified before, in chunks
  not complete, costs one compiled call (``_gather.blocks_verified``; the
  numpy path of ``verify_blocks`` is its definition).
* A batch all of whose records were verified before (every column's bytes
  of each record) costs one lookup in a bit per record of the version (for
  versions of at most ``_RECORD_BITS`` records): the steady state of a rank
  after its first epoch, without locating a single byte range.
* Fork: a child inherits the memo (the bytes it marks are those of the same
  committed build, named by its chunk keys) with fresh locks.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from storage_backends.errors import CorruptCacheError
from yogastore.arrays import IntArray
from yogastore.format import ChunkView
from yogastore.format.blocks import BlockSums
from yogastore.format.manifest import Manifest, checksum

try:  # the compiled lookup; without it the numpy path answers every batch
    from yogastore import _gather
except ImportError:  # pragma: no cover - the package builds it on install
    _gather = None  # type: ignore[assignment]

__all__ = ["BlockMemo", "block_memo", "check_regions", "forget_memos", "verify_blocks"]

Spans = tuple[list[int], list[int]]  # byte ranges: starts, ends
_WHOLE_SHARE = 4  # a quarter of a chunk's blocks at once: one hash of the whole chunk
_BIT = np.left_shift(np.uint8(1), np.arange(8, dtype=np.uint8))
_HEADERS_KEPT = 1 << 14  # chunk headers kept parsed per version (a few KiB each)
_RECORD_BITS = 1 << 28  # versions with more records keep no record bits (32 MiB at most)


class BlockMemo:
    """The verified indexes and data blocks of one dataset version in this process.

    Args:
        num_chunks: chunks of the version.
        num_records: records of the version.
    """

    def __init__(self, num_chunks: int, num_records: int = 0) -> None:
        self.lock = threading.Lock()
        self.slot = np.full(num_chunks, -1, dtype=np.int64)  # first bit; -1: index unchecked
        self.base = np.zeros(num_chunks, dtype=np.int64)  # data area start
        self.size = np.ones(num_chunks, dtype=np.int64)  # block size
        self.nblocks = np.zeros(num_chunks, dtype=np.int64)
        self.total = np.zeros(num_chunks, dtype=np.int64)  # chunk length
        self.done = np.zeros(num_chunks, dtype=np.int64)  # blocks verified
        self.complete = np.zeros(num_chunks, dtype=bool)
        self.all_complete = num_chunks == 0
        self._completed = 0
        self._bits = np.zeros(0, dtype=np.uint8)
        self.expected = np.zeros(0, dtype=np.uint64)  # each block's digest, by block id
        self._used = 0
        self._num_records = num_records
        self._headers: dict[int, dict[str, Any]] = {}
        self._records: npt.NDArray[np.uint8] | None = None  # a bit per verified record

    def records_verified(self, records: IntArray) -> bool:
        """Whether every byte of these records (in range) was verified (``mark_records``)."""
        bits = self._records
        if bits is None or not len(records):
            return False
        return bool((bits[records >> 3] & _BIT[records & 7]).all())

    def mark_records(self, records: IntArray) -> None:
        """Mark records (in range) all of whose bytes, in every column, were verified."""
        if not len(records) or self._num_records > _RECORD_BITS:
            return
        with self.lock:
            if self._records is None:
                self._records = np.zeros(-(-self._num_records // 8), dtype=np.uint8)
            np.bitwise_or.at(self._records, records >> 3, _BIT[records & 7])

    def index_verified(self, chunk: int) -> bool:
        return bool(self.slot[chunk] >= 0)

    def header(self, chunk: int) -> dict[str, Any] | None:
        """The parsed header of ``chunk``'s index as checked before, if kept."""
        return self._headers.get(chunk)

    def add_chunk(self, chunk: int, sums: BlockSums, header: dict[str, Any] | None = None) -> None:
        """Record that ``chunk``'s index was verified; give its blocks their bits.

        ``header``, the index's parsed header, is kept for the views made of
        the same index bytes later (for at most ``_HEADERS_KEPT`` chunks).
        """
        with self.lock:
            if header is not None and len(self._headers) < _HEADERS_KEPT:
                self._headers.setdefault(chunk, header)
            if self.slot[chunk] >= 0:
                return
            n = len(sums.sums)
            need = -(-(self._used + n) // 8)
            if need > len(self._bits):
                grown = np.zeros(max(need, 2 * len(self._bits)), dtype=np.uint8)
                grown[: len(self._bits)] = self._bits
                self._bits = grown
            if self._used + n > len(self.expected):
                table = np.zeros(max(self._used + n, 2 * len(self.expected)), dtype=np.uint64)
                table[: self._used] = self.expected[: self._used]
                self.expected = table
            self.expected[self._used : self._used + n] = sums.sums
            self.base[chunk], self.size[chunk] = sums.base, sums.size
            self.total[chunk] = sums.total
            self.nblocks[chunk] = n
            self.slot[chunk] = self._used
            self._used += n
            if n == 0:
                self._complete(np.array([chunk], dtype=np.int64))

    def _complete(self, chunks: IntArray) -> None:
        fresh = chunks[~self.complete[chunks]]
        self.complete[fresh] = True
        self._completed += len(fresh)
        self.all_complete = self._completed == len(self.complete)

    def unverified(self, ids: IntArray) -> npt.NDArray[np.bool_]:
        """Return, per block id (a chunk's slot plus its block number), whether it is unchecked."""
        with self.lock:
            bits = self._bits[ids >> 3]
        unset: npt.NDArray[np.bool_] = (bits & _BIT[ids & 7]) == 0
        return unset

    def covers(self, chunks: IntArray, starts: IntArray, ends: IntArray) -> bool:
        """Whether every block of the byte ranges is verified (compiled; ``False`` without it).

        The steady state of a rank that reads only part of each chunk: one call
        instead of the numpy path of ``verify_blocks``, which defines the answer.
        """
        if _gather is None:  # pragma: no cover - the package builds it on install
            return False
        with self.lock:
            return _gather.blocks_verified(
                chunks, starts, ends, self.base, self.size, self.slot, self._bits
            )

    def mark(self, ids: IntArray, chunks: IntArray) -> None:
        """Mark distinct blocks ``ids`` (of chunks ``chunks``) as verified."""
        with self.lock:
            fresh = (self._bits[ids >> 3] & _BIT[ids & 7]) == 0
            ids, chunks = ids[fresh], chunks[fresh]
            np.bitwise_or.at(self._bits, ids >> 3, _BIT[ids & 7])
            np.add.at(self.done, chunks, 1)
            touched = np.unique(chunks)
            self._complete(touched[self.done[touched] == self.nblocks[touched]])


# One memo per version and process; see the module's rules.
_MEMOS: dict[tuple[str, str, str], BlockMemo] = {}
_MEMOS_LOCK = threading.Lock()


def block_memo(url: str, manifest: Manifest) -> BlockMemo:
    """Return this process's memo of the version ``manifest`` names in the store at ``url``.

    A new build of a version replaces the memos of its builds before (readers holding
    one keep it): a process that rebuilds or re-reads versions does not grow with them.
    """
    token = (url, manifest.key, manifest.build_id)
    with _MEMOS_LOCK:
        memo = _MEMOS.get(token)
        if memo is None:
            _drop_memos(url, manifest.key)
            memo = _MEMOS[token] = BlockMemo(len(manifest.chunks), manifest.num_records)
        return memo


def forget_memos(url: str, key: str) -> None:
    """Drop this process's memos of every build of one version (it is deleted or rebuilt)."""
    with _MEMOS_LOCK:
        _drop_memos(url, key)


def _drop_memos(url: str, key: str) -> None:
    """Drop the memos of every build of one version (the caller holds ``_MEMOS_LOCK``)."""
    for token in [k for k in _MEMOS if k[:2] == (url, key)]:
        del _MEMOS[token]


def _after_fork() -> None:
    global _MEMOS_LOCK
    _MEMOS_LOCK = threading.Lock()
    for memo in _MEMOS.values():
        memo.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def check_regions(view: ChunkView, sums: BlockSums) -> None:
    """Check that every data region of a chunk lies in its data area (what blocks cover).

    ``parse_header`` and ``ChunkView`` keep regions and offsets inside the
    chunk; this keeps every record range a batch verifies inside the blocks,
    so that ``verify_blocks`` need not check ranges one by one.
    """
    for i, col in enumerate(view.columns):
        if col.data.nbytes and col.data_at < sums.base:
            raise CorruptCacheError(
                f"{sums.where}: column {i}'s data starts at byte {col.data_at}, before the "
                f"checksummed data area [{sums.base}, {sums.total}); the cache is corrupted, "
                "delete and rebuild this version"
            )


def verify_blocks(
    memo: BlockMemo,
    chunks: IntArray,
    starts: IntArray,
    ends: IntArray,
    sums: dict[int, BlockSums],
    data: dict[int, memoryview],
    checksums: Sequence[str],
    will_read: Callable[[int, Callable[[], Spans]], None] | None = None,
) -> int:
    """Check the blocks holding byte ranges ``[starts, ends)`` of ``chunks`` not checked yet.

    A chunk of which at least ``1/_WHOLE_SHARE`` of the blocks are to be
    checked at once (tiny records: a batch touches most blocks) is checked
    whole against its manifest checksum instead, one hash being cheaper than
    many; if that fails, its blocks are checked one by one, so only damage
    in what is read stops the read and the error names the block.

    Args:
        memo: the version's memo; every chunk's index verified (``add_chunk``)
            and its regions checked (``check_regions``).
        chunks: the chunk of each byte range.
        starts: where each range starts, within its chunk's data regions.
        ends: where each range ends.
        sums: each chunk's block table.
        data: each chunk's bytes.
        checksums: every chunk's checksum, as the manifest records it.
        will_read: called with a chunk and a function giving the byte ranges
            of it to be hashed (``(starts, ends)``), before any is hashed, so a
            backend mapping files on demand can read them ahead (all of a
            batch at once: the disk serves them in parallel).

    Returns:
        The bytes hashed (0 when every block was checked before).

    Raises:
        CorruptCacheError: a block whose digest differs from its table, named
            by chunk, block and bytes.
    """
    if not len(chunks) or memo.covers(chunks, starts, ends):
        return 0
    base, size = memo.base[chunks], memo.size[chunks]
    first = (starts - base) // size
    # Blocks per range; an empty range has none, wherever it points.
    counts = ((ends - 1 - base) // size - first + 1) * (ends > starts)
    # Every block of every range: ids are slot + block number.
    at = memo.slot[chunks] + first
    total = int(counts.sum())
    ids = np.repeat(at - np.cumsum(counts) + counts, counts) + np.arange(total, dtype=np.int64)
    todo = memo.unverified(ids)
    if not todo.any():
        return 0
    owners = np.repeat(chunks, counts)
    ids, where = np.unique(ids[todo], return_index=True)
    owners = owners[todo][where]
    # Ids sort by slot, so each chunk's blocks are one run.
    heads = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
    runs, lengths = owners[heads], np.diff(np.r_[heads, len(ids)])
    whole = set(np.flatnonzero(lengths * _WHOLE_SHARE >= memo.nblocks[runs]).tolist())
    # Each block's bytes; the last block of a chunk may be short.
    block = memo.size[owners]
    lo = memo.base[owners] + (ids - memo.slot[owners]) * block
    hi = np.minimum(lo + block, memo.total[owners])
    if will_read is not None:  # announce every read of the batch, then read
        _announce(will_read, owners, lo, hi, runs, whole, data)
    hashed = 0
    by_block = np.ones(len(ids), dtype=bool)
    marks, marked_chunks = [], []
    for i in sorted(whole):
        chunk = int(runs[i])
        view = data[chunk]
        if checksum(view) == checksums[chunk]:
            hashed += len(view)
            by_block[heads[i] : heads[i] + lengths[i]] = False
            n = int(memo.nblocks[chunk])
            marks.append(int(memo.slot[chunk]) + np.arange(n, dtype=np.int64))
            marked_chunks.append(np.full(n, chunk, dtype=np.int64))
    ids, owners = ids[by_block], owners[by_block]
    hashed += _check_blocks(memo, ids, owners, lo[by_block], hi[by_block], sums, data)
    memo.mark(np.concatenate([ids, *marks]), np.concatenate([owners, *marked_chunks]))
    return hashed


def prefix_span(end: int) -> Spans:
    """The byte range ``[0, end)``."""
    return [0], [end]


def _announce(
    will_read: Callable[[int, Callable[[], Spans]], None],
    owners: IntArray,
    starts: IntArray,
    ends: IntArray,
    runs: IntArray,
    whole: set[int],
    data: dict[int, memoryview],
) -> None:
    """Call ``will_read`` for each chunk of a batch with its blocks' byte ranges.

    Adjacent blocks of a chunk are one range; chunks ``runs[i]`` with ``i``
    in ``whole`` are announced whole.
    """
    joined = (ends[:-1] == starts[1:]) & (owners[:-1] == owners[1:])
    heads = np.flatnonzero(np.r_[True, ~joined])
    tails = np.r_[heads[1:], len(starts)] - 1
    span_owners = owners[heads]
    firsts = np.flatnonzero(np.r_[True, span_owners[1:] != span_owners[:-1]])
    bounds = np.r_[firsts, len(heads)].tolist()
    los, his = starts[heads].tolist(), ends[tails].tolist()
    for i, chunk in enumerate(runs.tolist()):
        if i in whole:
            will_read(chunk, functools.partial(prefix_span, len(data[chunk])))
        else:
            will_read(chunk, functools.partial(_spans, los, his, bounds[i], bounds[i + 1]))


def _spans(los: list[int], his: list[int], a: int, b: int) -> Spans:
    return los[a:b], his[a:b]


def _check_blocks(
    memo: BlockMemo,
    ids: IntArray,
    owners: IntArray,
    starts: IntArray,
    ends: IntArray,
    sums: dict[int, BlockSums],
    data: dict[int, memoryview],
) -> int:
    """Check blocks ``ids``, bytes ``[starts, ends)`` of chunks ``owners``; return bytes hashed.

    One pass over every block of the batch, whatever chunks hold them: a
    batch of a global shuffle touches a block or two in each of many chunks.
    """
    if not len(ids):
        return 0
    if _gather is not None:  # one call for the batch, hashing without the GIL
        chunks, which = np.unique(owners, return_inverse=True)
        got = np.empty(len(ids), dtype=np.uint64)
        views = [data[c] for c in chunks.tolist()]
        _gather.hash_blocks(got, views, which.astype(np.int64), starts, ends)
    else:
        digest = xxhash.xxh3_64_intdigest
        got = np.array(
            [
                digest(data[c][lo:hi])
                for c, lo, hi in zip(owners.tolist(), starts.tolist(), ends.tolist(), strict=True)
            ],
            dtype=np.uint64,
        )
    bad = np.flatnonzero(got != memo.expected[ids])
    if len(bad):
        at = int(bad[0])
        chunk = int(owners[at])
        raise CorruptCacheError(
            f"{sums[chunk].where}: block {int(ids[at] - memo.slot[chunk])} (bytes "
            f"[{int(starts[at])}, {int(ends[at])})) fails its checksum; the cache is corrupted, "
            "delete and rebuild this version"
        )
    return int((ends - starts).sum())
