"""The one registry of open LMDB environments of this process, safe across ``fork``.

LMDB's rules, and py-lmdb's, that every user of an environment here follows:

* One environment per file per process: py-lmdb refuses a second open of the
  same files (identified by device and inode of the data and lock files), and
  LMDB's fcntl locks would be released by closing a second handle.
* An environment inherited across ``fork`` must never be used nor closed in
  the child: using it corrupts the reader table; closing it (or aborting a
  transaction of it) clears the parent's reader slots, which share its pid.
  A child therefore sets inherited environments aside, keeps them referenced
  until it exits, and opens its own. py-lmdb still counts the inherited files
  as open in the child, so that one open is told apart from theirs (see
  ``_open_beside_inherited``); LMDB itself is content, since the child holds
  no fcntl locks of the inherited handle.
* A path may be deleted and created again by another process: an entry is
  returned only while the file at its path is still the file it opened
  (same device and inode), so a long-lived process sees new files.

The registry also makes a new environment's lock file safe on a full disk:
LMDB maps the lock file after growing it with ``ftruncate``, and touching a
page of that mapping that the filesystem cannot back kills the process with
``SIGBUS``; the space is reserved with ``posix_fallocate`` first, so a full
disk is an ``ENOSPC`` error instead.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import threading
from collections.abc import Callable
from typing import Any

from storage_backends.errors import CorruptCacheError, StorageError

__all__ = [
    "Entry",
    "acquire",
    "disk_full_error",
    "free_bytes",
    "keys_under",
    "lookup",
    "peek",
    "release",
    "reserve_lock_file",
    "was_inherited",
]

#: Bytes reserved for a lock file: LMDB's header plus 1,000 reader slots of 64
#: bytes. LMDB sizes its reader table from an existing lock file's length.
LOCK_FILE_BYTES = 64 << 10


@dataclasses.dataclass(slots=True)
class Entry:
    """One open environment of this process.

    Attributes:
        env: the ``lmdb.Environment``.
        identity: ``(st_dev, st_ino)`` of its data file when opened.
        extra: whatever the opener attached (named databases, state).
    """

    env: Any
    identity: tuple[int, int]
    extra: Any = None


_ENTRIES: dict[str, Entry] = {}
_LOCK = threading.RLock()
# Entries of a parent process: referenced until exit, never used or closed.
_INHERITED: list[Entry] = []
_INHERITED_IDS: set[tuple[int, int]] = set()


def _after_fork() -> None:
    global _LOCK
    _LOCK = threading.RLock()  # a parent thread may have held it
    for entry in _ENTRIES.values():
        _INHERITED.append(entry)
        _INHERITED_IDS.add(entry.identity)
    _ENTRIES.clear()


os.register_at_fork(after_in_child=_after_fork)


def _identity(data_file: str) -> tuple[int, int] | None:
    try:
        st = os.stat(data_file)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def free_bytes(path: str) -> int:
    """Return the bytes available to this user on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def disk_full_error(path: str, needed: int, cause: object) -> StorageError:
    """Return the ``StorageError`` for a full disk under ``path``."""
    try:
        free = free_bytes(path)
    except OSError:
        free = -1
    have = f"{free:,} bytes free" if free >= 0 else "free space unknown"
    return StorageError(
        errno.ENOSPC,
        f"disk full writing {path}: {have}, {needed:,} bytes needed by the write that failed "
        f"({cause}); free space (for example `yogastore gc`, or delete unused versions) and "
        "retry",
    )


def reserve_lock_file(lock_file: str) -> None:
    """Allocate a lock file's blocks before LMDB maps it.

    Raises:
        StorageError: ``ENOSPC``, the disk is full.
        CorruptCacheError: the lock file is a FIFO, a device or a socket.
    """
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCacheError(
                f"LMDB lock file {lock_file} is not a regular file; delete this dataset "
                "version (`yogastore delete ID VERSION`) and build it again"
            )
        size = max(os.fstat(fd).st_size, LOCK_FILE_BYTES)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise disk_full_error(lock_file, size, err) from err
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    finally:
        os.close(fd)


def was_inherited(data_file: str) -> bool:
    """Return whether the file is open in an environment inherited across fork."""
    identity = _identity(data_file)
    return identity is not None and identity in _INHERITED_IDS


def lookup(
    key: str, data_file: str, on_stale: Callable[[Entry], None] | None = None
) -> Entry | None:
    """Return the entry of ``key`` if its data file is still the one it opened.

    An entry whose file was deleted or replaced is dropped from the registry
    and handed to ``on_stale`` (views of it may be alive: the owner decides
    when to close it).
    """
    with _LOCK:
        entry = _ENTRIES.get(key)
        if entry is None:
            return None
        if _identity(data_file) == entry.identity:
            return entry
        del _ENTRIES[key]
    if on_stale is not None:
        on_stale(entry)
    return None


def peek(key: str) -> Entry | None:
    """Return the entry of ``key`` without checking that its file is still in place.

    Lock-free (one dictionary read): for checks run before every batch.
    """
    return _ENTRIES.get(key)


def acquire(
    key: str,
    data_file: str,
    opener: Callable[[], tuple[Any, Any]],
    on_stale: Callable[[Entry], None] | None = None,
) -> Entry:
    """Return the current entry of ``key``, opening it with ``opener`` if needed.

    ``opener`` returns ``(env, extra)``; it runs under the registry lock, so
    one process opens one file once.
    """
    with _LOCK:
        entry = lookup(key, data_file, on_stale)
        if entry is not None:
            return entry
        if was_inherited(data_file):
            env, extra = _open_beside_inherited(opener)
        else:
            env, extra = opener()
        identity = _identity(data_file)
        if identity is None:  # pragma: no cover - the opener created it
            raise StorageError(errno.ENOENT, f"{data_file} vanished while being opened")
        entry = Entry(env, identity, extra)
        _ENTRIES[key] = entry
        return entry


def release(key: str, entry: Entry) -> None:
    """Forget ``entry`` (if still registered under ``key``); the caller closes it."""
    with _LOCK:
        if _ENTRIES.get(key) is entry:
            del _ENTRIES[key]


def keys_under(root: str) -> list[str]:
    """Return the registered keys equal to ``root`` or below it (paths)."""
    with _LOCK:
        return [k for k in _ENTRIES if k == root or k.startswith(root.rstrip(os.sep) + os.sep)]


def _open_beside_inherited(opener: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """Open files that an environment inherited from the parent also has open.

    py-lmdb (3.x) refuses an open whose files it already counts as open in
    this process, which after ``fork`` includes the parent's environments
    that the child must never touch. Their identities are told apart for this
    one open by the child's pid; the open is still refused if this process
    itself opened the files (the registry lock makes that impossible here).
    """
    try:
        from lmdb import _envid
    except ImportError:  # py-lmdb without the check: nothing to tell apart
        return opener()
    original = _envid.env_keys
    pid = os.getpid()

    def child_keys(path: Any, subdir: Any) -> tuple[Any, ...]:
        return tuple(("fork-child", pid, *k) for k in original(path, subdir))  # type: ignore[no-untyped-call]

    _envid.env_keys = child_keys
    try:
        return opener()
    finally:
        _envid.env_keys = original
