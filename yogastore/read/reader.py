"""Fetching chunks and gathering records: order-agnostic, TensorFlow-free.

A ``ChunkSource`` turns an array of record indices into one ``ColumnBatch``
per column. The local source maps whole chunks zero-copy (LMDB memory map),
verifies each chunk's checksum the first time this process touches it and then
gathers each column across all chunks with one compiled copy
(``yogastore.format.memory``): rows for fixed shapes, byte ranges for the others.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol

import numpy as np

from storage_backends import Backend
from storage_backends.errors import (
    CorruptCacheError,
    DatasetChangedError,
    KeyNotFoundError,
    YogaStoreError,
)
from yogastore.arrays import IntArray
from yogastore.format import ChunkView, ColumnBatch
from yogastore.format.manifest import Manifest, checksum
from yogastore.format.memory import FixedRows, VarRows

__all__ = [
    "ChunkSource",
    "LocalChunkSource",
    "ReadStats",
    "locate",
    "uniform_chunk_size",
    "verify_chunk",
]


# Chunks whose checksum this process has verified: (backend url, key, checksum).
_VERIFIED: set[tuple[str, str, str]] = set()
_VERIFIED_LOCK = threading.Lock()


@dataclasses.dataclass(slots=True)
class ReadStats:
    """Counters of one stream's reads."""

    records: int = 0
    batches: int = 0
    bytes_fetched: int = 0
    requests: int = 0
    chunks_verified: int = 0
    cache_hits: int = 0
    cache_misses: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class ChunkSource(Protocol):
    """Gathers records of one dataset version.

    Rules: ``gather`` returns one ``ColumnBatch`` per schema column, in the order
    of ``records``; every chunk's bytes are validated before use.
    """

    stats: ReadStats

    def gather(self, records: IntArray) -> list[ColumnBatch]: ...

    def close(self) -> None: ...


def uniform_chunk_size(manifest: Manifest) -> int | None:
    """Return the record count of every chunk but the last, if they all hold the same."""
    counts = [c.count for c in manifest.chunks]
    if not counts or counts[0] < 1 or any(c != counts[0] for c in counts[:-1]):
        return None
    return counts[0] if counts[-1] <= counts[0] else None


def locate(
    manifest: Manifest, starts: IntArray, records: IntArray, uniform: int | None = None
) -> tuple[IntArray, IntArray]:
    """Return (chunk index, index within chunk) for each record.

    ``uniform`` (from ``uniform_chunk_size``) replaces the binary search by a
    division.
    """
    if records.size and (records.min() < 0 or records.max() >= manifest.num_records):
        raise CorruptCacheError(f"{manifest.where}: record index out of range")
    if uniform is not None:
        which, local = np.divmod(records, uniform)
        return which, local
    which = np.searchsorted(starts, records, side="right") - 1
    return which.astype(np.int64), records - starts[which]


def missing_chunk_error(backend: Backend, manifest: Manifest, where: str) -> YogaStoreError:
    """Return the error for a chunk the manifest names but the store does not hold.

    A version deleted or rebuilt by another process since this reference was
    opened is not a corrupted cache: say so, and how to go on.
    """
    try:
        prefix = f"{manifest.dataset_id}/{manifest.version}/"
        current = Manifest.from_json(backend.get(manifest.key), where, prefix)
    except KeyNotFoundError:
        return DatasetChangedError(
            f"{where}: this version was deleted from {backend.url} after it was opened; "
            "open it again (or cache it again)"
        )
    except YogaStoreError:
        current = None
    if current is not None and current.build_id != manifest.build_id:
        return DatasetChangedError(
            f"{where}: this version was rebuilt (build {current.build_id}, opened as build "
            f"{manifest.build_id}) after it was opened; open it again to read the new build"
        )
    return CorruptCacheError(
        f"{where}: chunk listed in the manifest is missing from {backend.url}; "
        "delete and rebuild this version"
    )


def verify_chunk(
    url: str, manifest: Manifest, chunk: int, data: bytes | memoryview, *, memo: bool = True
) -> bool:
    """Check one chunk's bytes against the manifest: their length and checksum.

    The one check of whole chunks, and its one memo: chunks of a backend whose
    bytes stay put for the life of the process (a memory-mapped local store)
    are checked the first time this process reads them, not on every read.

    Args:
        url: the backend's URL (with the chunk key and checksum, the memo's key).
        manifest: the version the chunk belongs to.
        chunk: the chunk's index in the manifest.
        data: the chunk's bytes.
        memo: skip a chunk this process already verified, and remember this
            one; ``False`` for bytes just fetched or when every chunk must be
            checked (``yogastore verify``): the memo is then neither read nor
            written.

    Returns:
        Whether the bytes were checked now (``False``: verified before).

    Raises:
        CorruptCacheError: wrong length or checksum mismatch.
    """
    info = manifest.chunks[chunk]
    token = (url, info.key, info.checksum)
    if memo:
        with _VERIFIED_LOCK:
            if token in _VERIFIED:
                return False
    if len(data) != info.nbytes:
        raise CorruptCacheError(
            f"{manifest.where} chunk {chunk} ({info.key}): {len(data)} bytes, "
            f"manifest says {info.nbytes}"
        )
    if checksum(data) != info.checksum:
        raise CorruptCacheError(
            f"{manifest.where} chunk {chunk} ({info.key}): checksum mismatch; the cache is "
            "corrupted, delete and rebuild this version"
        )
    if memo:
        with _VERIFIED_LOCK:
            _VERIFIED.add(token)
    return True


class LocalChunkSource:
    """Whole chunks read zero-copy from a backend whose ``get`` maps memory."""

    def __init__(self, backend: Backend, manifest: Manifest) -> None:
        self.backend = backend
        self.manifest = manifest
        self.stats = ReadStats()
        self._columns = manifest.columns()
        self._starts = manifest.chunk_starts()
        self._uniform = uniform_chunk_size(manifest)
        self._views: dict[int, ChunkView] = {}
        self._lock = threading.Lock()
        # Every column gathers across chunks with one compiled copy.
        num_chunks = len(manifest.chunks)
        self._rows: dict[int, FixedRows | VarRows] = {
            i: FixedRows(spec, num_chunks) if spec.layout == "fixed" else VarRows(spec, num_chunks)
            for i, spec in enumerate(self._columns)
        }
        self._loaded = np.zeros(num_chunks, dtype=bool)
        self._all_loaded = num_chunks == 0
        # Any key of the version names the file its views map.
        self._mapped_key = manifest.key

    def view(self, chunk: int) -> ChunkView:
        """Return the validated view of one chunk."""
        view = self._views.get(chunk)
        if view is not None:
            return view
        info = self.manifest.chunks[chunk]
        where = f"{self.manifest.where} chunk {chunk} ({info.key})"
        try:
            data = self.backend.get(info.key)
        except KeyNotFoundError as err:
            raise missing_chunk_error(self.backend, self.manifest, where) from err
        verified = verify_chunk(self.backend.url, self.manifest, chunk, data)
        view = ChunkView(data, self._columns, info.count, where)
        with self._lock:
            known = self._views.get(chunk)
            if known is not None:  # another thread was first
                return known
            for i, rows in self._rows.items():
                rows.add(chunk, view, i)
            self._views[chunk] = view
            self._loaded[chunk] = True
            self._all_loaded = len(self._views) == len(self._loaded)
            self.stats.requests += 1
            self.stats.bytes_fetched += len(data)
            self.stats.chunks_verified += int(verified)
        return view

    def gather(self, records: IntArray) -> list[ColumnBatch]:
        which, local = locate(self.manifest, self._starts, records, self._uniform)
        # Views handed out earlier read a memory map: make sure its file did
        # not shrink since (an outside truncation), which would be a SIGBUS.
        self.backend.check_mapped(self._mapped_key)
        if not self._all_loaded:
            for c in np.unique(which[~self._loaded[which]]):
                self.view(int(c))
        out = [self._rows[i].gather(which, local) for i in range(len(self._columns))]
        with self._lock:
            self.stats.records += len(records)
            self.stats.batches += 1
        return out

    def close(self) -> None:
        self._views.clear()
