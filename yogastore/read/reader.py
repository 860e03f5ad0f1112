"""Fetching chunks and gathering records: order-agnostic, TensorFlow-free.

A ``ChunkSource`` turns an array of record indices into one ``ColumnBatch``
per column. The local source maps whole chunks zero-copy (LMDB memory map) and
verifies what it reads (``yogastore.read.verified``): a chunk's length and
index the first time this process views it, then the data blocks holding the
records of each batch, each block once per process, before anything is
copied. It then gathers each column across all chunks with one compiled copy
(``yogastore.format.memory``): rows for fixed shapes, byte ranges for the others.
Whole chunks are verified by ``verify_chunk`` (``yogastore verify``,
``Store.copy``, whole fetches of remote reads).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import threading
from collections.abc import Callable
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
from yogastore.format import ChunkView, ColumnBatch, parse_header
from yogastore.format.blocks import BlockSums
from yogastore.format.manifest import Manifest, checksum
from yogastore.format.memory import MappedFault, column_rows, record_ranges
from yogastore.read.verified import (
    Spans,
    block_memo,
    check_regions,
    prefix_span,
    verify_blocks,
)

__all__ = [
    "ChunkSource",
    "LocalChunkSource",
    "ChunkLookup",
    "ReadStats",
    "chunk_lookup",
    "check_length",
    "locate",
    "uniform_chunk_size",
    "verify_chunk",
]


@dataclasses.dataclass(slots=True)
class ReadStats:
    """Counters of one stream's reads.

    ``bytes_verified`` counts the bytes this source hashed to check them:
    chunk indexes, data blocks and whole chunks; ``chunks_verified`` the whole
    chunks among them.
    """

    records: int = 0
    batches: int = 0
    bytes_fetched: int = 0
    bytes_verified: int = 0
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


#: Largest lookup table ``chunk_lookup`` builds (entries).
_LOOKUP_ENTRIES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ChunkLookup:
    """The chunk of a record by table look-up instead of a binary search.

    Entry ``b`` of ``table`` is the chunk holding record ``b << shift``. No
    chunk but the last holds fewer than ``1 << shift`` records, so at most one
    more chunk starts among the records of an entry: ``ends[c]`` (the first
    record after chunk ``c``) says whether a record lies past it.
    """

    table: IntArray
    shift: int
    ends: IntArray

    def chunks(self, records: IntArray) -> IntArray:
        which: IntArray = self.table[records >> self.shift]
        which += records >= self.ends[which]
        return which


def chunk_lookup(starts: IntArray, n: int) -> ChunkLookup | None:
    """Return the ``ChunkLookup`` of chunks starting at ``starts`` (``n`` records in all).

    ``None`` if its table would be large (more than ``_LOOKUP_ENTRIES``: many
    small chunks), if some chunk is empty, or if there is one chunk at most.
    """
    if len(starts) < 2 or n < 1:
        return None
    ends = np.append(starts[1:], n).astype(np.int64)
    shortest = int(np.diff(starts).min())  # every chunk but the last
    if shortest < 1 or int(ends[-1] - starts[-1]) < 1:
        return None
    shift = shortest.bit_length() - 1
    entries = ((n - 1) >> shift) + 1
    if entries > _LOOKUP_ENTRIES:
        return None
    firsts = np.arange(entries, dtype=np.int64) << shift
    table = (np.searchsorted(starts, firsts, side="right") - 1).astype(np.int64)
    return ChunkLookup(table, shift, ends)


def locate(
    manifest: Manifest,
    starts: IntArray,
    records: IntArray,
    uniform: int | ChunkLookup | None = None,
) -> tuple[IntArray, IntArray]:
    """Return (chunk index, index within chunk) for each record.

    ``uniform`` replaces the binary search: a record count (from
    ``uniform_chunk_size``) by a division, a ``ChunkLookup`` by its table.
    """
    if records.size and (records.min() < 0 or records.max() >= manifest.num_records):
        raise CorruptCacheError(f"{manifest.where}: record index out of range")
    if isinstance(uniform, ChunkLookup):
        which = uniform.chunks(records)
        return which, records - starts[which]
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


def check_length(manifest: Manifest, chunk: int, data: bytes | memoryview) -> None:
    """Check that a chunk's bytes are as many as the manifest records."""
    info = manifest.chunks[chunk]
    if len(data) != info.nbytes:
        raise CorruptCacheError(
            f"{manifest.where} chunk {chunk} ({info.key}): {len(data)} bytes, "
            f"manifest says {info.nbytes}; delete and rebuild this version"
        )


def verify_chunk(manifest: Manifest, chunk: int, data: bytes | memoryview) -> None:
    """Check one whole chunk's bytes against the manifest: length, checksum, index checksum.

    The one check of whole chunks: ``yogastore verify``, ``Store.copy`` and
    whole fetches of remote reads (local reads check blocks instead).

    Raises:
        CorruptCacheError: wrong length, checksum mismatch, or bytes that could not be
            read (a mapped file cut short while it was hashed).
    """
    info = manifest.chunks[chunk]
    check_length(manifest, chunk, data)
    try:
        whole = checksum(data)
        index = checksum(memoryview(data)[: info.index_bytes])
    except MappedFault as err:  # a mapped file cut short while it was hashed
        raise CorruptCacheError(
            f"{manifest.where} chunk {chunk} ({info.key}): its bytes could not be read: {err}"
        ) from err
    if whole != info.checksum:
        raise CorruptCacheError(
            f"{manifest.where} chunk {chunk} ({info.key}): checksum mismatch; the cache is "
            "corrupted, delete and rebuild this version"
        )
    # What local reads check first: a chunk that passes here reads without error.
    if index != info.index_checksum:
        raise CorruptCacheError(
            f"{manifest.where} chunk {chunk} ({info.key}): index (bytes [0, {info.index_bytes})) "
            "does not match the manifest's index checksum; the cache is corrupted, delete and "
            "rebuild this version"
        )


class LocalChunkSource:
    """Whole chunks read zero-copy from a backend whose ``get`` maps memory."""

    def __init__(self, backend: Backend, manifest: Manifest) -> None:
        self.backend = backend
        self.manifest = manifest
        self.stats = ReadStats()
        self._columns = manifest.columns()
        self._starts = manifest.chunk_starts()
        # How a record's chunk is found: by division, by a table, or (None) by binary search.
        self._chunk_of: int | ChunkLookup | None = uniform_chunk_size(manifest)
        if self._chunk_of is None:
            self._chunk_of = chunk_lookup(self._starts, manifest.num_records)
        self._views: dict[int, ChunkView] = {}
        self._data: dict[int, memoryview] = {}
        self._sums: dict[int, BlockSums] = {}
        self._lock = threading.Lock()
        # Every column gathers across chunks with one compiled copy.
        num_chunks = len(manifest.chunks)
        self._rows = column_rows(self._columns, num_chunks)
        self._loaded = np.zeros(num_chunks, dtype=bool)
        self._advise = np.ones(num_chunks, dtype=bool)  # reads of it worth announcing
        self._all_loaded = num_chunks == 0
        self._memo = block_memo(backend.url, manifest)
        self._checksums = [c.checksum for c in manifest.chunks]
        # Any key of the version names the file its views map.
        self._mapped_key = manifest.key
        self._pid = os.getpid()

    def sibling(self) -> LocalChunkSource | None:
        """A new source sharing this one's chunk views, or ``None`` if they may be stale.

        Views are shared only in the process that made them, and only while
        the build they belong to is still stored (its chunk keys name the
        build: a delete or a rebuild since removed them): a later stream of
        the same reference then neither reads nor parses a chunk index
        again, but hashes each index it uses once more, as a new view would
        (an index changed under the running process is refused). The new
        source counts its own statistics.
        """
        if self._pid != os.getpid() or not self.manifest.chunks:
            return None
        try:
            if not self.backend.exists(self.manifest.chunks[0].key):
                return None
        except YogaStoreError:
            return None
        twin = copy.copy(self)
        twin.stats = ReadStats()
        # Chunks this source has checked itself: a shared view is hashed again on first use.
        twin._loaded = np.zeros_like(self._loaded)
        twin._all_loaded = not len(self._loaded)
        return twin

    def view(self, chunk: int) -> ChunkView:
        """Return the view of one chunk, its length and index verified."""
        view = self._views.get(chunk)
        if view is not None:
            if not self._loaded[chunk]:
                self._check_shared(chunk)
            return view
        info = self.manifest.chunks[chunk]
        where = f"{self.manifest.where} chunk {chunk} ({info.key})"
        try:
            data = memoryview(self.backend.get(info.key)).cast("B")
        except KeyNotFoundError as err:
            raise missing_chunk_error(self.backend, self.manifest, where) from err
        check_length(self.manifest, chunk, data)
        index = data[: info.index_bytes]
        # Before parsing: nothing read from an index is trusted unchecked. An
        # index this process checked before is hashed again (a few KiB) so that
        # the same bytes may skip the structural checks they passed then.
        seen = self._memo.index_verified(chunk)
        if checksum(index) != info.index_checksum:
            raise CorruptCacheError(
                f"{where}: index (bytes [0, {info.index_bytes})) fails its checksum; the "
                "cache is corrupted, delete and rebuild this version"
            )
        hashed = info.index_bytes
        # The same bytes parse the same: a header parsed and checked before is kept.
        header = self._memo.header(chunk) if seen else None
        if header is None:
            header = parse_header(index, info.nbytes, where)
        if header.get("index_end") != info.index_bytes:
            raise CorruptCacheError(
                f"{where}: chunk index ends at {header.get('index_end')!r}, manifest says "
                f"{info.index_bytes}; delete and rebuild this version"
            )
        sums = BlockSums.from_header(header, index, info.nbytes, where)
        view = ChunkView(data, self._columns, info.count, where, header, checked=seen)
        check_regions(view, sums)
        self._memo.add_chunk(chunk, sums, header)
        with self._lock:
            known = self._views.get(chunk)
            if known is not None:  # another thread (or a sibling) was first
                self._loaded[chunk] = True
                self._all_loaded = bool(self._loaded.all())
                return known
            for i, rows in enumerate(self._rows):
                rows.add(chunk, view, i)
            self._data[chunk] = data
            self._sums[chunk] = sums
            self._views[chunk] = view
            self._loaded[chunk] = True
            self._all_loaded = bool(self._loaded.all())
            self.stats.requests += 1
            self.stats.bytes_fetched += len(data)
            self.stats.bytes_verified += hashed
        return view

    def _check_shared(self, chunk: int) -> None:
        """Hash again the index of a view a sibling made, before this source first uses it."""
        info = self.manifest.chunks[chunk]
        data = self._data[chunk]
        if checksum(data[: info.index_bytes]) != info.index_checksum:
            raise CorruptCacheError(
                f"{self.manifest.where} chunk {chunk} ({info.key}): index (bytes [0, "
                f"{info.index_bytes})) fails its checksum; the cache is corrupted, delete and "
                "rebuild this version"
            )
        with self._lock:
            self._loaded[chunk] = True
            self._all_loaded = bool(self._loaded.all())
            self.stats.bytes_verified += info.index_bytes

    gathers_in_place = True  # gather(in_place=True) leaves strings where they lie

    def gather(self, records: IntArray, in_place: bool = False) -> list[ColumnBatch]:
        """Return the records' column batches, checked (strings as views if ``in_place``)."""
        which, local = locate(self.manifest, self._starts, records, self._chunk_of)
        # Views handed out earlier read a memory map: make sure its file did
        # not shrink since (an outside truncation), which would be a SIGBUS.
        self.backend.check_mapped(self._mapped_key)
        try:
            out = self._gather_checked(records, which, local, in_place)
        except MappedFault as err:
            # The file shrank after the check above, while its bytes were read.
            self.backend.check_mapped(self._mapped_key)  # names it when it stays short
            mapped = self.backend.mapped_file(self._mapped_key)
            where = f" from {mapped[0]}" if mapped else ""
            raise CorruptCacheError(
                f"reading {len(records)} records of {self.manifest.where}{where} faulted: {err}"
            ) from err
        with self._lock:
            self.stats.records += len(records)
            self.stats.batches += 1
        return out

    def _gather_checked(
        self, records: IntArray, which: IntArray, local: IntArray, in_place: bool
    ) -> list[ColumnBatch]:
        if not self._all_loaded:
            new = np.unique(which[~self._loaded[which]]).tolist()
            chunks = self.manifest.chunks
            unseen = [c for c in new if c not in self._views]
            for c in unseen if len(unseen) > 1 else ():  # their indexes, read in parallel
                self._will_read(c, functools.partial(prefix_span, chunks[c].index_bytes))
            for c in new:
                self.view(c)
        memo = self._memo
        if not memo.all_complete and not memo.records_verified(records):
            pending = ~memo.complete[which]
            if pending.all():
                self._verify(which, local)
            elif pending.any():
                self._verify(which[pending], local[pending])
            memo.mark_records(records)
        # Strings stay in place only inside one memory map: all bytes an array
        # spanning them covers are then readable.
        region = self.backend.mapped_span(self._mapped_key) if in_place else None
        return [rows.gather(which, local, region) for rows in self._rows]

    def check_mapped(self) -> None:
        """Raise ``CorruptCacheError`` if the file views of this source map shrank."""
        self.backend.check_mapped(self._mapped_key)

    def mapped_file(self) -> tuple[str, int, int, int] | None:
        """The mapped file views of this source read (see ``Backend.mapped_file``), or ``None``."""
        return self.backend.mapped_file(self._mapped_key)

    def _verify(self, which: IntArray, local: IntArray) -> None:
        """Check the blocks holding these records' bytes, in every column (before any copy)."""
        chunks, starts, ends = record_ranges(self._rows, which, local)
        hashed = verify_blocks(
            self._memo,
            chunks,
            starts,
            ends,
            self._sums,
            self._data,
            self._checksums,
            will_read=self._will_read,
        )
        if hashed:
            with self._lock:
                self.stats.bytes_verified += hashed

    def _will_read(self, chunk: int, spans: Callable[[], Spans]) -> None:
        """Announce reads of ``chunk`` while the backend says that may help."""
        if self._advise[chunk]:
            starts, ends = spans()
            key = self.manifest.chunks[chunk].key
            self._advise[chunk] = self.backend.will_read(key, starts, ends)

    def close(self) -> None:
        """Drop the idle gather buffers; views go with the last source sharing them."""
        for rows in self._rows:
            rows.clear_buffers()
