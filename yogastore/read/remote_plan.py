"""What a remote reader holds and fetches: chunk states, byte range jobs, coalescing.

The pieces of ``yogastore.read.remote`` that do no I/O: what this process holds of
each chunk, which byte ranges of a chunk hold given records, how ranges merge
into few requests, how cached pieces and gaps cover a range, and which fetch
jobs a batch needs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from storage_backends.errors import CorruptCacheError
from yogastore.arrays import BoolArray, IntArray
from yogastore.format import ChunkView, ColumnSpec
from yogastore.format.blocks import BlockSums
from yogastore.format.manifest import ChunkInfo
from yogastore.format.memory import BufferPool, column_rows, record_ranges
from yogastore.read.diskcache import Piece

__all__ = [
    "ChunkState",
    "Job",
    "Planned",
    "Range",
    "coalesce",
    "cover",
    "first_jobs",
    "record_jobs",
]

Range = tuple[int, int]  # [start, end) byte offsets within one chunk

_WHOLE_GAP = 4096  # holes this close are fetched together when completing a chunk
_RANGES_POOL = BufferPool(max_buffers=0)  # range lookups gather nothing


def cover(a: int, b: int, pieces: Sequence[Piece]) -> tuple[list[Piece], list[Range]]:
    """Split ``[a, b)`` into the parts cached pieces cover and the gaps."""
    fills: list[Piece] = []
    gaps: list[Range] = []
    pos = a
    for p in pieces:
        lo, hi = max(p.start, pos), min(p.end, b)
        if hi <= lo:
            continue
        if lo > pos:
            gaps.append((pos, lo))
        fills.append(Piece(lo, hi, p.data[lo - p.start : hi - p.start]))
        pos = hi
    if pos < b:
        gaps.append((pos, b))
    return fills, gaps


def coalesce(starts: IntArray, ends: IntArray, gap: int, overfetch: float = 0.0) -> list[Range]:
    """Merge byte ranges that overlap or lie close together.

    Ranges at most ``gap`` bytes apart always merge. Beyond that, neighbours
    merge while the bytes skipped inside a merged range stay within
    ``overfetch`` times the bytes it needs, so merging never inflates the bytes
    fetched by more than that fraction.
    """
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if not len(starts):
        return []
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1] + gap
    firsts = np.nonzero(new)[0]
    group_ends = np.maximum.reduceat(e, firsts)
    merged = [(int(x), int(y)) for x, y in zip(s[firsts], group_ends, strict=True)]
    if overfetch <= 0 or len(merged) < 2:
        return merged
    out = [merged[0]]
    needed = merged[0][1] - merged[0][0]
    skipped = 0
    for a, b in merged[1:]:
        lo, hi = out[-1]
        hole = a - hi
        if skipped + hole <= overfetch * (needed + b - a):
            out[-1] = (lo, b)
            needed += b - a
            skipped += hole
        else:
            out.append((a, b))
            needed, skipped = b - a, 0
    return out


@dataclasses.dataclass(eq=False, slots=True)
class ChunkState:
    """What this process holds of one chunk: nothing, its index and some records, or all."""

    chunk: int
    info: ChunkInfo
    cid: bytes
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    buf: npt.NDArray[np.uint8] | None = None
    view: ChunkView | None = None
    header: dict[str, Any] | None = None
    have: npt.NDArray[np.bool_] | None = None
    sums: BlockSums | None = None
    whole: bool = False
    resident: int = 0
    pins: int = 0

    def record_ranges(
        self, records: IntArray, columns: Sequence[ColumnSpec]
    ) -> tuple[IntArray, IntArray]:
        """Return the data byte ranges (starts, ends) of ``records`` in every column."""
        if self.view is None:  # pragma: no cover - index loaded first
            raise CorruptCacheError(f"chunk {self.info.key}: index not loaded")
        rows = column_rows(columns, 1, _RANGES_POOL)
        for i, r in enumerate(rows):
            r.add(0, self.view, i)
        _chunks, starts, ends = record_ranges(rows, np.zeros(len(records), np.int64), records)
        return starts, ends


@dataclasses.dataclass(eq=False, slots=True)
class Job:
    """Byte ranges of one chunk to place into ``buf``.

    ``sums`` is set for ranges of the data area: each range is then made of
    whole blocks and every fetched or cached byte is checked against them.
    Index and whole-chunk jobs are checked against the manifest's checksums
    once assembled.
    """

    state: ChunkState
    buf: npt.NDArray[np.uint8]
    ranges: list[Range]
    gap: int
    whole: bool = False
    from_cache: bool = False
    sums: BlockSums | None = None


@dataclasses.dataclass(eq=False, slots=True)
class Planned:
    """A batch of record indices handed through ``plan``, counted until gathered."""

    records: IntArray
    chunks: IntArray
    counts: IntArray
    which: IntArray | None = None  # chunk of each record
    local: IntArray | None = None  # index of each record within its chunk
    counted: bool = True
    future: concurrent.futures.Future[None] | None = None


def first_jobs(
    states: Sequence[ChunkState],
    wanted: Sequence[IntArray],
    need: IntArray,
    counted: bool,
    whole_fraction: float,
) -> tuple[list[Job], list[Job]]:
    """Decide, per chunk of a batch, to fetch it whole, fetch its index, or neither.

    Args:
        states: the batch's chunks (their locks held by the caller).
        wanted: per chunk, the records of it the batch reads.
        need: per chunk, records counted as needed soon (look-ahead horizon).
        counted: whether the batch itself is among those counted.
        whole_fraction: share of a chunk's records that makes fetching it whole pay.

    Returns:
        The whole-chunk jobs and the index jobs.
    """
    whole_jobs: list[Job] = []
    index_jobs: list[Job] = []
    for state, want, soon in zip(states, wanted, need, strict=True):
        if state.whole:
            continue
        # Records of this chunk needed by this batch and the ones ahead.
        expected = int(soon) + (0 if counted else len(want))
        # A chunk already partly read by ranges is completed by ranges:
        # fetching it whole would fetch those bytes again.
        started = state.have is not None and bool(state.have.any())
        if not started and expected >= whole_fraction * state.info.count:
            buf = _chunk_buffer(state, np.empty)
            whole_jobs.append(Job(state, buf, [(0, state.info.nbytes)], _WHOLE_GAP, whole=True))
        elif state.view is None:
            buf = _chunk_buffer(state, np.zeros)
            index_jobs.append(Job(state, buf, [(0, state.info.index_bytes)], 0))
    return whole_jobs, index_jobs


def _chunk_buffer(state: ChunkState, make: Any) -> np.ndarray:
    """A buffer for a whole chunk, of the size its manifest row gives."""
    try:
        buf: np.ndarray = make(state.info.nbytes, dtype=np.uint8)
    except MemoryError as err:
        raise CorruptCacheError(
            f"chunk {state.info.key}: its manifest row gives {state.info.nbytes} bytes, more "
            "than this process can allocate (a damaged manifest, or a chunk too large to "
            "read on this machine)"
        ) from err
    return buf


def record_jobs(
    states: Sequence[ChunkState],
    wanted: Sequence[IntArray],
    columns: Sequence[ColumnSpec],
    gap: int,
    overfetch: float,
) -> tuple[list[Job], list[tuple[BoolArray, IntArray]]]:
    """Return the ranged reads of records not held yet, once chunk indexes are loaded.

    Returns:
        The jobs, and per chunk read by ranges its ``have`` array with the
        records to mark held once the jobs are done.
    """
    jobs: list[Job] = []
    marks: list[tuple[BoolArray, IntArray]] = []
    for state, want in zip(states, wanted, strict=True):
        if state.whole or state.have is None or state.buf is None:
            continue
        missing = want[~state.have[want]]
        if not len(missing):
            continue
        starts, ends = state.record_ranges(missing, columns)
        ranges = coalesce(starts, ends, gap, overfetch)
        if state.sums is None:  # pragma: no cover - set with the index
            raise CorruptCacheError(f"chunk {state.info.key}: block checksums not loaded")
        # Only whole blocks can be verified: widen every range to its blocks.
        ranges = state.sums.cover(ranges)
        if ranges:
            jobs.append(Job(state, state.buf, ranges, gap, sums=state.sums))
        marks.append((state.have, missing))
    return jobs, marks
