"""Column batches -> user values (numpy elements and numpy batches).

Each schema component is stored as one or more columns (see
``yogastore.format.columns_for``); these functions rebuild the component, per
record or per batch, with vectorised numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from storage_backends.errors import UnsupportedElementError
from yogastore.format import (
    ColumnBatch,
    StringBuffer,
    StringFormat,
    StringRanges,
    columns_for,
    reshape_values,
)
from yogastore.spec import ComponentSpec, Kind, RaggedValue, Schema, SparseValue

__all__ = [
    "batch_components",
    "batch_length",
    "element_components",
    "slice_batch",
    "split_columns",
]


def split_columns(schema: Schema, cols: Sequence[ColumnBatch]) -> list[list[ColumnBatch]]:
    """Group a flat column list by component."""
    out, i = [], 0
    for comp in schema.components:
        n = len(columns_for(comp))
        out.append(list(cols[i : i + n]))
        i += n
    return out


def element_components(schema: Schema, cols: Sequence[ColumnBatch], i: int) -> list[Any]:
    """Return the components of record ``i`` of a batch."""
    out: list[Any] = []
    for comp, group in zip(schema.components, split_columns(schema, cols), strict=True):
        if comp.kind is Kind.TENSOR:
            out.append(group[0].record(i))
        elif comp.kind is Kind.RAGGED:
            flat = group[0].record(i)
            if comp.ragged_rank == 0:
                out.append(flat)
            else:
                out.append(RaggedValue(flat, tuple(g.record(i) for g in group[1:])))
        else:
            out.append(SparseValue(group[0].record(i), group[1].record(i), group[2].record(i)))
    return out


def _batched_ragged(
    comp: ComponentSpec, group: list[ColumnBatch], where: str, strings: StringFormat
) -> RaggedValue:
    flat = group[0]
    b = len(flat)
    lead = flat.shapes[:, 0] if flat.spec.ndim else np.ones(b, dtype=np.int64)
    inner = flat.shapes[:, 1:]
    if b and np.any(inner != inner[:1]):
        raise UnsupportedElementError(f"{where}: ragged inner dimensions differ within a batch")
    inner_shape = (
        tuple(int(d) for d in inner[0]) if b else tuple(d or 0 for d in flat.spec.shape[1:])
    )
    # The row count is given, not inferred: numpy cannot infer it when a dimension is 0.
    values = reshape_values(flat.values(strings), (int(lead.sum()), *inner_shape))
    splits: list[np.ndarray] = []
    dtype = np.dtype(comp.row_splits_dtype)
    if comp.ragged_rank == 0:
        offsets = flat.offsets
        if flat.spec.ndim == 1 and offsets is not None and b and offsets[0] == 0:
            # One value per row: the values' offsets are the row splits already.
            splits.append(offsets.astype(dtype, copy=False))
        else:
            splits.append(np.concatenate([[0], np.cumsum(lead)]).astype(dtype))
        return RaggedValue(values, tuple(splits))
    rows = np.diff(group[1].offsets) - 1 if group[1].offsets is not None else lead
    splits.append(np.concatenate([[0], np.cumsum(rows)]).astype(dtype))
    for g in group[1:]:
        if g.offsets is None:  # pragma: no cover - split columns are var columns
            raise UnsupportedElementError(f"{where}: row splits column lacks offsets")
        data = g.data.astype(np.int64)
        ends = g.offsets[1:] - 1
        last = data[ends] if b else np.empty(0, np.int64)
        shift = np.concatenate([[0], np.cumsum(last)[:-1]]) if b else last
        seg = np.diff(g.offsets)
        shifted = data + np.repeat(shift, seg)
        keep = np.ones(len(data), dtype=bool)
        keep[ends] = False
        total = int(last.sum()) if b else 0
        splits.append(np.concatenate([shifted[keep], [total]]).astype(dtype))
    return RaggedValue(values, tuple(splits))


def _batched_sparse(
    comp: ComponentSpec, group: list[ColumnBatch], strings: StringFormat
) -> SparseValue:
    indices_col, values_col, shape_col = group
    rank = len(comp.shape)
    b = len(indices_col)
    offsets = indices_col.offsets if indices_col.offsets is not None else np.zeros(b + 1, np.int64)
    nnz = np.diff(offsets) // max(rank, 1)
    ids = np.repeat(np.arange(b, dtype=np.int64), nnz)
    idx = indices_col.data.astype(np.int64).reshape(-1, rank)
    indices = np.concatenate([ids[:, None], idx], axis=1)
    dense = shape_col.data.reshape(b, rank)
    dims = dense.max(axis=0) if b else np.array([d or 0 for d in comp.shape], dtype=np.int64)
    return SparseValue(
        indices, values_col.values(strings), np.concatenate([[b], dims]).astype(np.int64)
    )


def batch_components(
    schema: Schema,
    cols: Sequence[ColumnBatch],
    where: str,
    strings: StringFormat = StringFormat.OBJECTS,
) -> list[Any]:
    """Return the components of a whole batch, stacked like ``tf.data`` ``batch``.

    Strings come as ``strings`` says: object arrays, or ``StringBuffer``s
    (bytes plus offsets, no Python object per string).
    """
    out: list[Any] = []
    for comp, group in zip(schema.components, split_columns(schema, cols), strict=True):
        if comp.kind is Kind.TENSOR:
            out.append(group[0].stacked(where, strings))
        elif comp.kind is Kind.RAGGED:
            out.append(_batched_ragged(comp, group, where, strings))
        else:
            out.append(_batched_sparse(comp, group, strings))
    return out


def slice_rows(values: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of an array, a ``StringBuffer`` or ``StringRanges``."""
    per = math.prod(values.shape[1:])
    if isinstance(values, StringRanges):
        a, b = start * per, stop * per
        return StringRanges._made(
            values.data, values.starts[a:b], values.lengths[a:b], (stop - start, *values.shape[1:])
        )
    if not isinstance(values, StringBuffer):
        return values[start:stop]
    offsets = values.offsets[start * per : stop * per + 1]
    data = values.data[int(offsets[0]) : int(offsets[-1])]
    return StringBuffer._made(data, offsets - offsets[0], (stop - start, *values.shape[1:]))


def batch_length(schema: Schema, comps: Sequence[Any]) -> int:
    """Return the records in a batch of tensor and rank-0 ragged components."""
    first = comps[0]
    if isinstance(first, RaggedValue):
        return len(first.nested_row_splits[0]) - 1
    return len(first)


def slice_batch(schema: Schema, comps: Sequence[Any], start: int, stop: int) -> list[Any]:
    """Return records ``[start, stop)`` of a batch of tensor and rank-0 ragged components.

    Views, no copies: slices of the batch's arrays and shifted row splits.
    """
    out: list[Any] = []
    for comp, value in zip(schema.components, comps, strict=True):
        if comp.kind is Kind.TENSOR:
            out.append(slice_rows(value, start, stop))
            continue
        splits = value.nested_row_splits[0]
        a, b = int(splits[start]), int(splits[stop])
        flat = slice_rows(value.flat_values, a, b)
        out.append(RaggedValue(flat, (splits[start : stop + 1] - splits[start],)))
    return out
