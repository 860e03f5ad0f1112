"""TensorFlow adapters: the only module that imports TensorFlow.

* ``schema_from_element_spec`` / ``element_spec_from_schema``: tf.data specs
  <-> yogastore schemas.
* ``dataset_items``: the first pass over a ``tf.data.Dataset``, batched when
  every component has a fixed shape.
* ``to_tf_dataset``: a stream as a ``tf.data.Dataset``; one Python call per
  batch hands flat numpy arrays to TensorFlow and a graph-mode ``map``
  rebuilds ragged and sparse components from values and row splits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from storage_backends.errors import UnsupportedElementError
from yogastore.assemble import batch_components, element_components
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
from yogastore.stream import Stream, fixed_numeric, splittable

__all__ = [
    "dataset_items",
    "element_spec_from_schema",
    "numpy_records",
    "record_dataset",
    "schema_from_element_spec",
    "to_tf_dataset",
]

_FIRST_PASS_BATCH = 512  # records, at most
_FIRST_PASS_START = 16  # records in the first batch; later ones double up to the cap
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
        batched = _growing_batches(ds, size).prefetch(2)
        for batch in batched.as_numpy_iterator():
            yield "batch", [np.asarray(v) for v in schema.flatten(_plain(batch))]
        return
    if splittable(schema):
        yield from _records_of_batches(ds, schema)
        return
    for element in numpy_records(ds.prefetch(64)):
        values: list[Any] = []
        for comp, leaf, path in zip(
            schema.components, schema.flatten(_plain(element)), schema.paths, strict=True
        ):
            values.extend(component_columns(comp, leaf, path))
        yield "record", values


def _growing_batches(ds: tf.data.Dataset, cap: int) -> tf.data.Dataset:
    """Batch ``ds`` in batches of 16, 32, 64, ... records, then of about ``cap``.

    A slow source (a second per record) then shows progress after its first
    16 records, not after ``cap``. The batches of 16 are regrouped in tf.data
    (one key function call per 16 records), not in Python.
    """
    base = min(_FIRST_PASS_START, cap)
    counts = [1]  # batches of ``base`` per output batch, per step of growth
    while counts[-1] * 2 * base <= cap:
        counts.append(counts[-1] * 2)
    if len(counts) == 1:
        return ds.batch(base)
    starts = tf.constant(np.cumsum([0, *counts[:-1]]), tf.int64)
    sizes = tf.constant(counts, tf.int64)

    def key(i: tf.Tensor, _batch: Any) -> tf.Tensor:
        return tf.reduce_sum(tf.cast(i >= starts, tf.int64)) - 1

    def window_size(k: tf.Tensor) -> tf.Tensor:
        return tf.gather(sizes, k)

    def regroup(k: tf.Tensor, window: tf.data.Dataset) -> tf.data.Dataset:
        return window.map(lambda _i, b: b).unbatch().batch(base * tf.gather(sizes, k))

    convert = tf.autograph.experimental.do_not_convert  # plain graph code
    return (
        ds.batch(base)
        .enumerate()
        .group_by_window(convert(key), convert(regroup), window_size_func=convert(window_size))
    )


def _records_of_batches(ds: tf.data.Dataset, schema: Schema) -> Iterator[tuple[str, list[Any]]]:
    """Yield the records of ``ds``, batched by tf.data and split with numpy slices.

    For fixed-shape tensors (strings too) and rank-0 ragged components: tf.data's
    per-element Python cost is then paid once per batch, not per record.
    """
    for batch in _growing_batches(ds, _FIRST_PASS_BATCH).prefetch(2):
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


def _rebuild(schema: Schema, wire: tuple[Any, ...], batch: int | None, batched: bool) -> Any:
    out: list[Any] = []
    i = 0
    for comp in schema.components:
        n = len(_wire_specs(comp, batch, batched))
        parts = wire[i : i + n]
        i += n
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
    if unbatch and not any(c.kind is Kind.RAGGED and c.ragged_rank == 0 for c in schema.components):
        # (A ragged_rank-0 component comes out of unbatching a batch, as in
        # the source; per element it would be a dense TensorSpec.)
        return _per_element_dataset(stream, schema)
    if batch_size is not None and splittable(schema):
        return _grouped_dataset(stream, schema, batch_size, drop_remainder)
    size = _UNBATCH_INTERNAL if batch_size is None else batch_size
    static = size if (drop_remainder and not unbatch) else None
    specs = tuple(s for c in schema.components for s in _wire_specs(c, static, True))

    def generate() -> Iterator[tuple[Any, ...]]:
        # Strings cross as object arrays of bytes made in C (yogastore._gather.split_bytes):
        # measured faster than one byte string per batch cut by tf.strings.substr, whose
        # conversion into a tensor costs more than the per-string objects.
        for _records, cols in stream.column_batches(size, drop_remainder and not unbatch):
            comps = batch_components(schema, cols, where)
            del cols
            yield tuple(
                w for c, v in zip(schema.components, comps, strict=True) for w in _wire(c, v)
            )
            del comps

    def rebuild(*w: Any) -> Any:
        return _rebuild(schema, w, static, True)

    ds = tf.data.Dataset.from_generator(generate, output_signature=specs)
    ds = ds.map(
        tf.autograph.experimental.do_not_convert(rebuild),  # plain graph code, nothing to convert
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


def _grouped_dataset(
    stream: Stream, schema: Schema, batch_size: int, drop_remainder: bool
) -> tf.data.Dataset:
    """Strings and rank-0 ragged components: several batches per Python call, like fixed ones.

    The generator hands over ``k`` consecutive batches as ``[k, batch, ...]`` tensors (ragged
    components as flat values + row splits of ``k * batch`` rows, regrouped in the graph with
    a uniform row length) and ``unbatch`` splits them in C++: the per-call cost of
    ``from_generator`` is paid once per about ``_GROUP_BYTES``.
    """
    where = stream.ref.manifest.where
    size = batch_size
    per_record = stream.ref.manifest.nbytes / max(1, stream.ref.num_records)
    k = max(1, min(_MAX_GROUP, round(_GROUP_BYTES / max(1.0, per_record * size))))
    if type(stream).column_batches is not Stream.column_batches:
        k = 1  # a subclass may give batches a meaning of their own (steps, padding)
    static = size if drop_remainder else None
    comps = schema.components
    specs: list[tf.TensorSpec] = [tf.TensorSpec([], tf.int64)]  # rows per batch
    for c in comps:
        dtype = _tf_dtype(c.dtype)
        if c.kind is Kind.TENSOR:
            specs.append(tf.TensorSpec([None, None, *c.shape], dtype))
        else:
            splits = tf.as_dtype(c.row_splits_dtype)
            specs += [tf.TensorSpec([None, *c.shape[1:]], dtype), tf.TensorSpec([None], splits)]

    def wire(arrays: list[Any], start: int, stop: int, rows: int) -> tuple[Any, ...]:
        out: list[Any] = [np.int64(rows)]
        for c, a in zip(comps, arrays, strict=True):
            if c.kind is Kind.TENSOR:
                part = a[start:stop]
                out.append(part.reshape(len(part) // rows, rows, *part.shape[1:]))
            else:
                sp = a.nested_row_splits[0]
                out += [a.flat_values[sp[start] : sp[stop]], sp[start : stop + 1] - sp[start]]
        return tuple(out)

    def generate() -> Iterator[tuple[Any, ...]]:
        for _records, cols in stream.column_batches(size * k):
            arrays = batch_components(schema, cols, where)
            del cols
            n = (
                len(arrays[0])
                if comps[0].kind is Kind.TENSOR
                else len(arrays[0].nested_row_splits[0]) - 1
            )
            full = n // size * size
            if full:
                yield wire(arrays, 0, full, size)
            if full < n and not drop_remainder:
                yield wire(arrays, full, n, n - full)
            del arrays

    def regroup(rows: Any, *w: Any) -> Any:
        out: list[Any] = []
        i = 0
        for c in comps:
            if c.kind is Kind.TENSOR:
                t = w[i]
                t.set_shape([None, static, *c.shape])
                out.append(t)
                i += 1
                continue
            flat = tf.RaggedTensor.from_row_splits(w[i], w[i + 1], validate=False)
            rt = tf.RaggedTensor.from_uniform_row_length(
                flat, tf.cast(rows, flat.row_splits.dtype), validate=False
            )
            rt._set_shape([None, static, *c.shape])  # restores the static dims tf.data expects
            out.append(rt)
            i += 2
        return schema.pack(out)

    ds = tf.data.Dataset.from_generator(generate, output_signature=tuple(specs))
    ds = ds.map(tf.autograph.experimental.do_not_convert(regroup)).unbatch()
    return _finish(ds, row_bytes(schema) * size)


def record_dataset(stream: Stream, batch_size: int, drop_remainder: bool) -> tf.data.Dataset:
    """Return one element per record, read as the stream's batches of ``batch_size``.

    For batching records whose dense components vary in shape (padded or
    ragged batches): the records are exactly those of
    ``to_tf_dataset(stream, batch_size, drop_remainder)``, in order, but never
    stacked into one dense array. Ragged_rank-0 components come as dense
    tensors.
    """
    return _per_element_dataset(stream, stream.ref.schema, batch_size, drop_remainder)


def _per_element_dataset(
    stream: Stream,
    schema: Schema,
    batch_size: int = _UNBATCH_INTERNAL,
    drop_remainder: bool = False,
) -> tf.data.Dataset:
    specs = tuple(s for c in schema.components for s in _wire_specs(c, None, False))

    def generate() -> Iterator[tuple[Any, ...]]:
        # A stream subclass may give batches a meaning (steps), so read in its batches.
        for _records, cols in stream.column_batches(batch_size, drop_remainder):
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
