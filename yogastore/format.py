"""Chunk bytes <-> columns, numpy only.

A chunk holds ``k`` consecutive records. Each component of the schema is stored
as one or more *columns*:

* ``fixed``: every record has the same known shape; one contiguous
  little-endian array ``[k, *shape]``.
* ``var``: numeric values of varying shape; per-record ``shapes [k, ndim]``
  (only when some dimension is unknown), element ``offsets [k + 1]`` and the
  flat ``data``.
* ``bytes``: strings; ``shapes`` (when needed), per-record string ``offsets
  [k + 1]``, per-string byte offsets ``boffsets [n + 1]`` and the bytes.

Chunk layout::

    b"YGC1" | u32 header length | JSON header | index regions | data regions

Regions are 64-byte aligned so ``numpy.frombuffer`` views them in place. The
header and all index regions (shapes, offsets) come first and end at
``index_end``: an object-store reader fetches ``[0, index_end)`` in one ranged
read and then only the data bytes of the records it needs.

Every offset and length read from a chunk is checked before use; a violation
raises ``CorruptCacheError`` naming the chunk and what failed.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from storage_backends.errors import CorruptCacheError, UnsupportedElementError
from yogastore import boundedjson
from yogastore.blocks import block_size, digest_blocks
from yogastore.spec import STRING, ComponentSpec, Kind, numpy_dtype

try:  # compiled loops; without them the gathers fall back to numpy
    from yogastore import _gather
except ImportError:  # pragma: no cover - the package builds it on install
    _gather = None  # type: ignore[assignment]

__all__ = [
    "ChunkBuilder",
    "ChunkView",
    "ColumnBatch",
    "ColumnSpec",
    "StringBuffer",
    "StringFormat",
    "columns_for",
    "encode_chunk",
    "gather",
    "parse_header",
    "reshape_values",
    "split_strings",
]

MAGIC = b"YGC1"
ALIGN = 64
_PREFIX = struct.Struct("<4sI")
_I64 = np.dtype("<i8")
_MAX_HEADER = 1 << 24
IntArray = npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True, slots=True)
class ColumnSpec:
    """How one column is laid out: ``fixed``, ``var`` or ``bytes``."""

    layout: str
    dtype: str
    shape: tuple[int | None, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def has_shapes(self) -> bool:
        return self.layout != "fixed" and any(d is None for d in self.shape)

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return np.dtype(np.uint8) if self.layout == "bytes" else numpy_dtype(self.dtype)


def _dims(col: ColumnSpec) -> tuple[int, ...]:
    """Return the shape with unknown dimensions as 0 (for empty arrays and products)."""
    return tuple(d if d is not None else 0 for d in col.shape)


def _leaf_column(dtype: str, shape: tuple[int | None, ...]) -> ColumnSpec:
    if dtype == STRING:
        return ColumnSpec("bytes", dtype, shape)
    if all(d is not None for d in shape):
        return ColumnSpec("fixed", dtype, shape)
    return ColumnSpec("var", dtype, shape)


def columns_for(spec: ComponentSpec) -> list[ColumnSpec]:
    """Return the columns that store one component."""
    if spec.kind is Kind.TENSOR:
        return [_leaf_column(spec.dtype, spec.shape)]
    if spec.kind is Kind.RAGGED:
        r = spec.ragged_rank
        # flat_values drop the r outer ragged dims and keep the uniform rest.
        flat_shape = (None, *spec.shape[r + 1 :]) if r else spec.shape
        cols = [ColumnSpec("bytes" if spec.dtype == STRING else "var", spec.dtype, flat_shape)]
        cols += [ColumnSpec("var", spec.row_splits_dtype, (None,)) for _ in range(r)]
        return cols
    rank = len(spec.shape)
    return [
        ColumnSpec("var", "int64", (None, rank)),
        ColumnSpec("bytes" if spec.dtype == STRING else "var", spec.dtype, (None,)),
        ColumnSpec("fixed", "int64", (rank,)),
    ]


# Writing ---------------------------------------------------------------------


class ChunkBuilder:
    """Accumulates records column by column and encodes them as one chunk."""

    def __init__(self, columns: Sequence[ColumnSpec]) -> None:
        self.columns = list(columns)
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

    def add_record(self, values: Sequence[Any]) -> None:
        """Add one record given as one value per column."""
        for col, parts, value in zip(self.columns, self._parts, values, strict=True):
            if col.layout == "fixed":
                a = np.asarray(value, dtype=col.np_dtype)
                if a.shape != col.shape:
                    raise UnsupportedElementError(
                        f"value of shape {a.shape} does not match {col.shape}"
                    )
                parts.append(a[None])
                self.nbytes += a.nbytes
            else:
                self._add_one(col, parts, value)
        self.count += 1

    def _add_one(self, col: ColumnSpec, parts: list[Any], value: Any) -> None:
        if col.layout == "bytes":
            a = np.asarray(value, dtype=object)
            _check_shape(col, a.shape)
            strings = [
                s if isinstance(s, bytes) else str(s).encode() if isinstance(s, str) else bytes(s)
                for s in a.reshape(-1)
            ]
            parts.append((a.shape, strings))
            self.nbytes += sum(len(s) for s in strings) + 8 * (len(strings) + 1)
        else:
            a = np.asarray(value, dtype=col.np_dtype)
            _check_shape(col, a.shape)
            parts.append(a)
            self.nbytes += a.nbytes + 8 * (col.ndim + 1)

    def encode(self) -> bytes:
        """Return the chunk bytes for everything added so far."""
        regions: list[tuple[str, int, Region]] = []  # (kind, col, data)
        for i, (col, parts) in enumerate(zip(self.columns, self._parts, strict=True)):
            if col.layout == "fixed":
                # The parts are copied straight into the chunk, not concatenated first.
                regions.append(("data", i, [np.ascontiguousarray(p, col.np_dtype) for p in parts]))
                continue
            if col.layout == "var":
                shapes = np.array([p.shape for p in parts], dtype=_I64).reshape(
                    len(parts), col.ndim
                )
                counts = np.array([p.size for p in parts], dtype=_I64)
                flat = (
                    np.concatenate([p.reshape(-1) for p in parts])
                    if parts
                    else np.empty(0, col.np_dtype)
                )
                data_part: np.ndarray | bytes = np.ascontiguousarray(flat, col.np_dtype)
            else:
                shapes = np.array([p[0] for p in parts], dtype=_I64).reshape(len(parts), col.ndim)
                counts = np.array([len(p[1]) for p in parts], dtype=_I64)
                strings = [s for p in parts for s in p[1]]
                lens = np.fromiter((len(s) for s in strings), dtype=_I64, count=len(strings))
                regions.append(("boffsets", i, np.concatenate([[0], np.cumsum(lens)]).astype(_I64)))
                data_part = b"".join(strings)
            if col.has_shapes:
                regions.append(("shapes", i, shapes))
            regions.append(("offsets", i, np.concatenate([[0], np.cumsum(counts)]).astype(_I64)))
            regions.append(("data", i, data_part))
        return encode_chunk(self.count, len(self.columns), regions)


def _check_shape(col: ColumnSpec, shape: tuple[int, ...]) -> None:
    if len(shape) != col.ndim or any(
        d is not None and d != s for d, s in zip(col.shape, shape, strict=True)
    ):
        raise UnsupportedElementError(f"value of shape {shape} does not match {col.shape}")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


#: A region's content: an array, bytes, or a list of arrays laid out one after another.
Region = np.ndarray | bytes | list[np.ndarray]


def _pieces(buf: Region) -> list[memoryview]:
    arrays = buf if isinstance(buf, list) else [buf]
    out = []
    for a in arrays:
        if isinstance(a, np.ndarray):
            # As raw bytes: some dtypes (bfloat16) have no buffer-protocol format.
            view = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
        else:
            view = memoryview(a)
        out.append(view.cast("B") if view.nbytes else memoryview(b""))
    return out


def encode_chunk(count: int, num_columns: int, regions: Sequence[tuple[str, int, Region]]) -> bytes:
    """Lay out regions (index regions first) behind a JSON header.

    The index ends with the data area's block checksum table
    (``yogastore.blocks``), so verifying the index verifies the table.
    """
    ordered = [r for r in regions if r[0] != "data"] + [r for r in regions if r[0] == "data"]
    contents = [_pieces(buf) for _k, _c, buf in ordered]
    sizes = [sum(v.nbytes for v in views) for views in contents]
    # The data area's length does not depend on where it starts (each region
    # is aligned), so the size of its checksum table is known before layout.
    span = 0
    for (kind, _c, _b), size in zip(ordered, sizes, strict=True):
        if kind == "data":
            span = _align(span + size)
    block = block_size(span)
    table_bytes = 8 * -(-span // block)
    # The header lists region offsets, which depend on the header's own size:
    # reserve room, and grow it until the header fits.
    room = 128 + 64 * len(ordered)
    while True:
        cols: list[dict[str, list[int]]] = [{} for _ in range(num_columns)]
        pos = _align(_PREFIX.size + room)
        starts = []
        index_end = pos
        table_at = -1
        for (kind, col, _buf), size in zip(ordered, sizes, strict=True):
            if kind == "data" and table_at < 0:
                table_at, index_end = pos, pos + table_bytes
                pos = _align(index_end)
            starts.append(pos)
            cols[col][kind] = [pos, size]
            if kind != "data":
                index_end = pos + size
            pos = _align(pos + size)
        if table_at < 0:
            table_at, index_end = pos, pos + table_bytes
            pos = _align(index_end)
        base = _align(index_end)
        blocks = [table_at, table_bytes, base, block]
        header = json.dumps(
            {"k": count, "cols": cols, "index_end": index_end, "blocks": blocks},
            separators=(",", ":"),
        ).encode()
        if len(header) <= room:
            break
        room = len(header) + 64
    # The data area, piece by piece with its zero padding, hashed where it lies.
    data_pieces: list[bytes | memoryview] = []
    end = base
    for (kind, _c, _b), views, start, size in zip(ordered, contents, starts, sizes, strict=True):
        if kind != "data":
            continue
        data_pieces.append(bytes(start - end))
        data_pieces.extend(views)
        end = start + size
    data_pieces.append(bytes(pos - end))
    table = digest_blocks(data_pieces, block)
    # One join: every byte is copied once; gaps (alignment padding) are zeros.
    pieces: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, len(header)), header]
    end = _PREFIX.size + len(header)
    for (kind, _c, _b), views, start, size in zip(ordered, contents, starts, sizes, strict=True):
        if kind == "data":
            break
        pieces.append(bytes(start - end))
        pieces.extend(views)
        end = start + size
    pieces += [bytes(table_at - end), table.data.cast("B"), bytes(base - table_at - table_bytes)]
    pieces += data_pieces
    return b"".join(pieces)


# Reading ---------------------------------------------------------------------


def parse_header(prefix: bytes | memoryview, total: int, where: str) -> dict[str, Any]:
    """Parse and bounds-check a chunk header.

    Args:
        prefix: the first bytes of the chunk (at least the header).
        total: the chunk's full length in bytes.
        where: text naming the dataset and chunk for error messages.
    """
    if len(prefix) < _PREFIX.size:
        raise CorruptCacheError(f"{where}: chunk is shorter than its header prefix")
    magic, length = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise CorruptCacheError(f"{where}: bad chunk magic {bytes(magic)!r}")
    if length > _MAX_HEADER or _PREFIX.size + length > len(prefix):
        raise CorruptCacheError(f"{where}: chunk header length {length} is out of bounds")
    header = boundedjson.loads(
        prefix[_PREFIX.size : _PREFIX.size + length], f"{where}: chunk header", CorruptCacheError
    )
    if not isinstance(header, dict) or not isinstance(header.get("cols"), list):
        raise CorruptCacheError(f"{where}: chunk header lacks a column table")
    end = header.get("index_end")
    if (
        not isinstance(end, int)
        or isinstance(end, bool)
        or not _PREFIX.size + length <= end <= total
    ):
        raise CorruptCacheError(f"{where}: chunk index end {end!r} is out of bounds")
    for col in header["cols"]:
        if not isinstance(col, dict):
            raise CorruptCacheError(f"{where}: malformed column entry {col!r}")
        for kind, region in col.items():
            limit = total if kind == "data" else end
            if (
                kind not in ("data", "shapes", "offsets", "boffsets")
                or not isinstance(region, list)
                or len(region) != 2
                or not all(_is_int(v) for v in region)
                or region[0] < 0
                or region[1] < 0
                or region[0] + region[1] > limit
                or region[0] % 8
            ):
                raise CorruptCacheError(
                    f"{where}: region {kind}={region!r} lies outside the chunk ({limit} bytes)"
                )
    return header


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(slots=True)
class _ColumnView:
    spec: ColumnSpec
    data: np.ndarray  # fixed: [k, *shape]; var: flat elements; bytes: uint8
    shapes: np.ndarray | None = None  # [k, ndim] when some dim is unknown
    offsets: np.ndarray | None = None  # [k + 1] elements (var) / strings (bytes)
    boffsets: np.ndarray | None = None  # [n + 1] bytes per string
    address: int = dataclasses.field(init=False, default=0)  # of data's first byte

    def __post_init__(self) -> None:
        self.address = int(self.data.__array_interface__["data"][0])

    def record_shapes(self, idx: IntArray) -> IntArray:
        if self.shapes is not None:
            return self.shapes[idx]
        known = np.array(_dims(self.spec), dtype=np.int64)
        return np.broadcast_to(known, (len(idx), self.spec.ndim))


class ChunkView:
    """Columns of one chunk, viewed in place over its bytes.

    Args:
        buf: the chunk bytes (or a buffer holding ``[0, index_end)`` plus the
            data regions at their offsets; see ``regions``).
        columns: the schema's columns.
        count: the record count the manifest promises.
        where: text naming dataset and chunk for error messages.
        header: an already parsed header, if any.
    """

    def __init__(
        self,
        buf: bytes | memoryview,
        columns: Sequence[ColumnSpec],
        count: int,
        where: str,
        header: dict[str, Any] | None = None,
    ) -> None:
        self.where = where
        header = header if header is not None else parse_header(buf, len(buf), where)
        if header.get("k") != count:
            raise CorruptCacheError(
                f"{where}: chunk holds {header.get('k')!r} records, manifest says {count}"
            )
        if len(header["cols"]) != len(columns):
            raise CorruptCacheError(
                f"{where}: chunk has {len(header['cols'])} columns, schema has {len(columns)}"
            )
        self.count = count
        self.columns = [
            self._view(buf, spec, regions, i)
            for i, (spec, regions) in enumerate(zip(columns, header["cols"], strict=True))
        ]

    def _region(
        self, buf: bytes | memoryview, regions: dict[str, Any], kind: str, dtype: Any, i: int
    ) -> np.ndarray:
        if kind not in regions:
            raise CorruptCacheError(f"{self.where}: column {i} lacks its {kind} region")
        start, size = regions[kind]
        dt = np.dtype(dtype)
        if size % dt.itemsize or start + size > len(buf):
            raise CorruptCacheError(
                f"{self.where}: column {i} {kind} region of {size} bytes is not a whole "
                f"number of {dt} items or lies past the chunk end"
            )
        return np.frombuffer(buf, dtype=dt, count=size // dt.itemsize, offset=start)

    def _view(
        self, buf: bytes | memoryview, spec: ColumnSpec, regions: dict[str, Any], i: int
    ) -> _ColumnView:
        k = self.count
        bad = f"{self.where}: column {i} ({spec.layout} {spec.dtype})"
        if spec.layout == "fixed":
            data = self._region(buf, regions, "data", spec.np_dtype, i)
            per = int(np.prod(_dims(spec), dtype=np.int64))
            if data.size != k * per:
                raise CorruptCacheError(f"{bad}: {data.size} values, expected {k * per}")
            return _ColumnView(spec, data.reshape(k, *_dims(spec)))
        offsets = self._region(buf, regions, "offsets", _I64, i)
        if offsets.size != k + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise CorruptCacheError(
                f"{bad}: record offsets are not {k + 1} ascending values from 0"
            )
        counts = np.diff(offsets)
        shapes = None
        if spec.has_shapes:
            shapes = self._region(buf, regions, "shapes", _I64, i)
            if shapes.size != k * spec.ndim:
                raise CorruptCacheError(f"{bad}: shape table has {shapes.size} values")
            shapes = shapes.reshape(k, spec.ndim)
            known = [j for j, d in enumerate(spec.shape) if d is not None]
            expected = np.array([spec.shape[j] for j in known], dtype=np.int64)
            if (
                np.any(shapes < 0)
                or (known and np.any(shapes[:, known] != expected))
                or np.any(np.prod(shapes.astype(np.float64), axis=1) != counts)
            ):
                raise CorruptCacheError(f"{bad}: record shapes disagree with offsets or spec")
        elif np.any(counts != int(np.prod(_dims(spec), dtype=np.int64))):
            raise CorruptCacheError(f"{bad}: record sizes disagree with the fixed shape")
        if spec.layout == "var":
            data = self._region(buf, regions, "data", spec.np_dtype, i)
            if offsets[-1] != data.size:
                raise CorruptCacheError(
                    f"{bad}: offsets end at {offsets[-1]}, data has {data.size}"
                )
            return _ColumnView(spec, data, shapes, offsets)
        boffsets = self._region(buf, regions, "boffsets", _I64, i)
        data = self._region(buf, regions, "data", np.uint8, i)
        if (
            boffsets.size != offsets[-1] + 1
            or (boffsets.size and boffsets[0] != 0)
            or np.any(np.diff(boffsets) < 0)
            or (boffsets.size and boffsets[-1] != data.size)
        ):
            raise CorruptCacheError(f"{bad}: string offsets are inconsistent with the data")
        return _ColumnView(spec, data, shapes, offsets, boffsets)


# Batches ---------------------------------------------------------------------


class StringFormat(enum.Enum):
    """How a batch hands over strings.

    ``OBJECTS``: a numpy object array of ``bytes`` (one Python object per
    string). ``BUFFERS``: a ``StringBuffer``, all bytes in one array plus
    offsets, with no Python object per string.
    """

    OBJECTS = "objects"
    BUFFERS = "buffers"


@dataclasses.dataclass(frozen=True, slots=True)
class StringBuffer:
    """Strings as one byte buffer plus offsets: string ``i`` is ``data[offsets[i]:offsets[i + 1]]``.

    Attributes:
        data: ``uint8`` array holding every string's bytes, back to back.
        offsets: ``int64`` array of ``n + 1`` ascending byte offsets from 0.
        shape: the shape of the string array (its product is ``n``), e.g.
            ``(batch,)`` for a batch of scalar strings.
    """

    data: np.ndarray
    offsets: np.ndarray
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.offsets) - 1
        if n < 0 or math.prod(self.shape) != n:
            raise UnsupportedElementError(
                f"StringBuffer of shape {self.shape} needs {math.prod(self.shape) + 1} offsets, "
                f"got {len(self.offsets)}"
            )
        if n and (self.offsets[0] != 0 or self.offsets[-1] > len(self.data)):
            raise CorruptCacheError(
                f"StringBuffer offsets run from {self.offsets[0]} to {self.offsets[-1]}, "
                f"the buffer holds {len(self.data)} bytes"
            )

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def lengths(self) -> IntArray:
        """Return the length in bytes of every string (flat)."""
        return np.diff(self.offsets)

    def to_numpy(self) -> np.ndarray:
        """Return the strings as a numpy object array of ``bytes`` of ``shape``."""
        return split_strings(self.data, self.offsets).reshape(self.shape)


def split_strings(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Return ``data[offsets[i]:offsets[i + 1]]`` for each ``i`` as a flat object array."""
    n = len(offsets) - 1
    out = np.empty(max(n, 0), dtype=object)
    if n <= 0:
        return out
    if _gather is not None:
        try:
            out[:] = _gather.split_bytes(data, np.ascontiguousarray(offsets, dtype=np.int64))
        except IndexError as err:
            raise CorruptCacheError(f"string offsets out of bounds: {err}") from err
        return out
    raw = data.tobytes()  # pragma: no cover - the package builds the extension
    bounds = offsets.tolist()  # pragma: no cover
    out[:] = [raw[a:b] for a, b in itertools.pairwise(bounds)]  # pragma: no cover
    return out  # pragma: no cover


@dataclasses.dataclass(slots=True)
class ColumnBatch:
    """One column of a batch of records, in batch order."""

    spec: ColumnSpec
    data: np.ndarray
    shapes: np.ndarray  # [B, ndim]
    offsets: np.ndarray | None = None
    boffsets: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.shapes)

    def record(self, i: int) -> Any:
        """Return record ``i`` as numpy (bytes for scalar strings)."""
        if self.spec.layout == "fixed":
            return self.data[i]
        if self.offsets is None:  # pragma: no cover - var/bytes always have offsets
            raise CorruptCacheError("column batch lacks offsets")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        shape = tuple(int(d) for d in self.shapes[i])
        if self.spec.layout == "var":
            return self.data[a:b].reshape(shape)
        if self.boffsets is None:  # pragma: no cover
            raise CorruptCacheError("string column batch lacks byte offsets")
        bo = self.boffsets
        strings = [self.data[int(bo[j]) : int(bo[j + 1])].tobytes() for j in range(a, b)]
        if not shape:
            return strings[0]
        out = np.empty(len(strings), dtype=object)
        out[:] = strings
        return out.reshape(shape)

    def strings(self) -> np.ndarray:
        """Return all strings of the batch as a flat object array."""
        if self.boffsets is None:
            raise UnsupportedElementError("not a string column")
        return split_strings(self.data, self.boffsets)

    def values(self, strings: StringFormat = StringFormat.OBJECTS) -> Any:
        """Return the flat values: numbers, or strings as ``strings`` says."""
        if self.spec.layout != "bytes":
            return self.data.reshape(-1)
        if strings is StringFormat.BUFFERS:
            if self.boffsets is None:  # pragma: no cover - bytes columns have them
                raise UnsupportedElementError("not a string column")
            return StringBuffer(self.data, self.boffsets, (len(self.boffsets) - 1,))
        return self.strings()

    def stacked(self, where: str, strings: StringFormat = StringFormat.OBJECTS) -> Any:
        """Return the batch as one dense ``[B, *shape]`` array (shapes must agree).

        Strings come as ``strings`` says (a ``StringBuffer`` of that shape for
        ``BUFFERS``).
        """
        if self.spec.layout == "fixed":
            return self.data
        if len(self) and np.any(self.shapes != self.shapes[:1]):
            raise UnsupportedElementError(
                f"{where}: cannot batch records of different shapes into one dense array "
                "(as tf.data.Dataset.batch would fail); pass batching=Batching.PADDED or "
                "Batching.RAGGED (yogastore.tf_map) to to_tf_dataset, or read them unbatched"
            )
        shape = (
            tuple(int(d) for d in self.shapes[0])
            if len(self)
            else tuple(d or 0 for d in self.spec.shape)
        )
        return reshape_values(self.values(strings), (len(self), *shape))


def reshape_values(values: Any, shape: tuple[int, ...]) -> Any:
    """Reshape flat values (an array or a ``StringBuffer``); one dimension may be -1."""
    if not isinstance(values, StringBuffer):
        return values.reshape(shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        missing = (len(values.offsets) - 1) // known if known else 0
        shape = tuple(missing if d == -1 else d for d in shape)
    return StringBuffer(values.data, values.offsets, shape)


def gather(
    spec: ColumnSpec, views: Sequence[ChunkView], which: IntArray, local: IntArray, column: int
) -> ColumnBatch:
    """Gather records ``local[j]`` of chunk ``views[which[j]]`` for one column.

    One compiled, bounds-checked copy per column (see ``yogastore.rows``); no
    per-record Python work.
    """
    from yogastore import rows  # rows builds on this module's views

    return rows.gather_views(spec, views, which, local, column)
