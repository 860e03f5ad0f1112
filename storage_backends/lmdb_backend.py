"""Local backend: one LMDB environment per key directory.

A key ``a/b/name`` lives in the LMDB environment at ``<root>/a/b`` under the
record key ``name``; a dataset version (``<id>/<version>/...``) is therefore one
environment. Values are read zero-copy from the memory map. Environments are
opened once per process (py-lmdb refuses a second open of the same file) and
never carried across ``fork``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import lmdb

from storage_backends.base import Backend, Buffer
from storage_backends.errors import (
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
    StorageError,
)

__all__ = ["LmdbBackend"]

_DATA_FILE = "data.mdb"
_INITIAL_MAP_SIZE = 1 << 34  # address space only; the file grows as written
_LOCK_SUFFIX = ".lock"


class _Env:
    """One open environment plus the read transaction that pins its views."""

    def __init__(self, path: Path, create: bool) -> None:
        size = (path / _DATA_FILE).stat().st_size if (path / _DATA_FILE).exists() else 0
        self.path = path
        self.env = lmdb.open(
            str(path),
            map_size=max(_INITIAL_MAP_SIZE, 2 * size),
            subdir=True,
            create=create,
            readahead=False,
            max_readers=512,
            # Commits reach the OS page cache (safe if the process dies);
            # durability against an OS crash comes from the explicit syncs
            # around exclusive puts, which is how a manifest is committed.
            sync=False,
            metasync=False,
            lock=True,
        )
        self.mutex = threading.Lock()
        self.txn: Any = None  # pinned read transaction (buffers stay valid)
        self.retired: list[Any] = []  # older pinned transactions, kept alive

    def read(self, key: bytes) -> memoryview | None:
        with self.mutex:
            if self.txn is None:
                self.txn = self.env.begin(buffers=True)
            value = self.txn.get(key)
            if value is None:
                # The value may have been committed after our snapshot began.
                # Older views must stay valid, so keep the old transaction.
                self.retired.append(self.txn)
                self.txn = self.env.begin(buffers=True)
                value = self.txn.get(key)
            return value if value is None else memoryview(value)

    def write(self, key: bytes, data: bytes | memoryview, overwrite: bool) -> bool:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    done = bool(txn.put(key, data, overwrite=overwrite))
                break
            except lmdb.MapFullError:
                self._grow()
        self.refresh()
        return done

    def delete(self, key: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.delete(key)
        self.refresh()

    def refresh(self) -> None:
        """Make later reads see this process's writes; earlier views stay valid."""
        with self.mutex:
            if self.txn is not None:
                self.retired.append(self.txn)
                self.txn = None

    def _grow(self) -> None:
        with self.mutex:
            if self.txn is not None or self.retired:
                raise StorageError(
                    errno.ENOSPC,
                    f"LMDB map of {self.path} is full and cannot grow while this "
                    "process holds read views of it; close readers and retry",
                )
            self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def close(self) -> None:
        with self.mutex:
            for txn in [*self.retired, self.txn]:
                if txn is not None:
                    txn.abort()
            self.retired.clear()
            self.txn = None
            self.env.close()


# Environments of this process, by absolute path. A fork child starts empty and
# keeps the parent's objects unreferenced-but-alive: closing them would touch
# the parent's locks.
_ENVS: dict[str, _Env] = {}
_ENVS_LOCK = threading.Lock()
_INHERITED: list[_Env] = []


def _after_fork() -> None:
    _INHERITED.extend(_ENVS.values())
    _ENVS.clear()


os.register_at_fork(after_in_child=_after_fork)


def _root_from_url(url: str) -> Path:
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgumentError(f"file URL {url!r} names a remote host")
        return Path(unquote(parsed.path))
    return Path(url)


class LmdbBackend(Backend):
    """Key/bytes store in LMDB environments under a local directory."""

    schemes = ("", "file")

    def __init__(self, url: str, **options: Any) -> None:
        if options:
            raise InvalidArgumentError(f"unknown LMDB backend options: {sorted(options)}")
        super().__init__(url)
        self.root = _root_from_url(url).expanduser().resolve()

    def _split(self, key: str) -> tuple[Path, bytes]:
        directory, _, name = key.rpartition("/")
        return (self.root / directory if directory else self.root), name.encode()

    def _env(self, path: Path, create: bool) -> _Env | None:
        with _ENVS_LOCK:
            env = _ENVS.get(str(path))
            if env is not None:
                return env
            if not (path / _DATA_FILE).exists():
                if not create:
                    return None
                path.mkdir(parents=True, exist_ok=True)
            try:
                env = _Env(path, create=create)
            except lmdb.Error as err:
                raise StorageError(
                    errno.EIO, f"cannot open LMDB environment {path}: {err}"
                ) from err
            _ENVS[str(path)] = env
            return env

    def _get(self, key: str) -> Buffer:
        path, name = self._split(key)
        env = self._env(path, create=False)
        value = env.read(name) if env is not None else None
        if value is None:
            raise KeyNotFoundError(errno.ENOENT, f"no key {key!r} in {self.root}")
        return value

    def _get_range(self, key: str, start: int, length: int) -> Buffer:
        value = self._get(key)
        if start + length > len(value):
            raise InvalidArgumentError(
                f"byte range [{start}, {start + length}) is past the end of {key!r} "
                f"({len(value)} bytes)"
            )
        return value[start : start + length]

    def _put(self, key: str, data: bytes | memoryview) -> None:
        path, name = self._split(key)
        env = self._env(path, create=True)
        if env is None:  # pragma: no cover - create=True always returns an env
            raise StorageError(errno.EIO, f"cannot create {path}")
        env.write(name, data, overwrite=True)

    def _put_exclusive(self, key: str, data: bytes | memoryview) -> None:
        path, name = self._split(key)
        env = self._env(path, create=True)
        if env is None:  # pragma: no cover - create=True always returns an env
            raise StorageError(errno.EIO, f"cannot create {path}")
        # Everything written before (a dataset's chunks) is on disk before the
        # exclusive put (its manifest), and the put itself before we return.
        env.env.sync(True)
        written = env.write(name, data, overwrite=False)
        env.env.sync(True)
        if not written:
            raise KeyExistsError(errno.EEXIST, f"key {key!r} already exists in {self.root}")

    def _exists(self, key: str) -> bool:
        path, name = self._split(key)
        env = self._env(path, create=False)
        return env is not None and env.read(name) is not None

    def _size(self, key: str) -> int:
        return len(self._get(key))

    def _list(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix.rstrip("/") if prefix else self.root
        if not base.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base):
            if _DATA_FILE not in files:
                continue
            rel = Path(dirpath).relative_to(self.root).as_posix()
            env = self._env(Path(dirpath), create=False)
            if env is None:
                continue
            with env.env.begin() as txn:
                names = [bytes(k).decode() for k in txn.cursor().iternext(values=False)]
            for name in names:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    yield key

    def _delete(self, key: str) -> None:
        path, name = self._split(key)
        env = self._env(path, create=False)
        if env is not None:
            env.delete(name)

    def _delete_prefix(self, prefix: str) -> None:
        base = self.root / prefix.rstrip("/")
        with _ENVS_LOCK:
            for path in list(_ENVS):
                if path == str(base) or path.startswith(str(base) + os.sep):
                    env = _ENVS.pop(path)
                    if env.txn is None and not env.retired:
                        env.close()
                    else:
                        # Views of it may still be in use; the mapping stays
                        # valid (unlinked file) until the process exits.
                        _INHERITED.append(env)
        if base.is_dir():
            shutil.rmtree(base, ignore_errors=False)

    @contextlib.contextmanager
    def _lock(self, name: str, timeout: float | None) -> Iterator[None]:
        path = self.root / (name + _LOCK_SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            delay = 0.01
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise LockTimeoutError(
                            f"lock {path} still held by another process after {timeout}s"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.25)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the environments under this backend's root that have no live views."""
        with _ENVS_LOCK:
            for path in list(_ENVS):
                if path.startswith(str(self.root)):
                    env = _ENVS[path]
                    if env.txn is None and not env.retired:
                        _ENVS.pop(path).close()
