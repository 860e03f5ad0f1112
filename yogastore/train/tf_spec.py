"""tf.data element specs <-> yogastore schemas, and tf dtypes by name."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from storage_backends.errors import UnsupportedElementError
from yogastore.spec import (
    ComponentSpec,
    Kind,
    Schema,
    dtype_name,
    flatten_structure,
    leaf_paths,
)

__all__ = ["element_spec_from_schema", "schema_from_element_spec", "tf_dtype"]


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


def tf_dtype(name: str) -> tf.DType:
    return tf.string if name == "string" else tf.as_dtype(name)


def _type_spec(comp: ComponentSpec) -> tf.TypeSpec:
    dtype = tf_dtype(comp.dtype)
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
