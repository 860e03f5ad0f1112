"""Reading from an object store: only the bytes a rank needs, cached on local disk.

``RemoteChunkSource`` is the ``ChunkSource`` of remote backends (``backend.remote``).
For each chunk a batch touches it either

* fetches the chunk *whole* (one request, verified against the chunk checksum
  of the manifest) when the records this rank will need soon cover most of it,
  as with ``Shuffle.BLOCK`` where a rank's positions are runs of whole chunks;
* or fetches its *index* ``[0, index_bytes)`` in one ranged read, verified
  against the chunk's ``index_checksum``, and then only the data bytes of the
  records needed, as byte ranges coalesced where they touch, many in flight
  on a thread pool (``Shuffle.GLOBAL``, span boundaries, small datasets).

What is verified: a whole chunk against the manifest's chunk checksum; an
index against the manifest's ``index_checksum`` (which covers the chunk's
block checksum table, ``yogastore.format.blocks``); the data bytes of a ranged read
block by block: ranges are widened to whole blocks (4 KiB as written today)
and every block fetched or found in the disk cache is checked against the
table. A response that fails, comes back short, or is refused as past the end
is fetched again (bounded, ``_ATTEMPTS`` fetches in all), then reported as
``CorruptCacheError``. Only checked bytes enter the disk cache. Every offset
and length derived from the index is bounds-checked (``parse_header`` and
``ChunkView``), so a range never leaves the chunk.

"Soon" is a horizon of upcoming batches: ``Stream`` hands its batches of
record indices through ``plan``, which looks ahead a few chunks' worth of
records, counts per chunk how many this rank will need, and prepares the next
batches on background threads (read-ahead on top of the stream's own prefetch).

Every byte range fetched goes through a local read-through cache
(``yogastore.read.diskcache``): one LMDB file, ``remote-cache.mdb`` under the
store's ``ReadOptions.cache_dir`` or yogastore's default root, shared safely
by the processes of one machine, bounded by ``cache_bytes`` with
least-recently-used eviction. Each cached range carries an xxh3 digest checked on every hit, and
what it serves is checked again against the build's checksums as above; a bad
entry is dropped and fetched again.

A source may be used on both sides of ``os.fork``: the child starts with no
worker threads, no chunks in memory and fresh locks, made on first use; the
parent is unaffected. The child cannot use the disk cache its parent had open
(see ``yogastore.read.diskcache``): it reads from the object store only and logs a
warning saying so.

``stats``: ``requests`` and ``bytes_fetched`` count network reads only;
``cache_hits`` and ``cache_misses`` count byte ranges found whole in, or
missing (partly) from, the disk cache; ``chunks_verified`` counts whole chunks
checked against their checksum, ``bytes_verified`` every byte checked (whole
chunks, indexes, data blocks fetched or served by the disk cache).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import struct
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lmdb
import numpy as np

from storage_backends import Backend
from storage_backends.errors import (
    CorruptCacheError,
    InvalidArgumentError,
    KeyNotFoundError,
)
from yogastore.arrays import IntArray
from yogastore.format import ChunkView, ColumnBatch, gather, parse_header
from yogastore.format.blocks import BlockSums
from yogastore.format.manifest import Manifest, checksum
from yogastore.read import waits
from yogastore.read.diskcache import DiskCache
from yogastore.read.read_options import ReadOptions
from yogastore.read.reader import ReadStats, locate, missing_chunk_error, verify_chunk
from yogastore.read.remote_plan import (
    ChunkState,
    Job,
    Planned,
    Range,
    coalesce,
    cover,
    first_jobs,
    record_jobs,
)

__all__ = ["RemoteChunkSource", "coalesce"]

logger = logging.getLogger(__name__)

_MAX_HORIZON = 1 << 25  # records counted ahead, at most (8 chunks of 4 MiB of 1-byte records)
_ATTEMPTS = 4  # fetches of one range before a mismatch or short read is reported


# Sources of this process, reset in a fork child before any other code runs there.
_LIVE: weakref.WeakSet[RemoteChunkSource] = weakref.WeakSet()


def _after_fork() -> None:
    for source in list(_LIVE):
        source._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork)


class RemoteChunkSource:
    """Gathers records from a remote backend with ranged reads and a disk cache.

    Args:
        backend: a backend with ``remote = True``.
        manifest: the dataset version to read.
        options: reader settings (default: ``ReadOptions()``).
    """

    def __init__(
        self, backend: Backend, manifest: Manifest, options: ReadOptions | None = None
    ) -> None:
        self.backend = backend
        self.manifest = manifest
        self.options = ReadOptions.of(options)
        self._cache_dir = self.options.cache_path()
        self._max_parallel = self.options.parallel_for(backend)
        self.stats = ReadStats()
        self.refetches = 0  # ranges fetched again after failing a check
        self._columns = manifest.columns()
        self._starts = manifest.chunk_starts()
        self._states: collections.OrderedDict[int, ChunkState] = collections.OrderedDict()
        self._resident = 0
        self._need = np.zeros(len(manifest.chunks), dtype=np.int64)
        self._handed: dict[int, Planned] = {}
        self._counted: set[Planned] = set()  # planned batches within the horizon
        self._lock = threading.Lock()
        self._fetch_pool: waits.DaemonPool | None = None
        self._prep_pool: waits.DaemonPool | None = None
        mean = manifest.num_records / max(len(manifest.chunks), 1)
        # Capped: the horizon's records are indexed before any chunk is read, and only a
        # manifest's counts say how many there are (a damaged one could claim 2**47).
        self._horizon = max(min(int(mean * self.options.horizon_chunks), _MAX_HORIZON), 1)
        self._memory = max(
            self.options.memory_bytes,
            3 * self.options.horizon_chunks * max((c.nbytes for c in manifest.chunks), default=0),
        )
        self._pid = os.getpid()
        self._born = waits.current()  # waits end if the process exits (yogastore.read.waits)
        self._reopen = False
        self.cache = self._open_cache()
        _LIVE.add(self)

    def _open_cache(self) -> DiskCache | None:
        if self.options.cache_bytes <= 0:
            return None
        try:
            return DiskCache(self._cache_dir, self.options.cache_bytes)
        except (lmdb.Error, OSError) as err:
            logger.warning(
                "read cache under %s unavailable, reading from %s only: %s",
                self._cache_dir,
                self.backend.url,
                err,
            )
            return None

    def _reset_after_fork(self) -> None:
        """Drop what belongs to the parent process (called in a fork child).

        Its pool threads do not exist here (a pool would queue work forever),
        its locks may have been held by them, and its LMDB environment must not
        be used here; opening the disk cache is tried again on first use.
        """
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._fetch_pool = self._prep_pool = None
        self._states = collections.OrderedDict()
        self._resident = 0
        self._need = np.zeros(len(self.manifest.chunks), dtype=np.int64)
        self._handed = {}
        self._counted = set()
        self._reopen = self._reopen or self.cache is not None
        self.cache = None

    def _check_process(self) -> None:
        """Make this source usable in the current process (after fork, first use)."""
        if self._pid != os.getpid():  # pragma: no cover - the fork hook ran first
            self._reset_after_fork()
        if self._reopen:
            with self._lock:
                if self._reopen:
                    self._reopen = False
                    self.cache = self._open_cache()

    # Public ----------------------------------------------------------------------

    def gather(self, records: IntArray) -> list[ColumnBatch]:
        """Return one ``ColumnBatch`` per column for ``records``, in order."""
        self._check_process()
        with self._lock:
            item = self._handed.pop(id(records), None)
        if item is not None and item.records is not records:  # pragma: no cover - ids unique
            item = None
        records = np.asarray(records, dtype=np.int64)
        try:
            views, inverse, local = self._ensure(records, item)
        finally:
            if item is not None:
                self._uncount(item)
        with self._lock:
            self.stats.records += len(records)
            self.stats.batches += 1
        out = [gather(c, views, inverse, local, i) for i, c in enumerate(self._columns)]
        self._trim()
        return out

    def cap_horizon(self, records: int) -> None:
        """Look at most about ``records`` records ahead of the batch being read.

        A work queue claims a slice when the look-ahead first needs it, so its
        streams keep the look-ahead within about one slice.
        """
        self._horizon = max(1, min(self._horizon, int(records)))

    def plan(self, batches: Iterator[IntArray]) -> Iterator[IntArray]:
        """Pass ``batches`` through, looking ahead to decide and prefetch.

        The batches yielded are the ones received, in order. While they flow,
        the next ``readahead_batches`` are prepared on background threads, and
        the records of the next ``horizon_chunks`` chunks' worth (plus batches
        handed out but not gathered yet) are counted per chunk, so that a chunk
        mostly needed soon is fetched whole.
        """
        self._check_process()
        ahead: collections.deque[Planned] = collections.deque()
        queued = 0
        upstream = iter(batches)
        exhausted = False
        window = self.options.readahead_batches
        try:
            while True:
                # The horizon starts after the batches being prepared, so each of
                # them sees a full horizon of records beyond itself.
                reach = self._horizon + sum(
                    len(item.records) for item in itertools.islice(ahead, window)
                )
                while not exhausted and queued < reach:
                    try:
                        records = np.asarray(next(upstream), dtype=np.int64)
                    except StopIteration:
                        exhausted = True
                        break
                    which, local = locate(self.manifest, self._starts, records)
                    chunks, counts = np.unique(which, return_counts=True)
                    item = Planned(records, chunks, counts.astype(np.int64), which, local)
                    with self._lock:
                        self._need[chunks] += item.counts
                        self._counted.add(item)
                    ahead.append(item)
                    queued += len(records)
                    if len(ahead) <= window:
                        reach += len(records)
                if not ahead:
                    return
                for item in itertools.islice(ahead, window):
                    if item.future is None:
                        item.future = self._prep().submit(self._prepare, item)
                item = ahead.popleft()
                queued -= len(item.records)
                # Counted until gathered: the consumer may hold a few batches.
                with self._lock:
                    self._handed[id(item.records)] = item
                yield item.records
        finally:
            with self._lock:
                leftovers = [*ahead, *self._handed.values()]
                self._handed.clear()
            for item in leftovers:
                self._uncount(item)
                if item.future is not None:
                    item.future.cancel()

    def close(self) -> None:
        """Stop the worker threads and drop the chunks held in memory."""
        self._check_process()
        for pool in (self._prep_pool, self._fetch_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._prep_pool = self._fetch_pool = None
        with self._lock:
            self._states.clear()
            self._resident = 0

    # Planning ------------------------------------------------------------------------

    def _uncount(self, item: Planned) -> None:
        with self._lock:
            if item.counted:
                self._need[item.chunks] -= item.counts
                item.counted = False
                self._counted.discard(item)

    def _prep(self) -> waits.DaemonPool:
        with self._lock:
            if self._prep_pool is None:
                self._prep_pool = waits.DaemonPool(2, "yoga-ahead", self._born)
            return self._prep_pool

    def _pool(self) -> waits.DaemonPool:
        with self._lock:
            if self._fetch_pool is None:
                self._fetch_pool = waits.DaemonPool(self._max_parallel, "yoga-get", self._born)
            return self._fetch_pool

    def _prepare(self, item: Planned) -> None:
        try:
            self._ensure(item.records, item)
        except Exception as err:  # gather repeats the work and raises it properly
            logger.debug("read-ahead failed, retried on demand: %s", err)

    def _state(self, chunk: int) -> ChunkState:
        with self._lock:
            state = self._states.get(chunk)
            if state is None:
                info = self.manifest.chunks[chunk]
                state = ChunkState(chunk, info, DiskCache.chunk_id(self.backend.url, info))
                self._states[chunk] = state
            else:
                self._states.move_to_end(chunk)
            state.pins += 1
            return state

    def _trim(self) -> None:
        """Drop in-memory chunks, least recently used first, beyond the memory budget."""
        with self._lock:
            if self._resident <= self._memory:
                return
            for chunk, state in list(self._states.items()):
                if self._resident <= self._memory * 3 // 4:
                    break
                if state.pins or self._need[chunk] > 0 or not state.lock.acquire(blocking=False):
                    continue
                try:
                    del self._states[chunk]
                    self._resident -= state.resident
                finally:
                    state.lock.release()

    # Fetching -----------------------------------------------------------------------

    def _where(self, state: ChunkState) -> str:
        return f"{self.manifest.where} chunk {state.chunk} ({state.info.key})"

    def _ensure(
        self, records: IntArray, item: Planned | None = None
    ) -> tuple[list[ChunkView], IntArray, IntArray]:
        """Make every record of ``records`` readable; return views, chunk slots, locals.

        ``item`` is the planned batch, if any: until it is gathered its records
        are counted in ``_need``.
        """
        which, local = locate(self.manifest, self._starts, records)
        chunks, inverse = np.unique(which, return_inverse=True)
        inverse = inverse.astype(np.int64).reshape(-1)
        states = [self._state(int(c)) for c in chunks]
        try:
            return self._ensure_states(states, chunks, inverse, local, item)
        finally:
            with self._lock:
                for state in states:
                    state.pins -= 1

    def _ensure_states(
        self,
        states: list[ChunkState],
        chunks: IntArray,
        inverse: IntArray,
        local: IntArray,
        item: Planned | None,
    ) -> tuple[list[ChunkView], IntArray, IntArray]:
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(states) + 1))
        wanted = [np.unique(local[order[a:b]]) for a, b in itertools.pairwise(bounds)]
        with contextlib.ExitStack() as stack:
            for state in states:  # ascending chunk order: no lock-order cycles
                stack.enter_context(state.lock)
            with self._lock:
                need = self._need[chunks].copy()
                counted = item is not None and item.counted
            whole_jobs, index_jobs = first_jobs(
                states, wanted, need, counted, self.options.whole_fraction
            )
            self._run(whole_jobs + index_jobs)
            for job in whole_jobs:
                self._install_whole(job)
            for job in index_jobs:
                self._install_index(job)
            wanted = self._with_upcoming(states, chunks, wanted)
            data_jobs, missing_sets = record_jobs(
                states, wanted, self._columns, self.options.coalesce_gap, self.options.overfetch
            )
            self._run(data_jobs)
            with self._lock:
                for have, missing in missing_sets:
                    have[missing] = True
                for job in data_jobs:
                    added = sum(b - a for a, b in job.ranges)
                    job.state.resident += added
                    self._resident += added
            views = []
            for state in states:
                if state.view is None:  # pragma: no cover - loaded above
                    raise CorruptCacheError(f"{self._where(state)}: chunk was not loaded")
                views.append(state.view)
        return views, inverse, local

    def _with_upcoming(
        self, states: list[ChunkState], chunks: IntArray, wanted: list[IntArray]
    ) -> list[IntArray]:
        """Add, for chunks read by ranges, the records of them the planned batches need.

        One round of ranged reads per chunk then serves every batch of the
        look-ahead horizon (block shuffle mixes a window of chunks, so a
        chunk's records come in many batches), instead of one round per batch.
        """
        ranged = [i for i, st in enumerate(states) if not st.whole and st.have is not None]
        if not ranged:
            return wanted
        with self._lock:
            items = [it for it in self._counted if it.which is not None and it.local is not None]
        if not items:
            return wanted
        which = np.concatenate([it.which for it in items if it.which is not None])
        local = np.concatenate([it.local for it in items if it.local is not None])
        out = list(wanted)
        for i in ranged:
            extra = local[which == chunks[i]]
            if len(extra):
                out[i] = np.union1d(wanted[i], extra)
        return out

    def _refetch_until(self, job: Job, where: str, what: str, check: Callable[[], None]) -> None:
        """Fetch ``job`` again until ``check`` passes, at most ``_ATTEMPTS`` fetches.

        A cached copy that fails is dropped and fetched; a fetch that fails is
        retried, then ``CorruptCacheError`` says what was seen. ``what`` names
        the bytes checked (``"chunk"``, ``"chunk index"``).
        """
        attempt = 1
        while True:
            try:
                check()
                return
            except CorruptCacheError as err:
                if job.from_cache and self.cache is not None:
                    logger.warning(
                        "%s: cached %s fails its checksum; fetching it again", where, what
                    )
                    self._cache_call(self.cache.drop_chunk, job.state.cid)
                elif attempt >= _ATTEMPTS:
                    raise CorruptCacheError(
                        f"{where}: {what} checksum mismatch in {attempt} fetches from "
                        f"{self.backend.url}; the stored chunk or the network path corrupts "
                        "data: check the endpoint, or delete and rebuild this version"
                    ) from err
                else:
                    attempt += 1
                    self._count_refetch(where, f"{what} checksum mismatch")
            job.from_cache = False
            self._run([job], use_cache=False)

    def _install_whole(self, job: Job) -> None:
        state = job.state
        where = self._where(state)
        self._refetch_until(
            job, where, "chunk", lambda: verify_chunk(self.manifest, state.chunk, job.buf.data)
        )
        if self.cache is not None:
            # One entry for the whole chunk replaces the ranges read before.
            self._cache_call(self.cache.drop_chunk, state.cid)
            self._cache_call(self.cache.update, [], [(state.cid, 0, job.buf.tobytes())])
        view = ChunkView(job.buf.data, self._columns, state.info.count, where)
        with self._lock:
            self.stats.chunks_verified += 1
            self.stats.bytes_verified += state.info.nbytes
            self._resident += state.info.nbytes - state.resident
            state.resident = state.info.nbytes
            state.buf, state.view, state.whole, state.have = job.buf, view, True, None

    def _install_index(self, job: Job) -> None:
        state = job.state
        where = self._where(state)
        size = state.info.index_bytes

        def check_index() -> None:
            if checksum(job.buf[:size].data) != state.info.index_checksum:
                raise CorruptCacheError(f"{where}: chunk index checksum mismatch")

        self._refetch_until(job, where, "chunk index", check_index)
        if self.cache is not None and not job.from_cache:
            self._cache_call(self.cache.update, [], [(state.cid, 0, job.buf[:size].tobytes())])
        header = parse_header(job.buf.data[:size], state.info.nbytes, where)
        if header.get("index_end") != size:
            raise CorruptCacheError(
                f"{where}: chunk index ends at {header.get('index_end')!r}, manifest says {size}"
            )
        sums = BlockSums.from_header(header, job.buf.data[:size], state.info.nbytes, where)
        view = ChunkView(job.buf.data, self._columns, state.info.count, where, header)
        with self._lock:
            self.stats.bytes_verified += size
            state.buf, state.view, state.header, state.sums = job.buf, view, header, sums
            state.have = np.zeros(state.info.count, dtype=bool)
            state.resident = size
            self._resident += size

    def _count_refetch(self, where: str, why: str) -> None:
        logger.warning("%s: %s; fetching it again", where, why)
        with self._lock:
            self.refetches += 1

    def _cache_call(self, fn: Any, *args: Any) -> Any:
        """Run a disk cache operation; on failure disable the cache, keep reading."""
        try:
            return fn(*args)
        except (lmdb.Error, OSError, struct.error) as err:
            logger.warning("read cache disabled after an error: %s", err)
            self.cache = None
            return None

    def _run(self, jobs: Sequence[Job], use_cache: bool = True) -> None:
        """Fill every job's ranges from the disk cache, then the network.

        Data ranges (``job.sums`` set) are checked block by block: cached
        pieces that fail are dropped and fetched, fetched ranges that fail are
        fetched again (``_get``). Only checked bytes enter the disk cache;
        index and whole-chunk jobs are cached by their install step, once
        they pass the manifest's checksum.
        """
        if not jobs:
            return
        cache = self.cache if use_cache else None
        fetches: list[tuple[Job, int, int]] = []
        touched: list[bytes] = []
        damaged: list[bytes] = []
        hits = misses = checked = 0
        for job in jobs:
            gaps: list[Range] = list(job.ranges)
            if cache is not None:
                found = self._cache_call(cache.read, job.state.cid, job.ranges)
                if found is not None:
                    pieces_per_range, used = found
                    gaps, covered = [], 0
                    for (a, b), pieces in zip(job.ranges, pieces_per_range, strict=True):
                        fills, holes = cover(a, b, pieces)
                        if job.sums is not None and any(
                            job.sums.bad_blocks(p.data, p.start) for p in fills
                        ):
                            damaged.append(job.state.cid)
                            fills, holes = [], [(a, b)]
                        for p in fills:
                            job.buf[p.start : p.end] = np.frombuffer(p.data, dtype=np.uint8)
                            covered += p.end - p.start
                            checked += (p.end - p.start) if job.sums is not None else 0
                        gaps += holes
                        hits += not holes
                        misses += bool(holes)
                    if job.whole and gaps and covered < job.state.info.nbytes // 2:
                        # Mostly missing: one request for the chunk beats many for holes.
                        gaps, covered = list(job.ranges), 0
                    else:
                        touched += used
                    job.from_cache = covered > 0
            if gaps:
                starts = np.array([a for a, _ in gaps], dtype=np.int64)
                ends = np.array([b for _, b in gaps], dtype=np.int64)
                for a, b in coalesce(starts, ends, job.gap):
                    step = self.options.max_request_bytes
                    if job.sums is not None:  # keep every request whole blocks
                        step = max(step // job.sums.size, 1) * job.sums.size
                    fetches += [(job, s, min(s + step, b)) for s in range(a, b, step)]
        if damaged and cache is not None:
            logger.warning("read cache entries fail the build's block checksums; dropping them")
            for cid in set(damaged):
                self._cache_call(cache.drop_chunk, cid)
        results: list[bytes] = []
        if fetches:
            pool = self._pool()
            futures = [pool.submit(self._get, job, a, b) for job, a, b in fetches]
            try:
                results = [waits.result(f, self._born) for f in futures]
            finally:
                for f in futures:
                    f.cancel()
        inserts = []
        for (job, a, b), data in zip(fetches, results, strict=True):
            job.buf[a:b] = np.frombuffer(data, dtype=np.uint8)
            if job.sums is not None:
                inserts.append((job.state.cid, a, data))
                checked += len(data)
        with self._lock:
            self.stats.bytes_verified += checked
            self.stats.requests += len(fetches)
            self.stats.bytes_fetched += sum(len(d) for d in results)
            self.stats.cache_hits += hits
            self.stats.cache_misses += misses
        if cache is not None and (touched or inserts):
            self._cache_call(cache.update, touched, inserts)

    def _get(self, job: Job, start: int, end: int) -> bytes:
        """Fetch ``[start, end)`` of a chunk; data ranges are checked block by block.

        A response that fails its block checksums, comes back short, or is
        refused as past the end is fetched again, ``_ATTEMPTS`` times in all,
        then reported as ``CorruptCacheError`` saying which it was. Failed
        requests and broken bodies are the backend's to retry (bounded there).
        """
        where = self._where(job.state)
        key = job.state.info.key
        problem = ""
        for attempt in range(1, _ATTEMPTS + 1):
            if attempt > 1:
                self._count_refetch(f"{where} bytes [{start}, {end})", problem)
            try:
                data = bytes(self.backend.get_range(key, start, end - start))
            except KeyNotFoundError as err:
                raise missing_chunk_error(self.backend, self.manifest, where) from err
            except InvalidArgumentError as err:
                if attempt == _ATTEMPTS:
                    raise CorruptCacheError(
                        f"{where}: bytes [{start}, {end}) were refused as past the end, or "
                        f"answered with another length, {attempt} times (the manifest records "
                        f"{job.state.info.nbytes} bytes for this chunk: the chunk is shorter, or "
                        f"the store or a proxy answers ranged reads wrongly): {err}"
                    ) from err
                problem = f"range refused or short: {err}"
                continue
            if len(data) != end - start:
                problem = f"short response ({len(data)} of {end - start} bytes)"
                continue
            if job.sums is None or not job.sums.bad_blocks(data, start):
                return data
            problem = "block checksum mismatch"
        raise CorruptCacheError(
            f"{where}: bytes [{start}, {end}) from {self.backend.url}: {problem} in "
            f"{_ATTEMPTS} fetches; the stored chunk or the network path corrupts data: check "
            "the endpoint, or delete and rebuild this version"
        )
