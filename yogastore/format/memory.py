"""Gathers of the read path: compiled copies from chunk views into pooled buffers.

Invariants (the memory tricks of the read path live here and only here:
``BufferPool``'s reuse by reference count, the strided spans of ``FixedRows``,
``VarRows`` and ``_gather_fixed``; nothing outside this module builds either):

* A *span* is a read-only ``uint8`` view from the lowest to the highest
  address of the chunk arrays added to it (for LMDB all inside one memory
  map). Only bytes inside chunk regions are ever read through it: row and
  range starts come from ``locate`` and from each chunk's offsets, which
  ``ChunkView`` validated and every gather checks again against the chunk's
  own sizes before copying; the compiled copies check every range against the
  span as well. The object holding a span keeps every spanned array alive.
* ``record_ranges`` (the byte ranges a record occupies, for verification
  and ranged fetches) reads record and string offsets through the same spans
  and bounds-checks them as the gathers do; it copies no values.
* ``BufferPool`` hands a buffer out again only when the pool's own reference
  is the last one: any view of a batch a caller (or TensorFlow) keeps pins it.
* No per-record Python work: a batch of one column is a handful of numpy
  operations on arrays of one entry per record, and one compiled copy (for
  variable-length columns, one compiled loop that locates and checks the
  records, then the copy).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence

import numpy as np

from storage_backends.errors import CorruptCacheError, UnsupportedElementError
from yogastore.arrays import IntArray
from yogastore.format.batch import ColumnBatch
from yogastore.format.decode import ChunkView
from yogastore.format.layout import ALIGN, ColumnSpec, dims_or_zero

try:  # the compiled copies; without them numpy does the same (slower)
    from yogastore import _gather
except ImportError:  # pragma: no cover - the package builds it on install
    _gather = None  # type: ignore[assignment]

#: Raised by the compiled copies and hashes when a read of mapped bytes faults
#: (SIGBUS: the file under the map was cut short); callers name the file.
MappedFault: type[OSError] = (
    _gather.MappedFault if _gather is not None else type("MappedFault", (OSError,), {})
)

_LOCATE_COMPILED = True  # False: the numpy definition, which tests compare it with
__all__ = [
    "BufferPool",
    "FixedRows",
    "MappedFault",
    "VarRows",
    "column_rows",
    "copy_ranges",
    "copy_rows",
    "gather_views",
    "owned_copy",
    "record_ranges",
]


# Compiled copies and their numpy definitions ------------------------------------


def _segments(starts: IntArray, lengths: IntArray) -> IntArray:
    """Return ``concat(arange(s, s + n) for s, n in zip(starts, lengths))``."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(starts - ends + lengths, lengths) + np.arange(total, dtype=np.int64)


def copy_rows(dst: np.ndarray, src: np.ndarray, starts: IntArray, row: int) -> None:
    """Copy ``src[starts[i]:starts[i] + row]`` to ``dst[i * row:(i + 1) * row]`` (bytes)."""
    if _gather is not None:
        _gather.gather_rows(dst, src, starts, row)
        return
    flat = dst.reshape(-1).view(np.uint8)  # pragma: no cover - numpy definition
    flat[: len(starts) * row] = src[
        (starts[:, None] + np.arange(row)).reshape(-1)
    ]  # pragma: no cover


def copy_rows_at(
    dst: np.ndarray,
    src: np.ndarray,
    addresses: IntArray,
    chunks: IntArray,
    local: IntArray,
    lowest: int,
    row: int,
    stride: int | None = None,
) -> None:
    """Copy row ``local[i]`` of chunk ``chunks[i]`` to ``dst[i * row:(i + 1) * row]`` (bytes).

    Row ``j`` of chunk ``c`` is ``src[addresses[c] - lowest + j * stride:][:row]``
    (``stride``: ``row`` unless given); an address of 0 is a chunk never added.
    """
    stride = row if stride is None else stride
    if _gather is not None:
        chunks = np.ascontiguousarray(chunks, np.int64)
        _gather.gather_rows_at(
            dst, src, addresses, chunks, np.ascontiguousarray(local, np.int64), lowest, row, stride
        )
        return
    at = addresses[chunks]  # pragma: no cover - numpy definition
    if not at.all():  # pragma: no cover
        raise RuntimeError("a chunk of the batch was never added")  # pragma: no cover
    copy_rows(dst, src, at - lowest + local * stride, row)  # pragma: no cover


def copy_ranges(dst: np.ndarray, src: np.ndarray, starts: IntArray, lengths: IntArray) -> int:
    """Append ``src[starts[i]:starts[i] + lengths[i]]`` to ``dst`` (bytes); return the total."""
    if _gather is not None:
        total: int = _gather.gather_ranges(dst, src, starts, lengths)
        return total
    flat = dst.reshape(-1).view(np.uint8)  # pragma: no cover - numpy definition
    total = int(lengths.sum())  # pragma: no cover
    flat[:total] = src[_segments(starts, lengths)]  # pragma: no cover
    return total  # pragma: no cover


def owned_copy(data: bytes | memoryview) -> bytes | memoryview:
    """Return ``data`` in memory of its own (``bytes`` as they are), copied by the compiled copy.

    For a view that maps a file: a file cut short under the copy raises
    ``MappedFault`` instead of SIGBUS (a plain ``bytes(view)`` would not).
    """
    if isinstance(data, bytes):
        return data
    src = np.frombuffer(data, np.uint8)
    out = np.empty(len(src), np.uint8)
    copy_ranges(out, src, np.zeros(1, np.int64), np.full(1, len(src), np.int64))
    return out.data  # a memoryview of the copy


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


# Fixed-shape columns of many chunks are gathered with ONE fancy index: each
# chunk's column is a C-contiguous ``[k, *shape]`` array somewhere in memory
# (for LMDB, all inside one memory map), and a read-only byte view spanning
# from the lowest to the highest of them reaches every row: row ``j`` starts at
# ``address(chunk[j]) - lowest + local[j] * row_bytes``. Only those rows are
# ever read; ``locate`` and each chunk's validated record count keep every row
# inside its own chunk, and the caller keeps every spanned buffer alive.


def _row_span(lowest: np.ndarray, end: int, row: int) -> np.ndarray:
    """Return ``[end - address(lowest) - row + 1, row]`` byte rows starting at ``lowest``."""
    flat = lowest.reshape(-1).view(np.uint8)
    start = int(lowest.__array_interface__["data"][0])
    return np.lib.stride_tricks.as_strided(
        flat, shape=(end - start - row + 1, row), strides=(1, 1), writeable=False
    )


def _gather_fixed(
    spec: ColumnSpec, views: Sequence[ChunkView], which: IntArray, local: IntArray, column: int
) -> np.ndarray:
    """Gather fixed-shape records of ``views`` with one fancy index (see above)."""
    n = len(local)
    dims = dims_or_zero(spec)
    row = spec.np_dtype.itemsize * math.prod(dims)
    if n == 0 or row == 0:
        return np.empty((n, *dims), spec.np_dtype)
    cols = [v.columns[column] for v in views]
    if len(cols) == 1:
        return np.ascontiguousarray(cols[0].data[local])
    addresses = np.array([c.address for c in cols], dtype=np.int64)
    low = int(addresses.argmin())
    rows = _row_span(cols[low].data, max(c.address + c.data.nbytes for c in cols), row)
    starts = (addresses - cols[low].address)[which] + local * row
    out: np.ndarray = rows[starts].view(spec.np_dtype).reshape(n, *dims)
    return out


def _rounded(size: int) -> int:
    """Return ``size`` rounded up to a multiple of 1/16 of the next power of two."""
    step = max(ALIGN, (1 << max(size - 1, 1).bit_length()) // 16)
    return -(-size // step) * step


class BufferPool:
    """Aligned byte buffers for gathered batches, reused once nobody else holds them.

    ``take`` returns a ``ALIGN``-aligned array; its memory is handed out again
    only when the pool's own reference is the last one left: a batch the
    caller keeps, or a tensor TensorFlow made from it without copying (it
    does so for aligned arrays and keeps the array alive), is never
    overwritten. Reusing memory spares the page faults of fresh allocations;
    the pool never holds more buffers than were alive at once, at most
    ``max_buffers``.
    """

    def __init__(self, max_buffers: int = 8) -> None:
        self._buffers: list[np.ndarray] = []
        self._max = max_buffers
        self._lock = threading.Lock()
        probe = [np.empty(ALIGN, np.uint8)]
        self._idle = self._refs(probe, 0)  # count of a buffer only the pool holds

    @staticmethod
    def _refs(buffers: list[np.ndarray], i: int) -> int:
        return sys.getrefcount(buffers[i])

    @staticmethod
    def _aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
        start = -int(raw.__array_interface__["data"][0]) % ALIGN
        return raw[start : start + nbytes]

    def take(self, nbytes: int) -> np.ndarray:
        """Return a writable, aligned ``uint8`` array of ``nbytes`` (contents undefined).

        An idle buffer is reused when it holds ``nbytes`` but not more than
        twice that; new buffers are rounded up (by at most about 1/8) so
        that batches of varying size (strings, ragged values) find one.
        """
        size = nbytes + ALIGN
        with self._lock:
            spare = -1
            for i in range(len(self._buffers)):
                if self._refs(self._buffers, i) != self._idle:
                    continue
                if size <= self._buffers[i].size <= 2 * size:
                    return self._aligned(self._buffers[i], nbytes)
                spare = i
            raw = np.empty(_rounded(size), np.uint8)
            if spare >= 0:  # an idle buffer of another size makes room
                self._buffers[spare] = raw
            elif len(self._buffers) < self._max:
                self._buffers.append(raw)
            return self._aligned(raw, nbytes)

    def clear(self) -> None:
        """Drop the pool's references (buffers still in use live on with their users)."""
        with self._lock:
            self._buffers.clear()


class FixedRows:
    """One fixed-shape column across the chunks a source holds, gathered in one call.

    ``add`` each chunk's view once before gathering its records; the object
    keeps the spanned arrays alive. Safe to gather from several threads while
    another adds chunks: a gather uses one consistent (span, lowest) snapshot.
    With the compiled ``_gather`` module, rows are copied straight into
    aligned buffers from ``pool``; otherwise one numpy fancy index does it.

    Args:
        spec: the column (``fixed`` layout).
        num_chunks: chunks in the dataset.
        pool: where output buffers come from (default: a pool of its own).
    """

    def __init__(self, spec: ColumnSpec, num_chunks: int, pool: BufferPool | None = None) -> None:
        if spec.layout != "fixed":
            raise UnsupportedElementError(f"FixedRows needs a fixed column, got {spec.layout}")
        self.spec = spec
        self._dims = dims_or_zero(spec)
        self._dtype = spec.np_dtype
        self._row = self._dtype.itemsize * math.prod(self._dims)
        self._known = np.array(spec.shape, dtype=np.int64)
        self._shapes = np.broadcast_to(self._known, (0, spec.ndim))  # last batch's, reused
        self._addresses = np.zeros(num_chunks, dtype=np.int64)
        self._data_at = np.zeros(num_chunks, dtype=np.int64)  # data region's offset in its chunk
        self._arrays: list[np.ndarray] = []
        self._lowest: np.ndarray | None = None
        self._low = 0
        self._end = 0
        # (byte rows, their address, the same bytes as one flat array); made
        # again at the next gather after an added chunk widened it (``_stale``).
        self._span: tuple[np.ndarray, int, np.ndarray] | None = None
        self._stale = False
        self._pool = pool if pool is not None else BufferPool()
        self._lock = threading.Lock()

    def clear_buffers(self) -> None:
        """Drop the idle output buffers (the next gathers allocate again)."""
        self._pool.clear()

    def add(self, chunk: int, view: ChunkView, column: int) -> None:
        """Make chunk ``chunk``'s records of this column gatherable."""
        col = view.columns[column]
        with self._lock:
            self._addresses[chunk] = col.address
            self._data_at[chunk] = col.data_at
            if col.data.nbytes == 0 or self._row == 0:
                return
            self._arrays.append(col.data)
            if self._lowest is None or col.address < self._low:
                self._lowest, self._low, self._stale = col.data, col.address, True
            if col.address + col.data.nbytes > self._end:
                self._end, self._stale = col.address + col.data.nbytes, True

    def _current_span(self) -> tuple[np.ndarray, int, np.ndarray] | None:
        """The span over every chunk added so far (made once after chunks widened it)."""
        if not self._stale:
            return self._span
        with self._lock:
            if self._stale and self._lowest is not None:
                rows = _row_span(self._lowest, self._end, self._row)
                flat = np.lib.stride_tricks.as_strided(
                    rows, shape=(self._end - self._low,), strides=(1,), writeable=False
                )
                self._span = (rows, self._low, flat)
                self._stale = False
            return self._span

    def ranges(self, chunks: IntArray, local: IntArray) -> tuple[IntArray, IntArray]:
        """Return the byte ranges ``[start, end)`` within their chunks of the records' values."""
        starts = self._data_at[chunks] + local * self._row
        return starts, starts + self._row

    def gather(
        self, chunks: IntArray, local: IntArray, in_place: tuple[int, int] | None = None
    ) -> ColumnBatch:
        """Return records ``local[j]`` of chunk ``chunks[j]`` (all added before).

        ``in_place`` concerns strings only; fixed-shape rows are always copied.
        """
        n = len(local)
        shapes = self._shapes
        if len(shapes) != n:
            shapes = self._shapes = np.broadcast_to(self._known, (n, self.spec.ndim))
        span = self._current_span()
        if n == 0 or span is None:
            return ColumnBatch(self.spec, np.empty((n, *self._dims), self._dtype), shapes)
        _rows, lowest, flat = span
        data = self._pool.take(n * self._row)
        copy_rows_at(data, flat, self._addresses, chunks, local, lowest, self._row)
        return ColumnBatch(self.spec, data.view(self._dtype).reshape(n, *self._dims), shapes)


class VarRows:
    """One variable-length column (``var`` or ``bytes``) across chunks, gathered by range copies.

    ``add`` each chunk's view once before gathering its records. A gather
    reads each record's two offsets, checks them against the chunk's sizes
    and sums the batch's offsets (one compiled loop, ``ranges_at``), then
    copies the selected byte ranges into one pooled buffer (one compiled
    call). Strings take one more step: the records' string offsets, then the
    strings' bytes; with one string per record its record offsets are known
    and only its string offsets are read, in that same loop. Other layouts
    (several strings per record, shapes the schema fixes) and builds without
    the compiled module take the numpy definition. Safe to gather from
    several threads while another adds chunks.

    Args:
        spec: the column (``var`` or ``bytes`` layout).
        num_chunks: chunks in the dataset.
        pool: where output buffers come from (default: a pool of its own).
    """

    def __init__(self, spec: ColumnSpec, num_chunks: int, pool: BufferPool | None = None) -> None:
        if spec.layout == "fixed":
            raise UnsupportedElementError("VarRows needs a var or bytes column, got fixed")
        self.spec = spec
        self._strings = spec.layout == "bytes"
        self._item = spec.np_dtype.itemsize
        self._known = np.array(dims_or_zero(spec), dtype=np.int64)
        self._shapes = np.broadcast_to(self._known, (0, spec.ndim))  # last batch's, reused
        # What the schema already says is not read again (each read is a cache
        # miss): with every dimension known, a record's values (strings) are
        # ``_per_record`` and its offsets are ``local * _per_record``; with one
        # unknown dimension and the others non-zero, that dimension is the
        # record's count divided by the others' product (``_derived``).
        unknown = [i for i, d in enumerate(spec.shape) if d is None]
        self._per_record = None if unknown else math.prod(dims_or_zero(spec))
        rest = math.prod(d for d in spec.shape if d is not None)
        self._derived = (unknown[0], rest) if len(unknown) == 1 and rest > 0 else None
        # Per chunk: addresses of the record offsets, shapes, string offsets and
        # data, and the sizes offsets must stay within.
        self._offsets = np.zeros(num_chunks, dtype=np.int64)
        self._shape_rows = np.zeros(num_chunks, dtype=np.int64)
        self._boffsets = np.zeros(num_chunks, dtype=np.int64)
        self._data = np.zeros(num_chunks, dtype=np.int64)
        self._data_at = np.zeros(num_chunks, dtype=np.int64)  # data region's offset in its chunk
        self._items = np.zeros(num_chunks, dtype=np.int64)  # values (var) / strings (bytes)
        self._nbytes = np.zeros(num_chunks, dtype=np.int64)  # data bytes
        self._records = np.zeros(num_chunks, dtype=np.int64)  # records (offset pairs)
        self._added = np.zeros(num_chunks, dtype=bool)
        self._where: dict[int, str] = {}
        self._arrays: list[np.ndarray] = []
        self._lowest: np.ndarray | None = None
        self._low = 0
        self._end = 0
        # (flat bytes, their address); made again at the next gather after an
        # added chunk widened it (``_stale``).
        self._span: tuple[np.ndarray, int] | None = None
        self._stale = False
        self._aligned: tuple[np.ndarray, int, int] | None = None  # (span, low, end) it covers
        self._pool = pool if pool is not None else BufferPool()
        self._lock = threading.Lock()

    def clear_buffers(self) -> None:
        """Drop the idle output buffers (the next gathers allocate again)."""
        self._pool.clear()

    def add(self, chunk: int, view: ChunkView, column: int) -> None:
        """Make chunk ``chunk``'s records of this column gatherable."""
        col = view.columns[column]
        if col.offsets is None or (self._strings and col.boffsets is None):
            raise CorruptCacheError(f"{view.where}: column {column} lacks its offsets")
        arrays = [a for a in (col.offsets, col.shapes, col.boffsets, col.data) if a is not None]
        with self._lock:
            self._offsets[chunk] = _address(col.offsets)
            if col.shapes is not None:
                self._shape_rows[chunk] = _address(col.shapes)
            if col.boffsets is not None:
                self._boffsets[chunk] = _address(col.boffsets)
                self._items[chunk] = len(col.boffsets) - 1
            else:
                self._items[chunk] = col.data.size
            self._records[chunk] = len(col.offsets) - 1
            self._data[chunk] = col.address
            self._data_at[chunk] = col.data_at
            self._nbytes[chunk] = col.data.nbytes
            self._where[chunk] = view.where
            for a in arrays:
                if a.nbytes == 0:
                    continue  # never read: zero-length ranges are copied from start 0
                start = _address(a)
                self._arrays.append(a)
                if self._lowest is None or start < self._low:
                    self._lowest, self._low, self._stale = a, start, True
                if start + a.nbytes > self._end:
                    self._end, self._stale = start + a.nbytes, True
            self._added[chunk] = True

    def _current_span(self) -> tuple[np.ndarray, int] | None:
        """The span over every chunk added so far (made once after chunks widened it)."""
        if not self._stale:
            return self._span
        with self._lock:
            if self._stale and self._lowest is not None:
                flat = self._lowest.reshape(-1).view(np.uint8)
                span = np.lib.stride_tricks.as_strided(
                    flat, shape=(self._end - self._low,), strides=(1,), writeable=False
                )
                self._span = (span, self._low)
                self._stale = False
            return self._span

    def _corrupt(self, chunks: IntArray, bad: np.ndarray, what: str) -> CorruptCacheError:
        chunk = int(chunks[int(np.argmax(bad))])
        where = self._where.get(chunk, f"chunk {chunk}")
        return CorruptCacheError(
            f"{where}: {self.spec.layout} column {what}; the cache is corrupted, delete and "
            "rebuild this version"
        )

    def _record_shapes(
        self, flat: np.ndarray, low: int, chunks: IntArray, local: IntArray, counts: IntArray
    ) -> IntArray:
        n, ndim = len(local), self.spec.ndim
        if not self.spec.has_shapes:
            shapes = self._shapes
            if len(shapes) != n:
                shapes = self._shapes = np.broadcast_to(self._known, (n, ndim))
            return shapes
        out = np.empty((n, ndim), dtype=np.int64)
        if self._derived is not None:
            axis, rest = self._derived
            size, left = np.divmod(counts, rest)
            if left.any():
                raise self._corrupt(chunks, left != 0, "record sizes do not fit the shape")
            out[:] = self._known
            out[:, axis] = size
            return out
        copy_rows_at(out, flat, self._shape_rows, chunks, local, low, 8 * ndim)
        return out

    def _bounds(
        self, flat: np.ndarray, low: int, chunks: IntArray, local: IntArray
    ) -> tuple[IntArray, IntArray]:
        """Return each record's first and last value (var) or string (bytes), bounds-checked."""
        per = self._per_record
        if per is not None:  # the stored offsets are local * per: not read
            first = local * per
            last = first + per
            bad = last > self._items[chunks]
            if bad.any():
                raise self._corrupt(chunks, bad, "record offsets out of bounds")
            return first, last
        pairs = np.empty((len(local), 2), dtype=np.int64)
        copy_rows_at(pairs, flat, self._offsets, chunks, local, low, 16, 8)
        first, last = pairs[:, 0], pairs[:, 1]
        bad = (first < 0) | (last < first) | (last > self._items[chunks])
        if bad.any():
            raise self._corrupt(chunks, bad, "record offsets out of bounds")
        return first, last

    def ranges(self, chunks: IntArray, local: IntArray) -> tuple[IntArray, IntArray]:
        """Return the byte ranges ``[start, end)`` within their chunks of the records' values.

        Strings: from the first byte of a record's first string to the end of
        its last one (a record's strings lie back to back).
        """
        n = len(local)
        span = self._current_span()
        if n and not self._added[chunks].all():
            raise RuntimeError("VarRows.ranges: a chunk of the batch was never added")
        at = self._data_at[chunks]
        if n == 0 or span is None:
            return at, at.copy()
        flat, low = span
        try:
            first, last = self._bounds(flat, low, chunks, local)
            if not self._strings:
                return at + first * self._item, at + last * self._item
            # Records without strings read no string offsets: their ranges are empty.
            some = (last > first).nonzero()[0]
            begin, end = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
            if len(some):
                base = self._boffsets[chunks[some]] - low
                found = np.empty((2, len(some)), dtype=np.int64)
                copy_rows(found[0], flat, base + first[some] * 8, 8)
                copy_rows(found[1], flat, base + last[some] * 8, 8)
                begin[some], end[some] = found
                bad = (begin < 0) | (end < begin) | (end > self._nbytes[chunks])
                if bad.any():
                    raise self._corrupt(chunks, bad, "string offsets out of bounds")
        except IndexError as err:  # a range outside the span: offsets changed under us
            raise CorruptCacheError(
                f"{self._where.get(int(chunks[0]), 'chunk')}: {err}; the cache is corrupted"
            ) from err
        return at + begin, at + end

    def _aligned_span(self, region: tuple[int, int]) -> np.ndarray | None:
        """A read-only byte array over every added chunk's arrays, from an ``ALIGN``-aligned start.

        Handed to TensorFlow it is wrapped, not copied (aligned), and it keeps
        the arrays it spans alive. ``None`` unless it lies within ``region``
        (address, size): one memory map, all of whose bytes are readable.
        """
        with self._lock:
            cached = self._aligned
            if cached is not None and cached[1] == self._low and cached[2] == self._end:
                return cached[0]
            base = self._low - self._low % ALIGN
            if base < region[0] or self._end > region[0] + region[1]:
                return None
            span = np.asarray(_Borrowed(base, self._end - base, list(self._arrays)))
            self._aligned = (span, self._low, self._end)
            return span

    def gather(
        self, chunks: IntArray, local: IntArray, in_place: tuple[int, int] | None = None
    ) -> ColumnBatch:
        """Return records ``local[j]`` of chunk ``chunks[j]`` (all added before).

        ``in_place``: (address, size) of the one memory map all chunks lie in.
        Strings are then not copied: the batch's ``data`` is a read-only view
        spanning the chunks and ``ranges`` says where each string lies.
        """
        n = len(local)
        span = self._current_span()
        if _gather is not None and _LOCATE_COMPILED and n and span is not None:
            if self._strings and self._per_record == 1:
                return self._gather_scalar_strings(span, chunks, local, in_place)
            if not self._strings and self._per_record is None:
                return self._gather_values(span, chunks, local)
        if n and not self._added[chunks].all():
            raise RuntimeError("VarRows.gather: a chunk of the batch was never added")
        if n == 0 or span is None:
            return _empty_batch(self.spec, n)
        flat, low = span
        try:
            first, last = self._bounds(flat, low, chunks, local)
            counts = last - first
            shapes = self._record_shapes(flat, low, chunks, local, counts)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            if not self._strings:
                item = self._item
                data = self._pool.take(int(offsets[-1]) * item)
                lengths = counts * item
                starts = np.where(lengths > 0, self._data[chunks] - low + first * item, 0)
                copy_ranges(data, flat, starts, lengths)
                return ColumnBatch(self.spec, data.view(self.spec.np_dtype), shapes, offsets)
            return self._gather_strings(flat, low, chunks, first, counts, shapes, offsets, in_place)
        except IndexError as err:  # a range outside the span: offsets changed under us
            raise CorruptCacheError(
                f"{self._where.get(int(chunks[0]), 'chunk')}: {err}; the cache is corrupted"
            ) from err

    def _located(
        self,
        span: tuple[np.ndarray, int],
        chunks: IntArray,
        local: IntArray,
        strings: bool,
    ) -> tuple[IntArray, IntArray, IntArray, int]:
        """Each record's byte range and the running count of its values, in one compiled loop.

        ``strings``: one string per record, its two string offsets read and
        checked against the chunk's data bytes; otherwise the record's two
        value offsets, checked against the chunk's values. Returns (starts,
        lengths, offsets, total bytes).
        """
        flat, low = span
        n = len(local)
        starts, lengths = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        offsets = np.empty(n + 1, dtype=np.int64)
        chunks = np.ascontiguousarray(chunks, dtype=np.int64)
        local = np.ascontiguousarray(local, dtype=np.int64)
        if strings:
            pairs, rows, limits, item = self._boffsets, self._items, self._nbytes, 1
        else:
            pairs, rows, limits, item = self._offsets, self._records, self._items, self._item
        try:
            total, bad = _gather.ranges_at(
                starts,
                lengths,
                offsets,
                flat,
                pairs,
                rows,
                limits,
                self._data,
                chunks,
                local,
                low,
                item,
            )
        except IndexError as err:  # a range outside the span: offsets changed under us
            where = self._where.get(int(chunks[0]), "chunk")
            raise CorruptCacheError(f"{where}: {err}; the cache is corrupted") from err
        if bad >= 0:
            what = "string offsets" if strings else "record offsets"
            raise self._corrupt(chunks[bad : bad + 1], np.ones(1, bool), f"{what} out of bounds")
        return starts, lengths, offsets, total

    def _gather_values(
        self, span: tuple[np.ndarray, int], chunks: IntArray, local: IntArray
    ) -> ColumnBatch:
        """``gather`` of a column of values whose record offsets are stored (ragged, tensors)."""
        flat, low = span
        starts, lengths, offsets, total = self._located(span, chunks, local, strings=False)
        counts = np.diff(offsets) if self._derived is not None else offsets  # else unread
        shapes = self._record_shapes(flat, low, chunks, local, counts)
        data = self._pool.take(total)
        copy_ranges(data, flat, starts, lengths)
        return ColumnBatch(self.spec, data.view(self.spec.np_dtype), shapes, offsets)

    def _gather_scalar_strings(
        self,
        span: tuple[np.ndarray, int],
        chunks: IntArray,
        local: IntArray,
        in_place: tuple[int, int] | None,
    ) -> ColumnBatch:
        """``gather`` of one string per record: each record's string offsets, read in one loop."""
        flat, low = span
        n = len(local)
        starts, lengths, boffsets, _total = self._located(span, chunks, local, strings=True)
        shapes = self._record_shapes(flat, low, chunks, local, lengths)  # fixed: not read
        offsets = np.arange(n + 1, dtype=np.int64)
        return self._strings_batch(flat, low, starts, lengths, boffsets, shapes, offsets, in_place)

    def _gather_strings(
        self,
        flat: np.ndarray,
        low: int,
        chunks: IntArray,
        first: IntArray,
        counts: IntArray,
        shapes: IntArray,
        offsets: IntArray,
        in_place: tuple[int, int] | None = None,
    ) -> ColumnBatch:
        n = len(chunks)
        base = self._boffsets[chunks] - low + first * 8
        if np.all(counts == 1):  # scalar strings: each record's two string offsets
            pairs = np.empty((n, 2), dtype=np.int64)
            copy_rows(pairs, flat, base, 16)
            begin, end, owner = pairs[:, 0], pairs[:, 1], chunks
        else:  # each record's count + 1 string offsets, back to back
            per = counts + 1
            bounds = np.empty(int(per.sum()), dtype=np.int64)
            copy_ranges(bounds.view(np.uint8), flat, base, per * 8)
            stops = np.cumsum(per)
            is_last = np.zeros(len(bounds), dtype=bool)
            is_last[stops - 1] = True
            is_first = np.zeros(len(bounds), dtype=bool)
            is_first[stops - per] = True
            begin, end, owner = bounds[~is_last], bounds[~is_first], np.repeat(chunks, counts)
        lengths = end - begin
        bad = (begin < 0) | (lengths < 0) | (end > self._nbytes[owner])
        if bad.any():
            raise self._corrupt(owner, bad, "string offsets out of bounds")
        starts = np.where(lengths > 0, self._data[owner] - low + begin, 0)
        return self._strings_batch(flat, low, starts, lengths, None, shapes, offsets, in_place)

    def _strings_batch(
        self,
        flat: np.ndarray,
        low: int,
        starts: IntArray,
        lengths: IntArray,
        boffsets: IntArray | None,
        shapes: IntArray,
        offsets: IntArray,
        in_place: tuple[int, int] | None,
    ) -> ColumnBatch:
        """The batch of strings at ``flat[starts[i]:][:lengths[i]]`` (start 0 when empty).

        Left in place (``in_place``, when the aligned span lies in that map), or
        copied into one pooled buffer; ``boffsets``: the strings' running byte
        offsets, if already summed.
        """
        span = self._aligned_span(in_place) if in_place is not None else None
        if span is not None:
            shift = low - int(span.__array_interface__["data"][0])
            starts = np.where(lengths > 0, starts + shift, 0)
            return ColumnBatch(self.spec, span, shapes, offsets, ranges=(starts, lengths))
        if boffsets is None:
            boffsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=boffsets[1:])
        data = self._pool.take(int(boffsets[-1]))
        copy_ranges(data, flat, starts, lengths)
        return ColumnBatch(self.spec, data, shapes, offsets, boffsets)


class _Borrowed:
    """``size`` read-only bytes at ``address`` as an array interface, keeping ``owners`` alive."""

    def __init__(self, address: int, size: int, owners: list[np.ndarray]) -> None:
        self.__array_interface__ = {
            "data": (address, True),
            "shape": (size,),
            "typestr": "|u1",
            "version": 3,
        }
        self._owners = owners


def _empty_batch(spec: ColumnSpec, n: int) -> ColumnBatch:
    """A batch of ``n`` records of no values (no chunk added, or ``n == 0``)."""
    shapes = np.broadcast_to(np.array(dims_or_zero(spec), dtype=np.int64), (n, spec.ndim))
    data = np.empty(0, dtype=spec.np_dtype)
    offsets = np.zeros(n + 1, dtype=np.int64)
    if spec.layout == "bytes":
        return ColumnBatch(spec, data, shapes, offsets, np.zeros(1, dtype=np.int64))
    return ColumnBatch(spec, data, shapes, offsets)


_SHARED_POOL = BufferPool()


def column_rows(
    columns: Sequence[ColumnSpec], num_chunks: int, pool: BufferPool | None = None
) -> list[FixedRows | VarRows]:
    """Return one gatherer per column, for ``num_chunks`` chunks."""
    return [
        FixedRows(spec, num_chunks, pool)
        if spec.layout == "fixed"
        else VarRows(spec, num_chunks, pool)
        for spec in columns
    ]


def record_ranges(
    rows: Sequence[FixedRows | VarRows], chunks: IntArray, local: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """Return where the values of records ``local[j]`` of chunk ``chunks[j]`` lie, in every column.

    The one rule for which bytes of a chunk a record occupies (local reads
    verify those blocks, remote reads fetch them): fixed columns a row of the
    data region, ``var`` columns the values between two record offsets,
    ``bytes`` columns the bytes of the record's strings. Empty ranges are kept.

    Returns:
        (chunk, start, end) per record and column, column after column;
        offsets within the chunk.
    """
    if not rows:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    parts = [r.ranges(chunks, local) for r in rows]
    starts = np.concatenate([p[0] for p in parts])
    ends = np.concatenate([p[1] for p in parts])
    return np.tile(chunks, len(rows)), starts, ends


def gather_views(
    spec: ColumnSpec, views: Sequence[ChunkView], which: IntArray, local: IntArray, column: int
) -> ColumnBatch:
    """Gather records ``local[j]`` of chunk ``views[which[j]]`` for one column.

    For sources that hold views only for the current batch (remote reads).
    """
    n = len(local)
    if spec.layout == "fixed":
        shapes = np.broadcast_to(np.array(spec.shape, dtype=np.int64), (n, spec.ndim))
        return ColumnBatch(spec, _gather_fixed(spec, views, which, local, column), shapes)
    rows = VarRows(spec, len(views), _SHARED_POOL)
    for c, view in enumerate(views):
        rows.add(c, view, column)
    return rows.gather(which, local)
