"""``to_tf_dataset`` options: argument checks, an element-level map, padded and ragged batching.

A stream is read in batches (one Python call per batch or group of
batches). An element-level ``map_fn`` (e.g. decoding a JPEG) runs on the
records of those batches, in parallel, in order, and the records are batched
again with the same size: batch ``i`` holds the same records as without the
map, so the step alignment every distributed helper relies on is kept.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from storage_backends.errors import InvalidArgumentError
from yogastore.checks import check_int
from yogastore.spec import Kind

if TYPE_CHECKING:
    from yogastore.read.stream import Stream

__all__ = ["Batching", "check_tf_args", "to_tf_dataset"]


class Batching(enum.Enum):
    """How records are grouped into batches."""

    DENSE = "dense"
    """``Dataset.batch``: every component must have the same shape within a batch."""
    PADDED = "padded"
    """``Dataset.padded_batch``: variable-length dense components padded to the longest."""
    RAGGED = "ragged"
    """``Dataset.ragged_batch``: variable-length dense components become ragged."""


def check_tf_args(
    batch_size: Any,
    drop_remainder: Any,
    map_fn: Any = None,
    num_parallel_calls: Any = None,
    batching: Any = Batching.DENSE,
    padded_shapes: Any = None,
    padding_values: Any = None,
) -> None:
    """Validate ``to_tf_dataset`` arguments at the call, not at the first iteration.

    Raises:
        InvalidArgumentError: naming the argument and what it must be.
    """
    if batch_size is not None:
        check_int("batch_size", batch_size, 1)
    if not isinstance(drop_remainder, bool | np.bool_):
        raise InvalidArgumentError(f"drop_remainder must be a bool, got {drop_remainder!r}")
    if drop_remainder and batch_size is None:
        raise InvalidArgumentError("drop_remainder=True needs a batch_size")
    if map_fn is not None and not callable(map_fn):
        raise InvalidArgumentError(f"map_fn must be callable, got {map_fn!r}")
    if num_parallel_calls is not None:
        if map_fn is None:
            raise InvalidArgumentError("num_parallel_calls needs a map_fn")
        if num_parallel_calls != tf.data.AUTOTUNE:
            check_int("num_parallel_calls", num_parallel_calls, 1)
    if not isinstance(batching, Batching):
        raise InvalidArgumentError(f"batching must be a Batching, got {batching!r}")
    if batching is not Batching.DENSE and batch_size is None:
        raise InvalidArgumentError(f"batching=Batching.{batching.name} needs a batch_size")
    for name, value in (("padded_shapes", padded_shapes), ("padding_values", padding_values)):
        if value is not None and batching is not Batching.PADDED:
            raise InvalidArgumentError(
                f"{name} is used only with batching=Batching.PADDED, got "
                f"batching=Batching.{batching.name}: pass batching=Batching.PADDED or drop {name}"
            )


def _sparse_paths(spec: Any, path: str = "") -> list[str]:
    if isinstance(spec, tf.SparseTensorSpec):
        return [path or "<element>"]
    if isinstance(spec, dict):
        items: list[tuple[Any, Any]] = sorted(spec.items(), key=lambda kv: str(kv[0]))
    elif isinstance(spec, tuple | list):
        items = list(zip(getattr(spec, "_fields", range(len(spec))), spec, strict=True))
    else:
        return []
    return [p for key, sub in items for p in _sparse_paths(sub, f"{path}/{key}".lstrip("/"))]


def _check_not_sparse(element_spec: Any, mapped: bool) -> None:
    """Refuse sparse components before ``padded_batch`` (it raises a bare TypeError)."""
    paths = _sparse_paths(element_spec)
    if paths:
        what = "map_fn returns" if mapped else "the dataset has"
        raise InvalidArgumentError(
            f"batching=Batching.PADDED cannot pad sparse components; {what} sparse "
            f"component(s) {paths}: use Batching.DENSE (sparse components batch as they are) "
            "or make them dense in map_fn"
        )


def _densify(*element: Any) -> Any:
    """Turn ragged components into dense tensors (padded) so ``padded_batch`` accepts them."""
    value = element[0] if len(element) == 1 else element
    return tf.nest.map_structure(
        lambda t: t.to_tensor() if isinstance(t, tf.RaggedTensor) else t, value
    )


def _apply(fn: Callable[..., Any], ds: tf.data.Dataset, calls: Any) -> tf.data.Dataset:
    return ds.map(fn, num_parallel_calls=calls, deterministic=True)


def to_tf_dataset(
    stream: Stream,
    batch_size: int | None,
    drop_remainder: bool = False,
    *,
    map_fn: Callable[..., Any] | None = None,
    num_parallel_calls: int | None = None,
    batching: Batching = Batching.DENSE,
    padded_shapes: Any = None,
    padding_values: Any = None,
) -> tf.data.Dataset:
    """Return ``stream`` as a ``tf.data.Dataset`` (see ``Stream.to_tf_dataset``)."""
    from yogastore import tf as ytf

    check_tf_args(
        batch_size,
        drop_remainder,
        map_fn,
        num_parallel_calls,
        batching,
        padded_shapes,
        padding_values,
    )
    if map_fn is None and batching is Batching.DENSE:
        return ytf.to_tf_dataset(stream, batch_size, drop_remainder)
    calls = tf.data.AUTOTUNE if num_parallel_calls is None else num_parallel_calls
    if batch_size is None:  # element-level map only (batching is DENSE here)
        assert map_fn is not None
        return _apply(map_fn, ytf.to_tf_dataset(stream, None), calls).prefetch(2)
    # The stream is read in batches of batch_size (its step layout), then split,
    # mapped, and regrouped with the same boundaries. Dense components whose
    # shape varies cannot be stacked into one array: their records are handed
    # over one by one (still read in the stream's batches).
    if any(c.kind is Kind.TENSOR and not c.fixed for c in stream.ref.schema.components):
        ds = ytf.record_dataset(stream, batch_size, drop_remainder)
    else:
        ds = ytf.to_tf_dataset(stream, batch_size, drop_remainder).unbatch()
    if map_fn is not None:
        ds = _apply(map_fn, ds, calls)
    if batching is Batching.PADDED:
        _check_not_sparse(ds.element_spec, map_fn is not None)
    if batching is Batching.DENSE:
        ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    elif batching is Batching.RAGGED:
        ds = ds.ragged_batch(batch_size, drop_remainder=drop_remainder)
    else:
        try:
            ds = _apply(_densify, ds, calls).padded_batch(
                batch_size,
                padded_shapes=padded_shapes,
                padding_values=padding_values,
                drop_remainder=drop_remainder,
            )
        except (TypeError, ValueError) as err:  # raised by tf at the call
            raise InvalidArgumentError(
                f"padded_shapes={padded_shapes!r:.200} / padding_values={padding_values!r:.200} "
                f"do not fit the records ({ds.element_spec!r:.300}): {err}"
            ) from err
    return ds.prefetch(2)
