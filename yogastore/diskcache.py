"""A disk cache of chunk byte ranges, shared by the processes of one machine.

One LMDB file (``remote-cache.mdb``) holds ranges keyed by (chunk id, start,
end), each with an xxh3 digest checked on every read; entries are evicted
least recently used first once their total passes a size limit. LMDB's own
locking makes the file safe for several processes; each process opens it
once (py-lmdb refuses a second open) and never uses it across ``fork``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb
import xxhash

from yogastore.manifest import ChunkInfo

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

# Open environments of this process, by path: py-lmdb must not open one file
# twice in a process, nor use an environment inherited across fork.
_ENVS: dict[str, Any] = {}
_ENVS_LOCK = threading.Lock()
_INHERITED: list[Any] = []


def _after_fork() -> None:
    _INHERITED.extend(_ENVS.values())
    _ENVS.clear()


os.register_at_fork(after_in_child=_after_fork)


@dataclasses.dataclass(slots=True)
class Piece:
    start: int
    end: int
    data: bytes


class DiskCache:
    """Byte ranges of chunks in one LMDB file, evicted least recently used first.

    Entries are keyed by (chunk id, start, end). Several processes may share
    the file (LMDB's own locking); each process opens it once. The file is
    written without fsync: it is a cache, and a torn entry fails its digest.

    Args:
        directory: where ``remote-cache.mdb`` lives (created if missing).
        limit: bytes of entries kept (values plus a per-entry overhead).
    """

    def __init__(self, directory: Path, limit: int) -> None:
        self.path = directory / CACHE_FILE
        self.limit = limit
        directory.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        with _ENVS_LOCK:
            env = _ENVS.get(key)
            if env is None:
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
                _ENVS[key] = env
        self.env = env
        self.data_db = env.open_db(b"data")
        self.meta_db = env.open_db(b"meta")
        self.lru_db = env.open_db(b"lru")

    @staticmethod
    def chunk_id(url: str, info: ChunkInfo) -> bytes:
        """Return the 16-byte id of a chunk: its store, key and checksum."""
        return xxhash.xxh3_128_digest(f"{url}\0{info.key}\0{info.checksum}".encode())

    def read(self, cid: bytes, ranges: Sequence[Range]) -> tuple[list[list[Piece]], list[bytes]]:
        """Return, per range, the cached pieces overlapping it, and the keys read.

        Entries failing their digest are deleted and not returned.
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
                    _, start, end = _ENTRY.unpack(key)
                    if start >= b:
                        break
                    if end > a:
                        raw = cur.value()
                        meta = txn.get(key, db=self.meta_db)
                        digest = _META.unpack(bytes(meta))[2] if meta is not None else None
                        if digest is not None and xxhash.xxh3_64_intdigest(raw) == digest:
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
            total_raw = txn.get(_TOTAL_KEY, db=self.meta_db)
            total = _TICK.unpack(total_raw)[0] if total_raw is not None else 0
            for key in drop:
                total -= self._remove(txn, key)
            for key in touched:
                meta = txn.get(key, db=self.meta_db)
                if meta is None:
                    continue
                charged, tick, digest = _META.unpack(meta)
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
                txn.put(
                    key, _META.pack(charged, now, xxhash.xxh3_64_intdigest(data)), db=self.meta_db
                )
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
                        meta = txn.get(key, db=self.meta_db)
                        total -= _META.unpack(meta)[0] if meta is not None else 0
                        victims.append(key)
                for key in victims:
                    self._remove(txn, key)
            txn.put(_TOTAL_KEY, _TICK.pack(max(total, 0)), db=self.meta_db)

    def _remove(self, txn: Any, key: bytes) -> int:
        meta = txn.get(key, db=self.meta_db)
        if meta is None:
            return 0
        charged, tick, _ = _META.unpack(meta)
        txn.delete(key, db=self.data_db)
        txn.delete(key, db=self.meta_db)
        txn.delete(_TICK.pack(tick) + key, db=self.lru_db)
        return int(charged)

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
            raw = txn.get(_TOTAL_KEY, db=self.meta_db)
        return _TICK.unpack(raw)[0] if raw is not None else 0
