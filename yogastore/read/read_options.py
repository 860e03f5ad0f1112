"""How a store's readers read from an object store: one validated options object.

``ReadOptions`` belongs to the ``Store`` (``Store(url, read_options=...)``)
and reaches every remote reader it makes; nothing of it is stored on, or read
from, the backend. Two of its fields stand in for what a backend declares when
left ``None``: ``max_parallel`` (``Backend.max_parallel``) and ``cache_dir``
(yogastore's default root).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from storage_backends.base import Backend
from storage_backends.errors import InvalidArgumentError
from yogastore.checks import check_int
from yogastore.paths import default_root

__all__ = ["ReadOptions"]

_MIB = 1 << 20


def _int_at_least(name: str, value: object, low: int) -> None:
    check_int(f"read option {name}", value, low, allow_numpy=False)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReadOptions:
    """How the readers of a store on an object store fetch, cache and look ahead.

    Args:
        cache_dir: directory of the disk read cache (``None``: yogastore's
            default root, ``$YOGASTORE_HOME`` or ``~/.cache/yogastore``).
        cache_bytes: disk cache size limit; 0 disables the disk cache.
        max_parallel: ranged reads in flight (``None``: the backend's
            ``max_parallel``).
        whole_fraction: fetch a chunk whole once this fraction of its records
            is needed within the look-ahead horizon.
        coalesce_gap: merge byte ranges separated by at most this many bytes.
        overfetch: also merge ranges while the bytes skipped between them stay
            within this fraction of the bytes needed (fewer requests).
        horizon_chunks: look-ahead horizon, in chunks' worth of records.
        readahead_batches: upcoming batches prepared in the background.
        memory_bytes: chunk bytes kept in memory between batches.
        max_request_bytes: split larger ranges into parallel requests.

    Raises:
        InvalidArgumentError: a field is out of range; the message names it.
    """

    cache_dir: str | os.PathLike[str] | None = None
    cache_bytes: int = 8 << 30
    max_parallel: int | None = None
    whole_fraction: float = 0.9
    coalesce_gap: int = 256
    overfetch: float = 0.05
    horizon_chunks: int = 8
    readahead_batches: int = 4
    memory_bytes: int = 256 * _MIB
    max_request_bytes: int = 16 * _MIB

    def __post_init__(self) -> None:
        for name in ("cache_bytes", "coalesce_gap", "readahead_batches", "memory_bytes"):
            _int_at_least(name, getattr(self, name), 0)
        for name in ("horizon_chunks", "max_request_bytes"):
            _int_at_least(name, getattr(self, name), 1)
        if self.max_parallel is not None:
            _int_at_least("max_parallel", self.max_parallel, 1)
        if self.cache_dir is not None and (
            not isinstance(self.cache_dir, str | os.PathLike) or not os.fspath(self.cache_dir)
        ):
            raise InvalidArgumentError(
                f"read option cache_dir must be a non-empty path or None, got {self.cache_dir!r}"
            )
        for name in ("overfetch", "whole_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgumentError(f"read option {name} must be a number, got {value!r}")
        if not 0.0 <= self.overfetch <= 1.0:
            raise InvalidArgumentError(
                f"read option overfetch must be in [0, 1], got {self.overfetch!r}"
            )
        if not 0.0 < self.whole_fraction <= 1.0:
            raise InvalidArgumentError(
                f"read option whole_fraction must be in (0, 1], got {self.whole_fraction!r}"
            )

    @classmethod
    def of(cls, value: ReadOptions | Mapping[str, Any] | None) -> ReadOptions:
        """Return ``value`` as ``ReadOptions`` (``None``: the defaults; a mapping: its fields).

        Raises:
            InvalidArgumentError: unknown field names, or a field out of range.
        """
        if value is None:
            return cls()
        if isinstance(value, ReadOptions):
            return value
        if not isinstance(value, Mapping):
            raise InvalidArgumentError(
                f"read_options must be a ReadOptions or a mapping of its fields, got {value!r}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise InvalidArgumentError(f"unknown read options {unknown}; known: {sorted(known)}")
        return cls(**value)

    def cache_path(self) -> Path:
        """Return the directory of the disk read cache."""
        return Path(self.cache_dir).expanduser() if self.cache_dir is not None else default_root()

    def parallel_for(self, backend: Backend) -> int:
        """Return the ranged reads to keep in flight against ``backend``."""
        return self.max_parallel if self.max_parallel is not None else backend.max_parallel
