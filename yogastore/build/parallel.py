"""First pass across ranks: each rank writes its part, one manifest commits them all.

Keys, flat under ``<dataset>/<version>/`` (so a local version stays one LMDB
environment):

* ``intent-n<N>-<attempt>.json`` (``<attempt>``: a digest of the attempt's
  name): created with an exclusive put by the first rank of one launch of a
  job of N ranks. It holds the build id every rank of that launch uses, N,
  the attempt's name, how the source is split, the schema and the source
  fingerprint; a rank whose source or split differs is refused. Another
  launch (a new attempt) has another intent and another build id, so parts
  of a failed launch are never mixed into a new one.
* ``c-<build>-r<rank>-<n>``: the chunks of rank ``rank``'s part.
* ``part-<build>-r<rank>.json``: the rank's part, a manifest of its chunks
  (records numbered from 0), written last with an exclusive put. A rank that
  finds its own part there already was started twice in one attempt: it is
  refused, since its part may come from another source.
* ``manifest.json``: the commit, assembled from the parts in rank order by the
  first rank that sees every part, and written with an exclusive put; the
  others adopt it. The winner then deletes the intent, the parts and every
  chunk the manifest does not name. Without every part there is no manifest,
  so a version is never visible in part.

Liveness: each rank holds the lock ``<dataset>/<version>..n<N>-r<rank>``
(no version name contains ``..``) from start to end; the kernel (local
stores) or the end of its lease (S3) releases it when the rank dies. A rank
reads the manifest and the intent holding the version's build lock for a
moment, and ``gc`` and ``delete`` hold that lock and then every rank lock of
the version's intents before they remove anything: a live build is never
collected, and no rank adopts an intent that is being deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import xxhash

from storage_backends import Backend
from storage_backends.errors import (
    BuildTimeoutError,
    CorruptCacheError,
    DatasetNotFoundError,
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
    StaleCacheError,
)
from yogastore import boundedjson
from yogastore.build.batches import Batches
from yogastore.build.buildcheck import (
    BuildOptions,
    check_fingerprint,
    check_schema,
    check_source_size,
)
from yogastore.build.progress import Progress, default_progress
from yogastore.build.writer import (
    chunk_key_prefix,
    commit_manifest,
    creation_info,
    new_build_id,
    write_chunks,
)
from yogastore.checks import check_int
from yogastore.format.manifest import Manifest
from yogastore.spec import Schema

if TYPE_CHECKING:
    from yogastore.store import DatasetRef, Store

__all__ = [
    "build_parallel",
    "held_rank_locks",
    "intent_key",
    "intent_ranks",
    "part_key",
    "rank_lock_name",
    "rank_lock_names",
]

logger = logging.getLogger(__name__)

_INTENT_NAME = re.compile(r"intent-n([0-9]+)-([0-9a-f]{16})\.json")
_FORMAT = "yogastore-parallel-intent"
_FIRST_POLL = 0.05
_MAX_POLL = 2.0


def attempt_digest(attempt: str) -> str:
    """Return the 16 hex digits that stand for an attempt's name in keys and lock names."""
    return xxhash.xxh3_64_hexdigest(attempt.encode())


def intent_key(dataset_id: str, version: str, num_ranks: int, attempt: str) -> str:
    """Return the key of the intent of one attempt of a parallel build of ``num_ranks`` ranks."""
    return f"{dataset_id}/{version}/intent-n{num_ranks}-{attempt_digest(attempt)}.json"


def part_key(dataset_id: str, version: str, build_id: str, rank: int) -> str:
    """Return the key of rank ``rank``'s part manifest."""
    return f"{dataset_id}/{version}/part-{build_id}-r{rank}.json"


def rank_lock_name(dataset_id: str, version: str, num_ranks: int, digest: str, rank: int) -> str:
    """Return the name of the lock a rank of one attempt holds while it takes part in it."""
    return f"{dataset_id}/{version}..n{num_ranks}-{digest}-r{rank}"


def rank_lock_names(
    dataset_id: str, version: str, attempts: Iterable[tuple[int, str]]
) -> list[str]:
    """Return the rank lock names of the parallel builds ``attempts`` (``intent_ranks``)."""
    return [
        rank_lock_name(dataset_id, version, n, digest, r)
        for n, digest in sorted(set(attempts))
        for r in range(n)
    ]


def intent_ranks(keys: Iterable[str], prefix: str) -> list[tuple[int, str]]:
    """Return (rank count, attempt digest) of the parallel builds whose intents are in ``keys``."""
    found = (_INTENT_NAME.fullmatch(key[len(prefix) :]) for key in keys if key.startswith(prefix))
    return sorted((int(m.group(1)), m.group(2)) for m in found if m is not None)


@contextlib.contextmanager
def held_rank_locks(
    backend: Backend,
    dataset_id: str,
    version: str,
    attempts: Iterable[tuple[int, str]],
    timeout: float | None,
) -> Iterator[None]:
    """Hold every rank lock of the parallel builds ``attempts`` (``intent_ranks``); remove them.

    Raises:
        LockTimeoutError: a rank is still running after ``timeout`` seconds.
    """
    names = rank_lock_names(dataset_id, version, attempts)
    with contextlib.ExitStack() as held:
        for name in names:
            held.enter_context(backend.lock(name, timeout=timeout))
        yield
        for name in names:
            backend.delete_lock(name)


@dataclasses.dataclass(frozen=True, slots=True)
class _Intent:
    build_id: str
    num_ranks: int
    schema: Schema
    fingerprint: str | None
    attempt: str
    # "caller": make_dataset(rank, n); "stride": every n-th element from rank;
    # "stride-batches": every n-th batch of a ``Batches`` source from rank
    split: str

    def to_json(self) -> bytes:
        doc = {
            "format": _FORMAT,
            "build_id": self.build_id,
            "num_ranks": self.num_ranks,
            "attempt": self.attempt,
            "split": self.split,
            "schema": self.schema.to_json(),
            "source_fingerprint": self.fingerprint,
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | memoryview, where: str) -> _Intent:
        doc = boundedjson.loads(data, where, CorruptCacheError)
        build_id = doc.get("build_id") if isinstance(doc, dict) else None
        fingerprint = doc.get("source_fingerprint") if isinstance(doc, dict) else None
        if (
            not isinstance(doc, dict)
            or doc.get("format") != _FORMAT
            or not isinstance(build_id, str)
            or not re.fullmatch(r"[0-9a-f]{12}", build_id)
            or not (fingerprint is None or isinstance(fingerprint, str))
            or not isinstance(doc.get("attempt"), str)
            or doc.get("split") not in ("caller", "stride", "stride-batches")
        ):
            raise CorruptCacheError(
                f"{where} is not a parallel build intent; delete the version and build it again"
            )
        num_ranks = check_int(
            f"{where}: num_ranks", doc.get("num_ranks"), 1, error=CorruptCacheError
        )
        schema = Schema.from_json(doc.get("schema"), where)
        return cls(build_id, num_ranks, schema, fingerprint, doc["attempt"], doc["split"])


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    """One rank's view of a parallel build."""

    store: Store
    dataset_id: str
    version: str
    rank: int
    num_ranks: int
    attempt: str

    @property
    def name(self) -> str:
        return f"{self.dataset_id}/{self.version}"

    @property
    def backend(self) -> Backend:
        return self.store.backend

    def intent_key(self) -> str:
        return intent_key(self.dataset_id, self.version, self.num_ranks, self.attempt)

    def part_key(self, build_id: str, rank: int) -> str:
        return part_key(self.dataset_id, self.version, build_id, rank)

    def lock_name(self, rank: int) -> str:
        digest = attempt_digest(self.attempt)
        return rank_lock_name(self.dataset_id, self.version, self.num_ranks, digest, rank)

    def rank_is_running(self, rank: int) -> bool:
        """Whether a process holds rank ``rank``'s lock of this attempt (it is taking part)."""
        try:
            with self.backend.lock(self.lock_name(rank), timeout=0):
                return False
        except LockTimeoutError:
            return True

    def refuse_own_part(self, build_id: str) -> None:
        """Refuse to run as a rank whose part of this attempt is written already."""
        if self.backend.exists(self.part_key(build_id, self.rank)):
            raise StaleCacheError(
                f"caching {self.name}: part {self.rank} of {self.num_ranks} of attempt "
                f"{self.attempt!r:.100} is written already: two processes run as rank "
                f"{self.rank}, or this attempt was started before (its part may come from "
                "another source); give every launch a new attempt"
            )


def _takes_shard(make_dataset: Callable[..., Any]) -> bool:
    """Whether ``make_dataset`` has exactly two required positional parameters."""
    try:
        params = inspect.signature(make_dataset).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is p.empty]
    return len(required) == 2


def _part_source(make_dataset: Callable[..., Any], rank: int, num_ranks: int) -> Any:
    """Return this rank's part of the source (see ``Store.cache_parallel``)."""
    from yogastore.store import _is_tf_dataset

    if _takes_shard(make_dataset):
        return make_dataset(rank, num_ranks)
    source = make_dataset()
    if _is_tf_dataset(source):
        return source.shard(num_ranks, rank)
    if isinstance(source, Batches):
        return Batches(itertools.islice(iter(source), rank, None, num_ranks))
    return itertools.islice(iter(source), rank, None, num_ranks)


def _adopt_intent(job: _Job, schema: Schema, fingerprint: str | None, split: str) -> _Intent:
    """Create the attempt's intent, or read the one another rank created and check it."""
    mine = _Intent(new_build_id(), job.num_ranks, schema, fingerprint, job.attempt, split)
    key = job.intent_key()
    try:
        job.backend.put_exclusive(key, mine.to_json())
        return mine
    except KeyExistsError:
        pass
    where = f"parallel build intent {key!r} in {job.store.url}"
    theirs = _Intent.from_json(job.backend.get(key), where)
    what = []
    if theirs.num_ranks != job.num_ranks:
        what.append(f"{theirs.num_ranks} ranks")
    if theirs.schema != schema:
        what.append("another schema")
    if theirs.fingerprint != fingerprint:
        what.append(f"source fingerprint {theirs.fingerprint!r:.200}")
    if theirs.attempt != job.attempt:
        what.append(f"attempt {theirs.attempt!r:.200}")
    if theirs.split != split:
        how = {
            "caller": "make_dataset(rank, num_ranks)",
            "stride": "every n-th element",
            "stride-batches": "every n-th batch of Batches",
        }
        what.append(f"its source split by {how[theirs.split]}")
    if what:
        raise StaleCacheError(
            f"{where} belongs to a build of {job.name} with {', '.join(what)}, not this "
            f"source; if no rank of that build runs any more, remove it with `yogastore "
            f"delete {job.dataset_id} {job.version}` (or Store.delete / `yogastore gc`), "
            "or cache this source under another version"
        )
    return theirs


def _read_part(job: _Job, intent: _Intent, rank: int) -> Manifest:
    key = job.part_key(intent.build_id, rank)
    where = f"part {rank} of {job.num_ranks} of {job.name} ({key!r} in {job.store.url})"
    prefix = chunk_key_prefix(job.dataset_id, job.version, intent.build_id, rank)
    part = Manifest.from_json(job.backend.get(key), where, f"{job.name}/")
    bad = [c.key for c in part.chunks if not c.key.startswith(prefix)]
    if (part.dataset_id, part.version, part.build_id) != (
        job.dataset_id,
        job.version,
        intent.build_id,
    ) or bad:
        raise CorruptCacheError(
            f"{where} names another build or rank; delete the version and build it again"
        )
    if part.schema != intent.schema:
        raise CorruptCacheError(f"{where} has another schema than the build's intent")
    return part


def _write_part(
    job: _Job,
    intent: _Intent,
    items: Iterable[Any],
    *,
    chunk_bytes: int,
    progress: Progress,
) -> None:
    """Write this rank's chunks, then (last) its part manifest."""
    table = write_chunks(
        job.backend,
        chunk_key_prefix(job.dataset_id, job.version, intent.build_id, job.rank),
        intent.schema,
        items,
        chunk_bytes=chunk_bytes,
        progress=progress,
        upload_workers=job.backend.upload_workers,
    )
    part = Manifest(
        dataset_id=job.dataset_id,
        version=job.version,
        num_records=table.num_records,
        schema=intent.schema,
        chunks=table.chunks,
        build_id=intent.build_id,
        created=creation_info(chunk_bytes, rank=job.rank, num_ranks=job.num_ranks),
        source_fingerprint=intent.fingerprint,
    )
    try:
        job.backend.put_exclusive(job.part_key(intent.build_id, job.rank), part.to_json())
    except KeyExistsError:
        # Another process wrote this rank's part meanwhile (one whose lease on
        # the rank lock ran out while it was paused): its chunk table must
        # describe the chunks as they are now, i.e. as this process wrote them.
        if _read_part(job, intent, job.rank).chunks != part.chunks:
            raise CorruptCacheError(
                f"{job.name}: two processes wrote part {job.rank} of {job.num_ranks} of build "
                f"{intent.build_id} with different chunks; delete the version and build it "
                "again, with one process per rank"
            ) from None


def _assemble(job: _Job, intent: _Intent, chunk_bytes: int) -> Manifest:
    """Return the manifest of every part, in rank order."""
    chunks = []
    first = 0
    for rank in range(job.num_ranks):
        part = _read_part(job, intent, rank)
        chunks += [dataclasses.replace(c, first=c.first + first) for c in part.chunks]
        first += part.num_records
    return Manifest(
        dataset_id=job.dataset_id,
        version=job.version,
        num_records=first,
        schema=intent.schema,
        chunks=tuple(chunks),
        build_id=intent.build_id,
        created=creation_info(chunk_bytes, num_ranks=job.num_ranks),
        source_fingerprint=intent.fingerprint,
    )


def _missing_parts(job: _Job, intent: _Intent, ranks: list[int], *, all_of_them: bool) -> list[int]:
    """Return the ranks of ``ranks`` whose parts are not there yet.

    Looks in rank order and, unless ``all_of_them``, stops at the first missing
    part: a waiting rank then costs one request per poll.
    """
    missing = []
    for rank in ranks:
        if not job.backend.exists(job.part_key(intent.build_id, rank)):
            missing.append(rank)
            if not all_of_them:
                return missing + [r for r in ranks if r > rank]
    return missing


def _wait_and_commit(
    job: _Job, intent: _Intent, timeout: float | None, chunk_bytes: int
) -> Manifest:
    """Wait for every part, then commit the manifest or adopt the one committed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting = [r for r in range(job.num_ranks) if r != job.rank]
    pause = _FIRST_POLL
    while True:
        committed = job.store._read_manifest(job.dataset_id, job.version)
        if committed is not None:
            return committed
        waiting = _missing_parts(job, intent, waiting, all_of_them=False)
        if not waiting:
            break
        if deadline is not None and time.monotonic() >= deadline:
            missing = _missing_parts(job, intent, waiting, all_of_them=True)
            if missing:
                raise BuildTimeoutError(
                    f"caching {job.name} on {job.num_ranks} ranks (attempt "
                    f"{job.attempt!r:.100}): rank {job.rank} stopped waiting after {timeout}s "
                    f"for the parts of ranks {missing} and commits nothing (the other ranks "
                    "commit if those parts still arrive); if those ranks failed, start every "
                    "rank again with a new attempt"
                )
            break
        time.sleep(pause)
        pause = min(pause * 1.5, _MAX_POLL)
    # Every other part must come from a rank of this launch: its writer waits,
    # holding its rank lock, until the commit. A part without a running writer
    # was left by an earlier launch under this attempt's name (or by a rank
    # that gave up): committing it could mix in records of another source.
    gone = [r for r in range(job.num_ranks) if r != job.rank and not job.rank_is_running(r)]
    committed = job.store._read_manifest(job.dataset_id, job.version)
    if committed is not None:
        return committed
    if gone:
        raise StaleCacheError(
            f"caching {job.name} on {job.num_ranks} ranks (attempt {job.attempt!r:.100}): "
            f"the parts of ranks {gone} were written by processes that are not running any "
            "more (an earlier launch used this attempt's name, or those ranks gave up); "
            "nothing was committed: start every rank again with a new attempt"
        )
    try:
        manifest = _assemble(job, intent, chunk_bytes)
        commit_manifest(job.backend, manifest)
    except (KeyExistsError, KeyNotFoundError):
        # Another rank committed first (and may have swept the parts already).
        committed = job.store._read_manifest(job.dataset_id, job.version)
        if committed is None:
            raise
        return committed
    logger.info(
        "cached %s on %d ranks: %d records, %d chunks, %.1f MB",
        job.name,
        job.num_ranks,
        manifest.num_records,
        len(manifest.chunks),
        manifest.nbytes / 1e6,
    )
    job.store._sweep(manifest)  # the intents, the parts, chunks of other builds
    return manifest


def build_parallel(
    store: Store,
    dataset_id: str,
    version: str,
    make_dataset: Callable[..., Any],
    *,
    rank: int,
    num_ranks: int,
    attempt: str,
    spec: Any,
    chunk_bytes: int,
    progress: Progress | None,
    fingerprint: str | None,
    timeout: float | None,
) -> DatasetRef:
    """Take part in a parallel first pass as ``rank`` of ``num_ranks``: ``Store.cache_parallel``."""
    job = _Job(store, dataset_id, version, rank, num_ranks, attempt)
    options = BuildOptions(fingerprint=fingerprint)
    committed = store._read_manifest(dataset_id, version)
    if committed is None:
        problem = store.backend.exclusive_puts_problem()
        if problem is not None:
            raise InvalidArgumentError(
                f"caching {job.name} on {num_ranks} ranks needs exclusive puts that hold "
                f"across processes, and {store.url} cannot promise them: {problem}"
            )
        # Before taking the rank lock (a committer reads a held lock as "this
        # rank's part is from this launch"): a part of ours from an earlier
        # launch of this attempt is refused now.
        try:
            known = _Intent.from_json(job.backend.get(job.intent_key()), job.intent_key())
        except KeyNotFoundError:
            known = None
        if known is not None:
            job.refuse_own_part(known.build_id)
        lock = job.lock_name(rank)
        with store.backend.lock(lock, timeout=store.lock_timeout):
            try:
                committed, element_spec = _take_part(
                    job, make_dataset, spec, chunk_bytes, progress, options, timeout
                )
            finally:
                store.backend.delete_lock(lock)
        if committed is not None:
            from yogastore.store import DatasetRef

            with _no_rebuild_advice():
                check_fingerprint(committed, options.fingerprint)
            return DatasetRef(store, committed, element_spec)
        committed = store._read_manifest(dataset_id, version)  # committed meanwhile
        if committed is None:
            raise DatasetNotFoundError(f"{job.name} was deleted while rank {rank} opened it")

    def whole() -> Any:
        return make_dataset(rank, num_ranks) if _takes_shard(make_dataset) else make_dataset()

    with _no_rebuild_advice():
        return store._hit(committed, whole, spec, options)


@contextlib.contextmanager
def _no_rebuild_advice() -> Iterator[None]:
    """Turn ``cache``'s "pass rebuild=True" advice into what ``cache_parallel`` offers."""
    try:
        yield
    except StaleCacheError as err:
        raise StaleCacheError(
            f"{err} (cache_parallel has no rebuild=: delete the version, then cache it "
            "again, or use a new version)"
        ) from err


def _take_part(
    job: _Job,
    make_dataset: Callable[..., Any],
    spec: Any,
    chunk_bytes: int,
    progress: Progress | None,
    options: BuildOptions,
    timeout: float | None,
) -> tuple[Manifest | None, Any]:
    """Write this rank's part unless there; return the committed manifest (``None``: a hit)."""
    store = job.store
    source = _part_source(make_dataset, job.rank, job.num_ranks)
    total = check_source_size(source, job.name, options)
    schema, items, element_spec = store._prepare(source, spec)
    if _takes_shard(make_dataset):
        split = "caller"
    else:
        split = "stride-batches" if isinstance(source, Batches) else "stride"
    with store.backend.lock(job.name, timeout=store.lock_timeout):
        if store._read_manifest(job.dataset_id, job.version) is not None:
            return None, None  # committed meanwhile: checked as a hit
        try:
            intent = _adopt_intent(job, schema, options.fingerprint, split)
        except KeyNotFoundError:
            # The intent went between our exclusive put and our read: a rank
            # committed and swept it. That commit is the answer.
            if store._read_manifest(job.dataset_id, job.version) is not None:
                return None, None
            raise
    job.refuse_own_part(intent.build_id)
    label = f"caching {job.name} part {job.rank}/{job.num_ranks}"
    _write_part(
        job,
        intent,
        items,
        chunk_bytes=chunk_bytes,
        progress=progress or default_progress(label, total),
    )
    committed = _wait_and_commit(job, intent, timeout, chunk_bytes)
    check_schema(committed, schema)
    return committed, element_spec if committed.schema == schema else None
