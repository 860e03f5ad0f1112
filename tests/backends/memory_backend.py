"""A backend in process memory, written only against the public contract.

It stands in for a third-party backend: registered by scheme, found through
an entry point, and checked with ``storage_backends.contract``.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections.abc import Iterator
from typing import Any

from storage_backends import Backend, Buffer
from storage_backends.errors import (
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
)

# url -> (values, lock names held, guard): one store per URL in this process.
_STORES: dict[str, tuple[dict[str, bytes], set[str], threading.Condition]] = {}
_STORES_GUARD = threading.Lock()


class MemoryBackend(Backend):
    """Keys and bytes in a dict shared by every backend object of one URL."""

    schemes = ("mem", "memx")
    put_copies = True

    def __init__(self, url: str, **options: Any) -> None:
        if options:
            raise InvalidArgumentError(f"unknown memory backend options: {sorted(options)}")
        super().__init__(url)
        with _STORES_GUARD:
            store = _STORES.setdefault(url, ({}, set(), threading.Condition()))
        self._values, self._held, self._cond = store

    def _get(self, key: str) -> Buffer:
        with self._cond:
            if key not in self._values:
                raise KeyNotFoundError(errno.ENOENT, f"no key {key!r} in {self.url}")
            return self._values[key]

    def _get_range(self, key: str, start: int, length: int) -> Buffer:
        value = self._get(key)
        if start + length > len(value):
            raise InvalidArgumentError(f"range past the end of {key!r}")
        return value[start : start + length]

    def _put(self, key: str, data: bytes | memoryview) -> None:
        with self._cond:
            self._values[key] = bytes(data)

    def _put_exclusive(self, key: str, data: bytes | memoryview) -> None:
        with self._cond:
            if key in self._values:
                raise KeyExistsError(errno.EEXIST, f"key {key!r} exists in {self.url}")
            self._values[key] = bytes(data)

    def _exists(self, key: str) -> bool:
        with self._cond:
            return key in self._values

    def _size(self, key: str) -> int:
        return len(self._get(key))

    def _list(self, prefix: str) -> list[str]:
        with self._cond:
            return [k for k in self._values if k.startswith(prefix)]

    def _delete(self, key: str) -> None:
        with self._cond:
            self._values.pop(key, None)

    @contextlib.contextmanager
    def _lock(self, name: str, timeout: float | None) -> Iterator[None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while name in self._held:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise LockTimeoutError(f"lock {name!r} in {self.url} still held")
                self._cond.wait(left)
            self._held.add(name)
        try:
            yield
        finally:
            with self._cond:
                self._held.discard(name)
                self._cond.notify_all()
