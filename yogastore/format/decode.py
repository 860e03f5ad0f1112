"""Reading chunks: header parsing and column views in place, every bound checked.

Every offset and length read from a chunk is checked before use; a violation
raises ``CorruptCacheError`` naming the chunk and what failed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from storage_backends.errors import CorruptCacheError
from yogastore import boundedjson
from yogastore.arrays import IntArray
from yogastore.checks import is_int
from yogastore.format.layout import (
    I64,
    MAGIC,
    MAX_HEADER,
    PREFIX,
    ColumnSpec,
    dims_or_zero,
)

__all__ = ["ChunkView", "parse_header"]


def parse_header(prefix: bytes | memoryview, total: int, where: str) -> dict[str, Any]:
    """Parse and bounds-check a chunk header.

    Args:
        prefix: the first bytes of the chunk (at least the header).
        total: the chunk's full length in bytes.
        where: text naming the dataset and chunk for error messages.
    """
    if len(prefix) < PREFIX.size:
        raise CorruptCacheError(f"{where}: chunk is shorter than its header prefix")
    magic, length = PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise CorruptCacheError(f"{where}: bad chunk magic {bytes(magic)!r}")
    if length > MAX_HEADER or PREFIX.size + length > len(prefix):
        raise CorruptCacheError(f"{where}: chunk header length {length} is out of bounds")
    header = boundedjson.loads(
        prefix[PREFIX.size : PREFIX.size + length], f"{where}: chunk header", CorruptCacheError
    )
    if not isinstance(header, dict) or not isinstance(header.get("cols"), list):
        raise CorruptCacheError(f"{where}: chunk header lacks a column table")
    end = header.get("index_end")
    if not is_int(end, allow_numpy=False) or not PREFIX.size + length <= end <= total:
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
                or not all(is_int(v, allow_numpy=False) for v in region)
                or region[0] < 0
                or region[1] < 0
                or region[0] + region[1] > limit
                or region[0] % 8
            ):
                raise CorruptCacheError(
                    f"{where}: region {kind}={region!r} lies outside the chunk ({limit} bytes)"
                )
    return header


@dataclasses.dataclass(slots=True)
class _ColumnView:
    spec: ColumnSpec
    data: np.ndarray  # fixed: [k, *shape]; var: flat elements; bytes: uint8
    shapes: np.ndarray | None = None  # [k, ndim] when some dim is unknown
    offsets: np.ndarray | None = None  # [k + 1] elements (var) / strings (bytes)
    boffsets: np.ndarray | None = None  # [n + 1] bytes per string
    data_at: int = 0  # offset of the data region in the chunk
    address: int = dataclasses.field(init=False, default=0)  # of data's first byte

    def __post_init__(self) -> None:
        self.address = int(self.data.__array_interface__["data"][0])

    def record_shapes(self, idx: IntArray) -> IntArray:
        if self.shapes is not None:
            return self.shapes[idx]
        known = np.array(dims_or_zero(self.spec), dtype=np.int64)
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
        checked: these index bytes passed every check of a view before (in
            this process): the checks that scan whole offset and shape tables
            are skipped. Sizes are still checked, and gathers check every
            offset they read whatever this says.
    """

    def __init__(
        self,
        buf: bytes | memoryview,
        columns: Sequence[ColumnSpec],
        count: int,
        where: str,
        header: dict[str, Any] | None = None,
        checked: bool = False,
    ) -> None:
        self.where = where
        self._checked = checked
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
        at = int(regions["data"][0]) if "data" in regions else 0
        if spec.layout == "fixed":
            data = self._region(buf, regions, "data", spec.np_dtype, i)
            per = math.prod(dims_or_zero(spec))
            if data.size != k * per:
                raise CorruptCacheError(f"{bad}: {data.size} values, expected {k * per}")
            return _ColumnView(spec, data.reshape(k, *dims_or_zero(spec)), data_at=at)
        offsets = self._region(buf, regions, "offsets", I64, i)
        if offsets.size != k + 1 or offsets[0] != 0:
            raise CorruptCacheError(
                f"{bad}: record offsets are not {k + 1} ascending values from 0"
            )
        shapes = None
        if spec.has_shapes:
            shapes = self._region(buf, regions, "shapes", I64, i)
            if shapes.size != k * spec.ndim:
                raise CorruptCacheError(f"{bad}: shape table has {shapes.size} values")
            shapes = shapes.reshape(k, spec.ndim)
        if not self._checked:
            self._check_records(bad, spec, offsets, shapes)
        if spec.layout == "var":
            data = self._region(buf, regions, "data", spec.np_dtype, i)
            if offsets[-1] != data.size:
                raise CorruptCacheError(
                    f"{bad}: offsets end at {offsets[-1]}, data has {data.size}"
                )
            return _ColumnView(spec, data, shapes, offsets, data_at=at)
        boffsets = self._region(buf, regions, "boffsets", I64, i)
        data = self._region(buf, regions, "data", np.uint8, i)
        if (
            boffsets.size != offsets[-1] + 1
            or (boffsets.size and boffsets[0] != 0)
            or (not self._checked and np.any(np.diff(boffsets) < 0))
            or (boffsets.size and boffsets[-1] != data.size)
        ):
            raise CorruptCacheError(f"{bad}: string offsets are inconsistent with the data")
        return _ColumnView(spec, data, shapes, offsets, boffsets, data_at=at)

    @staticmethod
    def _check_records(
        bad: str, spec: ColumnSpec, offsets: np.ndarray, shapes: np.ndarray | None
    ) -> None:
        """Check a column's record offsets ascend and agree with its shapes (or fixed shape)."""
        counts = np.diff(offsets)
        if np.any(counts < 0):
            raise CorruptCacheError(
                f"{bad}: record offsets are not {len(offsets)} ascending values from 0"
            )
        if shapes is not None:
            known = [j for j, d in enumerate(spec.shape) if d is not None]
            expected = np.array([spec.shape[j] for j in known], dtype=np.int64)
            if (
                np.any(shapes < 0)
                or (known and np.any(shapes[:, known] != expected))
                or np.any(np.prod(shapes.astype(np.float64), axis=1) != counts)
            ):
                raise CorruptCacheError(f"{bad}: record shapes disagree with offsets or spec")
        elif np.any(counts != int(np.prod(dims_or_zero(spec), dtype=np.int64))):
            raise CorruptCacheError(f"{bad}: record sizes disagree with the fixed shape")
