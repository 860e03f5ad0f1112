"""The first pass over a ``tf.data.Dataset``: its elements as numpy records or batches.

Batched by tf.data when every component has a fixed shape (or can be split
with numpy slices), so the per-element Python cost is paid once per batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from storage_backends.errors import UnsupportedElementError
from yogastore.format.encode import PackedStrings, Slab
from yogastore.format.layout import columns_for
from yogastore.read.stream import splittable
from yogastore.spec import (
    STRING,
    ComponentSpec,
    Kind,
    RaggedValue,
    Schema,
    SparseValue,
    row_bytes,
)

__all__ = ["dataset_items", "numpy_records"]

# Records per tf.data batch of the first pass, at most. Every batch is full size from
# the start: growing ones (16, 32, ... regrouped in tf.data) showed a slow source's
# progress sooner but cost tf.data's per-batch overhead on every record (a text source
# iterated 5-7x slower than ``batch(512)``).
_FIRST_PASS_BATCH = 512
_FIRST_PASS_BYTES = 8 << 20
# Without the library's TensorFlow kernel, dense strings shorter than this on average reach
# the chunk writer joined (_pack_strings); with it, all of them do.
_PACK_BELOW = 2048


def _to_numpy(value: Any) -> Any:
    if isinstance(value, tf.RaggedTensor):
        return RaggedValue(
            value.flat_values.numpy(), tuple(s.numpy() for s in value.nested_row_splits)
        )
    if isinstance(value, tf.SparseTensor):
        return SparseValue(value.indices.numpy(), value.values.numpy(), value.dense_shape.numpy())
    if hasattr(value, "flat_values") and hasattr(value, "nested_row_splits"):
        return RaggedValue(
            np.asarray(value.flat_values), tuple(np.asarray(s) for s in value.nested_row_splits)
        )
    if hasattr(value, "indices") and hasattr(value, "dense_shape"):
        return SparseValue(
            np.asarray(value.indices), np.asarray(value.values), np.asarray(value.dense_shape)
        )
    if hasattr(value, "numpy"):
        return value.numpy()
    return value


def numpy_records(items: Iterable[Any]) -> Iterator[Any]:
    """Convert elements holding tf values to numpy structures."""
    for element in items:
        yield tf.nest.map_structure(_to_numpy, element)


def dataset_items(ds: tf.data.Dataset, schema: Schema) -> Iterator[tuple[str, list[Any]]]:
    """Iterate a dataset for caching: whole batches when every component is fixed."""
    from yogastore.build.writer import component_columns

    if all(c.fixed and c.dtype != STRING for c in schema.components):
        # About _FIRST_PASS_BYTES per batch: large records in small batches keep
        # every buffer below the size at which malloc maps fresh memory each time.
        size = max(1, min(_FIRST_PASS_BATCH, _FIRST_PASS_BYTES // max(1, row_bytes(schema))))
        batched = ds.batch(size).prefetch(2)
        for batch in batched.as_numpy_iterator():
            yield "batch", [np.asarray(v) for v in schema.flatten(_plain(batch))]
        return
    # Slabs need tf.data to batch the records: ragged rows must agree on their inner
    # dimensions (strings are cut into chunks by their bytes, which the "batch" path
    # above does not know).
    if splittable(schema) and all(
        c.fixed or all(d is not None for d in c.shape[1:]) for c in schema.components
    ):
        yield from _records_of_batches(ds, schema)
        return
    for element in numpy_records(ds.prefetch(64)):
        values: list[Any] = []
        for comp, leaf, path in zip(
            schema.components, schema.flatten(_plain(element)), schema.paths, strict=True
        ):
            values.extend(component_columns(comp, leaf, path))
        yield "record", values


def _records_of_batches(ds: tf.data.Dataset, schema: Schema) -> Iterator[tuple[str, list[Any]]]:
    """Yield the records of ``ds`` as slabs: batched by tf.data, handed over column by column.

    For fixed-shape tensors (strings too) and rank-0 ragged components: no
    Python object per record, only per batch (dense strings come packed, see
    ``_pack_strings``; ragged strings stay one ``bytes`` each).
    """
    columns = [c for comp in schema.components for c in columns_for(comp)]
    batched = ds.batch(_FIRST_PASS_BATCH)
    packed = [_packable(c) for c in schema.components]
    packing = any(packed)
    if packing:
        # tf.data calls the function with a tuple element's items as arguments.
        whole = type(batched.element_spec) is tuple
        batched = batched.map(
            lambda *e: _pack_strings(schema, packed, e if whole else e[0]),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
    for at, batch in enumerate(batched.prefetch(2)):
        # Packed batches come as a flat tuple: the schema's leaves, four per packable one.
        leaves = iter(batch) if packing else iter(schema.flatten(_plain(batch)))
        n = 0
        counts: list[int] = []  # records of each component
        data: list[Any] = []
        for comp, col, pack, path in zip(
            schema.components, columns, packed, schema.paths, strict=True
        ):
            if pack:  # dense strings: bytes + lengths, or the strings (see _pack_strings)
                joined, lengths, listed, shape = (next(leaves) for _ in range(4))
                dims = tuple(int(d) for d in shape.numpy())
                _check_packed_shape(comp, path, dims, at)
                strings: Any = listed.numpy()
                if len(strings) != len(lengths):
                    # np.asarray shares the tensor's memory (read-only); .numpy() would copy.
                    strings = PackedStrings.of(np.asarray(joined), lengths.numpy())
                n = dims[0]
                counts.append(n)
                shapes = np.broadcast_to(np.asarray(comp.shape, np.int64), (n, col.ndim))
                data.append((shapes, strings))
                continue
            leaf = next(leaves)
            if packing:  # the other leaves of the flat tuple, as _plain converts them
                leaf = _to_numpy(leaf)
            if comp.kind is Kind.TENSOR:
                arr = np.asarray(leaf)
                n = len(arr)
                if col.layout == "fixed":
                    data.append(arr)
                else:  # strings of a fixed shape
                    shapes = np.broadcast_to(np.asarray(arr.shape[1:], np.int64), (n, col.ndim))
                    data.append((shapes, arr.reshape(-1)))
            else:
                splits = np.asarray(leaf.nested_row_splits[0], dtype=np.int64)
                flat = np.asarray(leaf.flat_values)
                n = len(splits) - 1
                shapes = np.empty((n, col.ndim), np.int64)
                shapes[:, 0] = np.diff(splits)
                shapes[:, 1:] = flat.shape[1:]
                data.append((shapes, flat))
            counts.append(n)
        if len(set(counts)) > 1:  # a component whose values lied about their shape
            sizes = ", ".join(f"{p!r}: {c}" for p, c in zip(schema.paths, counts, strict=True))
            raise UnsupportedElementError(
                f"batch {at} of the first pass: components hold different numbers of records "
                f"({sizes}); a value's shape differs from the source's element_spec"
            )
        yield "slab", [Slab(n, tuple(data))]


def _check_packed_shape(comp: ComponentSpec, path: str, shape: tuple[int, ...], at: int) -> None:
    """Refuse a batch of strings whose values do not have the shape the element_spec gives.

    The strings are joined in tf.data, where nothing else checks it (``tf.py_function``
    with ``set_shape`` can claim any shape): records would be cut wrongly, or lost.
    """
    if shape[1:] != tuple(comp.shape):
        raise UnsupportedElementError(
            f"component {path!r}: batch {at} of the first pass holds values of shape "
            f"{shape[1:]}, but the source's element_spec says {tuple(comp.shape)}"
        )


def _packable(comp: ComponentSpec) -> bool:
    """Whether a component's batches are dense strings of a known, non-empty shape."""
    return comp.fixed and comp.dtype == STRING and math.prod(d or 0 for d in comp.shape) > 0


def _pack_strings(schema: Schema, packed: list[bool], element: Any) -> tuple[Any, ...]:
    """In tf.data: each packable string component as ``(bytes, lengths, strings, shape)``.

    With the library's TensorFlow kernel (``tf_ops.join_bytes``), ``bytes`` holds the
    strings one after another (row-major), each copied once, and ``strings`` is empty:
    the first pass takes them without a Python object per string.

    Without it, only strings averaging less than ``_PACK_BELOW`` bytes are joined
    (``reduce_join``, then ``decode_raw``: two copies); longer ones come as they are
    (``bytes`` empty, a Python ``bytes`` each): for them those copies cost more than the
    objects (1 GB of 2-24 KiB strings built about 0.6 s slower packed that way).
    """
    from yogastore.train import tf_ops

    kernel = tf_ops.load() is not None
    leaves = schema.flatten(element)
    out: list[Any] = []
    for leaf, pack in zip(leaves, packed, strict=True):
        if not pack:
            out.append(leaf)
            continue
        shape = tf.shape(leaf, out_type=tf.int64)  # as the values are, checked against the spec
        if kernel:
            data, lengths = tf_ops.join_bytes(leaf)
            out += [data, lengths, tf.zeros([0], tf.string), shape]
            continue
        flat = tf.reshape(leaf, [-1])
        lengths = tf.cast(tf.strings.length(flat, unit="BYTE"), tf.int64)
        short = tf.reduce_sum(lengths) < _PACK_BELOW * tf.size(lengths, out_type=tf.int64)
        data, strings = tf.cond(
            short,
            lambda flat=flat: (
                tf.io.decode_raw(tf.strings.reduce_join(flat), tf.uint8),
                tf.zeros([0], tf.string),
            ),
            lambda flat=flat: (tf.zeros([0], tf.uint8), flat),
        )
        out += [data, lengths, strings, shape]
    return tuple(out)


def _plain(element: Any) -> Any:
    """Turn namedtuples and dicts from tf into plain nests the schema can walk."""
    return tf.nest.map_structure(_to_numpy, element)
