"""Storage backends: keys and bytes behind one abstract contract.

Backends are looked up by URL scheme: first in a registry of classes or
``"module:Class"`` strings (the built-in ones, and any added with
``register_backend``), then among the entry points of the group
``yogastore.backends`` that installed packages declare (name: the scheme,
value: ``"module:Class"``). Importing this package imports neither lmdb nor
boto3; a backend's module is imported when a store first uses its scheme.
A third-party backend checks itself with ``storage_backends.contract``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import threading
from typing import Any

from storage_backends.base import Backend, Buffer, check_capabilities, check_key
from storage_backends.errors import InvalidArgumentError

__all__ = [
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "Backend",
    "Buffer",
    "backend_class",
    "check_key",
    "open_backend",
    "register_backend",
]

#: Entry point group through which installed packages offer backends.
ENTRY_POINT_GROUP = "yogastore.backends"

#: URL scheme -> backend class, or "module:Class" imported on first use.
REGISTRY: dict[str, str | type[Backend]] = {
    "": "storage_backends.lmdb_backend:LmdbBackend",
    "file": "storage_backends.lmdb_backend:LmdbBackend",
    "s3": "storage_backends.s3_backend:S3Backend",
}

_LOCK = threading.Lock()


def _scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def _check_scheme(scheme: str) -> str:
    if not isinstance(scheme, str) or scheme != scheme.lower() or "://" in scheme:
        raise InvalidArgumentError(
            f"a backend scheme is a lower-case URL scheme without '://', got {scheme!r}"
        )
    return scheme


def _load(scheme: str, target: str | type[Backend]) -> type[Backend]:
    """Return the class ``target`` names, checked to be a backend serving ``scheme``."""
    if isinstance(target, str):
        module_name, _, class_name = target.partition(":")
        if not module_name or not class_name:
            raise InvalidArgumentError(
                f"backend for scheme {scheme!r} must be a class or 'module:Class', got {target!r}"
            )
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception as err:  # an import can raise anything; name what failed
            raise InvalidArgumentError(
                f"cannot load the backend {target!r} for scheme {scheme!r}: {err}"
            ) from err
    else:
        cls = target
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise InvalidArgumentError(
            f"backend {target!r} for scheme {scheme!r} is not a storage_backends.Backend"
        )
    name = f"{cls.__module__}.{cls.__qualname__}"
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise InvalidArgumentError(
            f"backend {name} for scheme {scheme!r} does not implement {missing}"
        )
    schemes = cls.schemes
    if not isinstance(schemes, tuple) or not all(isinstance(s, str) for s in schemes):
        raise InvalidArgumentError(
            f"backend {name}: schemes must be a tuple of strings, got {schemes!r}"
        )
    if scheme not in schemes:
        raise InvalidArgumentError(
            f"backend {name} does not serve scheme {scheme!r}: its schemes are {schemes!r}"
        )
    check_capabilities(cls)
    return cls


def _name(target: str | type[Backend]) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def register_backend(scheme: str, backend: str | type[Backend], *, replace: bool = False) -> None:
    """Serve URLs of ``scheme`` with ``backend``.

    Args:
        scheme: a lower-case URL scheme (``"gs"`` for ``gs://...``; ``""`` for paths).
        backend: a ``Backend`` subclass, or ``"module:Class"`` imported on first
            use. Its ``schemes`` must list ``scheme`` (checked now for a class,
            on first use for a string).
        replace: replace a backend already registered for ``scheme``.

    Raises:
        InvalidArgumentError: bad scheme or class, or ``scheme`` is taken.
    """
    _check_scheme(scheme)
    if not isinstance(backend, str):
        _load(scheme, backend)
    with _LOCK:
        taken = REGISTRY.get(scheme)
        if taken is not None and not replace and _name(taken) != _name(backend):
            raise InvalidArgumentError(
                f"scheme {scheme!r} is already served by {_name(taken)!r}; "
                "pass replace=True to replace it"
            )
        REGISTRY[scheme] = backend


def _from_entry_points(scheme: str) -> str | type[Backend] | None:
    """Look ``scheme`` up among installed packages' ``yogastore.backends`` entry points."""
    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    matches = [ep for ep in found if ep.name == scheme]
    if not matches:
        return None
    if len({ep.value for ep in matches}) > 1:
        raise InvalidArgumentError(
            f"several installed packages offer a backend for scheme {scheme!r}: "
            f"{sorted(ep.value for ep in matches)}; call register_backend to choose"
        )
    return matches[0].value


def backend_class(scheme: str) -> type[Backend]:
    """Return the backend class serving ``scheme`` (imports its module).

    Raises:
        InvalidArgumentError: no backend serves ``scheme``, or it cannot be loaded.
    """
    with _LOCK:
        target = REGISTRY.get(scheme)
    if target is None:
        target = _from_entry_points(scheme)
        if target is None:
            raise InvalidArgumentError(
                f"no storage backend for scheme {scheme!r}; known: {sorted(REGISTRY)}, and "
                f"none in the entry point group {ENTRY_POINT_GROUP!r} of installed packages"
            )
    cls = _load(scheme, target)
    with _LOCK:
        REGISTRY.setdefault(scheme, cls)
    return cls


def open_backend(url: str | os.PathLike[str], **options: Any) -> Backend:
    """Return the backend serving ``url`` (a path or ``scheme://...`` URL).

    Raises:
        InvalidArgumentError: no backend serves the URL's scheme, or an option is bad.
    """
    text = os.fspath(url)
    scheme = _scheme_of(text)
    try:
        cls = backend_class(scheme)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{text!r}: {err}") from err
    return check_capabilities(cls(text, **options))
