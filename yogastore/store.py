"""The store: named, versioned datasets, built once, listed, deleted, copied."""

from __future__ import annotations

import builtins
import collections
import dataclasses
import functools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from storage_backends import Backend, open_backend
from storage_backends.errors import (
    CorruptCacheError,
    DatasetNotFoundError,
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    LockLostError,
    LockTimeoutError,
    StorageError,
    UnsupportedElementError,
    YogaStoreError,
    coordination_refused,
)
from yogastore import boundedjson, housekeeping
from yogastore.build.batches import Batches, items_of_batches
from yogastore.build.buildcheck import (
    BuildOptions,
    canonical_fingerprint,
    check_fingerprint,
    check_schema,
    check_source_size,
    delete_build,
    guarded_items,
)
from yogastore.build.parallel import held_rank_locks, intent_ranks, rank_lock_names
from yogastore.build.progress import Progress, default_progress
from yogastore.build.writer import new_build_id, records_from_iterable, write_dataset
from yogastore.checks import check_int, explain_keyword_only
from yogastore.format.manifest import Manifest, manifest_key, validate_name
from yogastore.format.memory import MappedFault, owned_copy
from yogastore.paths import default_root
from yogastore.read.order import Shuffle
from yogastore.read.read_options import ReadOptions
from yogastore.read.reader import ChunkSource, LocalChunkSource, verify_chunk
from yogastore.read.stream import Stream, StreamState
from yogastore.read.verified import forget_memos
from yogastore.spec import ComponentSpec, Schema

if TYPE_CHECKING:
    from yogastore.queue.work_queue import WorkQueue, WorkQueueState

__all__ = ["DatasetInfo", "DatasetRef", "GcEntry", "Store", "default_root"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_BLOCK_WINDOW = 4
#: Seconds a rank of ``Store.cache_parallel`` waits for the other ranks' parts.
DEFAULT_PARALLEL_TIMEOUT = 3600.0
#: ``Store`` keywords that set a field of its ``ReadOptions`` (not backend options).
_READ_KEYWORDS = ("cache_dir", "cache_bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class GcEntry:
    """What ``Store.gc()`` removed from one dataset version.

    Attributes:
        dataset_id: the dataset.
        version: the version.
        keys: keys removed.
        bytes: bytes freed (values; on disk for a whole local version).
        committed: whether the version has a manifest (only leftovers went).
    """

    dataset_id: str
    version: str
    keys: int
    bytes: int
    committed: bool


@dataclasses.dataclass(frozen=True, slots=True)
class DatasetInfo:
    """One entry of ``Store.list()``."""

    dataset_id: str
    version: str
    num_records: int
    bytes: int


def _readable(schema: Schema) -> Schema:
    """Refuse, before any record is read, a structure nested too deep for its manifest.

    Raises:
        UnsupportedElementError: the manifest would nest deeper than stored JSON is read.
    """
    levels = 1 + boundedjson.depth(json.dumps(schema.to_json()).encode())
    if levels > boundedjson.MAX_DEPTH:
        raise UnsupportedElementError(
            f"the element's structure nests {levels} levels deep in the manifest, and stored "
            f"JSON is read to {boundedjson.MAX_DEPTH} levels: flatten the structure"
        )
    return schema


def _is_tf_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("tensorflow") and hasattr(obj, "element_spec")


_SOURCES_LOCK = threading.Lock()  # DatasetRef.make_source
# Local sources whose tf.data iteration ended (Stream.released_after), by store and build:
# the next source of that build shares their views, as it would a live source's. A few
# builds at most, so views of builds deleted or rebuilt since pin no more than these.
_RELEASED: collections.OrderedDict[tuple[str, str, str], LocalChunkSource] = (
    collections.OrderedDict()
)
_RELEASED_KEPT = 2
_FORKED_AWAY: list[dict[tuple[str, str, str], LocalChunkSource]] = []


def _forget_released(url: str, key: str) -> None:
    """Drop the released views and block memos of every build of one version.

    Called before a delete or rebuild; readers holding either keep theirs.
    """
    with _SOURCES_LOCK:
        for entry in [k for k in _RELEASED if k[:2] == (url, key)]:
            del _RELEASED[entry]
    forget_memos(url, key)


def _after_fork() -> None:
    global _SOURCES_LOCK
    _SOURCES_LOCK = threading.Lock()
    # A child makes views of its own; the parent's are set aside, not dropped, in the hook.
    _FORKED_AWAY.append(dict(_RELEASED))
    _RELEASED.clear()


os.register_at_fork(after_in_child=_after_fork)


class DatasetRef:
    """A committed dataset version: its manifest, schema and streams."""

    def __init__(self, store: Store, manifest: Manifest, element_spec: Any = None) -> None:
        self.store = store
        self.manifest = manifest
        self._element_spec = element_spec
        # Its local sources still in use: a new one shares their views.
        self._sources: weakref.WeakSet[LocalChunkSource] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, Any]:
        # A copy sent to another process (multiprocessing pickles it) shares no views.
        state = self.__dict__.copy()
        del state["_sources"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sources = weakref.WeakSet()

    def __repr__(self) -> str:
        return (
            f"DatasetRef({self.dataset_id!r}, version={self.version!r}, "
            f"num_records={self.num_records}, store={self.store.url!r})"
        )

    @property
    def dataset_id(self) -> str:
        return self.manifest.dataset_id

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def num_records(self) -> int:
        """Number of records in the dataset."""
        return self.manifest.num_records

    @property
    def nbytes(self) -> int:
        """Bytes of all chunks."""
        return self.manifest.nbytes

    @property
    def schema(self) -> Schema:
        return self.manifest.schema

    @property
    def fingerprint(self) -> str:
        """Identifies this build; resume states carry it."""
        return f"{self.dataset_id}/{self.version}/{self.manifest.build_id}"

    @property
    def element_spec(self) -> Any:
        """The ``tf.data`` element_spec of the cached dataset (imports TensorFlow)."""
        if self._element_spec is None:
            from yogastore import tf as ytf

            self._element_spec = ytf.element_spec_from_schema(self.schema)
        return self._element_spec

    def make_source(self) -> ChunkSource:
        """Return a new chunk source reading this dataset.

        From a local store, a source made while another of this reference is
        alive shares its chunk views (``LocalChunkSource.sibling``): a stream
        made before the last one is dropped does not read and parse every
        chunk's index again, only hashes each before it first reads through
        it. The reference itself holds no views: they pin
        the build's pages (a rebuild could not reuse them, a delete could not
        free them) for as long as a source uses them, and the views of the
        last ``_RELEASED_KEPT`` builds released by ``release_source`` until a
        delete or rebuild of their version in this process (or until newer
        builds push them out).
        """
        key = (self.store.backend.url, self.manifest.key, self.manifest.build_id)
        with _SOURCES_LOCK:
            live = next(iter(self._sources), None) or _RELEASED.get(key)
            twin = live.sibling() if live is not None else None
            if twin is None:
                _RELEASED.pop(key, None)
            if twin is not None:
                twin.backend = self.store.backend  # reads on through this store's backend
            source: ChunkSource = twin or self.store.make_source(self.manifest)
            if isinstance(source, LocalChunkSource):
                if twin is None:  # views of a build no longer stored: share none of them
                    self._sources.clear()
                self._sources.add(source)
            return source

    def release_source(self, source: ChunkSource) -> None:
        """Take back a source whose reading ended (``Stream.released_after``).

        Its buffers, and an object store's read threads and chunks in memory,
        are released (``close``); a local source's views are kept for the
        next source of the same build in this process (the last
        ``_RELEASED_KEPT`` builds' only).
        """
        source.close()
        if isinstance(source, LocalChunkSource):
            key = (self.store.backend.url, self.manifest.key, self.manifest.build_id)
            with _SOURCES_LOCK:
                _RELEASED[key] = source
                _RELEASED.move_to_end(key)
                while len(_RELEASED) > _RELEASED_KEPT:
                    _RELEASED.popitem(last=False)

    def _shuffle(self, shuffle: bool | Shuffle) -> Shuffle:
        if isinstance(shuffle, Shuffle):
            return shuffle
        if isinstance(shuffle, bool):
            if not shuffle:
                return Shuffle.NONE
            return Shuffle.BLOCK if self.store.remote else Shuffle.GLOBAL
        raise InvalidArgumentError(f"shuffle must be a bool or Shuffle, got {shuffle!r}")

    # Everything up to num_epochs used to be positional: such calls get a
    # TypeError naming the keywords to use.
    @explain_keyword_only
    def stream(
        self,
        shard_rank: int = 0,
        num_shards: int = 1,
        *,
        shuffle: bool | Shuffle = True,
        seed: int = 0,
        epoch: int = 0,
        start_offset: int = 0,
        drop_remainder: bool = False,
        num_epochs: int | None = 1,
        block_window: int = DEFAULT_BLOCK_WINDOW,
        prefetch: int | None = None,
    ) -> Stream:
        """Return rank ``shard_rank``'s stream of ``num_shards``.

        Every argument after ``num_shards`` is keyword-only.

        Args:
            shard_rank: this rank, ``0 <= shard_rank < num_shards``.
            num_shards: number of ranks sharing each epoch.
            shuffle: ``True`` (global shuffle locally, block shuffle on object
                stores), ``False``, or a ``Shuffle``.
            seed: shuffle seed; every rank must use the same.
            epoch: first epoch number.
            start_offset: skip this many of the rank's records first.
            drop_remainder: give every rank exactly ``N // num_shards`` records.
            num_epochs: epochs to read; ``None`` reads forever.
            block_window: chunks mixed together by ``Shuffle.BLOCK``.
            prefetch: batches read ahead on a background thread (0: none; default:
                2 for object stores, none for local memory-mapped reads, where
                a thread hand-off costs more than the copy it would overlap).

        Raises:
            InvalidArgumentError: an argument is out of range.
        """
        return Stream(
            self,
            shard_rank=shard_rank,
            num_shards=num_shards,
            shuffle=self._shuffle(shuffle),
            seed=seed,
            epoch=epoch,
            start_offset=start_offset,
            drop_remainder=drop_remainder,
            num_epochs=num_epochs,
            block_window=block_window,
            prefetch=prefetch,
        )

    def work_queue(
        self,
        job: str,
        *,
        num_slices: int = 40,
        shuffle: bool | Shuffle = True,
        seed: int = 0,
        epoch: int = 0,
        num_epochs: int = 1,
        lease_seconds: float = 30.0,
        block_window: int | None = None,
        resume: WorkQueueState | str | None = None,
        attempt: str = "",
    ) -> WorkQueue:
        """Return job ``job``'s dynamic work queue over this dataset.

        Each epoch's order (the same as ``stream``'s for ``shuffle``, ``seed``
        and ``epoch``) is cut into ``num_slices`` contiguous slices; workers
        claim them one at a time with ``queue.stream(worker=...)``, so fast
        workers read more. A claim is a lease renewed while its worker reads;
        the slice of a worker that stops renewing for ``lease_seconds`` is read
        again whole by another. Every worker of a job must pass the same
        arguments. ``resume`` (a merged ``WorkQueueState``) continues a job
        from a checkpoint; its ordering arguments replace the others.

        A run of a job is identified by (``job``, resume state, ``attempt``).
        Workers of one start of a job pass the same ``attempt``; a restart
        after a crash (fresh or from a checkpoint) must pass a new one (e.g.
        the launcher's run id or restart count), or call ``queue.delete()``
        first: otherwise it joins the earlier start's progress, and the slices
        that start marked done or still holds are not read again.

        Raises:
            InvalidArgumentError: an argument is out of range.
        """
        from yogastore.queue.work_queue import WorkQueue

        return WorkQueue(
            self,
            job,
            num_slices=num_slices,
            shuffle=shuffle,
            seed=seed,
            epoch=epoch,
            num_epochs=num_epochs,
            lease_seconds=lease_seconds,
            block_window=block_window,
            resume=resume,
            attempt=attempt,
        )

    def resume(
        self,
        state: StreamState | str | bytes,
        shard_rank: int = 0,
        num_shards: int = 1,
        *,
        drop_remainder: bool = False,
        num_epochs: int | None = 1,
        prefetch: int | None = None,
    ) -> Stream:
        """Continue from ``state`` as rank ``shard_rank`` of ``num_shards``.

        The ranks together read exactly the records of ``state.epoch`` not yet
        consumed (each within one record of the others), then, if
        ``num_epochs`` allows, the following epochs in their usual order.
        ``num_shards`` may differ from the count the state was taken with.
        """
        if isinstance(state, str | bytes | bytearray):
            state = StreamState.from_json(bytes(state) if not isinstance(state, str) else state)
        elif not isinstance(state, StreamState):
            raise InvalidArgumentError(
                f"resume state must be a StreamState or its JSON text, got {type(state).__name__}"
            )
        if state.dataset != self.fingerprint or state.num_records != self.num_records:
            raise InvalidArgumentError(
                f"resume state belongs to {state.dataset!r} ({state.num_records} records), "
                f"not {self.fingerprint!r} ({self.num_records} records)"
            )
        return Stream(
            self,
            shard_rank=shard_rank,
            num_shards=num_shards,
            shuffle=state.shuffle,
            seed=state.seed,
            epoch=state.epoch,
            start_offset=0,
            drop_remainder=drop_remainder,
            num_epochs=num_epochs,
            block_window=state.block_window,
            first_intervals=state.remaining,
            prefetch=prefetch,
        )


class Store:
    """A place holding cached datasets: a local directory (LMDB) or an object store.

    Args:
        url: a path, ``file://`` URL or ``s3://bucket/prefix``; ``None`` means
            ``$YOGASTORE_HOME`` or ``~/.cache/yogastore``.
        chunk_bytes: target chunk size when building.
        lock_timeout: seconds to wait for another process building the same
            dataset (``None``: wait as long as it takes).
        read_options: how readers fetch from an object store (a ``ReadOptions``
            or a mapping of its fields); ``cache_dir=`` and ``cache_bytes=``
            given as keywords set those fields too.
        **backend_options: passed to the backend (e.g. ``endpoint_url`` for S3).
            On S3, ``coordination="single-writer"`` builds, deletes and runs
            ``gc`` on a store that ignores conditional writes (by default such
            a store is refused before the first of these; reading never is;
            see ``storage_backends.s3_options.Coordination``).
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        lock_timeout: float | None = None,
        read_options: ReadOptions | Mapping[str, Any] | None = None,
        **backend_options: Any,
    ) -> None:
        chunk_bytes = check_int("chunk_bytes", chunk_bytes, 1)
        self.read_options = ReadOptions.of(read_options)
        shorthand = {k: backend_options.pop(k) for k in _READ_KEYWORDS if k in backend_options}
        default = ReadOptions()
        twice = sorted(k for k in shorthand if getattr(self.read_options, k) != getattr(default, k))
        if twice:
            raise InvalidArgumentError(
                f"{twice} given both as Store keywords and in read_options; give each once"
            )
        if shorthand:
            self.read_options = dataclasses.replace(self.read_options, **shorthand)
        self.url = os.fspath(url) if url is not None else str(default_root())
        self.backend: Backend = open_backend(self.url, **backend_options)
        self.chunk_bytes = self._check_chunk_bytes(chunk_bytes)
        self.lock_timeout = lock_timeout

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _check_chunk_bytes(self, chunk_bytes: int) -> int:
        """Refuse chunks larger than the backend stores as one value (before any build)."""
        most = getattr(self.backend, "max_value_bytes", None)
        if most is not None and chunk_bytes > most:
            raise InvalidArgumentError(
                f"chunk_bytes={chunk_bytes:,} is over the {most:,} bytes "
                f"{type(self.backend).__name__} stores as one value; give a smaller one"
            )
        return chunk_bytes

    @property
    def remote(self) -> bool:
        """Whether the backend is an object store (reads cost requests)."""
        return self.backend.remote

    def make_source(self, manifest: Manifest) -> ChunkSource:
        """Return a chunk source suited to this store's backend."""
        if self.remote:
            from yogastore.read.remote import RemoteChunkSource

            return RemoteChunkSource(self.backend, manifest, self.read_options)
        return LocalChunkSource(self.backend, manifest)

    def _read_manifest(self, dataset_id: str, version: str) -> Manifest | None:
        where = f"dataset {dataset_id!r} version {version!r} in {self.url}"
        try:
            data = self.backend.get(manifest_key(dataset_id, version))
        except KeyNotFoundError:
            return None
        manifest = Manifest.from_json(data, where, f"{dataset_id}/{version}/")
        if manifest.dataset_id != dataset_id or manifest.version != version:
            raise CorruptCacheError(
                f"{where}: manifest names {manifest.dataset_id!r}/{manifest.version!r}"
            )
        return manifest

    def open(self, dataset_id: str, version: str = "1") -> DatasetRef:
        """Return the committed dataset ``dataset_id`` at ``version``.

        Raises:
            DatasetNotFoundError: no committed dataset under that name.
        """
        validate_name(dataset_id, "dataset id")
        validate_name(version, "version")
        manifest = self._read_manifest(dataset_id, version)
        if manifest is None:
            raise DatasetNotFoundError(
                f"no dataset {dataset_id!r} version {version!r} in {self.url}; "
                "build it with Store.cache()"
            )
        return DatasetRef(self, manifest)

    def cache(
        self,
        dataset_id: str,
        version: str = "1",
        make_dataset: Callable[[], Any] | None = None,
        *,
        spec: Any = None,
        chunk_bytes: int | None = None,
        progress: Progress | None = None,
        fingerprint: str | Mapping[str, Any] | None = None,
        rebuild: bool = False,
        max_records: int | None = None,
        max_bytes: int | None = None,
    ) -> DatasetRef:
        """Return the dataset, building it first if it is not cached yet.

        ``make_dataset`` is called only when this process is the one to build,
        or, on a hit without ``spec=``, to compare the ``element_spec`` of the
        ``tf.data.Dataset`` it returns (nothing is read from it). Concurrent
        callers on one machine (or, on S3, anywhere) wait for the builder and
        then read its result.

        Args:
            dataset_id: dataset name (printable, no ``/`` or ``..``).
            version: version name (same rules).
            make_dataset: returns a ``tf.data.Dataset``, or an iterable of numpy
                structures described by ``spec`` (records, or ``Batches`` of them).
            spec: for iterables, a nest of ``ComponentSpec`` (or of ``tf.TypeSpec``).
            chunk_bytes: target chunk size (default: the store's).
            progress: progress sink (default: tqdm on a terminal, else a line
                every ~10 s on stderr).
            fingerprint: what identifies the source (a string, or a JSON-able
                dict such as file names, sizes, mtimes, preprocessing version);
                stored in the manifest and compared on every hit.
            rebuild: replace a committed version deliberately.
            max_records: stop and fail the build past this many records.
            max_bytes: stop and fail the build past this many bytes of records.

        Raises:
            StaleCacheError: the committed version was built from a source with
                another element_spec or fingerprint (pass ``rebuild=True`` or a
                new version).
            BuildLimitError: the source is infinite, or a guard was exceeded;
                nothing of the failed build is left behind.
        """
        validate_name(dataset_id, "dataset id")
        validate_name(version, "version")
        if make_dataset is None or not callable(make_dataset):
            raise InvalidArgumentError("make_dataset must be a callable returning the dataset")
        chunk_bytes = self._check_chunk_bytes(
            check_int("chunk_bytes", chunk_bytes or self.chunk_bytes, 1)
        )
        options = BuildOptions(
            fingerprint=canonical_fingerprint(fingerprint),
            rebuild=rebuild,
            max_records=max_records,
            max_bytes=max_bytes,
        )
        manifest = None if options.rebuild else self._read_manifest(dataset_id, version)
        if manifest is not None:
            return self._hit(manifest, make_dataset, spec, options)
        with self.backend.lock(f"{dataset_id}/{version}", timeout=self.lock_timeout):
            manifest = self._read_manifest(dataset_id, version)
            if manifest is not None and not options.rebuild:
                return self._hit(manifest, make_dataset, spec, options)
            # rebuild=True: the committed version stays readable until the new
            # build replaces its manifest; a failed rebuild leaves it as it was.
            replaces = manifest
            if replaces is not None:  # its views, released here, must not pin its pages
                _forget_released(self.backend.url, replaces.key)
            # Keys left by a build that died before its manifest are never read
            # and are swept after the commit, not now: a holder whose lease ran
            # out unnoticed may still be writing, and deleting first could leave
            # its (refused or not) commit pointing at deleted chunks.
            source = make_dataset()
            total = check_source_size(source, f"{dataset_id}/{version}", options)
            schema, items, element_spec = self._prepare(source, spec)
            items = guarded_items(items, f"{dataset_id}/{version}", options)
            build_id = new_build_id()

            def build() -> Manifest:
                return write_dataset(
                    self.backend,
                    dataset_id,
                    version,
                    schema,
                    items,
                    chunk_bytes=chunk_bytes,
                    progress=progress or default_progress(f"caching {dataset_id}/{version}", total),
                    upload_workers=self.backend.upload_workers,
                    build_id=build_id,
                    source_fingerprint=options.fingerprint,
                    replace=replaces is not None,
                )

            def drop_build() -> None:
                # Still the holder: our own chunks are nobody else's to read. A local
                # version with no manifest goes whole, and this build's chunks with it
                # (deleting them one by one needs room in the file that a full disk lacks).
                if replaces is None and self._drop_uncommitted(dataset_id, version):
                    return
                delete_build(self.backend, dataset_id, version, build_id)

            manifest, ours = self._commit_or_adopt(dataset_id, version, build, drop_build)
            if not ours and manifest.schema != schema:
                element_spec = None
            elif ours and replaces is not None:
                logger.info("%s: rebuilt, replacing build %s", manifest.where, replaces.build_id)
        return DatasetRef(self, manifest, element_spec)

    def cache_parallel(
        self,
        dataset_id: str,
        version: str = "1",
        make_dataset: Callable[..., Any] | None = None,
        *,
        rank: int,
        num_ranks: int,
        attempt: str,
        spec: Any = None,
        chunk_bytes: int | None = None,
        progress: Progress | None = None,
        fingerprint: str | Mapping[str, Any] | None = None,
        timeout: float | None = DEFAULT_PARALLEL_TIMEOUT,
    ) -> DatasetRef:
        """Like ``cache``, with every rank of a job writing its part of the first pass.

        Call it on every rank ``0 <= rank < num_ranks``, with the same source.
        Each rank writes the chunks of its part; once every part is there, one
        manifest commits the whole dataset, and every rank returns the same
        ``DatasetRef``. A committed version is a hit, as with ``cache``.

        The part of a rank: ``make_dataset(rank, num_ranks)`` when
        ``make_dataset`` has exactly two required positional parameters (it
        returns that rank's records only, so no rank reads the others'); otherwise
        ``make_dataset()`` is the whole source and the rank takes
        ``source.shard(num_ranks, rank)`` of a ``tf.data.Dataset`` or every
        ``num_ranks``-th element from ``rank`` of an iterable (each rank then
        iterates the whole source). Records are stored part after part in
        rank order: the order depends only on the source and ``num_ranks``.

        ``attempt`` names this launch of the job: every rank of one launch
        passes the same text, and a launch started again after a failure
        passes a new one (a job id, a launch time the launcher hands to every
        rank; ``yogastore.distributed.cache_parallel`` makes one). Parts of
        other attempts are never used: a rerun writes every part again. A
        rank that finds its own part of its attempt already written (two
        processes with one rank, or an attempt name used again) raises
        ``StaleCacheError``. A rank that does not see every other part within
        ``timeout`` seconds of finishing its own raises ``BuildTimeoutError``
        naming the missing ranks; it commits nothing (the others may still
        commit if the missing parts arrive).

        Args:
            dataset_id: dataset name.
            version: version name.
            make_dataset: returns the source or, given ``(rank, num_ranks)``,
                this rank's part of it (see above).
            rank: this rank.
            num_ranks: number of ranks taking part.
            attempt: the name of this launch, the same on every rank, new
                for every launch (1-200 printable characters).
            spec: for iterables, a nest of ``ComponentSpec`` (or of ``tf.TypeSpec``).
            chunk_bytes: target chunk size (default: the store's).
            progress: progress sink for this rank's part.
            fingerprint: what identifies the source (see ``cache``).
            timeout: seconds to wait for the other ranks' parts (``None``: forever).

        Raises:
            BuildTimeoutError: a part was still missing after ``timeout``.
            StaleCacheError: the committed version, or another parallel build
                of it in progress or abandoned, has another schema or fingerprint.
            InvalidArgumentError: an argument is out of range, or the store
                cannot promise exclusive puts across processes.
        """
        from yogastore.build.parallel import build_parallel

        validate_name(dataset_id, "dataset id")
        validate_name(version, "version")
        if make_dataset is None or not callable(make_dataset):
            raise InvalidArgumentError("make_dataset must be a callable returning the dataset")
        num_ranks = check_int("num_ranks", num_ranks, 1)
        rank = check_int("rank", rank, 0, num_ranks - 1)
        if (
            not isinstance(attempt, str)
            or not 1 <= len(attempt) <= 200
            or not attempt.isprintable()
        ):
            raise InvalidArgumentError(
                f"attempt must be 1-200 printable characters naming this launch, got {attempt!r}"
            )
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0
        ):
            raise InvalidArgumentError(f"timeout must be None or seconds >= 0, got {timeout!r}")
        return build_parallel(
            self,
            dataset_id,
            version,
            make_dataset,
            rank=rank,
            num_ranks=num_ranks,
            attempt=attempt,
            spec=spec,
            chunk_bytes=self._check_chunk_bytes(
                check_int("chunk_bytes", chunk_bytes or self.chunk_bytes, 1)
            ),
            progress=progress,
            fingerprint=canonical_fingerprint(fingerprint),
            timeout=timeout,
        )

    def _hit(
        self,
        manifest: Manifest,
        make_dataset: Callable[[], Any],
        spec: Any,
        options: BuildOptions,
    ) -> DatasetRef:
        """Return a committed version after checking it was built from this source."""
        check_fingerprint(manifest, options.fingerprint)
        if spec is not None:
            schema, element_spec = self._schema_of_spec(spec), None
        else:
            source = make_dataset()
            if not _is_tf_dataset(source):
                raise InvalidArgumentError(
                    "make_dataset returned a non-tf.data iterable; pass spec= "
                    "(a nest of ComponentSpec)"
                )
            from yogastore import tf as ytf

            schema = ytf.schema_from_element_spec(source.element_spec)
            element_spec = source.element_spec
        check_schema(manifest, schema)
        return DatasetRef(self, manifest, element_spec)

    def _schema_of_spec(self, spec: Any) -> Schema:
        if _contains_component_spec(spec):
            return Schema.from_specs(spec)
        from yogastore import tf as ytf

        return ytf.schema_from_element_spec(spec)

    def _drop_uncommitted(self, dataset_id: str, version: str) -> bool:
        """After a failed build (lock held): free a local version that has no manifest.

        On a local store the lock cannot be lost unnoticed, so whatever the
        version holds is dead: its files go (an LMDB file never shrinks, and a
        full disk must not stay full), and its lock file. On an object store
        another builder may still be writing after a lease it lost: only the
        failed build's own chunks are deleted (``delete_build``); ``gc`` removes
        the rest. Returns whether the version's files went.
        """
        if self.backend.remote:
            return False
        name = f"{dataset_id}/{version}"
        try:
            if self._read_manifest(dataset_id, version) is not None:
                return False
            self.backend.delete_prefix(name + "/")
            self.backend.delete_lock(name)
        except YogaStoreError as err:
            logger.warning("%s: could not remove the failed build's files: %s", name, err)
            return False
        return True

    def _commit_or_adopt(
        self,
        dataset_id: str,
        version: str,
        commit: Callable[[], Manifest],
        abandon: Callable[[], None] | None = None,
    ) -> tuple[Manifest, bool]:
        """Write a version under its lock; if another writer's commit won, adopt it.

        ``commit`` writes the chunks and then the manifest (the exclusive put
        that commits). It is refused when another manifest is already there
        (``KeyExistsError``) or another process took the lock over
        (``LockLostError``): that writer's committed manifest, if any, is then
        the answer. While this process still holds the lock (our commit, or a
        refused exclusive put), the keys the committed manifest does not name
        are swept. Called holding the version's lock.

        Args:
            dataset_id: the dataset.
            version: the version.
            commit: writes the version and returns its committed manifest.
            abandon: called when ``commit`` fails for any other reason,
                before the error propagates (drop what it wrote).

        Returns:
            The committed manifest, and whether it is ours.
        """
        try:
            manifest = commit()
        except (KeyExistsError, LockLostError) as err:
            winner = self._winner(dataset_id, version)
            if winner is None:
                raise
            if isinstance(err, KeyExistsError):  # still the holder: clean up
                self._sweep(winner)
            return winner, False
        except BaseException:
            if abandon is not None:
                abandon()
            raise
        self._sweep(manifest)
        return manifest, True

    def _winner(self, dataset_id: str, version: str) -> Manifest | None:
        """Return the manifest another builder committed when ours was refused."""
        manifest = self._read_manifest(dataset_id, version)
        if manifest is None:
            return None
        logger.warning(
            "%s: another builder committed build %s first; using it and dropping this build",
            manifest.where,
            manifest.build_id,
        )
        return manifest

    def _sweep(self, manifest: Manifest) -> None:
        """Delete the keys of a version that its committed manifest does not name.

        They are leftovers of builds that died or lost the lock; readers never
        see them. Best effort: the dataset is committed either way.
        """
        if not self.backend.coordinated:
            # Without enforced conditional writes another builder may still be
            # writing what looks like a leftover: never delete it here.
            return
        prefix = f"{manifest.dataset_id}/{manifest.version}/"
        keep = manifest.keys()
        try:
            stale = [key for key in self.backend.list(prefix) if key not in keep]
            for key in stale:
                self.backend.delete(key)
        except StorageError as err:
            logger.warning(
                "%s: could not delete leftovers of other builds: %s", manifest.where, err
            )
            return
        if stale:
            logger.info("%s: deleted %d leftover keys of other builds", manifest.where, len(stale))

    def _prepare(self, source: Any, spec: Any) -> tuple[Schema, Iterable[Any], Any]:
        if _is_tf_dataset(source):
            from yogastore import tf as ytf

            schema = _readable(ytf.schema_from_element_spec(source.element_spec))
            return schema, ytf.dataset_items(source, schema), source.element_spec
        if spec is None:
            raise InvalidArgumentError(
                "make_dataset returned a non-tf.data iterable; pass spec= (a nest of ComponentSpec)"
            )
        schema = _readable(self._schema_of_spec(spec))
        element_spec = None if _contains_component_spec(spec) else spec
        if isinstance(source, Batches):
            return schema, items_of_batches(schema, source), element_spec
        if element_spec is not None:
            from yogastore import tf as ytf

            source = ytf.numpy_records(source)
        return schema, records_from_iterable(schema, source), element_spec

    def cacheable(
        self, dataset_id: str, version: str = "1", **options: Any
    ) -> Callable[[Callable[[], Any]], Callable[[], DatasetRef]]:
        """Decorator form of ``cache``: calling the decorated function returns the ref."""

        def decorate(fn: Callable[[], Any]) -> Callable[[], DatasetRef]:
            @functools.wraps(fn)
            def wrapper() -> DatasetRef:
                return self.cache(dataset_id, version, fn, **options)

            return wrapper

        return decorate

    def list(self) -> list[DatasetInfo]:
        """Return every committed dataset version in this store.

        A version whose manifest or file is damaged is skipped with a warning
        (``verify`` and ``delete`` name it); builds without a manifest are not
        listed, and neither is anything yogastore did not write (see ``versions``).
        """
        out = []
        for dataset_id, version in self.versions():
            try:
                manifest = self._read_manifest(dataset_id, version)
            except CorruptCacheError as err:
                logger.warning("skipping %s/%s: %s", dataset_id, version, err)
                continue
            if manifest is not None:
                out.append(
                    DatasetInfo(
                        manifest.dataset_id, manifest.version, manifest.num_records, manifest.nbytes
                    )
                )
        return out

    def versions(self) -> builtins.list[tuple[str, str]]:
        """Return the (dataset id, version) pairs that have keys, committed or not, sorted.

        Only yogastore's own versions count: ``<id>/<version>/`` holding
        nothing but a ``manifest.json``, chunks ``c-<build>-<n>`` and the
        intents and parts of parallel builds (``cache_parallel``), under
        valid names. Anything else found under the store's root (another
        program's LMDB files, say) is never listed, collected nor deleted.
        A damaged local version is skipped with a warning.
        """
        return housekeeping.own_versions(self.backend, self.url)

    def building(self, dataset_id: str, version: str = "1") -> bool:
        """Return whether a build of this version holds its lock right now.

        A rank of a parallel build (``cache_parallel``) holding its lock counts
        too. A local store takes the locks for an instant when they are free;
        an object store only looks at the lock objects (``Backend.lock_held``),
        so, as any read, this needs no write access and no conditional writes.
        Asking about a version that does not exist leaves nothing behind.
        """
        validate_name(dataset_id, "dataset id")
        validate_name(version, "version")
        name = f"{dataset_id}/{version}"
        if self.remote:
            counts = intent_ranks(self.backend.list(name + "/"), name + "/")
            names = [name, *rank_lock_names(dataset_id, version, counts)]
            return any(self.backend.lock_held(lock) for lock in names)
        try:
            with self.backend.lock(name, timeout=0):
                keys = self.backend.list(name + "/")
                counts = intent_ranks(keys, name + "/")
                with held_rank_locks(self.backend, dataset_id, version, counts, 0):
                    pass
                if not keys:
                    self.backend.delete_lock(name)
                return False
        except LockTimeoutError:
            return True

    def delete(self, dataset_id: str, version: str = "1") -> None:
        """Delete every trace of a dataset version.

        The manifest goes first (readers never see half a dataset), then the
        chunks of every build of it, committed or not, then its directory and
        lock (and the dataset's directory with its last version), and last
        the keys of its work queue jobs. A local version whose file is damaged
        is removed without opening it. Waits for a build in progress (up to
        ``lock_timeout``), including every rank of a parallel one
        (``cache_parallel``), whose intents and parts go too.

        Raises:
            DatasetNotFoundError: nothing of that version is in the store.
            InvalidArgumentError: the place holds keys yogastore did not write
                (another program's data); nothing is deleted.
            LockTimeoutError: a build kept the lock past ``lock_timeout``.
            CoordinationError: the store ignores conditional writes and was
                not opened with ``coordination="single-writer"``.
        """
        from yogastore.queue.work_queue import queue_prefix

        validate_name(dataset_id, "dataset id")
        validate_name(version, "version")
        prefix = f"{dataset_id}/{version}/"
        name = f"{dataset_id}/{version}"
        self._check_coordination(f"delete {name}")
        _forget_released(self.backend.url, manifest_key(dataset_id, version))
        with self.backend.lock(name, timeout=self.lock_timeout):
            keys = self.backend.list(prefix)
            housekeeping.check_own(keys, prefix, self.url)
            present = bool(keys) or self.backend.disk_usage(prefix) > 0
            committed = manifest_key(dataset_id, version)
            # Ranks of a parallel build still running hold their locks.
            counts = intent_ranks(keys, prefix)
            with held_rank_locks(self.backend, dataset_id, version, counts, self.lock_timeout):
                if committed in keys:
                    self.backend.delete(committed)
                self.backend.delete_prefix(prefix)
            self.backend.delete_lock(name)
        queues = queue_prefix(dataset_id, version)
        queue_keys = self.backend.list(queues)
        if queue_keys:
            self.backend.delete_prefix(queues)
        if not present and not queue_keys:
            raise DatasetNotFoundError(
                f"no dataset {dataset_id!r} version {version!r} in {self.url}"
            )

    def gc(self) -> builtins.list[GcEntry]:
        """Remove what dead builds left behind, in every dataset version.

        A version without a manifest (its build died or failed) is deleted
        whole, with its lock and, if it was the last, its dataset's directory;
        a committed version loses the chunks its manifest does not name. A
        version whose lock is held (a build in progress) is not touched, nor
        is one whose manifest or file is damaged (``verify`` and ``delete``
        deal with it), nor anything yogastore did not write (see ``versions``).

        Returns:
            One entry per version something was removed from.

        Raises:
            CoordinationError: the store ignores conditional writes and was
                not opened with ``coordination="single-writer"``.
        """
        self._check_coordination("run gc")
        return housekeeping.collect_garbage(self)

    def _check_coordination(self, operation: str) -> None:
        """Refuse ``operation``, a change its locks keep safe, where they cannot.

        A store opened with ``coordination="single-writer"`` (a backend that
        declares ``coordinated = False``) trusts its user instead.

        Raises:
            CoordinationError: the store ignores conditional writes.
        """
        if not self.backend.coordinated:
            return
        problem = self.backend.exclusive_puts_problem()
        if problem is not None:
            raise coordination_refused(operation, self.url, problem)

    def copy(self, dataset_id: str, version: str = "1", *, to: Store) -> DatasetRef:
        """Copy a dataset version to another store, verifying every chunk's checksum."""
        ref = self.open(dataset_id, version)
        key = ref.manifest.key
        if to.backend.exists(key):
            return to.open(dataset_id, version)

        def upload() -> Manifest:
            for i, info in enumerate(ref.manifest.chunks):
                try:
                    data = owned_copy(self.backend.get(info.key))
                except MappedFault as err:  # the source's file was cut short meanwhile
                    self.backend.check_mapped(info.key)  # names it when it stays short
                    raise CorruptCacheError(
                        f"copying from {self.url}: chunk {i} ({info.key}) faulted: {err}"
                    ) from err
                try:
                    verify_chunk(ref.manifest, i, data)
                except CorruptCacheError as err:
                    raise CorruptCacheError(f"copying from {self.url}: {err}") from err
                to.backend.put(info.key, data)
            to.backend.put_exclusive(key, ref.manifest.to_json())
            return ref.manifest

        to._check_coordination(f"copy {dataset_id}/{version}")
        with to.backend.lock(f"{dataset_id}/{version}", timeout=to.lock_timeout):
            if to.backend.exists(key):
                return to.open(dataset_id, version)  # another copier finished first
            # Leftovers of a copy or build that died are swept after the commit.
            manifest, ours = to._commit_or_adopt(dataset_id, version, upload)
            if not ours:
                return DatasetRef(to, manifest)
        return to.open(dataset_id, version)


def _contains_component_spec(spec: Any) -> bool:
    if isinstance(spec, ComponentSpec):
        return True
    if isinstance(spec, dict):
        return any(_contains_component_spec(v) for v in spec.values())
    if isinstance(spec, tuple | list):
        return any(_contains_component_spec(v) for v in spec)
    return False
