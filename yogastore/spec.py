"""Element specs without TensorFlow: what a dataset element looks like.

A *schema* is a nest structure plus a flat list of components. Components are
tensors (fixed or variable shape), ragged tensors or sparse tensors; each is
stored as one or more *columns* (see ``yogastore.format``). Everything here is
plain data that round-trips through JSON; dtype names come from an allow-list,
so a manifest can never name an arbitrary numpy dtype (e.g. ``object``).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import keyword
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from storage_backends.errors import CorruptCacheError, UnsupportedElementError
from yogastore.checks import is_int

__all__ = [
    "ComponentSpec",
    "Kind",
    "MAX_DIM",
    "MAX_ELEMENTS",
    "MAX_RANK",
    "RaggedValue",
    "Schema",
    "SparseValue",
    "numpy_dtype",
]

#: Largest size of one dimension of a record's shape.
MAX_DIM = 2**31 - 1
#: Most elements in one record of a known-shape component (2**40: 8 TiB of int64).
MAX_ELEMENTS = 2**40
#: Most dimensions of a record's shape.
MAX_RANK = 32

_PLAIN_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_EXTRA_DTYPES = ("bfloat16",)
STRING = "string"
DTYPES = frozenset((*_PLAIN_DTYPES, *_EXTRA_DTYPES, STRING))


def numpy_dtype(name: str) -> np.dtype[Any]:
    """Return the little-endian numpy dtype for an allowed dtype name."""
    if name in _PLAIN_DTYPES:
        return np.dtype(name).newbyteorder("<")
    if name == "bfloat16":
        import ml_dtypes  # shipped with TensorFlow; needed only for bfloat16

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    if name == STRING:
        return np.dtype(object)
    raise UnsupportedElementError(f"dtype {name!r} is not supported; supported: {sorted(DTYPES)}")


def dtype_name(dtype: Any) -> str:
    """Return the allowed name of a numpy or TensorFlow dtype (or raise)."""
    name = getattr(dtype, "name", None) or str(dtype)
    if name in ("bytes", "str", "object") or name.startswith(("bytes", "<U", "|S", "str")):
        return STRING
    if name in DTYPES:
        return name
    raise UnsupportedElementError(f"dtype {name!r} is not supported; supported: {sorted(DTYPES)}")


class Kind(enum.Enum):
    """What a component is."""

    TENSOR = "tensor"
    RAGGED = "ragged"
    SPARSE = "sparse"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ComponentSpec:
    """One leaf of an element: its kind, dtype and shape (``None`` = unknown dim).

    Args:
        shape: the per-record shape; ``None`` entries are unknown.
        dtype: a dtype name such as ``"float32"`` or ``"string"``.
        kind: tensor, ragged or sparse.
        ragged_rank: number of ragged dimensions (ragged only).
        row_splits_dtype: ``"int64"`` or ``"int32"`` (ragged only).
    """

    shape: tuple[int | None, ...]
    dtype: str
    kind: Kind = Kind.TENSOR
    ragged_rank: int = 0
    row_splits_dtype: str = "int64"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UnsupportedElementError(
                f"dtype {self.dtype!r} is not supported; supported: {sorted(DTYPES)}"
            )
        if not isinstance(self.shape, tuple) or len(self.shape) > MAX_RANK:
            raise UnsupportedElementError(
                f"shape {self.shape!r} is not a tuple of <= {MAX_RANK} dims"
            )
        elements = 1
        for d in self.shape:
            if d is not None and (not is_int(d, allow_numpy=False) or not 0 <= d <= MAX_DIM):
                raise UnsupportedElementError(
                    f"shape {self.shape} has an invalid dimension {d!r} (each must be an "
                    f"integer in [0, {MAX_DIM}] or None)"
                )
            elements *= d or 1
        if elements > MAX_ELEMENTS:
            raise UnsupportedElementError(
                f"shape {self.shape} holds {elements} elements per record (at most "
                f"{MAX_ELEMENTS} accepted)"
            )
        if self.kind is Kind.RAGGED:
            if not 0 <= self.ragged_rank < max(len(self.shape), 1):
                raise UnsupportedElementError(
                    f"ragged_rank {self.ragged_rank} does not fit shape {self.shape}"
                )
            if self.row_splits_dtype not in ("int32", "int64"):
                raise UnsupportedElementError(f"row_splits_dtype {self.row_splits_dtype!r}")
        if self.kind is Kind.SPARSE and any(d is None for d in self.shape) and not self.shape:
            raise UnsupportedElementError("sparse components need a known rank")

    @property
    def fixed(self) -> bool:
        """Whether every record has the same, fully known shape (dense only)."""
        return self.kind is Kind.TENSOR and all(d is not None for d in self.shape)

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-compatible dict."""
        return {
            "kind": self.kind.value,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "ragged_rank": self.ragged_rank,
            "row_splits_dtype": self.row_splits_dtype,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> ComponentSpec:
        """Parse and validate a component written by ``to_json``."""
        try:
            shape = obj["shape"]
            if not isinstance(shape, list) or len(shape) > 32:
                raise TypeError("shape")
            return cls(
                kind=Kind(obj["kind"]),
                dtype=str(obj["dtype"]),
                shape=tuple(None if d is None else _json_int(d) for d in shape),
                ragged_rank=_json_int(obj.get("ragged_rank", 0)),
                row_splits_dtype=str(obj.get("row_splits_dtype", "int64")),
            )
        except (KeyError, TypeError, ValueError, UnsupportedElementError) as err:
            raise CorruptCacheError(f"{where}: malformed component spec {obj!r}: {err}") from err


def _json_int(value: Any) -> int:
    if not is_int(value, allow_numpy=False):
        raise TypeError(f"expected an integer, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True, slots=True)
class RaggedValue:
    """A ragged component of one record: ``flat_values`` plus nested row splits."""

    flat_values: np.ndarray
    nested_row_splits: tuple[np.ndarray, ...]

    def to_list(self) -> Any:
        """Return the nested Python list this value represents."""
        values: Any = list(self.flat_values)
        for splits in reversed(self.nested_row_splits):
            values = [values[int(a) : int(b)] for a, b in itertools.pairwise(splits)]
        return values


@dataclasses.dataclass(frozen=True, slots=True)
class SparseValue:
    """A sparse component of one record (COO, like ``tf.SparseTensor``)."""

    indices: np.ndarray
    values: np.ndarray
    dense_shape: np.ndarray


# Nest structures -----------------------------------------------------------------

_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


def _namedtuple_class(name: str, fields: tuple[str, ...]) -> type:
    """Return a tuple subclass with ``_fields`` built without exec/eval."""
    for ident in (name, *fields):
        if not ident.isidentifier() or keyword.iskeyword(ident) or ident.startswith("_"):
            raise CorruptCacheError(f"namedtuple name or field {ident!r} is not a plain identifier")
    key = (name, fields)
    cls = _NAMEDTUPLES.get(key)
    if cls is None:

        def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
            values = list(args) + [kwargs.pop(f) for f in fields[len(args) :] if f in kwargs]
            if kwargs or len(values) != len(fields):
                raise TypeError(f"{name} takes fields {fields}")
            return tuple.__new__(klass, values)  # type: ignore[type-var]

        namespace: dict[str, Any] = {
            "__slots__": (),
            "_fields": fields,
            "__new__": __new__,
            "_asdict": lambda self: dict(zip(fields, self, strict=True)),
            "_make": classmethod(lambda klass, it: klass(*it)),
            "__repr__": lambda self: (
                name
                + "("
                + ", ".join(f"{f}={v!r}" for f, v in zip(fields, self, strict=True))
                + ")"
            ),
            "__getnewargs__": lambda self: tuple(self),
        }
        for i, field in enumerate(fields):
            namespace[field] = property(operator.itemgetter(i))
        cls = type(name, (tuple,), namespace)
        _NAMEDTUPLES[key] = cls
    return cls


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple)


def _describe(node: Any, leaf: Callable[[Any], bool], leaves: list[Any]) -> Any:
    if leaf(node):
        leaves.append(node)
        return {"type": "leaf", "index": len(leaves) - 1}
    if isinstance(node, Mapping):
        keys = sorted(node)
        for k in keys:
            if not isinstance(k, str):
                raise UnsupportedElementError(f"dict key {k!r} is not a string")
        return {
            "type": "dict",
            "keys": keys,
            "items": [_describe(node[k], leaf, leaves) for k in keys],
        }
    if _is_namedtuple(node):
        return {
            "type": "namedtuple",
            "name": type(node).__name__,
            "fields": list(type(node)._fields),
            "items": [_describe(v, leaf, leaves) for v in node],
        }
    if isinstance(node, tuple | list):
        return {"type": "tuple", "items": [_describe(v, leaf, leaves) for v in node]}
    raise UnsupportedElementError(f"element part of type {type(node).__name__} is not supported")


def flatten_structure(value: Any, leaf: Callable[[Any], bool]) -> tuple[Any, list[Any]]:
    """Split a nest into a JSON structure description and its leaves."""
    # Module-level recursion (here and in pack_structure, Schema.flatten): a
    # closure calling itself is a reference cycle that keeps every element's
    # arrays alive until the garbage collector runs.
    leaves: list[Any] = []
    return _describe(value, leaf, leaves), leaves


def _check_structure(node: Any, count: int, seen: set[int], depth: int = 0) -> None:
    if depth > 64 or not isinstance(node, dict):
        raise CorruptCacheError(f"malformed nest structure node {node!r}")
    kind = node.get("type")
    if kind == "leaf":
        index = node.get("index")
        if not isinstance(index, int) or not 0 <= index < count:
            raise CorruptCacheError(f"nest structure leaf index {index!r} out of range")
        if index in seen:
            raise CorruptCacheError(
                f"nest structure names component {index} twice (a duplicated leaf index)"
            )
        seen.add(index)
        return
    items = node.get("items")
    if not isinstance(items, list):
        raise CorruptCacheError(f"nest structure node {kind!r} has no item list")
    if kind == "dict":
        keys = node.get("keys")
        if not isinstance(keys, list) or len(keys) != len(items):
            raise CorruptCacheError("nest structure dict keys do not match its items")
        if not all(isinstance(k, str) for k in keys):
            raise CorruptCacheError("nest structure dict keys must be strings")
        if keys != sorted(set(keys)):
            # Written sorted and unique (as tf.nest orders them): anything else
            # is damage, e.g. a key changed into its neighbour's name.
            raise CorruptCacheError(
                f"nest structure dict keys {keys!r:.200} are not sorted and unique"
            )
    elif kind == "namedtuple":
        fields = node.get("fields")
        name = node.get("name")
        if not isinstance(fields, list) or len(fields) != len(items) or not isinstance(name, str):
            raise CorruptCacheError("nest structure namedtuple fields do not match its items")
        _namedtuple_class(name, tuple(str(f) for f in fields))
    elif kind != "tuple":
        raise CorruptCacheError(f"unknown nest structure type {kind!r}")
    for item in items:
        _check_structure(item, count, seen, depth + 1)


def pack_structure(structure: Any, leaves: Sequence[Any]) -> Any:
    """Rebuild a nest from its structure description and leaves."""
    kind = structure["type"]
    if kind == "leaf":
        return leaves[structure["index"]]
    items = [pack_structure(v, leaves) for v in structure["items"]]
    if kind == "dict":
        return dict(zip(structure["keys"], items, strict=True))
    if kind == "namedtuple":
        return _namedtuple_class(structure["name"], tuple(structure["fields"]))(*items)
    return tuple(items)


@dataclasses.dataclass(frozen=True, slots=True)
class Schema:
    """Nest structure plus the flat list of component specs."""

    structure: Any
    components: tuple[ComponentSpec, ...]
    paths: tuple[str, ...]
    # (key, leaf index) pairs when the nest is one dict of leaves (the common
    # case), which ``pack`` then builds without walking the structure.
    _flat_dict: tuple[tuple[Any, int], ...] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        s = self.structure
        if isinstance(s, dict) and s.get("type") == "dict":
            items = s.get("items", [])
            if all(isinstance(v, dict) and v.get("type") == "leaf" for v in items):
                pairs = tuple((k, int(v["index"])) for k, v in zip(s["keys"], items, strict=True))
                object.__setattr__(self, "_flat_dict", pairs)

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-compatible dict."""
        return {
            "structure": self.structure,
            "components": [c.to_json() for c in self.components],
            "paths": list(self.paths),
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Schema:
        """Parse and validate a schema written by ``to_json``."""
        if not isinstance(obj, dict) or not isinstance(obj.get("components"), list):
            raise CorruptCacheError(f"{where}: schema is not an object with a component list")
        comps = tuple(
            ComponentSpec.from_json(c, f"{where} component {i}")
            for i, c in enumerate(obj["components"])
        )
        paths = obj.get("paths", [str(i) for i in range(len(comps))])
        if not isinstance(paths, list) or len(paths) != len(comps):
            raise CorruptCacheError(f"{where}: schema paths do not match its components")
        seen: set[int] = set()
        try:
            _check_structure(obj.get("structure"), len(comps), seen)
        except CorruptCacheError as err:
            raise CorruptCacheError(f"{where}: {err}") from err
        if len(seen) != len(comps):
            raise CorruptCacheError(f"{where}: nest structure does not use every component")
        return cls(obj["structure"], comps, tuple(str(p) for p in paths))

    @classmethod
    def from_specs(cls, spec: Any) -> Schema:
        """Build a schema from a nest of ``ComponentSpec``."""
        structure, leaves = flatten_structure(spec, lambda x: isinstance(x, ComponentSpec))
        return cls(structure, tuple(leaves), tuple(leaf_paths(structure, len(leaves))))

    def pack(self, leaves: Sequence[Any]) -> Any:
        """Rebuild one element (or batch) from its flat components."""
        if self._flat_dict is not None:
            return {key: leaves[i] for key, i in self._flat_dict}
        return pack_structure(self.structure, leaves)

    def flatten(self, element: Any) -> list[Any]:
        """Return the leaves of an element with this schema's structure."""
        leaves: list[Any] = []
        _flatten_into(self.structure, element, "", leaves)
        return leaves


def _flatten_into(node: Any, value: Any, path: str, leaves: list[Any]) -> None:
    kind = node["type"]
    if kind == "leaf":
        leaves.append(value)
        return
    if kind == "dict":
        if not isinstance(value, Mapping) or sorted(value) != node["keys"]:
            raise UnsupportedElementError(f"element at {path or 'top'} does not match the spec")
        for k, child in zip(node["keys"], node["items"], strict=True):
            _flatten_into(child, value[k], f"{path}/{k}", leaves)
        return
    if not isinstance(value, tuple | list) or len(value) != len(node["items"]):
        raise UnsupportedElementError(f"element at {path or 'top'} does not match the spec")
    for i, (child, v) in enumerate(zip(node["items"], value, strict=True)):
        _flatten_into(child, v, f"{path}/{i}", leaves)


def row_bytes(schema: Schema) -> int:
    """Return the bytes of one record's known-size parts (64 per string, 0 per unknown dim)."""
    row = 0
    for comp in schema.components:
        itemsize = 64 if comp.dtype == STRING else np.dtype(comp.dtype).itemsize
        row += itemsize * int(np.prod([d or 0 for d in comp.shape], dtype=np.int64))
    return row


def leaf_paths(structure: Any, count: int) -> list[str]:
    paths = [""] * count

    def walk(node: Any, path: str) -> None:
        if node["type"] == "leaf":
            paths[node["index"]] = path or "<element>"
            return
        names = (
            node.get("keys") or node.get("fields") or [str(i) for i in range(len(node["items"]))]
        )
        for name, child in zip(names, node["items"], strict=True):
            walk(child, f"{path}/{name}" if path else str(name))

    walk(structure, "")
    return paths
