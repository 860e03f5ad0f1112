"""Iterable sources that yield batches of records: ``Batches``.

A record-by-record iterable costs a Python call and a few small arrays per
record (about 8 us for an 8-byte record here); a batch of a million records
costs about as much as one. Each batch is checked whole (structure, shape
past the batch dimension, lossless dtype) and handed to the chunk writer as
column data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from storage_backends.errors import InvalidArgumentError, UnsupportedElementError
from yogastore.build.casts import as_numpy, check_value
from yogastore.format.encode import Slab, text_bytes
from yogastore.format.layout import columns_for
from yogastore.spec import STRING, Schema, numpy_dtype

__all__ = ["Batches", "items_of_batches"]


class Batches:
    """An iterable source whose elements are batches of records, not records.

    Return it from ``make_dataset`` (with ``spec=`` describing one record):
    every element has the structure of a record, and each leaf holds the
    batch's records along a leading dimension (``[n, *shape]``; numpy arrays,
    or anything ``numpy.asarray`` takes). Batches may differ in size, and an
    empty one is skipped. Records keep their order: batch by batch, row by row.
    Every component must be dense with a fixed shape (strings too); ragged,
    sparse or variable-length components are yielded record by record.

    With ``Store.cache_parallel`` and a ``make_dataset`` without ``(rank,
    num_ranks)``, rank ``r`` takes every ``num_ranks``-th batch from ``r``.

    Args:
        batches: the batches (iterated once per build).

    Example::

        def make():
            for start in range(0, 10**9, 1 << 20):
                yield {"id": np.arange(start, min(start + (1 << 20), 10**9))}

        store.cache("ids", "1", lambda: yogastore.Batches(make()),
                    spec={"id": yogastore.ComponentSpec(shape=(), dtype="int64")})
    """

    __slots__ = ("batches",)
    batches: Iterable[Any]

    def __init__(self, batches: Iterable[Any]) -> None:
        if isinstance(batches, Batches):
            batches = batches.batches
        if not isinstance(batches, Iterable):
            raise InvalidArgumentError(
                f"Batches takes an iterable of batches, got {type(batches).__name__}"
            )
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __repr__(self) -> str:
        return f"Batches({self.batches!r})"


def items_of_batches(schema: Schema, batches: Iterable[Any]) -> Iterator[tuple[str, list[Any]]]:
    """Turn batches (see ``Batches``) into the writer's items: ``batch`` or ``slab``.

    Raises:
        InvalidArgumentError: a component is not dense with a fixed shape.
        UnsupportedElementError: a batch does not match the spec (naming the
            batch, the component and what differs), or its values would be
            cast lossily.
    """
    for comp, path in zip(schema.components, schema.paths, strict=True):
        if not comp.fixed:
            raise InvalidArgumentError(
                f"component {path!r} ({comp.kind.value}, shape {comp.shape}) cannot come in "
                "Batches: every component must be dense with a fixed shape; yield the "
                "records one by one instead"
            )
    if not schema.components:
        raise InvalidArgumentError(
            "Batches needs at least one component to count a batch's records; a spec with "
            "no components is yielded record by record"
        )
    strings = any(c.dtype == STRING for c in schema.components)
    columns = [col for comp in schema.components for col in columns_for(comp)]
    for at, element in enumerate(batches):
        try:
            leaves = schema.flatten(element)
        except UnsupportedElementError as err:
            raise UnsupportedElementError(f"batch {at}: {err}") from err
        arrays = [
            _batch_array(comp, leaf, path, at)
            for comp, leaf, path in zip(schema.components, leaves, schema.paths, strict=True)
        ]
        n = len(arrays[0])
        if any(len(arr) != n for arr in arrays):
            sizes = ", ".join(f"{p!r}: {len(a)}" for a, p in zip(arrays, schema.paths, strict=True))
            raise UnsupportedElementError(
                f"batch {at}: components hold different numbers of records ({sizes})"
            )
        if n == 0:
            continue
        if not strings:
            yield "batch", arrays
            continue
        data: list[Any] = []
        for col, arr, path in zip(columns, arrays, schema.paths, strict=True):
            if col.layout == "fixed":
                data.append(arr)
            else:
                shapes = np.broadcast_to(np.asarray(arr.shape[1:], np.int64), (n, col.ndim))
                where = f"batch {at}: component {path!r}"
                data.append((shapes, [text_bytes(s, where) for s in arr.reshape(-1)]))
        yield "slab", [Slab(n, tuple(data))]


def _batch_array(comp: Any, leaf: Any, path: str, at: int) -> np.ndarray:
    """A copy of ``leaf`` as an ``[n, *shape]`` array of the component's dtype (checked first).

    A copy: sources often refill one buffer for every batch, and the chunk writer
    keeps a batch's arrays until its chunk is written.
    """
    if leaf is None or isinstance(leaf, str | bytes):
        raise _not_a_batch(comp, leaf, path, at)
    leaf = as_numpy(leaf)
    try:
        check_value(comp, leaf, path)
    except UnsupportedElementError as err:
        raise UnsupportedElementError(f"batch {at}: {err}") from err
    try:
        arr = np.array(leaf, dtype=object if comp.dtype == STRING else numpy_dtype(comp.dtype))
    except (ValueError, TypeError, OverflowError) as err:
        raise UnsupportedElementError(
            f"batch {at}: component {path!r} is not an array of records of shape "
            f"{comp.shape}: {err}"
        ) from err
    if arr.ndim == 0:
        raise _not_a_batch(comp, leaf, path, at)
    if arr.shape == (0,) and comp.shape:
        arr = arr.reshape((0, *comp.shape))  # an empty list: no records
    if arr.shape[1:] != comp.shape:
        raise UnsupportedElementError(
            f"batch {at}: component {path!r} has shape {arr.shape}; a batch of n records "
            f"of shape {comp.shape} has shape ({', '.join(['n', *map(str, comp.shape)])})"
        )
    return arr


def _not_a_batch(comp: Any, leaf: Any, path: str, at: int) -> UnsupportedElementError:
    return UnsupportedElementError(
        f"batch {at}: component {path!r} is {type(leaf).__name__} {leaf!r:.40}, not a "
        f"batch of records of shape {comp.shape} (its first dimension counts the records)"
    )
