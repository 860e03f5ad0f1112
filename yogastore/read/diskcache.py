"""A disk cache of chunk byte ranges, shared by the processes of one machine.

One LMDB file (``remote-cache.mdb``) holds ranges keyed by (chunk id, start,
end), each with an xxh3 digest of key and value checked on every read, so a
value stored under the wrong key is caught like a damaged one; an entry whose
value length differs from ``end - start`` is refused before the digest is
even looked at. Entries are evicted least recently used first once their total
passes a size limit. LMDB's own locking makes the file safe for several
processes; each process opens it once (py-lmdb refuses a second open) and
never uses it across ``fork``.

A process forked from one that had the file open cannot use it: the
inherited environment must not be used, py-lmdb refuses to open the file
again while it is open, and closing it in the child would clear the parent's
reader slots in the shared lock table. Opening or using a cache there raises
``StorageError`` saying so; processes started with ``spawn`` or
``forkserver`` share the cache normally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb
import lmdb.verify
import xxhash

from storage_backends import lmdb_env
from storage_backends.errors import StorageError
from yogastore.format.manifest import ChunkInfo

__all__ = ["CACHE_FILE", "DiskCache", "Piece"]

logger = logging.getLogger(__name__)

Range = tuple[int, int]  # [start, end) byte offsets within one chunk

CACHE_FILE = "remote-cache.mdb"
_ENTRY = struct.Struct(">16sQQ")  # chunk id, start, end
_META = struct.Struct("<QQQ")  # charged bytes, last use (ns), xxh3_64 of the value
_TICK = struct.Struct(">Q")
_TOTAL_KEY = b"total"
_ENTRY_OVERHEAD = 160  # LMDB bytes per entry beyond its value, roughly
_MIB = 1 << 20

# The databases are opened once, with the environment (kept as the registry
# entry's ``extra``): ``open_db`` without a transaction waits for LMDB's writer
# lock without letting other threads run, so it deadlocks against a thread in
# a write. Environments are held in the one registry of this process
# (``storage_backends.lmdb_env``), which sets aside those inherited across fork.


def _forked_error(path: str) -> StorageError:
    return StorageError(
        errno.EBUSY,
        f"read cache {path} was open when this process was forked from its parent: LMDB "
        "must not be used across fork and cannot be opened again in this process; start "
        "worker processes with the 'spawn' or 'forkserver' method to share the cache",
    )


def _damage(key: str) -> list[str]:
    """Return what is wrong with the structure of the cache file (read without mapping it)."""
    try:
        return list(lmdb.verify.verify(key, subdir=False))  # type: ignore[no-untyped-call]
    except (lmdb.verify.VerifyError, OSError) as err:
        return [str(err)]


def _discard_if_damaged(key: str) -> None:
    """Replace a damaged cache file by an empty one before LMDB maps it.

    Mapping a file with damaged pages can crash the process (a page pointer
    past the map, a corrupted free list); the cache only holds copies of
    verified bytes, so a damaged one is dropped. A finding is trusted only
    if it is still there a moment later (another process may be committing).
    """
    if not os.path.exists(key) or not _damage(key):
        return
    time.sleep(0.2)
    problems = _damage(key)
    if not problems:
        return
    logger.warning("read cache %s is damaged (%s); starting an empty one", key, problems[0])
    for path in (key, key + "-lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _open_env(key: str, limit: int) -> tuple[Any, Any]:
    _discard_if_damaged(key)
    lmdb_env.reserve_lock_file(key + "-lock")
    env = lmdb.open(
        key,
        subdir=False,
        map_size=2 * limit + 64 * _MIB,
        max_dbs=4,
        readahead=False,
        sync=False,
        metasync=False,
        max_readers=1024,
        lock=True,
    )
    with env.begin(write=True) as txn:
        dbs = tuple(env.open_db(n, txn=txn) for n in (b"data", b"meta", b"lru"))
    return env, dbs


@dataclasses.dataclass(slots=True)
class Piece:
    """Cached bytes ``[start, end)`` of one chunk.

    Attributes:
        start: offset of the first byte within the chunk.
        end: offset one past the last byte; ``len(data) == end - start``.
        data: the bytes.
    """

    start: int
    end: int
    data: bytes


def _digest(key: bytes, value: bytes | memoryview) -> int:
    """Return the digest stored with an entry: xxh3_64 of its key, then its value."""
    hasher = xxhash.xxh3_64(key)
    hasher.update(value)
    return int(hasher.intdigest())


def _meta(raw: bytes | memoryview | None) -> tuple[int, int, int] | None:
    """Unpack an entry's (charged bytes, last use, digest), or None if absent or malformed."""
    if raw is None or len(raw) != _META.size:
        return None
    charged, tick, digest = _META.unpack(bytes(raw))
    return int(charged), int(tick), int(digest)


class DiskCache:
    """Byte ranges of chunks in one LMDB file, evicted least recently used first.

    Entries are keyed by (chunk id, start, end). Several processes may share
    the file (LMDB's own locking); each process opens it once. The file is
    written without fsync: it is a cache, and a torn entry fails its digest.

    Args:
        directory: where ``remote-cache.mdb`` lives (created if missing).
        limit: bytes of entries kept (values plus a per-entry overhead).

    Raises:
        StorageError: the file was open in the parent of this forked process
            (also raised by any use of a cache object inherited across fork).
    """

    def __init__(self, directory: Path, limit: int) -> None:
        self.path = directory / CACHE_FILE
        self.limit = limit
        directory.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        self._pid = os.getpid()
        # A child of a process that had the file open keeps refusing it: its
        # users (the remote source) read around the cache there.
        if lmdb_env.was_inherited(key):
            raise _forked_error(key)
        entry = lmdb_env.acquire(key, key, lambda: _open_env(key, limit))
        opened = (entry.env, *entry.extra)
        self._env: Any = opened[0]
        self.data_db: Any = opened[1]
        self.meta_db: Any = opened[2]
        self.lru_db: Any = opened[3]

    @property
    def env(self) -> Any:
        """The LMDB environment (only in the process that opened it)."""
        if self._pid != os.getpid():
            raise _forked_error(str(self.path))
        return self._env

    @staticmethod
    def chunk_id(url: str, info: ChunkInfo) -> bytes:
        """Return the 16-byte id of a chunk: its store, key and checksum."""
        return xxhash.xxh3_128_digest(f"{url}\0{info.key}\0{info.checksum}".encode())

    def read(self, cid: bytes, ranges: Sequence[Range]) -> tuple[list[list[Piece]], list[bytes]]:
        """Return, per range, the cached pieces overlapping it, and the keys read.

        Entries that fail their checks (key and value lengths, digest of key
        and value) are deleted and not returned.
        """
        out: list[list[Piece]] = []
        used: list[bytes] = []
        bad: list[bytes] = []
        with self.env.begin(buffers=True) as txn:
            cur = txn.cursor(db=self.data_db)
            for a, b in ranges:
                pieces: list[Piece] = []
                found = cur.set_range(_ENTRY.pack(cid, a, 0))
                # Step back to an entry starting before ``a`` that may cover it.
                if found:
                    if cur.prev() and bytes(cur.key()[:16]) == cid:
                        pass
                    else:
                        cur.set_range(_ENTRY.pack(cid, a, 0))
                elif not (cur.last() and bytes(cur.key()[:16]) == cid):
                    out.append(pieces)
                    continue
                ok = True
                while ok:
                    key = bytes(cur.key())
                    if key[:16] != cid:
                        break
                    if len(key) != _ENTRY.size:
                        bad.append(key)
                        ok = cur.next()
                        continue
                    _, start, end = _ENTRY.unpack(key)
                    if start >= b:
                        break
                    if end > a:
                        raw = cur.value()
                        meta = _meta(txn.get(key, db=self.meta_db))
                        if (
                            meta is not None
                            and start < end
                            and len(raw) == end - start
                            and _digest(key, raw) == meta[2]
                        ):
                            pieces.append(Piece(start, end, bytes(raw)))
                            used.append(key)
                        else:
                            bad.append(key)
                    ok = cur.next()
                out.append(pieces)
        if bad:
            logger.warning(
                "dropping %d damaged entries from the read cache %s", len(bad), self.path
            )
            self.update([], [], bad)
        return out, used

    def update(
        self,
        touched: Sequence[bytes],
        inserts: Sequence[tuple[bytes, int, bytes]],
        drop: Sequence[bytes] = (),
    ) -> None:
        """In one transaction: mark entries used, add entries, drop entries, evict."""
        now = time.time_ns()
        with self.env.begin(write=True) as txn:
            total = self._total(txn)
            for key in drop:
                total -= self._remove(txn, key)
            for key in touched:
                meta = _meta(txn.get(key, db=self.meta_db))
                if meta is None:
                    continue
                charged, tick, digest = meta
                txn.delete(_TICK.pack(tick) + key, db=self.lru_db)
                txn.put(key, _META.pack(charged, now, digest), db=self.meta_db)
                txn.put(_TICK.pack(now) + key, b"", db=self.lru_db)
            for cid, start, data in inserts:
                charged = len(data) + _ENTRY_OVERHEAD
                if charged > self.limit // 2:
                    continue
                key = _ENTRY.pack(cid, start, start + len(data))
                total -= self._remove(txn, key)
                txn.put(key, data, db=self.data_db)
                txn.put(key, _META.pack(charged, now, _digest(key, data)), db=self.meta_db)
                txn.put(_TICK.pack(now) + key, b"", db=self.lru_db)
                total += charged
            if total > self.limit:
                target = self.limit * 9 // 10
                cur = txn.cursor(db=self.lru_db)
                victims = []
                if cur.first():
                    for lru_key in cur.iternext(values=False):
                        if total <= target:
                            break
                        key = bytes(lru_key)[_TICK.size :]
                        meta = _meta(txn.get(key, db=self.meta_db))
                        total -= meta[0] if meta is not None else 0
                        victims.append((bytes(lru_key), key))
                for lru_key, key in victims:
                    self._remove(txn, key)
                    txn.delete(lru_key, db=self.lru_db)  # also when its entry was malformed
            txn.put(_TOTAL_KEY, _TICK.pack(max(total, 0)), db=self.meta_db)

    def _remove(self, txn: Any, key: bytes) -> int:
        """Delete one entry; return the bytes it was charged (0 if unknown)."""
        meta = _meta(txn.get(key, db=self.meta_db))
        txn.delete(key, db=self.data_db)
        txn.delete(key, db=self.meta_db)
        if meta is None:
            return 0
        charged, tick, _ = meta
        txn.delete(_TICK.pack(tick) + key, db=self.lru_db)
        return charged

    def _total(self, txn: Any) -> int:
        raw = txn.get(_TOTAL_KEY, db=self.meta_db)
        return int(_TICK.unpack(bytes(raw))[0]) if raw is not None and len(raw) == _TICK.size else 0

    def drop_chunk(self, cid: bytes) -> None:
        """Delete every entry of one chunk."""
        with self.env.begin(buffers=True) as txn:
            cur = txn.cursor(db=self.data_db)
            keys = []
            if cur.set_range(cid):
                for key in cur.iternext(values=False):
                    if bytes(key[:16]) != cid:
                        break
                    keys.append(bytes(key))
        if keys:
            self.update([], [], keys)

    def total(self) -> int:
        """Return the bytes currently charged to the cache."""
        with self.env.begin() as txn:
            return self._total(txn)
