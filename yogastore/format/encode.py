"""Writing chunks: records in, chunk bytes (index regions first, then data) out."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from storage_backends.errors import UnsupportedElementError
from yogastore.format.blocks import block_size, digest_blocks
from yogastore.format.layout import I64, MAGIC, PREFIX, ColumnSpec, align

try:
    from yogastore import _gather
except ImportError:  # not compiled: chunks are copied piece by piece in Python
    _gather = None  # type: ignore[assignment]

__all__ = ["ChunkBuilder", "PackedStrings", "Region", "Slab", "encode_chunk", "strings_as_bytes"]


@dataclasses.dataclass(frozen=True, slots=True)
class PackedStrings:
    """Strings given as one buffer: string ``i`` is ``data[offsets[i]:offsets[i + 1]]``.

    A ``bytes`` column of a ``Slab`` takes them instead of one ``bytes`` object per string.
    """

    data: np.ndarray  # uint8
    offsets: np.ndarray  # int64, [number of strings + 1]

    @classmethod
    def of(cls, data: Any, lengths: Any) -> PackedStrings:
        """Strings of ``lengths`` bytes, one after another in ``data`` (checked)."""
        buf = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else np.asarray(data)
        lens = np.asarray(lengths, I64).reshape(-1)
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise UnsupportedElementError(f"string bytes must be flat uint8, not {buf.dtype}")
        if (lens < 0).any():
            raise UnsupportedElementError("a string length is negative")
        offsets = np.zeros(len(lens) + 1, I64)
        np.cumsum(lens, out=offsets[1:])
        if offsets[-1] != len(buf):
            raise UnsupportedElementError(
                f"string lengths add up to {int(offsets[-1])} bytes, the buffer has {len(buf)}"
            )
        return cls(buf, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, part: slice) -> PackedStrings:
        start, stop, step = part.indices(len(self))
        if step != 1:
            raise IndexError("packed strings are sliced in order only")
        return PackedStrings(self.data, self.offsets[start : max(start, stop) + 1])

    @property
    def nbytes(self) -> int:
        return int(self.offsets[-1] - self.offsets[0])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def piece(self) -> np.ndarray:
        """The strings' bytes, one after another (a view)."""
        return self.data[int(self.offsets[0]) : int(self.offsets[-1])]


@dataclasses.dataclass(frozen=True, slots=True)
class Slab:
    """``n`` records given column by column, without a Python object per record.

    ``columns[i]`` is, by the layout of column ``i``: ``fixed``, an array
    ``[n, *shape]``; ``var``, ``(shapes, values)`` with ``shapes`` ``[n, ndim]``
    (int64) and ``values`` the records' elements one after another (any
    shape whose size is the sum of the records' sizes); ``bytes``, the same
    with ``values`` a sequence of ``bytes``, one per element.
    """

    n: int
    columns: tuple[Any, ...]

    def record_bytes(self, columns: Sequence[ColumnSpec]) -> np.ndarray:
        """Bytes each record adds to a chunk builder's ``nbytes``."""
        sizes = np.zeros(self.n, dtype=I64)
        for col, data in zip(columns, self.columns, strict=True):
            if col.layout == "fixed":
                sizes += data[0].nbytes if self.n else 0
                continue
            shapes, values = data
            counts = _counts(shapes)
            if col.layout == "var":
                sizes += counts * col.np_dtype.itemsize + 8 * (col.ndim + 1)
            else:
                total = np.concatenate([[0], np.cumsum(_lengths(values))])
                ends = np.cumsum(counts)
                sizes += total[ends] - total[ends - counts] + 8 * (counts + 1)
        return sizes

    def take(self, columns: Sequence[ColumnSpec], start: int, stop: int) -> Slab:
        """Records ``[start, stop)`` of this slab."""
        out: list[Any] = []
        for col, data in zip(columns, self.columns, strict=True):
            if col.layout == "fixed":
                out.append(data[start:stop])
                continue
            shapes, values = data
            ends = np.cumsum(_counts(shapes))
            lo = int(ends[start - 1]) if start else 0
            hi = int(ends[stop - 1]) if stop else 0
            flat = values.reshape(-1) if isinstance(values, np.ndarray) else values
            out.append((shapes[start:stop], flat[lo:hi]))
        return Slab(stop - start, tuple(out))


def _counts(shapes: np.ndarray) -> np.ndarray:
    """Elements of each record, from its shape."""
    return np.prod(shapes, axis=1, dtype=I64) if shapes.shape[1] else np.ones(len(shapes), I64)


def _lengths(values: Any) -> np.ndarray:
    if isinstance(values, PackedStrings):
        return values.lengths()
    flat = values.reshape(-1) if isinstance(values, np.ndarray) else values
    return np.fromiter((len(v) for v in flat), dtype=I64, count=len(flat))


@dataclasses.dataclass(frozen=True, slots=True)
class _Block:
    """Records of one variable-length column added together (see ``Slab``)."""

    shapes: np.ndarray
    values: Any


class ChunkBuilder:
    """Accumulates records column by column and encodes them as one chunk."""

    def __init__(self, columns: Sequence[ColumnSpec], names: Sequence[str] | None = None) -> None:
        self.columns = list(columns)
        # Each column's component, for messages about a record's values (add_record).
        self.names: list[str | None] = list(names) if names is not None else [None] * len(columns)
        self.count = 0
        self.nbytes = 0
        self._parts: list[list[Any]] = [[] for _ in self.columns]

    def add_batch(self, arrays: Sequence[np.ndarray]) -> None:
        """Add ``n`` records given as one ``[n, ...]`` array per column (fixed/bytes)."""
        n = len(arrays[0])
        for col, parts, arr in zip(self.columns, self._parts, arrays, strict=True):
            if col.layout == "fixed":
                a = np.ascontiguousarray(arr, dtype=col.np_dtype)
                if a.shape[1:] != col.shape or len(a) != n:
                    raise UnsupportedElementError(
                        f"batch of shape {a.shape} does not match record shape {col.shape}"
                    )
                parts.append(a)
                self.nbytes += a.nbytes
            else:
                for record in arr:
                    self._add_one(col, parts, record)
        self.count += n

    def add_slab(self, slab: Slab) -> None:
        """Add the records of ``slab`` (checked against the columns' shapes and dtypes)."""
        for col, parts, data in zip(self.columns, self._parts, slab.columns, strict=True):
            if col.layout == "fixed":
                a = np.ascontiguousarray(data, dtype=col.np_dtype)
                if a.shape[1:] != col.shape or len(a) != slab.n:
                    raise UnsupportedElementError(
                        f"batch of shape {a.shape} does not match record shape {col.shape}"
                    )
                parts.append(a)
                self.nbytes += a.nbytes
                continue
            shapes, values = data
            shapes = np.asarray(shapes, dtype=I64).reshape(slab.n, col.ndim)
            for d, size in zip(col.shape, shapes.T, strict=True):
                if d is not None and len(size) and (size != d).any():
                    raise UnsupportedElementError(
                        f"value of shape {tuple(shapes[int(np.argmax(size != d))])} does not "
                        f"match {col.shape}"
                    )
            counts = _counts(shapes)
            total = int(counts.sum())
            if col.layout == "var":
                flat = np.ascontiguousarray(values, dtype=col.np_dtype).reshape(-1)
                if len(flat) != total:
                    raise UnsupportedElementError(
                        f"{len(flat)} values for records of {total} elements"
                    )
                parts.append(_Block(shapes, flat))
                self.nbytes += flat.nbytes + 8 * (col.ndim + 1) * slab.n
            elif isinstance(values, PackedStrings):
                if len(values) != total:
                    raise UnsupportedElementError(
                        f"{len(values)} strings for records of {total} elements"
                    )
                parts.append(_Block(shapes, values))
                self.nbytes += values.nbytes + 8 * (total + slab.n)
            else:
                flat = values.reshape(-1) if isinstance(values, np.ndarray) else values
                strings = [text_bytes(v) for v in flat]
                if len(strings) != total:
                    raise UnsupportedElementError(
                        f"{len(strings)} strings for records of {total} elements"
                    )
                parts.append(_Block(shapes, strings))
                self.nbytes += sum(map(len, strings)) + 8 * (total + slab.n)
        self.count += slab.n

    def add_record(self, values: Sequence[Any]) -> None:
        """Add one record given as one value per column."""
        for col, parts, value, name in zip(
            self.columns, self._parts, values, self.names, strict=True
        ):
            if col.layout == "fixed":
                # A copy (as in _add_one): a source may refill one buffer for every record,
                # and the parts are kept until the chunk is encoded.
                a = np.array(value, dtype=col.np_dtype)
                _check_shape(col, a.shape, name)
                parts.append(a[None])
                self.nbytes += a.nbytes
            else:
                self._add_one(col, parts, value, name)
        self.count += 1

    def _add_one(
        self, col: ColumnSpec, parts: list[Any], value: Any, name: str | None = None
    ) -> None:
        if col.layout == "bytes":
            # A bytearray or memoryview is one string, not an array of its bytes.
            if isinstance(value, bytearray | memoryview):
                value = bytes(value)
            elif isinstance(value, list | tuple):
                value = strings_as_bytes(value)
            a = np.asarray(value, dtype=object)
            _check_shape(col, a.shape, name)
            where = None if name is None else f"component {name!r}"
            strings = [text_bytes(s, where) for s in a.reshape(-1)]
            parts.append((a.shape, strings))
            self.nbytes += sum(len(s) for s in strings) + 8 * (len(strings) + 1)
        else:
            a = np.array(value, dtype=col.np_dtype)  # a copy, see add_record
            _check_shape(col, a.shape, name)
            parts.append(a)
            self.nbytes += a.nbytes + 8 * (col.ndim + 1)

    def encode(self, into: Callable[[int], bytearray] | None = None) -> bytearray | memoryview:
        """Return the chunk bytes for everything added so far (see ``encode_chunk``)."""
        regions: list[tuple[str, int, Region]] = []  # (kind, col, data)
        for i, (col, parts) in enumerate(zip(self.columns, self._parts, strict=True)):
            if col.layout == "fixed":
                # The parts are copied straight into the chunk, not concatenated first.
                regions.append(("data", i, [np.ascontiguousarray(p, col.np_dtype) for p in parts]))
                continue
            if col.layout == "var":
                shapes, flats = _var_runs(col, parts)
                counts = _counts(shapes)
                flat = np.concatenate(flats) if flats else np.empty(0, col.np_dtype)
                data_part: Region = np.ascontiguousarray(flat, col.np_dtype)
            else:
                shapes, strings = _bytes_runs(col, parts)
                counts = _counts(shapes)
                lens, pieces = _string_pieces(strings)
                regions.append(("boffsets", i, np.concatenate([[0], np.cumsum(lens)]).astype(I64)))
                data_part = pieces
            if col.has_shapes:
                regions.append(("shapes", i, shapes))
            regions.append(("offsets", i, np.concatenate([[0], np.cumsum(counts)]).astype(I64)))
            regions.append(("data", i, data_part))
        paged = frozenset(
            i for i, col in enumerate(self.columns) if col.layout == "fixed" and _page_sized(col)
        )
        return encode_chunk(self.count, len(self.columns), regions, paged, into)


def _page_sized(col: ColumnSpec) -> bool:
    """Whether a fixed column's records are a page or more.

    Their data then starts on a page, and so does the checksum block grid: a
    record is read and verified in the pages it spans (a 4 KiB or 16 KiB record
    in exactly its own pages; a 5,000-byte one in 2.2 pages on average, not 3.4).
    """
    return col.np_dtype.itemsize * math.prod(d or 0 for d in col.shape) >= _PAGE


def _column_runs(
    col: ColumnSpec,
    parts: list[Any],
    record: Callable[[Any], tuple[tuple[int, ...], Sequence[Any]]],
    block_items: Callable[[Any], Sequence[Any]],
) -> tuple[np.ndarray, list[Any]]:
    """Shapes ``[n, ndim]`` and the items (arrays or strings) of a column's records, in order.

    ``parts`` mixes records added one by one (``record`` gives a shape and its
    items) and ``_Block`` s of many (``block_items`` gives the items of its values).
    """
    shapes: list[np.ndarray] = []
    items: list[Any] = []
    run: list[tuple[int, ...]] = []  # shapes of records added one by one, since the last block

    def close() -> None:
        if run:
            shapes.append(np.array(run, dtype=I64).reshape(len(run), col.ndim))
            run.clear()

    for p in parts:
        if isinstance(p, _Block):
            close()
            shapes.append(p.shapes)
            items.extend(block_items(p.values))
        else:
            shape, its = record(p)
            run.append(shape)
            items.extend(its)
    close()
    return (np.concatenate(shapes) if shapes else np.empty((0, col.ndim), I64)), items


def _var_runs(col: ColumnSpec, parts: list[Any]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Shapes ``[n, ndim]`` and flat values of a var column's records, in order."""
    return _column_runs(col, parts, lambda p: (p.shape, [p.reshape(-1)]), lambda v: [v])


def _bytes_runs(col: ColumnSpec, parts: list[Any]) -> tuple[np.ndarray, list[Any]]:
    """Shapes ``[n, ndim]`` and strings of a bytes column's records, in order.

    The strings are ``bytes`` and, for slabs given that way, whole ``PackedStrings``.
    """
    return _column_runs(
        col, parts, lambda p: (p[0], p[1]), lambda v: [v] if isinstance(v, PackedStrings) else v
    )


#: Strings at least this long on average go into the chunk's one join as they are; shorter
#: ones are joined into one piece first (below about 1.5-2 KiB a piece per string cost more
#: than the extra copy: 512 B strings encoded about 2x slower as pieces).
_OWN_PIECE_BYTES = 2048


def _string_pieces(strings: list[Any]) -> tuple[np.ndarray, list[np.ndarray | bytes]]:
    """The lengths of ``strings`` (``bytes`` and ``PackedStrings``) and their bytes in order."""
    lens: list[np.ndarray] = []
    pieces: list[np.ndarray | bytes] = []
    run: list[bytes] = []

    def close() -> None:
        if run:
            lengths = np.fromiter(map(len, run), dtype=I64, count=len(run))
            lens.append(lengths)
            if int(lengths.sum()) >= _OWN_PIECE_BYTES * len(run):
                pieces.extend(run)  # copied once, by encode_chunk's join
            else:
                pieces.append(np.frombuffer(b"".join(run), np.uint8))
            run.clear()

    for s in strings:
        if isinstance(s, PackedStrings):
            close()
            lens.append(s.lengths())
            pieces.append(s.piece())
        else:
            run.append(s)
    close()
    return (np.concatenate(lens) if lens else np.empty(0, I64)), pieces


def _check_shape(col: ColumnSpec, shape: tuple[int, ...], name: str | None = None) -> None:
    if len(shape) != col.ndim or any(
        d is not None and d != s for d, s in zip(col.shape, shape, strict=True)
    ):
        if name is None:
            raise UnsupportedElementError(f"value of shape {shape} does not match {col.shape}")
        raise UnsupportedElementError(
            f"component {name!r} has shape {shape}, the spec says {col.shape}"
        )


def text_bytes(value: Any, where: str | None = None) -> bytes:
    """One string's bytes: ``bytes`` as they are, ``str`` in UTF-8, others through ``bytes()``.

    A ``str`` that has no UTF-8 encoding (a lone surrogate) is refused, named by ``where``.
    """
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        return bytes(value)
    try:
        return value.encode()
    except UnicodeEncodeError as err:
        raise UnsupportedElementError(
            f"{where or 'a string'}: {value[:40]!r} cannot be encoded as UTF-8 "
            f"({err.reason} at character {err.start}); give bytes, or a str without lone "
            "surrogates"
        ) from err


def strings_as_bytes(value: list[Any] | tuple[Any, ...]) -> list[Any]:
    """Return nested lists of strings with every bytearray or memoryview as ``bytes``."""
    return [
        bytes(v)
        if isinstance(v, bytearray | memoryview)
        else strings_as_bytes(v)
        if isinstance(v, list | tuple)
        else v
        for v in value
    ]


#: A region's content: an array, bytes, or a list of arrays and bytes laid out one after
#: another.
Region = np.ndarray | bytes | list[np.ndarray] | list[np.ndarray | bytes]


def _pieces(buf: Region) -> list[bytes | memoryview]:
    """The region's parts as ``bytes`` and one-dimensional views of bytes."""
    arrays = buf if isinstance(buf, list) else [buf]
    out: list[bytes | memoryview] = []
    for a in arrays:
        if isinstance(a, bytes):
            out.append(a)
            continue
        if isinstance(a, np.ndarray):
            # As raw bytes: some dtypes (bfloat16) have no buffer-protocol format.
            view = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
        else:
            view = memoryview(a)
        out.append(view.cast("B") if view.nbytes else b"")
    return out


#: Where a stored value's first byte sits relative to a page of its file: LMDB keeps a large
#: value on overflow pages after a 16-byte page header. Elsewhere (object stores) it only
#: moves the padding. Only columns of records of a page or more are laid out on pages.
PAGE_PHASE = 16
_PAGE = 4096
_PAGED_FROM = 64 << 10  # data areas at least this large are laid out on pages


def _page_align(n: int) -> int:
    """Round ``n`` up so that ``n + PAGE_PHASE`` is a multiple of a page."""
    return -(-(n + PAGE_PHASE) // _PAGE) * _PAGE - PAGE_PHASE


def _round_page(n: int) -> int:
    """Round a length up to whole pages."""
    return -(-n // _PAGE) * _PAGE


def encode_chunk(
    count: int,
    num_columns: int,
    regions: Sequence[tuple[str, int, Region]],
    paged: frozenset[int] = frozenset(),
    into: Callable[[int], bytearray] | None = None,
) -> bytearray | memoryview:
    """Lay out regions (index regions first) behind a JSON header.

    The index ends with the data area's block checksum table
    (``yogastore.format.blocks``), so verifying the index verifies the table.
    In a data area of ``_PAGED_FROM`` bytes or more, the data of the columns in
    ``paged`` (records of a page or more) starts on a page of the stored value
    (see ``PAGE_PHASE``), so reading a record reads its own pages only.

    With ``into``, the chunk is written to the start of ``into(length)`` (a buffer
    of at least ``length`` bytes, which may hold old bytes: every byte of the chunk
    is written) and returned as a view of it; otherwise it is a new bytearray.
    """
    ordered = [r for r in regions if r[0] != "data"] + [r for r in regions if r[0] == "data"]
    contents = [_pieces(buf) for _k, _c, buf in ordered]
    sizes = [sum(map(len, views)) for views in contents]
    data = [
        (i, col, size)
        for i, ((kind, col, _b), size) in enumerate(zip(ordered, sizes, strict=True))
        if kind == "data"
    ]
    use_pages = sum(size for _i, _c, size in data) >= _PAGED_FROM and any(
        col in paged for _i, col, _s in data
    )
    # Data regions are placed relative to the data area's start, so its length
    # (and its checksum table's size) is known before the layout.
    rel: dict[int, int] = {}
    span = 0
    for i, col, size in data:
        rel[i] = _round_page(span) if use_pages and col in paged else align(span)
        span = align(rel[i] + size)
    block = block_size(span)
    table_bytes = 8 * -(-span // block)
    # The header lists region offsets, which depend on the header's own size:
    # reserve room, and grow it until the header fits.
    room = 128 + 64 * len(ordered)
    while True:
        cols: list[dict[str, list[int]]] = [{} for _ in range(num_columns)]
        pos = align(PREFIX.size + room)
        starts = [0] * len(ordered)
        for i, ((kind, col, _buf), size) in enumerate(zip(ordered, sizes, strict=True)):
            if kind == "data":
                continue
            starts[i] = pos
            cols[col][kind] = [pos, size]
            pos = align(pos + size)
        table_at = pos
        index_end = table_at + table_bytes
        base = _page_align(index_end) if use_pages else align(index_end)
        for i, col, size in data:
            starts[i] = base + rel[i]
            cols[col]["data"] = [starts[i], size]
        pos = base + span
        blocks = [table_at, table_bytes, base, block]
        header = json.dumps(
            {"k": count, "cols": cols, "index_end": index_end, "blocks": blocks},
            separators=(",", ":"),
        ).encode()
        if len(header) <= room:
            break
        room = len(header) + 64
    # One join: every byte is copied once; gaps (alignment padding) are zeros,
    # and so is the checksum table until the data area, now in one piece, is hashed.
    pieces: list[bytes | memoryview] = [PREFIX.pack(MAGIC, len(header)), header]
    end = PREFIX.size + len(header)
    for views, start, size in zip(contents, starts, sizes, strict=True):  # in file order
        pieces.append(bytes(start - end))
        pieces.extend(views)
        end = start + size
    pieces.append(bytes(pos - end))
    if into is not None:
        chunk: bytearray | memoryview = _copy_pieces(pieces, into(pos), pos)
    elif _gather is not None:  # copied without the GIL (_copy_pieces)
        chunk = _copy_pieces(pieces, bytearray(pos), pos).obj  # type: ignore[assignment]
    else:
        chunk = bytearray().join(pieces)
    with memoryview(chunk) as view:
        table = digest_blocks([view[base:pos]], block)
        view[table_at : table_at + table_bytes] = table.data.cast("B")
    return chunk


def _copy_pieces(
    pieces: Sequence[bytes | memoryview], buffer: bytearray, length: int
) -> memoryview:
    """Copy ``pieces`` one after another to the start of ``buffer``; return that part of it.

    A buffer used before costs no page faults, where a new one of chunk size
    (memory the allocator maps afresh for it) does on every page.
    """
    if len(buffer) < length:
        raise ValueError(
            f"chunk buffer of {len(buffer)} bytes is smaller than the chunk ({length})"
        )
    view = memoryview(buffer)[:length]
    if _gather is not None:  # one call, without the GIL
        at = _gather.join_into(view, pieces)
        if at != length:
            raise AssertionError(f"chunk pieces hold {at} bytes, the layout {length}")
        return view
    at = 0
    for piece in pieces:
        n = len(piece)  # bytes, or a one-dimensional view of bytes (_pieces)
        view[at : at + n] = piece
        at += n
    if at != length:
        raise AssertionError(f"chunk pieces hold {at} bytes, the layout {length}")
    return view
