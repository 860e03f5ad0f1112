"""TensorFlow adapters: the only module that imports TensorFlow.

* ``schema_from_element_spec`` / ``element_spec_from_schema``: tf.data specs
  <-> yogastore schemas.
* ``dataset_items``: the first pass over a ``tf.data.Dataset``, batched when
  every component has a fixed shape.
* ``to_tf_dataset``: a stream as a ``tf.data.Dataset``; one Python call per
  batch hands flat numpy arrays to TensorFlow and a graph-mode ``map``
  rebuilds ragged and sparse components. Strings cross as one byte string
  per batch plus offsets and are cut apart in the graph
  (``tf.strings.substr``): no Python object per string.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from storage_backends.errors import UnsupportedElementError
from yogastore.assemble import batch_components, element_components
from yogastore.format import StringBuffer, StringFormat
from yogastore.spec import (
    ComponentSpec,
    Kind,
    RaggedValue,
    Schema,
    SparseValue,
    dtype_name,
    flatten_structure,
    leaf_paths,
    row_bytes,
)
from yogastore.stream import Stream, fixed_numeric

__all__ = [
    "dataset_items",
    "element_spec_from_schema",
    "numpy_records",
    "schema_from_element_spec",
    "to_tf_dataset",
]

_FIRST_PASS_BATCH = 512  # records, at most
_FIRST_PASS_BYTES = 8 << 20
_UNBATCH_INTERNAL = 256
_GROUP_BYTES = 8 << 20  # records handed to tf.data per Python call, about
_MAX_GROUP = 64  # batches per Python call, at most
_PREFETCH_BYTES = 16 << 20  # read ahead by tf.data after the Python call
_MAX_PREFETCH = 8


def _finish(ds: tf.data.Dataset, element_bytes: int) -> tf.data.Dataset:
    """Prefetch a fixed number of elements and switch the tf.data autotuner off.

    On a 2-core machine the autotuner's model thread competes with the
    generator for CPU and roughly every other epoch ran at 60% of the speed
    (measured with ``benchmarks/read_throughput.py``); fixed buffers do not. A
    caller's own ``with_options`` still overrides this.
    """
    depth = max(2, min(_MAX_PREFETCH, _PREFETCH_BYTES // max(1, element_bytes)))
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.prefetch(depth).with_options(options)


def _is_spec(x: Any) -> bool:
    return isinstance(x, tf.TypeSpec)


def _component(spec: Any, path: str) -> ComponentSpec:
    try:
        if isinstance(spec, tf.TensorSpec):
            return ComponentSpec(shape=_dims(spec.shape, path), dtype=dtype_name(spec.dtype))
        if isinstance(spec, tf.RaggedTensorSpec):
            return ComponentSpec(
                shape=_dims(spec.shape, path),
                dtype=dtype_name(spec.dtype),
                kind=Kind.RAGGED,
                ragged_rank=spec.ragged_rank,
                row_splits_dtype=spec.row_splits_dtype.name,
            )
        if isinstance(spec, tf.SparseTensorSpec):
            return ComponentSpec(
                shape=_dims(spec.shape, path), dtype=dtype_name(spec.dtype), kind=Kind.SPARSE
            )
    except UnsupportedElementError as err:
        raise UnsupportedElementError(f"component {path!r}: {err}") from err
    raise UnsupportedElementError(
        f"component {path!r} is a {type(spec).__name__}; supported: tf.Tensor, "
        "tf.RaggedTensor, tf.SparseTensor of numeric, bool or string dtype"
    )


def _dims(shape: tf.TensorShape, path: str) -> tuple[int | None, ...]:
    if shape.rank is None:
        raise UnsupportedElementError(f"component {path!r} has unknown rank")
    return tuple(shape.as_list())


def schema_from_element_spec(element_spec: Any) -> Schema:
    """Return the schema of a ``tf.data`` element_spec (or raise UnsupportedElementError)."""
    structure, leaves = flatten_structure(element_spec, _is_spec)
    paths = tuple(leaf_paths(structure, len(leaves)))
    comps = tuple(_component(s, p) for s, p in zip(leaves, paths, strict=True))
    return Schema(structure, comps, paths)


def _tf_dtype(name: str) -> tf.DType:
    return tf.string if name == "string" else tf.as_dtype(name)


def _type_spec(comp: ComponentSpec) -> tf.TypeSpec:
    dtype = _tf_dtype(comp.dtype)
    if comp.kind is Kind.TENSOR:
        return tf.TensorSpec(comp.shape, dtype)
    if comp.kind is Kind.RAGGED:
        return tf.RaggedTensorSpec(
            comp.shape,
            dtype,
            ragged_rank=comp.ragged_rank,
            row_splits_dtype=tf.as_dtype(comp.row_splits_dtype),
        )
    return tf.SparseTensorSpec(comp.shape, dtype)


def element_spec_from_schema(schema: Schema) -> Any:
    """Return the ``tf.data`` element_spec a schema describes."""
    return schema.pack([_type_spec(c) for c in schema.components])


# First pass ------------------------------------------------------------------


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
    from yogastore.writer import component_columns

    if all(c.fixed for c in schema.components):
        # About _FIRST_PASS_BYTES per batch: large records in small batches keep
        # every buffer below the size at which malloc maps fresh memory each time.
        size = max(1, min(_FIRST_PASS_BATCH, _FIRST_PASS_BYTES // max(1, row_bytes(schema))))
        batched = ds.batch(size).prefetch(2)
        for batch in batched.as_numpy_iterator():
            yield "batch", [np.asarray(v) for v in schema.flatten(_plain(batch))]
        return
    if all(_batchable(c) for c in schema.components):
        yield from _records_of_batches(ds, schema)
        return
    for element in numpy_records(ds.prefetch(64)):
        values: list[Any] = []
        for comp, leaf, path in zip(
            schema.components, schema.flatten(_plain(element)), schema.paths, strict=True
        ):
            values.extend(component_columns(comp, leaf, path))
        yield "record", values


def _batchable(comp: ComponentSpec) -> bool:
    """Whether ``Dataset.batch`` stacks this component so that records split back in numpy."""
    return comp.fixed or (comp.kind is Kind.RAGGED and comp.ragged_rank == 0)


def _records_of_batches(ds: tf.data.Dataset, schema: Schema) -> Iterator[tuple[str, list[Any]]]:
    """Yield the records of ``ds``, batched by tf.data and split with numpy slices.

    For fixed-shape tensors (strings too) and rank-0 ragged components: tf.data's
    per-element Python cost is then paid once per batch, not per record.
    """
    for batch in ds.batch(_FIRST_PASS_BATCH).prefetch(2):
        leaves = schema.flatten(_plain(batch))
        n = 0
        getters: list[Any] = []
        for comp, leaf in zip(schema.components, leaves, strict=True):
            if comp.kind is Kind.TENSOR:
                arr = np.asarray(leaf)
                n = len(arr)
                getters.append(arr)
            else:
                splits = np.asarray(leaf.nested_row_splits[0], dtype=np.int64)
                n = len(splits) - 1
                getters.append((np.asarray(leaf.flat_values), splits))
        for i in range(n):
            yield (
                "record",
                [
                    g[i] if isinstance(g, np.ndarray) else g[0][g[1][i] : g[1][i + 1]]
                    for g in getters
                ],
            )


def _plain(element: Any) -> Any:
    """Turn namedtuples and dicts from tf into plain nests the schema can walk."""
    return tf.nest.map_structure(_to_numpy, element)


# Reading ---------------------------------------------------------------------


def _wire(comp: ComponentSpec, value: Any) -> list[Any]:
    if comp.kind is Kind.TENSOR:
        return [value]
    if comp.kind is Kind.RAGGED:
        if isinstance(value, RaggedValue):
            return [value.flat_values, *value.nested_row_splits]
        return [value]
    return [value.indices, value.values, value.dense_shape]


def _wire_specs(comp: ComponentSpec, batch: int | None, batched: bool) -> list[tf.TensorSpec]:
    dtype = _tf_dtype(comp.dtype)
    lead = [batch] if batched else []
    if comp.kind is Kind.TENSOR:
        return [tf.TensorSpec([*lead, *comp.shape], dtype)]
    if comp.kind is Kind.RAGGED:
        r = comp.ragged_rank
        inner = list(comp.shape[r + 1 :])
        splits = tf.as_dtype(comp.row_splits_dtype)
        if not batched and r == 0:
            return [tf.TensorSpec(list(comp.shape), dtype)]
        nsplits = r + 1 if batched else r
        return [tf.TensorSpec([None, *inner], dtype)] + [tf.TensorSpec([None], splits)] * nsplits
    rank = len(comp.shape)
    extra = 1 if batched else 0
    return [
        tf.TensorSpec([None, rank + extra], tf.int64),
        tf.TensorSpec([None], dtype),
        tf.TensorSpec([rank + extra], tf.int64),
    ]


def _buffer_specs(spec: tf.TensorSpec) -> list[tf.TensorSpec]:
    """Wire of a string tensor as bytes + offsets + shape (see ``_strings_from``)."""
    return [
        tf.TensorSpec([], tf.string),
        tf.TensorSpec([None], tf.int64),
        tf.TensorSpec([spec.shape.rank], tf.int64),
    ]


def _expand_specs(specs: list[tf.TensorSpec], buffers: bool) -> list[tf.TensorSpec]:
    if not buffers:
        return specs
    return [w for s in specs for w in (_buffer_specs(s) if s.dtype == tf.string else [s])]


def _expand_values(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, StringBuffer):
            # One bytes object per batch; offsets and shape as int64 arrays.
            out += [v.data.tobytes(), v.offsets, np.array(v.shape, dtype=np.int64)]
        else:
            out.append(v)
    return out


def _strings_from(blob: tf.Tensor, offsets: tf.Tensor, shape: tf.Tensor) -> tf.Tensor:
    """Cut one byte string into a string tensor of ``shape`` at ``offsets``."""
    flat = tf.strings.substr(blob, offsets[:-1], offsets[1:] - offsets[:-1])
    return tf.reshape(flat, shape)


def _rebuild(
    schema: Schema, wire: tuple[Any, ...], batch: int | None, batched: bool, buffers: bool = False
) -> Any:
    out: list[Any] = []
    i = 0
    for comp in schema.components:
        specs = _wire_specs(comp, batch, batched)
        parts: list[Any] = []
        for spec in specs:
            if buffers and spec.dtype == tf.string:
                t = _strings_from(*wire[i : i + 3])
                t.set_shape(spec.shape)
                parts.append(t)
                i += 3
            else:
                parts.append(wire[i])
                i += 1
        n = len(specs)
        if comp.kind is Kind.TENSOR or (comp.kind is Kind.RAGGED and n == 1):
            out.append(parts[0])
        elif comp.kind is Kind.RAGGED:
            rt = tf.RaggedTensor.from_nested_row_splits(parts[0], list(parts[1:]), validate=False)
            shape = [batch, *comp.shape] if batched else list(comp.shape)
            rt._set_shape(shape)  # restores the static dims tf.data expects
            out.append(rt)
        else:
            st = tf.SparseTensor(parts[0], parts[1], parts[2])
            st.set_shape([batch, *comp.shape] if batched else list(comp.shape))
            out.append(st)
    return schema.pack(out)


def to_tf_dataset(
    stream: Stream, batch_size: int | None, drop_remainder: bool = False
) -> tf.data.Dataset:
    """Return ``stream`` as a ``tf.data.Dataset`` (see ``Stream.to_tf_dataset``)."""
    schema = stream.ref.schema
    where = stream.ref.manifest.where
    unbatch = batch_size is None
    if fixed_numeric(schema):
        return _fixed_dataset(stream, schema, batch_size, drop_remainder)
    if unbatch:
        return _per_element_dataset(stream, schema)
    size = _UNBATCH_INTERNAL if batch_size is None else batch_size
    static = size if (drop_remainder and not unbatch) else None
    wire = [s for c in schema.components for s in _wire_specs(c, static, True)]
    specs = tuple(_expand_specs(wire, True))

    def generate() -> Iterator[tuple[Any, ...]]:
        for _records, cols in stream.column_batches(size, drop_remainder and not unbatch):
            comps = batch_components(schema, cols, where, StringFormat.BUFFERS)
            del cols
            values = [w for c, v in zip(schema.components, comps, strict=True) for w in _wire(c, v)]
            del comps
            yield tuple(_expand_values(values))
            del values

    @tf.autograph.experimental.do_not_convert
    def rebuild(*w: Any) -> Any:  # plain graph code: nothing for AutoGraph to convert
        return _rebuild(schema, w, static, True, buffers=True)

    ds = tf.data.Dataset.from_generator(generate, output_signature=specs)
    ds = ds.map(
        rebuild,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    if unbatch:
        ds = ds.unbatch()
    return _finish(ds, row_bytes(schema) * (1 if unbatch else size))


def _fixed_dataset(
    stream: Stream, schema: Schema, batch_size: int | None, drop_remainder: bool
) -> tf.data.Dataset:
    """Fixed-shape components: several batches per Python call, split by ``unbatch``.

    Each call of ``from_generator`` costs a few hundred microseconds whatever
    its size, so the generator hands over ``[k, batch, ...]`` groups of ``k``
    consecutive batches (about 8 MiB) and ``unbatch`` splits them in C++.
    Batches of more than about 5 MiB go one per call, as they are. The arrays
    come from the stream's aligned buffer pool, so ``from_generator`` wraps
    them without a copy. With ``batch_size=None`` it hands over ``[n, ...]``
    records and ``unbatch`` yields them one by one.
    """
    where = stream.ref.manifest.where
    unbatch = batch_size is None
    size = _UNBATCH_INTERNAL if batch_size is None else batch_size
    k = stream.group_factor(size, _GROUP_BYTES, _MAX_GROUP)
    comps = schema.components
    inner = size if drop_remainder else None
    # With one batch per call (large records) there is no group axis to split.
    whole = unbatch or k == 1
    lead = [None] if unbatch else [inner] if k == 1 else [None, inner]
    specs = tuple(tf.TensorSpec([*lead, *c.shape], _tf_dtype(c.dtype)) for c in comps)

    def generate() -> Iterator[tuple[Any, ...]]:
        for _records, cols in stream.column_batches(size * k):
            arrays = batch_components(schema, cols, where)
            n = len(arrays[0])
            if whole:
                if unbatch or n == size or not drop_remainder:
                    yield tuple(arrays)
                continue
            full = n // size * size
            if full:
                yield tuple(a[:full].reshape(full // size, size, *a.shape[1:]) for a in arrays)
            if full < n and not drop_remainder:
                yield tuple(a[full:].reshape(1, n - full, *a.shape[1:]) for a in arrays)

    # A flat tuple crosses from_generator faster and holds less memory than the
    # nested element (measured with 38 MB batches); the graph map repacks it.
    ds = tf.data.Dataset.from_generator(generate, output_signature=specs)
    ds = ds.map(lambda *w: schema.pack(list(w)))  # regroups tensors, no copy: no threads needed
    if not whole or unbatch:
        ds = ds.unbatch()
    return _finish(ds, row_bytes(schema) * (1 if unbatch else size))


def _per_element_dataset(stream: Stream, schema: Schema) -> tf.data.Dataset:
    specs = tuple(s for c in schema.components for s in _wire_specs(c, None, False))

    def generate() -> Iterator[tuple[Any, ...]]:
        for _records, cols in stream.column_batches(_UNBATCH_INTERNAL):
            for i in range(len(cols[0]) if cols else 0):
                comps = element_components(schema, cols, i)
                yield tuple(
                    w for c, v in zip(schema.components, comps, strict=True) for w in _wire(c, v)
                )

    ds = tf.data.Dataset.from_generator(generate, output_signature=specs)
    ds = ds.map(
        lambda *w: _rebuild(schema, w, None, False),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return _finish(ds, row_bytes(schema))
