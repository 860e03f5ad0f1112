"""The abstract storage backend: keys and bytes, nothing else.

A backend stores immutable byte values under ``/``-separated keys. It knows no
schema and no TensorFlow. Public methods validate their arguments and then call
small abstract primitives that each backend implements; a backend missing a
primitive fails at construction (``abc``), not at first call. What a backend
offers beyond the primitives is declared as class attributes with defaults
(``schemes``, ``remote``, ``coordinated``, ``upload_workers``,
``max_parallel``), as fsspec does; yogastore reads them, never guesses.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import ClassVar, TypeVar

from storage_backends.errors import InvalidArgumentError, LockTimeoutError

__all__ = ["Backend", "Buffer", "check_capabilities", "check_key"]

#: Read results: ``bytes`` or a read-only ``memoryview`` that stays valid until
#: the backend is closed.
Buffer = bytes | memoryview
_B = TypeVar("_B", bound="Backend | type[Backend]")

_FORBIDDEN = re.compile(r"[\\\x00]")


def check_key(key: str) -> str:
    r"""Validate a backend key and return it.

    Keys are ``/``-separated parts of printable characters other than ``\\``;
    no part may be empty, ``.`` or ``..``.

    Raises:
        InvalidArgumentError: the key is malformed.
    """
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"storage key must be a non-empty string, got {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or not part.isprintable() or _FORBIDDEN.search(part):
            raise InvalidArgumentError(f"storage key {key!r} has an invalid part {part!r}")
    return key


def _check_prefix(prefix: str) -> str:
    if prefix == "":
        return prefix
    if not prefix.endswith("/"):
        raise InvalidArgumentError(f"prefix {prefix!r} must be empty or end with '/'")
    check_key(prefix[:-1])
    return prefix


def check_capabilities(backend: _B) -> _B:
    """Return ``backend`` (a class or an instance) if its capabilities have the declared types.

    Raises:
        InvalidArgumentError: a capability has the wrong type or range; the
            message names the backend and the attribute.
    """
    cls = backend if isinstance(backend, type) else type(backend)
    name = f"backend {cls.__module__}.{cls.__qualname__}"
    for attr in ("remote", "coordinated", "put_copies"):
        value = getattr(backend, attr)
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name}: {attr} must be True or False, got {value!r}")
    for attr in ("upload_workers", "max_parallel"):
        value = getattr(backend, attr)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name}: {attr} must be an integer >= 1, got {value!r}")
    return backend


class Backend(abc.ABC):
    """Abstract key/bytes store.

    Rules every backend follows (checked by ``storage_backends.contract``):

    * ``get_range(key, start, length)`` returns exactly ``length`` bytes; a
      range past the end of the value raises ``InvalidArgumentError``; a
      zero-length range returns ``b""`` (even at the very end of the value).
    * ``put_exclusive`` raises ``KeyExistsError`` if the key exists, atomically.
    * ``list(prefix)`` returns sorted keys starting with ``prefix``.
    * Missing keys raise ``KeyNotFoundError``.
    * ``lock(name)`` excludes every other holder of ``name`` on the same
      store, in this process (other threads, other backend objects) and in
      others, and is released if its holder dies. A backend whose lock can be
      lost while held (a lease that ran out) fences it: once lost, writes
      under ``<name>/`` by the old holder raise ``LockLostError`` and an
      exclusive write there (a commit) checks with the store first.

    Subclasses are constructed as ``cls(url, **options)`` by
    ``storage_backends.open_backend`` and must reject options they do not know
    with ``InvalidArgumentError``.
    """

    #: URL schemes this backend serves (``""``: a plain path). A scheme can be
    #: registered (``storage_backends.register_backend``) only for a class
    #: listing it.
    schemes: ClassVar[tuple[str, ...]] = ()
    #: Whether reads cost requests (an object store): yogastore then reads it
    #: through its remote reader (ranged reads, disk cache, look-ahead) instead
    #: of mapping values in place, and block shuffle is the default.
    remote: ClassVar[bool] = False
    #: Whether ``put_exclusive`` and ``lock`` keep concurrent writers apart. If
    #: not (a store trusted to have one writer), a builder never deletes keys
    #: of other builds that look like leftovers.
    coordinated: bool = True
    #: Puts a builder keeps in flight.
    upload_workers: int = 1
    #: Whether ``put`` and ``put_exclusive`` are done with ``data`` when they return
    #: (they copied or sent it, and keep no reference to it): a builder then writes
    #: its next chunks into the buffers of chunks already put. Leave it ``False``
    #: for a backend that may keep the object it was given (or any part of it), and
    #: set it back to ``False`` in a subclass of a backend that declares it, if the
    #: subclass keeps values or defers writing them.
    put_copies: ClassVar[bool] = False
    #: Ranged reads a remote reader keeps in flight unless
    #: ``yogastore.ReadOptions.max_parallel`` says otherwise.
    max_parallel: int = 16

    def __init__(self, url: str) -> None:
        self.url = url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # Public, validating API -------------------------------------------------

    def get(self, key: str) -> Buffer:
        """Return the whole value stored under ``key``."""
        return self._get(check_key(key))

    def get_range(self, key: str, start: int, length: int) -> Buffer:
        """Return ``length`` bytes of ``key`` starting at byte ``start``."""
        check_key(key)
        if start < 0 or length < 0:
            raise InvalidArgumentError(
                f"byte range start={start} length={length} of {key!r} is negative"
            )
        if length == 0:
            return b""
        return self._get_range(key, start, length)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[Buffer]:
        """Return several ``(start, length)`` ranges of one value, in order.

        The default reads them one by one; a remote backend may fetch them in
        parallel. yogastore's remote reader schedules its own ranged reads and
        does not call this.
        """
        check_key(key)
        for start, length in ranges:
            if start < 0 or length < 0:
                raise InvalidArgumentError(
                    f"byte range start={start} length={length} of {key!r} is negative"
                )
        return self._get_ranges(key, list(ranges))

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key``, replacing any previous value."""
        self._put(check_key(key), data)

    def put_exclusive(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key`` only if the key is absent.

        Raises:
            KeyExistsError: the key already exists.
        """
        self._put_exclusive(check_key(key), data)

    def exists(self, key: str) -> bool:
        """Return whether ``key`` exists."""
        return self._exists(check_key(key))

    def size(self, key: str) -> int:
        """Return the length in bytes of the value under ``key``."""
        return self._size(check_key(key))

    def list(self, prefix: str = "") -> list[str]:
        """Return the sorted keys that start with ``prefix`` (``""`` or ending in ``/``)."""
        return sorted(self._list(_check_prefix(prefix)))

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""
        self._delete(check_key(key))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix`` (which must end with ``/``)."""
        if not prefix:
            raise InvalidArgumentError("delete_prefix needs a non-empty prefix")
        self._delete_prefix(_check_prefix(prefix))

    def lock(
        self, name: str, timeout: float | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Return a context manager holding an exclusive, crash-released lock.

        Args:
            name: lock name, a valid key.
            timeout: seconds to wait for the lock; ``None`` waits forever.

        Raises:
            LockTimeoutError: the lock was not acquired within ``timeout``.
        """
        return self._lock(check_key(name), timeout)

    def lock_held(self, name: str) -> bool:
        """Return whether lock ``name`` is held right now (by anyone); never waits.

        For read-only questions (is a build running?): on an object store it
        only looks, so it needs no write access and never probes the store's
        conditional writes, as taking a lock there does. Override
        ``_lock_held`` where the default below does not fit.
        """
        return self._lock_held(check_key(name))

    def delete_lock(self, name: str) -> None:
        """Remove what lock ``name`` leaves in the store; call while holding it.

        Backends whose locks leave nothing behind need not implement it.
        """
        self._delete_lock(check_key(name))

    def disk_usage(self, prefix: str = "") -> int:
        """Return the bytes the store spends on keys under ``prefix``.

        The default sums value sizes; a backend whose files hold more (free
        pages, lock files) reports what they take on disk.
        """
        return self._disk_usage(_check_prefix(prefix))

    def exclusive_puts_problem(self) -> str | None:
        """Return ``None`` if ``put_exclusive`` is atomic across processes here, else why not.

        A local store enforces it by its write lock; an object store may
        accept ``If-None-Match`` and ignore it, so its backend probes the
        store (once per process and bucket). Callers that rest on exclusive
        puts from many writers (work queue claims) refuse a store for which
        this is not ``None``.

        Raises:
            StorageError: the probe itself failed.
        """
        if not self.coordinated:
            return f"{type(self).__name__} declares coordinated = False"
        return None

    def mapped_file(self, key: str) -> tuple[str, int, int, int] | None:
        """Where views read earlier from where ``key`` lives are mapped, or ``None``.

        Backends returning memory-mapped views return the file's path, device,
        inode and the size it must keep for those views to stay readable, so a
        reader outside this process's Python (a TensorFlow kernel) can make the
        check ``check_mapped`` makes. Others return ``None``.
        """
        return None

    def mapped_span(self, key: str) -> tuple[int, int] | None:
        """Return (address, size) of the one memory map of every view read where ``key`` lives.

        ``None``: views not mapped, or in several maps. Within it, bytes between
        views are readable too: readers may hand out one array spanning views.
        """
        return None

    def check_mapped(self, key: str) -> None:
        """Raise if buffers read earlier from where ``key`` lives can no longer be read.

        Backends returning memory-mapped views check that the mapped file did
        not shrink (reading it would kill the process with ``SIGBUS``); others
        have nothing to check. Cheap: call it before each batch read from
        such views. ``key`` (any key of the dataset) only names where to look,
        and is not validated here: this runs before every batch.

        Raises:
            CorruptCacheError: the file was truncated under this process.
        """
        self._check_mapped(key)

    def will_read(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> bool:
        """Announce reads of byte ranges ``[starts[i], ends[i])`` of ``key``'s value.

        Backends whose ``get`` maps a file page by page on demand start reading
        those pages in the background, so the reads that follow find them in
        memory instead of each waiting for its own page; others ignore it.
        Advisory only: nothing is checked or raised, a key not read yet may
        be ignored, and the reads may come without it.

        Returns:
            Whether announcing more reads of ``key`` may help: ``False`` when
            the backend has nothing to read ahead (the value is in memory, or
            the backend does not read ahead), so a caller can stop asking.
        """
        return self._will_read(key, starts, ends)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; buffers returned earlier become invalid."""

    # Primitives ----------------------------------------------------------------

    @abc.abstractmethod
    def _get(self, key: str) -> Buffer: ...

    @abc.abstractmethod
    def _get_range(self, key: str, start: int, length: int) -> Buffer: ...

    def _get_ranges(
        self, key: str, ranges: builtins.list[tuple[int, int]]
    ) -> builtins.list[Buffer]:
        return [self.get_range(key, s, n) for s, n in ranges]

    @abc.abstractmethod
    def _put(self, key: str, data: bytes | memoryview) -> None: ...

    @abc.abstractmethod
    def _put_exclusive(self, key: str, data: bytes | memoryview) -> None: ...

    @abc.abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _size(self, key: str) -> int: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterator[str] | builtins.list[str]: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    def _delete_prefix(self, prefix: str) -> None:
        for key in self._list(prefix):
            self._delete(key)

    def _lock_held(self, name: str) -> bool:
        # Take the lock for an instant; a backend whose locks are objects it can look
        # at (S3) overrides this to look instead.
        try:
            with self._lock(name, 0.0):
                return False
        except LockTimeoutError:
            return True

    def _delete_lock(self, name: str) -> None:  # noqa: B027 - optional hook
        pass

    def _check_mapped(self, key: str) -> None:  # noqa: B027 - optional hook
        pass

    def _will_read(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> bool:
        return False

    def _disk_usage(self, prefix: str) -> int:
        return sum(self._size(key) for key in self._list(prefix))

    @abc.abstractmethod
    def _lock(
        self, name: str, timeout: float | None
    ) -> contextlib.AbstractContextManager[None]: ...
