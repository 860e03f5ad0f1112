"""Checks around ``Store.cache``: stale caches, infinite sources, size guards, cleanup.

* A hit is compared with the caller's source: its schema (from ``spec=`` or
  the ``tf.data`` element_spec) and, when given, its ``fingerprint=``.
* A build is refused at once when the source's cardinality is statically
  infinite, and stopped when it passes ``max_records`` / ``max_bytes``.
* A build that fails deletes its own chunks (keys of its build id only: a
  builder whose lock was taken over may still be writing others).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from storage_backends import Backend
from storage_backends.errors import (
    BuildLimitError,
    InvalidArgumentError,
    StaleCacheError,
    StorageError,
)
from yogastore.build.writer import SourceItem, chunk_key_prefix
from yogastore.checks import check_int
from yogastore.format.encode import PackedStrings
from yogastore.format.manifest import Manifest
from yogastore.spec import ComponentSpec, Kind, Schema

__all__ = [
    "BuildOptions",
    "canonical_fingerprint",
    "check_fingerprint",
    "check_schema",
    "check_source_size",
    "delete_build",
    "guarded_items",
    "structure_differences",
]

logger = logging.getLogger(__name__)

_INFINITE = -1  # tf.data.INFINITE_CARDINALITY
_UNKNOWN = -2  # tf.data.UNKNOWN_CARDINALITY


def _optional_positive(name: str, value: Any) -> None:
    if value is not None:
        check_int(name, value, 1)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BuildOptions:
    """What ``Store.cache`` checks besides the name.

    Args:
        fingerprint: canonical fingerprint text (see ``canonical_fingerprint``).
        rebuild: replace a committed version.
        max_records: fail the build past this many records.
        max_bytes: fail the build past this many bytes of record data.
    """

    fingerprint: str | None = None
    rebuild: bool = False
    max_records: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rebuild, bool):
            raise InvalidArgumentError(f"rebuild must be a bool, got {self.rebuild!r}")
        _optional_positive("max_records", self.max_records)
        _optional_positive("max_bytes", self.max_bytes)


def canonical_fingerprint(value: str | Mapping[str, Any] | None) -> str | None:
    """Return the text stored for a ``fingerprint=``: the string, or a dict as sorted JSON.

    Raises:
        InvalidArgumentError: not a string or a JSON-serialisable dict.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        try:
            return json.dumps(dict(value), sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(
                f"fingerprint dict must hold JSON values (str, int, float, bool, lists, "
                f"dicts): {err}"
            ) from err
    raise InvalidArgumentError(
        f"fingerprint must be a string or a dict, got {type(value).__name__}"
    )


def check_fingerprint(manifest: Manifest, fingerprint: str | None) -> None:
    """Raise ``StaleCacheError`` when ``fingerprint`` is given and differs from the stored one."""
    if fingerprint is None or fingerprint == manifest.source_fingerprint:
        return
    raise StaleCacheError(
        f"{manifest.where} was built from source fingerprint "
        f"{manifest.source_fingerprint!r:.300}, not {fingerprint!r:.300}; pass rebuild=True "
        "to replace it, or use a new version"
    )


def _component_text(comp: ComponentSpec | None) -> str:
    if comp is None:
        return "no such component"
    text = f"{comp.kind.value} {comp.dtype} shape {comp.shape}"
    return text + (f" ragged_rank {comp.ragged_rank}" if comp.kind is Kind.RAGGED else "")


def _node_text(node: Any) -> str:
    kind = node.get("type")
    if kind == "leaf":
        return "a component"
    if kind == "dict":
        return f"a dict with keys {node.get('keys')}"
    if kind == "namedtuple":
        return f"namedtuple {node.get('name')}({', '.join(map(str, node.get('fields', [])))})"
    return f"a tuple of {len(node.get('items', []))}"


def structure_differences(cached: Any, given: Any, path: str = "") -> list[str]:
    """Return where two nest structure descriptions (``Schema.structure``) differ.

    Each difference names the path of the nest (``<element>`` for the top)
    and what each side has there (a component, a dict, a tuple, a namedtuple).
    """
    where = path or "<element>"
    if cached == given:
        return []
    same_kind = cached.get("type") == given.get("type")
    same_shape = all(cached.get(k) == given.get(k) for k in ("keys", "name", "fields")) and len(
        cached.get("items", [])
    ) == len(given.get("items", []))
    if not same_kind or not same_shape or cached.get("type") == "leaf":
        return [f"{where}: cached {_node_text(cached)} vs source {_node_text(given)}"]
    names = cached.get("keys") or cached.get("fields") or range(len(cached["items"]))
    return [
        diff
        for name, a, b in zip(names, cached["items"], given["items"], strict=True)
        for diff in structure_differences(a, b, f"{path}/{name}" if path else str(name))
    ]


def check_schema(manifest: Manifest, schema: Schema) -> None:
    """Raise ``StaleCacheError`` when the caller's source has another schema."""
    if schema == manifest.schema:
        return
    stored = dict(zip(manifest.schema.paths, manifest.schema.components, strict=True))
    given = dict(zip(schema.paths, schema.components, strict=True))
    diffs = [
        f"{path}: cached {_component_text(stored.get(path))} vs source "
        f"{_component_text(given.get(path))}"
        for path in sorted(set(stored) | set(given))
        if stored.get(path) != given.get(path)
    ] or structure_differences(manifest.schema.structure, schema.structure)
    raise StaleCacheError(
        f"{manifest.where} was built from a source with another element_spec "
        f"({'; '.join(diffs)[:500]}); pass rebuild=True to replace it, or use a new version"
    )


def check_source_size(source: Any, name: str, options: BuildOptions) -> int | None:
    """Refuse a statically infinite ``tf.data`` source; return its cardinality if known.

    Raises:
        BuildLimitError: the cardinality is infinite, or known and above ``max_records``.
    """
    cardinality = getattr(source, "cardinality", None)
    if cardinality is None or not type(source).__module__.startswith("tensorflow"):
        try:
            return len(source)
        except TypeError:
            return None
    n = int(cardinality())
    if n == _INFINITE:
        raise BuildLimitError(
            f"caching {name}: the dataset is infinite (cardinality INFINITE, e.g. from "
            ".repeat()); cache the finite dataset and repeat the stream instead "
            "(num_epochs=None), or .take(n) first"
        )
    if n == _UNKNOWN:
        return None
    if options.max_records is not None and n > options.max_records:
        raise BuildLimitError(
            f"caching {name}: the dataset has {n} records, more than max_records="
            f"{options.max_records}"
        )
    return n


def _slab_bytes(slab: Any) -> int:
    total = 0
    for data in slab.columns:
        values = data if isinstance(data, np.ndarray) else data[1]
        if isinstance(values, PackedStrings):
            total += values.nbytes
        elif isinstance(values, np.ndarray):
            total += _value_bytes(values)
        else:
            total += sum(map(len, values))
    return total


def _value_bytes(value: Any) -> int:
    if isinstance(value, bytes | str):
        return len(value)
    arr = np.asarray(value)
    if arr.dtype == object:
        return sum(len(v) if isinstance(v, bytes | str) else 8 for v in arr.reshape(-1))
    return int(arr.nbytes)


def guarded_items(
    items: Iterable[SourceItem], name: str, options: BuildOptions
) -> Iterable[SourceItem]:
    """Return ``items``, stopped with ``BuildLimitError`` once a guard is passed.

    Without guards ``items`` is returned as is (no per-record cost).
    """
    if options.max_records is None and options.max_bytes is None:
        return items
    return _guard(items, name, options.max_records, options.max_bytes)


def _guard(
    items: Iterable[SourceItem], name: str, max_records: int | None, max_bytes: int | None
) -> Iterator[SourceItem]:
    records = nbytes = 0
    for kind, values in items:
        if kind == "batch":
            records += len(values[0]) if values else 0
            if max_bytes is not None:
                nbytes += sum(_value_bytes(v) for v in values)
        elif kind == "slab":
            records += values[0].n
            if max_bytes is not None:
                nbytes += _slab_bytes(values[0])
        else:
            records += 1
            if max_bytes is not None:
                nbytes += sum(_value_bytes(v) for v in values)
        if max_records is not None and records > max_records:
            raise BuildLimitError(
                f"caching {name}: more than max_records={max_records} records; the build was "
                "stopped and its chunks deleted (is the source endless?)"
            )
        if max_bytes is not None and nbytes > max_bytes:
            raise BuildLimitError(
                f"caching {name}: more than max_bytes={max_bytes} bytes of records; the build "
                "was stopped and its chunks deleted (is the source endless?)"
            )
        yield kind, values


def delete_build(backend: Backend, dataset_id: str, version: str, build_id: str) -> None:
    """Delete every chunk of one failed build (best effort; logs what it cannot)."""
    prefix = chunk_key_prefix(dataset_id, version, build_id)
    try:
        keys = [k for k in backend.list(f"{dataset_id}/{version}/") if k.startswith(prefix)]
        for key in keys:
            backend.delete(key)
    except StorageError as err:
        logger.warning("could not delete the chunks of failed build %s: %s", prefix, err)
        return
    if keys:
        logger.info("deleted %d chunks of failed build %s", len(keys), prefix)
