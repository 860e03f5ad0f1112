"""The read bridge: a stream as a ``tf.data.Dataset``.

One Python call per batch (or group of batches) hands flat numpy arrays to
TensorFlow and a graph-mode ``map`` rebuilds ragged and sparse components
from values and row splits.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from storage_backends.errors import UnsupportedElementError
from yogastore.format.batch import StringFormat, StringRanges
from yogastore.format.layout import ALIGN
from yogastore.read import waits
from yogastore.read.assemble import batch_components, element_components, slice_rows
from yogastore.read.stream import Stream, fixed_numeric, splittable
from yogastore.read.waits import ProcessExiting
from yogastore.spec import ComponentSpec, Kind, RaggedValue, Schema, row_bytes
from yogastore.train import tf_ops
from yogastore.train.tf_spec import tf_dtype

__all__ = ["ProcessExiting", "record_dataset", "to_tf_dataset"]

_UNBATCH_INTERNAL = 256
_GROUP_BYTES = 8 << 20  # fixed-shape records handed to tf.data per Python call, about
_MAX_GROUP = 64  # batches per Python call, at most
# Strings and ragged components: larger groups. Each group costs the generator Python work
# that holds the GIL, in many short stretches, whatever the group's size, and a Python loop
# taking the batches waits for it: four times fewer groups read texts of 50-500 B and
# records of 2-24 KiB faster through such a loop (benchmarks/var_groups.py; the README's
# "Group size").
_VAR_GROUP_BYTES = 32 << 20
_VAR_MAX_GROUP = 256
_VAR_MIN_DEPTH = 1  # groups read ahead beside those in the kernel's map, at least
_PREFETCH_BYTES = 16 << 20  # read ahead by tf.data after the Python call
_MAX_PREFETCH = 8


# Ending the generators before the interpreter finalizes -----------------------------
#
# A to_tf_dataset iterator still alive when the process ends is destroyed while the
# interpreter finalizes. A tf.data thread that calls into the generator then can no
# longer take the GIL: Python ends that thread, and the iterator's teardown waits for it
# forever. So at exit, before finalization, the generators then alive are ended (with an
# error, so that no consumer takes it for the end of the data), and exit waits until
# tf.data has stopped calling them:
# - none is in a step, and none was called for _EXIT_QUIET seconds since the exit began
#   (a read-ahead thread that a consumer's last take woke calls within that time);
# - a generator that has finished (its data, an error, or the exit) is called once more
#   by tf.data when its buffer has room, which ends the iteration, and from_generator then
#   drops it: exit waits until it is dropped, or was not called for _FINISHED_QUIET
#   seconds (the buffer was full: tf.data will not call it again).
# At most _EXIT_WAIT seconds in all. Generators started later (by an exit handler of the
# caller's) run as usual.
_EXIT_QUIET = 0.25
_FINISHED_QUIET = 1.0
_EXIT_WAIT = 5.0
_exit_lock = threading.Lock()


class _Live:
    """A generator that ``from_generator`` holds: its last call, and whether it finished."""

    __slots__ = ("finished", "last")

    def __init__(self) -> None:
        self.last = time.monotonic()  # start or end of the last step
        self.finished = False


class _ExitState:
    def __init__(self) -> None:
        self.registered = False  # the atexit handler
        self.busy = 0  # generator steps running
        # The generators from_generator has not yet dropped (an entry goes with its generator).
        self.live: weakref.WeakKeyDictionary[Any, _Live] = weakref.WeakKeyDictionary()


_exit_state = _ExitState()


def _forked() -> None:
    """In a fork's child: only the forking thread lives on, in no generator step."""
    global _exit_lock
    _exit_lock = threading.Lock()
    _exit_state.busy = 0
    _exit_state.live = weakref.WeakKeyDictionary()


os.register_at_fork(after_in_child=_forked)


def _settled(start: float, now: float) -> bool:
    """Whether tf.data has stopped calling the generators (see above); under ``_exit_lock``."""
    if _exit_state.busy:
        return False
    for live in list(_exit_state.live.values()):  # a copy: other threads drop generators
        if now - max(live.last, start) < _EXIT_QUIET:
            return False
        if live.finished and now - live.last < _FINISHED_QUIET:
            return False
    return True


def _end_generators() -> None:
    """``atexit``: end the generators alive now and wait until tf.data stops calling them."""
    waits.end_waits()  # the generators made before now end, and the reads they wait for
    start = time.monotonic()
    deadline = start + _EXIT_WAIT
    while True:
        time.sleep(0.005)  # the GIL released: the generators' threads run
        now = time.monotonic()
        with _exit_lock:
            if _settled(start, now) or now >= deadline:
                return


def _enter(born: int, live: _Live) -> None:
    """Count a generator step in; raise ``ProcessExiting`` if the exit began after ``born``."""
    with _exit_lock:
        live.last = time.monotonic()
        if waits.current() != born:
            live.finished = True
            raise ProcessExiting("the process is exiting: this to_tf_dataset iterator was ended")
        _exit_state.busy += 1


def _leave(live: _Live, finished: bool) -> None:
    with _exit_lock:
        _exit_state.busy -= 1
        live.last = time.monotonic()
        live.finished = live.finished or finished


def _guarded(
    generate: Callable[[], Iterator[tuple[Any, ...]]], born: int, live: _Live
) -> Iterator[tuple[Any, ...]]:
    items = generate()
    try:
        while True:
            _enter(born, live)
            finished = True  # unless the step gives an item
            try:
                item = next(items, None)
                finished = item is None
            finally:
                _leave(live, finished)
            if item is None:
                return
            yield item
    finally:
        with _exit_lock:
            _exit_state.busy += 1  # the generator's own cleanup is a step too
        try:
            close = getattr(items, "close", None)  # a generator's: end its with-blocks
            if close is not None:
                close()
        finally:
            _leave(live, True)


def _ends_at_exit(
    generate: Callable[[], Iterator[tuple[Any, ...]]],
) -> Callable[[], Iterator[tuple[Any, ...]]]:
    """Wrap a ``from_generator`` generator so that it ends when the process exits."""

    @functools.wraps(generate)
    def run() -> Iterator[tuple[Any, ...]]:
        with _exit_lock:
            if not _exit_state.registered:
                atexit.register(_end_generators)
                _exit_state.registered = True
        live = _Live()
        gen = _guarded(generate, waits.current(), live)
        with _exit_lock:
            _exit_state.live[gen] = live
        return gen

    return run


def _var_group_factor(ref: Any, batch_size: int) -> int:
    """Batches per Python call for strings and ragged records of ``ref`` (``_VAR_*``)."""
    per_record = float(ref.manifest.nbytes) / max(1, int(ref.num_records))
    return max(1, min(_VAR_MAX_GROUP, round(_VAR_GROUP_BYTES / max(1.0, per_record * batch_size))))


def _finish(ds: tf.data.Dataset, element_bytes: int, min_depth: int = 2) -> tf.data.Dataset:
    """Prefetch a fixed number of elements and switch the tf.data autotuner off.

    On a 2-core machine the autotuner's model thread competes with the
    generator for CPU and roughly every other epoch ran at 60% of the speed
    (measured with ``benchmarks/read_throughput.py``); fixed buffers do not. A
    caller's own ``with_options`` still overrides this.

    The readers below prefetch the generator's groups of batches and cut them
    into batches after this, in the consumer's thread: the read runs ahead by
    whole groups, and batches are not each handed from one thread to another,
    a cost per batch that decides the rate of small records (see the README's
    speed sections). ``min_depth`` elements are read ahead whatever their size.
    """
    depth = max(min_depth, min(_MAX_PREFETCH, _PREFETCH_BYTES // max(1, element_bytes)))
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.prefetch(depth).with_options(options)


def _wire(comp: ComponentSpec, value: Any) -> list[Any]:
    if comp.kind is Kind.TENSOR:
        return [value]
    if comp.kind is Kind.RAGGED:
        if isinstance(value, RaggedValue):
            return [value.flat_values, *value.nested_row_splits]
        return [value]
    return [value.indices, value.values, value.dense_shape]


def _wire_specs(comp: ComponentSpec, batch: int | None, batched: bool) -> list[tf.TensorSpec]:
    dtype = tf_dtype(comp.dtype)
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
    # TensorFlow's unbatch crashes (SIGSEGV) on a tensor with no elements, so components of
    # records with none (a shape such as (0,) or (2, 0)) cross one batch per call, never
    # grouped and split.
    empty = any(c.kind is Kind.TENSOR and 0 in c.shape for c in schema.components)
    ragged_rows = any(c.kind is Kind.RAGGED and c.ragged_rank == 0 for c in schema.components)
    if empty and unbatch and ragged_rows:
        raise UnsupportedElementError(
            f"{where}: to_tf_dataset(batch_size=None) cannot yield records that have both a "
            "component with no elements (a zero in its shape) and a ragged_rank-0 ragged "
            "component; give a batch_size, or read with Stream.batches"
        )
    if fixed_numeric(schema) and not empty:
        return _fixed_dataset(stream, schema, batch_size, drop_remainder)
    if unbatch and not ragged_rows:
        # (A ragged_rank-0 component comes out of unbatching a batch, as in
        # the source; per element it would be a dense TensorSpec.)
        return _per_element_dataset(stream, schema)
    if batch_size is not None and splittable(schema) and not empty:
        return _grouped_dataset(stream, schema, batch_size, drop_remainder)
    size = _UNBATCH_INTERNAL if batch_size is None else batch_size
    static = size if (drop_remainder and not unbatch) else None
    specs = tuple(s for c in schema.components for s in _wire_specs(c, static, True))

    def generate() -> Iterator[tuple[Any, ...]]:
        with stream.released_after():  # nothing held once an iteration ends
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

    ds = tf.data.Dataset.from_generator(_ends_at_exit(generate), output_signature=specs)
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
    """Fixed-shape components: several batches per Python call, split in ``tf.data``.

    Each call of ``from_generator`` costs a few hundred microseconds whatever
    its size, so the generator hands over ``[k, batch, ...]`` groups of ``k``
    consecutive batches (about 8 MiB). The arrays come from the stream's
    aligned buffer pool, so ``from_generator`` wraps them without a copy, and
    ``from_tensor_slices`` (in a ``flat_map``) cuts the batches out of a group
    as views of it where a batch's bytes keep the alignment (``unbatch``
    would copy each into freshly allocated memory). With ``batch_size=None``
    it hands over ``[n, ...]`` records and ``unbatch`` yields them one by one.
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
    specs = tuple(tf.TensorSpec([*lead, *c.shape], tf_dtype(c.dtype)) for c in comps)

    def generate() -> Iterator[tuple[Any, ...]]:
        with stream.released_after():  # nothing held once an iteration ends
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

    def split(groups: tf.data.Dataset) -> tf.data.Dataset:
        if unbatch:
            groups = groups.unbatch()
        elif not whole:
            groups = groups.flat_map(lambda *w: tf.data.Dataset.from_tensor_slices(w))
        return groups.map(lambda *w: schema.pack(list(w)))  # regroups tensors, no copy

    # A flat tuple crosses from_generator faster and holds less memory than the
    # nested element (measured with 38 MB batches); the graph map repacks it.
    # The generator's groups are read ahead and cut into batches as they are taken, but
    # records one by one from groups too large to hold two of are read ahead as records.
    ds = tf.data.Dataset.from_generator(_ends_at_exit(generate), output_signature=specs)
    group_bytes = row_bytes(schema) * size * k
    if unbatch and group_bytes > _PREFETCH_BYTES:
        return _finish(split(ds), row_bytes(schema))
    return split(_finish(ds, group_bytes))


def _grouped_dataset(
    stream: Stream, schema: Schema, batch_size: int, drop_remainder: bool
) -> tf.data.Dataset:
    """Strings and rank-0 ragged components: several batches per Python call, like fixed ones.

    The generator hands over ``k`` consecutive batches as ``[k, batch, ...]`` tensors (ragged
    components as flat values + row splits of ``k * batch`` rows, regrouped in the graph with
    a uniform row length) and ``unbatch`` splits them in C++: the per-call cost of
    ``from_generator`` and the generator's own Python work are paid once per about
    ``_VAR_GROUP_BYTES`` (at most ``_VAR_MAX_GROUP`` batches).
    """
    where = stream.ref.manifest.where
    size = batch_size
    per_record = stream.ref.manifest.nbytes / max(1, stream.ref.num_records)
    k = _var_group_factor(stream.ref, size)
    if type(stream).column_batches is not Stream.column_batches:
        k = 1  # a subclass may give batches a meaning of their own (steps, padding)
    static = size if drop_remainder else None
    comps = schema.components
    # With the kernel, strings cross as bytes + starts + lengths (see tf_ops), from a local
    # store as a view of the mapped chunks (wrapped, not copied), instead of object arrays.
    kernel = tf_ops.load(warn_missing=any(c.dtype == "string" for c in comps))
    strings = StringFormat.RANGES if kernel is not None else StringFormat.OBJECTS
    in_place = kernel is not None and stream.strings_in_place()
    buffers = [kernel is not None and c.dtype == "string" for c in comps]
    byte_specs = [tf.TensorSpec([None], tf.uint8)] + [tf.TensorSpec([None], tf.int64)] * 2
    specs: list[tf.TensorSpec] = [tf.TensorSpec([], tf.int64)]  # rows per batch
    # The file the strings' bytes map, and its device, inode and size to keep: the kernel
    # fails rather than read a file truncated meanwhile (which would be SIGBUS).
    no_file = (b"", np.zeros(3, np.int64))
    if any(buffers):
        specs += [tf.TensorSpec([], tf.string), tf.TensorSpec([3], tf.int64)]
    for c, buf in zip(comps, buffers, strict=True):
        dtype = tf_dtype(c.dtype)
        if c.kind is Kind.TENSOR:
            specs += byte_specs if buf else [tf.TensorSpec([None, None, *c.shape], dtype)]
        else:
            splits = tf.as_dtype(c.row_splits_dtype)
            flat = byte_specs if buf else [tf.TensorSpec([None, *c.shape[1:]], dtype)]
            specs += [*flat, tf.TensorSpec([None], splits)]

    def flat_wire(values: Any) -> list[Any]:
        if not isinstance(values, StringRanges):
            return [values]
        if values.data.__array_interface__["data"][0] % ALIGN:
            # TensorFlow would copy all of an unaligned array: copy only these strings.
            buf = values.to_buffer()
            return [buf.data, buf.offsets[:-1], values.lengths]
        return [values.data, values.starts, values.lengths]

    def wire(
        arrays: list[Any], start: int, stop: int, rows: int, file: tuple[bytes, Any]
    ) -> tuple[Any, ...]:
        out: list[Any] = [np.int64(rows), *file] if any(buffers) else [np.int64(rows)]
        for c, a in zip(comps, arrays, strict=True):
            if c.kind is Kind.TENSOR:
                part = slice_rows(a, start, stop)
                if isinstance(part, StringRanges):
                    out += flat_wire(part)
                else:
                    out.append(part.reshape(len(part) // rows, rows, *part.shape[1:]))
            else:
                sp = a.nested_row_splits[0]
                out += flat_wire(slice_rows(a.flat_values, int(sp[start]), int(sp[stop])))
                out.append(sp[start : stop + 1] - sp[start])
        return tuple(out)

    def generate() -> Iterator[tuple[Any, ...]]:
        with stream.released_after():  # nothing held once an iteration ends
            # Groups of 1, 2, 4, ... k batches: the first batch waits for one batch's read, not
            # a whole group's (k > 1 only through Stream's own column_batches).
            for _records, cols in stream._batch_groups(size, k, in_place):
                arrays = batch_components(schema, cols, where, strings)
                del cols
                file = no_file
                mapped = getattr(stream.source, "mapped_file", lambda: None)() if in_place else None
                if mapped is not None:
                    file = (mapped[0].encode(), np.array(mapped[1:], np.int64))
                n = (
                    len(arrays[0])
                    if comps[0].kind is Kind.TENSOR
                    else len(arrays[0].nested_row_splits[0]) - 1
                )
                full = n // size * size
                if full:
                    yield wire(arrays, 0, full, size, file)
                if full < n and not drop_remainder:
                    yield wire(arrays, full, n, n - full, file)
                del arrays

    def regroup(rows: Any, *w: Any) -> Any:
        out: list[Any] = []
        file: tuple[Any, ...] = ()
        if any(buffers):
            file, w = w[:2], w[2:]
        i = 0
        for c, buf in zip(comps, buffers, strict=True):
            if buf:  # bytes + starts + lengths: the kernel makes the strings
                values = tf_ops.gather_bytes(w[i], w[i + 1], w[i + 2], *file)
                i += 3
            else:
                values = w[i]
                i += 1
            if c.kind is Kind.TENSOR:
                if buf:
                    values = tf.reshape(values, [-1, rows, *c.shape])
                values.set_shape([None, static, *c.shape])
                out.append(values)
                continue
            if buf and len(c.shape) > 1:
                values = tf.reshape(values, [-1, *c.shape[1:]])
            flat = tf.RaggedTensor.from_row_splits(values, w[i], validate=False)
            rt = tf.RaggedTensor.from_uniform_row_length(
                flat, tf.cast(rows, flat.row_splits.dtype), validate=False
            )
            rt._set_shape([None, static, *c.shape])  # restores the static dims tf.data expects
            out.append(rt)
            i += 1
        return schema.pack(out)

    ds = tf.data.Dataset.from_generator(_ends_at_exit(generate), output_signature=tuple(specs))
    regroup_fn = tf.autograph.experimental.do_not_convert(regroup)  # plain graph code
    if any(buffers):  # the kernel's copies run on tf.data threads, beside the generator
        ds = ds.map(regroup_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # Whole groups are read ahead and split into batches as they are taken (without the
    # kernel the map is cheap and runs after the read-ahead, with the split). One group of
    # _VAR_GROUP_BYTES ahead, beside those in the map, reads as fast as two and holds less.
    ds = _finish(ds, round(per_record * size * k), min_depth=_VAR_MIN_DEPTH)
    if not any(buffers):
        ds = ds.map(regroup_fn)
    return ds.unbatch()


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
        with stream.released_after():  # nothing held once an iteration ends
            # A stream subclass may give batches a meaning (steps), so read in its batches.
            for _records, cols in stream.column_batches(batch_size, drop_remainder):
                for i in range(len(cols[0]) if cols else 0):
                    comps = element_components(schema, cols, i)
                    yield tuple(
                        w
                        for c, v in zip(schema.components, comps, strict=True)
                        for w in _wire(c, v)
                    )

    ds = tf.data.Dataset.from_generator(_ends_at_exit(generate), output_signature=specs)
    ds = ds.map(
        lambda *w: _rebuild(schema, w, None, False),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return _finish(ds, row_bytes(schema))
