"""Block checksums of a chunk's data area: written at build time, checked on every partial read.

A chunk's data area ``[base, total)`` (everything after its index) is cut into
blocks of ``size`` bytes (the last one may be shorter); the chunk's index holds
an xxh3_64 digest per block (little-endian ``uint64``), and the manifest's
``index_checksum`` covers that table. A reader that fetches byte ranges of a
chunk widens each range to whole blocks (``expand``) and checks every block
it receives (``bad_blocks``) before any byte reaches a user or a disk cache;
the disk cache checks what it serves against the same table. One rule, used
by remote reads, the disk cache and local verification alike.

Header entry: ``"blocks": [table offset, table bytes, base, size]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from storage_backends.errors import CorruptCacheError
from yogastore.checks import is_int

try:
    from yogastore import _gather
except ImportError:  # not compiled: the digests are taken block by block in Python
    _gather = None  # type: ignore[assignment]

__all__ = ["BLOCK_BYTES", "BlockSums", "block_size", "digest_blocks"]

#: Largest block size written by this version; readers take it from each chunk's header.
BLOCK_BYTES = 4096
_BLOCKS_PER_CHUNK = 256  # smaller chunks get smaller blocks, down to _MIN_BLOCK
_SUM = np.dtype("<u8")
_MIN_BLOCK = 256
_MAX_BLOCK = 1 << 24

Range = tuple[int, int]


def block_size(span: int) -> int:
    """Return the block size written for a data area of ``span`` bytes.

    About ``_BLOCKS_PER_CHUNK`` blocks per chunk, a power of two between
    ``_MIN_BLOCK`` and ``BLOCK_BYTES``: a partial read of a small chunk
    widens its ranges by less, a large chunk's table stays small (0.2%).
    """
    size = _MIN_BLOCK
    while size < BLOCK_BYTES and size * _BLOCKS_PER_CHUNK < span:
        size *= 2
    return size


def digest_blocks(pieces: Iterable[bytes | memoryview], size: int) -> npt.NDArray[np.uint64]:
    """Return the xxh3_64 digest of every ``size``-byte block of the concatenated ``pieces``.

    One piece (the chunk writer's data area) is hashed where it lies; several
    are joined first.
    """
    views = [memoryview(p).cast("B") for p in pieces]
    data = views[0] if len(views) == 1 else memoryview(b"".join(views))
    if _gather is not None:  # one call, without the GIL
        starts = np.arange(0, data.nbytes, size, dtype=np.int64)
        ends = np.minimum(starts + size, data.nbytes)
        out = np.empty(len(starts), np.uint64)
        _gather.hash_blocks(out, [data], np.zeros(len(starts), np.int64), starts, ends)
        return out.astype(_SUM, copy=False)
    digest = xxhash.xxh3_64_intdigest
    return np.array([digest(data[p : p + size]) for p in range(0, data.nbytes, size)], _SUM)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSums:
    """The block digests of one chunk, as its verified index records them.

    Attributes:
        sums: one digest per block.
        base: offset of the first block (start of the data area).
        size: block size in bytes.
        total: the chunk's length.
        where: text naming dataset and chunk for error messages.
    """

    sums: npt.NDArray[np.uint64]
    base: int
    size: int
    total: int
    where: str

    @classmethod
    def from_header(
        cls, header: dict[str, Any], index: bytes | memoryview, total: int, where: str
    ) -> BlockSums:
        """Read and check the block table of a parsed header.

        Args:
            header: the chunk header (``parse_header``).
            index: the chunk's first bytes, at least up to its ``index_end``.
            total: the chunk's length.
            where: text naming dataset and chunk.

        Raises:
            CorruptCacheError: the table is missing, out of bounds or of the
                wrong length for the data area.
        """
        entry = header.get("blocks")
        end = header.get("index_end")
        if (
            not isinstance(entry, list)
            or len(entry) != 4
            or not all(is_int(v, allow_numpy=False) for v in entry)
            or not isinstance(end, int)
        ):
            raise CorruptCacheError(
                f"{where}: chunk has no block checksum table (written by an older yogastore?); "
                "delete this version and build it again"
            )
        at, nbytes, base, size = entry
        if not (
            _MIN_BLOCK <= size <= _MAX_BLOCK
            and at >= 0
            and at % 8 == 0
            and at + nbytes <= end
            and end <= base <= total
            and nbytes == 8 * (-(-(total - base) // size))
        ):
            raise CorruptCacheError(f"{where}: block checksum table {entry!r} is inconsistent")
        sums = np.frombuffer(index, dtype=_SUM, count=nbytes // 8, offset=at)
        return cls(sums, base, size, total, where)

    def expand(self, start: int, end: int) -> Range:
        """Return ``[start, end)`` widened to whole blocks (ranges inside the data area)."""
        if start < self.base or end > self.total or start > end:
            raise CorruptCacheError(
                f"{self.where}: byte range [{start}, {end}) lies outside the data area "
                f"[{self.base}, {self.total})"
            )
        lo = self.base + (start - self.base) // self.size * self.size
        hi = min(self.total, self.base - (-(end - self.base) // self.size) * self.size)
        return lo, hi

    def cover(self, ranges: Iterable[Range]) -> list[Range]:
        """Return sorted, disjoint ``ranges`` widened to whole blocks, merged where they meet."""
        out: list[Range] = []
        for a, b in ranges:
            lo, hi = self.expand(a, b)
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return out

    def aligned(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` starts and ends on block bounds of the data area."""
        return (
            self.base <= start <= end <= self.total
            and (start - self.base) % self.size == 0
            and (end == self.total or (end - self.base) % self.size == 0)
        )

    def bad_blocks(self, data: bytes | memoryview, start: int) -> list[Range]:
        """Return the blocks of ``data`` (the bytes at ``start``) whose digest is wrong.

        ``[start, start + len(data))`` must be block-aligned (``aligned``);
        a range that is not counts as one bad range.
        """
        view = memoryview(data).cast("B")
        end = start + view.nbytes
        if not self.aligned(start, end):
            return [(start, end)]
        first = (start - self.base) // self.size
        size = self.size
        positions = range(0, view.nbytes, size)
        expected = self.sums[first : first + len(positions)].tolist()
        digest = xxhash.xxh3_64_intdigest
        return [
            (start + pos, min(start + pos + size, end))
            for pos, want in zip(positions, expected, strict=True)
            if digest(view[pos : pos + size]) != want
        ]
