"""Local backend: one LMDB environment per key directory.

A key ``a/b/name`` lives in the LMDB environment at ``<root>/a/b`` under the
record key ``name``; a dataset version (``<id>/<version>/...``) is therefore one
environment. Values are read zero-copy from the memory map.

Rules this module keeps (the registry, ``storage_backends.lmdb_env``, keeps
the per-process and fork ones):

* Every read sees what other processes committed: a read runs in a snapshot
  no older than the environment's last commit, and an environment whose file
  was deleted or replaced by another process is set aside and the new file
  opened.
* A buffer returned by ``get`` pins the read transaction it came from (and
  only that): the transaction ends when the last view of its buffers is
  gone, so reader slots never leak however often a missing key is polled.
* Values are found by this module's own reader of the committed tree
  (``storage_backends.lmdb_pages``: branch and leaf pages only, every field
  bounds-checked) and read from a map of the file made here, so a read touches
  the pages it reads and no more, and LMDB does not walk the tree. Only when
  that reader declines a file, or a listing asks LMDB to walk it, is the file's
  structure checked first (``lmdb.verify``, a reader that never maps the file,
  but visits every page), under LMDB's writer lock, so a damaged page is a
  ``CorruptCacheError`` naming the file instead of a ``SIGBUS`` inside LMDB.
* LMDB never shrinks a data file, so a file smaller than this process last saw
  it was truncated by an outside fault: every read, and ``check_mapped``
  before each batch gathered from views of it, compares the open file's size
  (one ``fstat``) and raises ``CorruptCacheError`` instead of touching pages
  that are gone (``SIGBUS``). A truncation between that check and the copy
  faults inside yogastore's compiled copies and hashes, which catch it in their
  thread (``MappedFault``); the reader then names the file.
* The same holds for LMDB's lock file (its reader table, mapped by every
  reader): a lock file smaller than at open is grown back (so that LMDB may end
  its transactions) and reported as ``CorruptCacheError`` naming it.
* A data file deleted or replaced by another process (``delete``, a rebuild)
  reads as missing keys, never as damage; a data file or version directory
  that is not a regular file (a FIFO, a device) is ``CorruptCacheError`` at
  open, before anything could block on it.
* ``list`` skips (with a warning) an environment that cannot be opened or is
  damaged, so one bad version never hides the others; ``delete_prefix``
  removes files without opening them, retrying while a reader in another
  process briefly recreates a lock file in the directory being removed.
* A full disk is a ``StorageError`` (``ENOSPC``) saying how much space is
  missing; other LMDB failures are ``StorageError`` or ``CorruptCacheError``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import lmdb
import lmdb.verify
import numpy as np

from storage_backends import lmdb_env, lmdb_pages
from storage_backends.base import Backend, Buffer
from storage_backends.errors import (
    CorruptCacheError,
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
    StorageError,
    UnsupportedElementError,
    YogaStoreError,
)
from storage_backends.lmdb_env_files import DATA_FILE, check_files, open_data_file, remove_tree
from storage_backends.lmdb_pages import Located

__all__ = ["LmdbBackend", "translate_error"]

logger = logging.getLogger(__name__)

_DATA_FILE = DATA_FILE
_LOCK_FILE = "lock.mdb"
_INITIAL_MAP_SIZE = 1 << 34  # address space only; the file grows as written
_OPEN_ATTEMPTS = 3  # a version opened for reading while another process rebuilds it
_REOPEN_PAUSE = 0.02
_LOCK_SUFFIX = ".lock"
_DIRS_KEPT = 1024  # key directories whose paths a backend keeps made
_RESIDENT = 0.9  # a value this much in the page cache is read without advice
_WRITE_MARGIN = 1 << 20  # bytes beyond a value a commit may need (pages, metas)
_WRITEBACK_BYTES = 32 << 20  # committed bytes after which writing them to disk starts
# LMDB failures that mean the file itself is damaged.
_CORRUPT = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.PanicError,
    lmdb.VersionMismatchError,  # a flipped version field as often as another LMDB
)


def translate_error(
    err: lmdb.Error, path: Path, what: str, needed: int = 0
) -> StorageError | CorruptCacheError:
    """Return the library error for an LMDB failure on the environment at ``path``.

    A write failing while the filesystem lacks ``needed`` bytes (plus a
    margin) is a full disk, whatever code LMDB reported.
    """
    if isinstance(err, _CORRUPT):
        return _corrupt(path, str(err))
    if needed:
        try:
            full = lmdb_env.free_bytes(str(path)) < needed + _WRITE_MARGIN
        except OSError:
            full = False
        if full or "No space" in str(err):
            return lmdb_env.disk_full_error(str(path), needed + _WRITE_MARGIN, err)
    return StorageError(errno.EIO, f"LMDB {what} failed on {path}: {err}")


def _corrupt(path: Path, detail: str) -> CorruptCacheError:
    return CorruptCacheError(
        f"LMDB file {path / _DATA_FILE} is damaged ({detail}); delete this dataset "
        "version (`yogastore delete ID VERSION`) and build it again"
    )


class _Snapshot:
    """One read transaction, alive while this object or any view it pinned is."""

    __slots__ = ("__weakref__", "spots", "txn", "txnid", "walked")

    def __init__(self, txn: Any) -> None:
        self.txn = txn
        self.txnid = int(txn.id())
        # Where each value is in the file (``None``: not a file lmdb_pages reads).
        self.spots: dict[bytes, Located] | None = None
        self.walked = False

    def located(self, fd: int) -> dict[bytes, Located] | None:
        """Where each value of this commit is (read once), or ``None``: ask LMDB."""
        if not self.walked:
            self.spots = lmdb_pages.locate_values(fd, self.txnid)
            self.walked = True
        return self.spots

    def pin(self, value: Any) -> memoryview:
        """Return a read-only view of ``value`` that keeps this transaction alive."""
        n = len(value)
        if n == 0:
            return memoryview(b"")
        address = np.frombuffer(value, dtype=np.uint8).ctypes.data
        holder = (ctypes.c_ubyte * n).from_address(address)
        holder._snapshot = self  # type: ignore[attr-defined]
        return memoryview(holder).cast("B").toreadonly()

    def pin_range(self, mapped: lmdb_pages.Mapping, offset: int, size: int) -> memoryview:
        """Return a read-only view of ``mapped``'s ``[offset, offset + size)`` keeping this alive.

        No page of the range is touched here: the reader pages in what it reads.
        """
        if size == 0:
            return memoryview(b"")
        address = mapped.address + offset
        holder = (ctypes.c_ubyte * size).from_address(address)
        holder._snapshot = self  # type: ignore[attr-defined]
        holder._map = mapped  # type: ignore[attr-defined]
        return memoryview(holder).cast("B").toreadonly()


_ABSENT = memoryview(b"absent")  # the tree holds no such key (identity-compared)


class _Vanished(Exception):
    """The environment's data file was deleted or replaced by another process."""


def _proc_fd_path(fd: int) -> str | None:
    """Return a path that opens exactly the file behind ``fd``, where the OS has one."""
    path = f"/proc/self/fd/{fd}"
    return path if os.path.exists(path) else None


class _Env:
    """One open environment: fresh, verified snapshots and translated errors."""

    def __init__(self, path: Path, env: Any, fd: int) -> None:
        self.path = path
        self.env = env
        self.fd = fd  # the data file LMDB mapped, for fstat (size, deletion)
        self.mutex = threading.Lock()
        self.snapshot: _Snapshot | None = None
        self.live: weakref.WeakSet[_Snapshot] = weakref.WeakSet()
        self.verified = -1  # last transaction id whose file structure was checked
        # The data file mapped by this module (read-only, random access) for large
        # values, which LMDB would page in whole when it hands them out.
        self.mapped: lmdb_pages.Mapping | None = None
        self.maps = 0  # mappings made; after the first, views may lie in older ones
        self.cached: dict[bytes, bool] = {}  # values found in the page cache when first announced
        self.write_checked = False  # structure checked before this process's first write
        self.unsynced = 0  # bytes committed since writeback was last started
        self.seen = os.fstat(fd).st_size  # LMDB never shrinks it: a smaller file is damage
        # The lock file LMDB mapped (its reader table): cut short, LMDB's next touch of
        # it (a read, or ending a read transaction) would be a SIGBUS, so its size is
        # checked with the data file's.
        try:
            self.lock_fd: int | None = os.open(path / _LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
            self.lock_seen = os.fstat(self.lock_fd).st_size
        except OSError:  # pragma: no cover - LMDB just opened it
            self.lock_fd, self.lock_seen = None, 0

    # Reading ------------------------------------------------------------------

    def check_size(self) -> None:
        """Raise unless the data file is at least as large as last seen (``mutex`` held).

        Raises:
            _Vanished: the file was deleted (or replaced) meanwhile.
            CorruptCacheError: the file shrank: touching its mapped pages
                would kill the process with ``SIGBUS``.
        """
        st = os.fstat(self.fd)
        if st.st_nlink == 0:
            raise _Vanished
        if st.st_size < self.seen:
            self.snapshot = None
            raise _corrupt(
                self.path,
                f"the file shrank from {self.seen:,} to {st.st_size:,} bytes while this "
                "process had it open (truncated by something other than LMDB)",
            )
        self.seen = st.st_size
        if self.lock_fd is not None:
            self._check_lock_file(self.lock_fd)

    def _check_lock_file(self, fd: int) -> None:
        """Raise ``CorruptCacheError`` if the lock file shrank (``mutex`` held).

        It is grown back first, so that LMDB may end its transactions (they write
        to their reader slots) without a SIGBUS.
        """
        size = os.fstat(fd).st_size
        if size >= self.lock_seen:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, self.lock_seen)  # zeros: the reader table is lost, not the data
        raise CorruptCacheError(
            f"LMDB lock file {self.path / _LOCK_FILE} shrank from {self.lock_seen:,} to "
            f"{size:,} bytes while this process had it open (truncated by something other "
            "than LMDB); the data is not affected: end every process using this store and "
            "open it again, which rebuilds the lock file"
        )

    def _current(self) -> _Snapshot:
        """Return a snapshot of the last commit (call with ``mutex`` held)."""
        self.check_size()  # before LMDB reads its meta pages from the map
        snap = self.snapshot
        last = int(self.env.info()["last_txnid"])
        if snap is not None and snap.txnid == last:
            return snap
        self.snapshot = None  # the old one lives on only through its views
        try:
            txn = self.env.begin(buffers=True)
        except lmdb.MapResizedError:
            if self.live:
                raise StorageError(
                    errno.EBUSY,
                    f"{self.path} grew past this process's map while views of it are in "
                    "use; drop them (close streams) and retry",
                ) from None
            self.env.set_mapsize(0)
            txn = self.env.begin(buffers=True)
        snap = _Snapshot(txn)
        self.snapshot = snap
        self.live.add(snap)
        return snap

    def _trusted(self, snap: _Snapshot) -> _Snapshot:
        """Return ``snap`` once LMDB may walk its file: its structure checked for this commit."""
        if snap.txnid != self.verified:
            self._verify()
            self.verified = snap.txnid
        return snap

    def _verify(self) -> None:
        """Check the file's structure without mapping it; raise if damaged.

        Runs under LMDB's writer lock where it can, so no commit changes the
        file meanwhile; a read-only store is checked without it, and a
        finding is trusted only if no commit happened during the check. The
        file checked is the one this environment mapped (through its open
        descriptor), even if another process deleted or replaced the path.
        """
        target = _proc_fd_path(self.fd) or str(self.path / _DATA_FILE)
        for _ in range(3):
            locked = None
            with contextlib.suppress(lmdb.Error):
                locked = self.env.begin(write=True)
            before = int(self.env.info()["last_txnid"])
            try:
                size = os.fstat(self.fd).st_size
                problems = lmdb.verify.verify(target, subdir=False)  # type: ignore[no-untyped-call]
            except (lmdb.verify.VerifyError, OSError) as err:
                problems = [str(err)]
            finally:
                if locked is not None:
                    locked.abort()
            if not problems:
                self.seen = max(self.seen, size)
                return
            self.check_size()  # a deleted file is not a damaged one
            if locked is not None or int(self.env.info()["last_txnid"]) == before:
                raise _corrupt(self.path, "; ".join(problems[:3]))
        raise _corrupt(self.path, "; ".join(problems[:3]))

    def _located(self, snap: _Snapshot, key: bytes) -> memoryview | None:
        """A view of ``key``'s value mapped here, untouched; ``None``: ask LMDB.

        Raises:
            CorruptCacheError: the value runs past the end of the file, or its
                first page is not the overflow page the tree points at; LMDB
                would read missing pages (``SIGBUS``) or wrong ones.
        """
        spots = snap.located(self.fd)
        if spots is None:  # not a file this module reads: LMDB, once checked
            return None
        spot = spots.get(key)
        if spot is None:
            return _ABSENT
        end = spot.offset + spot.size
        if self.mapped is None or self.mapped.size < end:
            self.check_size()  # shrank under this process
            size = os.fstat(self.fd).st_size
            if size < end:
                raise _corrupt(
                    self.path,
                    f"value {key.decode(errors='replace')!r} ends at byte {end:,}, past the "
                    f"end of the {size:,}-byte file (truncated)",
                )
            self.mapped = lmdb_pages.Mapping(self.fd, size)  # older maps live on through views
            self.maps += 1
        if not lmdb_pages.overflow_header_ok(self.fd, spot):
            self.check_size()
            raise _corrupt(
                self.path,
                f"value {key.decode(errors='replace')!r}: page {spot.pgno} is not the "
                "overflow page its tree points at",
            )
        return snap.pin_range(self.mapped, spot.offset, spot.size)

    def read(self, key: bytes) -> memoryview | None:
        with self.mutex:
            try:
                snap = self._current()
                view = self._located(snap, key)
                if view is _ABSENT:
                    return None
                if view is not None:
                    return view
                value = self._trusted(snap).txn.get(key)
            except _Vanished:
                return None
            except lmdb.Error as err:
                raise translate_error(err, self.path, "read") from err
            return None if value is None else snap.pin(value)

    def names(self) -> list[str]:
        with self.mutex:
            try:
                snap = self._current()
                spots = snap.located(self.fd)
                if spots is not None:  # in LMDB's order
                    return [self._key_text(k) for k in sorted(spots)]
                cursor = self._trusted(snap).txn.cursor()
                return [self._key_text(bytes(k)) for k in cursor.iternext(values=False)]
            except _Vanished:
                return []
            except lmdb.Error as err:
                raise translate_error(err, self.path, "listing") from err

    def will_read(self, key: bytes, starts: Sequence[int], ends: Sequence[int]) -> bool:
        """Start reading these ranges of a located value from the file (advice only).

        Returns ``False`` once the value is known to be (nearly) all in the
        page cache: a data set that fits in memory needs no advice.
        """
        snap = self.snapshot
        spot = snap.spots.get(key) if snap is not None and snap.spots else None
        mapped = self.mapped
        if spot is None or mapped is None:
            return True  # not read yet (a listing locates values, but reads none)
        if spot.offset + spot.size <= mapped.size:
            # Once per value: one in the page cache when first announced needs no
            # advice (the data fits in memory); one that is not keeps getting it.
            cached = self.cached.get(key)
            if cached is None:
                cached = self.cached[key] = mapped.resident(spot.offset, spot.size) >= _RESIDENT
            if cached:
                return False
        with contextlib.suppress(OSError, OverflowError):  # a damaged tree: read, then caught
            for lo, hi in zip(starts, ends, strict=True):
                if 0 <= lo < hi <= spot.size:
                    os.posix_fadvise(self.fd, spot.offset + lo, hi - lo, os.POSIX_FADV_WILLNEED)
        return True

    def _key_text(self, key: bytes) -> str:
        """A key as text; this library writes UTF-8 keys only, anything else is damage."""
        try:
            return key.decode()
        except UnicodeDecodeError:
            raise _corrupt(self.path, f"key {key!r} is not UTF-8") from None

    def file_guard(self) -> tuple[str, int, int, int]:
        """Return the data file's path, device, inode and the size it must keep (``seen``)."""
        st = os.fstat(self.fd)
        return str(self.path / _DATA_FILE), st.st_dev, st.st_ino, self.seen

    def mapped_span(self) -> tuple[int, int] | None:
        """Return (address, size) of the one mapping every view lies in, or ``None``."""
        mapped = self.mapped
        if mapped is None or self.maps != 1:
            return None
        return mapped.address, mapped.size

    def check_mapped(self) -> None:
        """Raise ``CorruptCacheError`` if views of this file could no longer be read."""
        st = os.fstat(self.fd)  # lock-free: ``seen`` only grows
        if st.st_nlink and st.st_size < self.seen:
            with self.mutex:
                self.check_size()
        # An unlinked file keeps its pages: views of it stay readable.

    # Writing ------------------------------------------------------------------

    def _writable(self) -> None:
        """Refuse to write into a file that shrank, vanished or is damaged.

        A write lets LMDB walk the tree, which reads never do: the first write of
        this process into a file it did not create checks the file's structure
        (once; later commits come from this library).
        """
        with self.mutex:
            try:
                self.check_size()
                if not self.write_checked:
                    if int(self.env.info()["last_txnid"]) > 0:
                        self._trusted(self._current())
                    self.write_checked = True
            except _Vanished:
                raise StorageError(
                    errno.ENOENT,
                    f"{self.path / _DATA_FILE} was deleted by another process while open here",
                ) from None

    def write(self, key: bytes, data: bytes | memoryview, overwrite: bool) -> bool:
        self._writable()
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    written = bool(txn.put(key, data, overwrite=overwrite))
                self._written(len(data))
                return written
            except lmdb.MapFullError:
                self._grow()
            except lmdb.Error as err:
                raise translate_error(err, self.path, "write", needed=len(data)) from err

    def _written(self, nbytes: int) -> None:
        # Commits do not sync (the manifest's put does): start the disk on what was
        # written every _WRITEBACK_BYTES, so the final sync finds little left to do.
        self.unsynced += nbytes
        if self.unsynced >= _WRITEBACK_BYTES:
            self.unsynced = 0
            lmdb_pages.start_writeback(self.fd)

    def delete(self, key: bytes) -> None:
        self._writable()
        try:
            with self.env.begin(write=True) as txn:
                txn.delete(key)
        except lmdb.Error as err:
            raise translate_error(err, self.path, "delete", needed=1) from err

    def sync(self) -> None:
        try:
            self.env.sync(True)
        except lmdb.Error as err:
            raise translate_error(err, self.path, "sync", needed=1) from err

    def _grow(self) -> None:
        with self.mutex:
            self.snapshot = None
            if self.live:
                raise StorageError(
                    errno.ENOSPC,
                    f"LMDB map of {self.path} is full and cannot grow while this "
                    "process holds read views of it; close readers and retry",
                )
            self.env.set_mapsize(self.env.info()["map_size"] * 2)

    @property
    def in_use(self) -> bool:
        """Whether buffers read from this environment may still be alive."""
        with self.mutex:
            self.snapshot = None
            return bool(self.live)

    def close(self) -> None:
        with self.mutex:
            self.snapshot = None
            self.mapped = None  # unmapped when its last view is gone
            self.env.close()
            with contextlib.suppress(OSError):
                os.close(self.fd)
            if self.lock_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self.lock_fd)


# Environments set aside while views of them may be alive (file deleted or
# replaced by another process, or deleted here); closed when no longer in use.
_SET_ASIDE: list[_Env] = []
_SET_ASIDE_LOCK = threading.Lock()
_PARENTS: list[_Env] = []  # set aside by a parent process: never used or closed here


def _set_aside(env: _Env) -> None:
    with _SET_ASIDE_LOCK:
        _SET_ASIDE.append(env)
        keep = []
        for old in _SET_ASIDE:
            if old.in_use:
                keep.append(old)
            else:
                old.close()
        _SET_ASIDE[:] = keep


def _stale(entry: lmdb_env.Entry) -> None:
    _set_aside(entry.extra)


def _after_fork() -> None:
    global _SET_ASIDE_LOCK
    _SET_ASIDE_LOCK = threading.Lock()
    _PARENTS.extend(_SET_ASIDE)
    _SET_ASIDE.clear()


os.register_at_fork(after_in_child=_after_fork)


def _root_from_url(url: str) -> Path:
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgumentError(f"file URL {url!r} names a remote host")
        return Path(unquote(parsed.path))
    return Path(url)


def _open(path: Path, create: bool) -> tuple[Any, _Env]:
    data = path / _DATA_FILE
    size = check_files(path)
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        lmdb_env.reserve_lock_file(str(path / _LOCK_FILE))
        if not data.exists():
            # LMDB writes two meta pages into a new file.
            needed = 2 * (os.sysconf("SC_PAGE_SIZE") or 4096)
            if lmdb_env.free_bytes(str(path)) < needed:
                raise lmdb_env.disk_full_error(str(path), needed, "creating the data file")
    except OSError as err:
        if isinstance(err, StorageError):
            raise
        if err.errno == errno.ENOSPC:
            raise lmdb_env.disk_full_error(str(path), 1, err) from err
        raise StorageError(err.errno, f"cannot prepare LMDB environment {path}: {err}") from err
    try:
        env = lmdb.open(
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
    except lmdb.Error as err:
        raise translate_error(err, path, "open", needed=1 if create else 0) from err
    try:
        fd = open_data_file(path)
    except BaseException as err:
        env.close()
        if isinstance(err, OSError) and not isinstance(err, YogaStoreError):
            raise StorageError(err.errno, f"cannot open {data}: {err}") from err
        raise
    wrapped = _Env(path, env, fd)
    return env, wrapped


class LmdbBackend(Backend):
    """Key/bytes store in LMDB environments under a local directory."""

    schemes = ("", "file")
    put_copies = True
    #: LMDB stores a value of at most this many bytes (``MDB_MAXDATASIZE``).
    max_value_bytes = 0xFFFFFFFF

    def __init__(self, url: str, **options: Any) -> None:
        if options:
            raise InvalidArgumentError(f"unknown LMDB backend options: {sorted(options)}")
        super().__init__(url)
        if not str(url).strip():
            raise InvalidArgumentError("the store path is empty; pass a directory")
        self.root = _root_from_url(url).expanduser().resolve()
        self._root = str(self.root)
        # Directory part of a key -> its path (every read of a version's chunk splits its key).
        self._dirs: dict[str, Path] = {}
        if self.root.exists() and not self.root.is_dir():
            raise InvalidArgumentError(
                f"store path {self.root} is not a directory; pass a directory (it is "
                "created on the first build)"
            )

    def _split(self, key: str) -> tuple[Path, bytes]:
        directory, _, name = key.rpartition("/")
        path = self._dirs.get(directory)
        if path is None:
            if len(self._dirs) >= _DIRS_KEPT:
                self._dirs.clear()
            path = self._dirs[directory] = self.root / directory if directory else self.root
        return path, name.encode()

    def _env(self, path: Path, create: bool) -> _Env | None:
        data = os.path.join(path, _DATA_FILE)
        entry = lmdb_env.lookup(str(path), data, _stale)
        if entry is not None:
            env: _Env = entry.extra
            return env
        if not create and not os.path.exists(data):
            check_files(path)  # a version "directory" that is a file is damage
            return None
        attempt = 0
        while True:
            try:
                entry = lmdb_env.acquire(str(path), data, lambda: _open(path, create), _stale)
            except (StorageError, CorruptCacheError):
                if not create and not os.path.exists(data):
                    return None  # deleted by another process while being opened: missing
                if create or attempt == _OPEN_ATTEMPTS - 1:
                    raise
                # Deleted and created again (a rebuild) while this process opened
                # it: what failed may be the old file's removal or the new one's
                # first pages. Open what is there now.
                attempt += 1
                time.sleep(_REOPEN_PAUSE * attempt)
                continue
            opened: _Env = entry.extra
            return opened

    def _check_mapped(self, key: str) -> None:
        # One fstat of the environment's data file, if this process has it open
        # (no path resolution: this runs before every batch gathered).
        directory = key.rpartition("/")[0]
        entry = lmdb_env.peek(os.path.join(self._root, directory) if directory else self._root)
        if entry is not None:
            entry.extra.check_mapped()

    def mapped_file(self, key: str) -> tuple[str, int, int, int] | None:
        entry = self._peek(key)
        return None if entry is None else entry.extra.file_guard()

    def mapped_span(self, key: str) -> tuple[int, int] | None:
        entry = self._peek(key)
        return None if entry is None else entry.extra.mapped_span()

    def _peek(self, key: str) -> Any:
        directory = key.rpartition("/")[0]
        return lmdb_env.peek(os.path.join(self._root, directory) if directory else self._root)

    def _will_read(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> bool:
        directory, _, name = key.rpartition("/")
        entry = lmdb_env.peek(os.path.join(self._root, directory) if directory else self._root)
        return entry is None or bool(entry.extra.will_read(name.encode(), starts, ends))

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

    def _writable(self, key: str) -> tuple[_Env, bytes]:
        path, name = self._split(key)
        env = self._env(path, create=True)
        if env is None:  # pragma: no cover - create=True always returns an env
            raise StorageError(errno.EIO, f"cannot create {path}")
        return env, name

    def _put(self, key: str, data: bytes | memoryview) -> None:
        if len(data) > self.max_value_bytes:  # LMDB's own error names no size or remedy
            raise UnsupportedElementError(
                f"{key!r}: a value of {len(data):,} bytes is over LMDB's limit of "
                f"{self.max_value_bytes:,} bytes per value; a local store keeps each chunk "
                "as one value, so a chunk (chunk_bytes) and a record must stay under 4 GiB"
            )
        env, name = self._writable(key)
        env.write(name, data, overwrite=True)

    def _put_exclusive(self, key: str, data: bytes | memoryview) -> None:
        env, name = self._writable(key)
        # Everything written before (a dataset's chunks) is on disk before the
        # exclusive put (its manifest), and the put itself before we return.
        env.sync()
        written = env.write(name, data, overwrite=False)
        env.sync()
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
            try:
                env = self._env(Path(dirpath), create=False)
                names = env.names() if env is not None else []
            except (CorruptCacheError, StorageError) as err:
                # One damaged (or unreadable) environment must not hide the
                # others; ``delete_prefix`` removes it without opening it.
                logger.warning("skipping %s: %s", dirpath, err)
                continue
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
        for dirpath, _dirs, files in os.walk(base) if base.is_dir() else ():
            if _DATA_FILE in files:
                entry = lmdb_env.lookup(dirpath, os.path.join(dirpath, _DATA_FILE), _stale)
                if entry is not None:
                    lmdb_env.release(dirpath, entry)
                    _set_aside(entry.extra)  # closed once no view of it is alive
        remove_tree(base)

    def _disk_usage(self, prefix: str) -> int:
        base = self.root / prefix.rstrip("/") if prefix else self.root
        total = 0
        if prefix and not base.is_dir():  # a version that is a stray file
            with contextlib.suppress(OSError):
                total += os.lstat(base).st_blocks * 512
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
        return total

    @contextlib.contextmanager
    def _lock(self, name: str, timeout: float | None) -> Iterator[None]:
        path = self.root / (name + _LOCK_SUFFIX)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
            except FileNotFoundError:
                continue  # its folder was removed (empty) by a delete or gc meanwhile
            except OSError as err:
                raise StorageError(err.errno, f"cannot open lock file {path}: {err}") from err
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if deadline is not None and time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"lock {path} still held by another process after {timeout}s"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
                continue
            # A holder may have deleted the lock file (``delete_lock``) while we
            # waited: a lock on the unlinked file excludes nobody, so go again.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _delete_lock(self, name: str) -> None:
        path = self.root / (name + _LOCK_SUFFIX)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        # The dataset's folder goes with its last version (never the root).
        parent = path.parent
        if parent != self.root and self.root in parent.parents:
            with contextlib.suppress(OSError):
                parent.rmdir()

    def close(self) -> None:
        """Close the environments under this backend's root that have no live views."""
        for path in lmdb_env.keys_under(str(self.root)):
            entry = lmdb_env.lookup(path, os.path.join(path, _DATA_FILE), _stale)
            if entry is not None and not entry.extra.in_use:
                lmdb_env.release(path, entry)
                entry.extra.close()
