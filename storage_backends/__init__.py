"""Storage backends: keys and bytes behind one abstract contract.

Backends are looked up by URL scheme through a registry of ``"module:Class"``
strings, so importing this package imports neither lmdb nor boto3.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from storage_backends.base import Backend, Buffer, check_key
from storage_backends.errors import InvalidArgumentError

__all__ = ["REGISTRY", "Backend", "Buffer", "check_key", "open_backend"]

#: URL scheme -> "module:Class" of the backend serving it.
REGISTRY: dict[str, str] = {
    "": "storage_backends.lmdb_backend:LmdbBackend",
    "file": "storage_backends.lmdb_backend:LmdbBackend",
    "s3": "storage_backends.s3_backend:S3Backend",
}


def open_backend(url: str | os.PathLike[str], **options: Any) -> Backend:
    """Return the backend serving ``url`` (a path, ``file://`` or ``s3://`` URL)."""
    text = os.fspath(url)
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    target = REGISTRY.get(scheme)
    if target is None:
        raise InvalidArgumentError(
            f"no storage backend for scheme {scheme!r} in {text!r}; known: {sorted(REGISTRY)}"
        )
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    backend: Backend = cls(text, **options)
    return backend
