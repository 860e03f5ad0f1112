"""Chunk layout: columns per component, the byte layout of a chunk, its constants.

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
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

from yogastore.spec import STRING, ComponentSpec, Kind, numpy_dtype

__all__ = [
    "ALIGN",
    "I64",
    "MAGIC",
    "MAX_HEADER",
    "PREFIX",
    "ColumnSpec",
    "align",
    "columns_for",
    "dims_or_zero",
]

MAGIC = b"YGC1"
ALIGN = 64
PREFIX = struct.Struct("<4sI")
I64 = np.dtype("<i8")
MAX_HEADER = 1 << 24


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


def dims_or_zero(col: ColumnSpec) -> tuple[int, ...]:
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


def align(n: int) -> int:
    """Return ``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN
