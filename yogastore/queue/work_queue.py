"""A dynamic work queue over a cached dataset: fast workers take more.

Each epoch's global order (the same order ``DatasetRef.stream`` uses) is cut
into ``num_slices`` contiguous slices of positions. A worker claims the next
free slice with an atomic create-if-absent in the store that holds the
dataset, renews the claim (a lease) while it reads, and marks the slice done
once its consumer has taken every record of it. A worker that dies leaves its
slice claimed until the lease expires; any worker then takes it over and reads
it whole. No server: the store's exclusive put is the only coordination.

Keys, under ``.queues/<dataset>/<version>/<job>/<run>/`` (``run`` is ``fresh``
or a digest of the resume state the job started from, followed by
``-a<digest of the attempt>`` when the job was started with an ``attempt``):

* ``job.json``: the job's parameters, created once; workers that disagree fail.
* ``e<epoch>/s<slice>.c<gen>``: claim generation ``gen`` (exclusive put; a
  takeover of an expired claim creates ``gen + 1``). Its value holds the worker
  and the lease's first expiry.
* ``e<epoch>/s<slice>.c<gen>.l<ms>``: lease renewed until ``ms`` (Unix time in
  milliseconds); only the claim's holder writes these.
* ``e<epoch>/s<slice>.done``: the slice's records were all consumed.

Every state the queue needs is read from one listing per claim, so a store
whose reads may serve an older snapshot of a value is still safe: the values
read (``job.json``, a claim's first expiry) never change after creation; a
done marker counts by its presence (``status`` shows its worker).
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from storage_backends.base import Backend
from storage_backends.errors import (
    CoordinationError,
    CorruptCacheError,
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
)
from yogastore import boundedjson
from yogastore.checks import check_int, is_int
from yogastore.queue.claims import QueueAssignment
from yogastore.queue.files import using
from yogastore.queue.lockstep import lockstep
from yogastore.queue.state import (
    EpochCounts,
    Lease,
    ListedSlice,
    QueueStatus,
    WorkQueueState,
    complement,
    union,
)
from yogastore.read.order import Interval, Shuffle, intervals_length, split_intervals
from yogastore.read.stream import Stream

if TYPE_CHECKING:
    from yogastore.read.reader import ChunkSource
    from yogastore.store import DatasetRef

__all__ = [
    "QueueAssignment",
    "QueueStatus",
    "QueueStream",
    "WorkQueue",
    "WorkQueueState",
    "lockstep",
]

#: Top folder of every work queue's keys in a store.
QUEUE_ROOT = ".queues"
_KEY = re.compile(r"s(\d{1,9})\.(?:c(\d{1,9})(?:\.l(\d{1,15}))?|(done))")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:+-]{0,199}")
_MAX_SLICES = 1_000_000
_MAX_EPOCHS = 1_000_000
_MAX_LEASE = 86400.0
_EPOCH_DIR = re.compile(r"e(\d{1,20})")


def queue_prefix(
    dataset_id: str | None = None,
    version: str | None = None,
    job: str | None = None,
    run: str | None = None,
) -> str:
    """Return the key prefix of a store's queues, a version's, a job's or a run's."""
    parts = [QUEUE_ROOT]
    for part in (dataset_id, version, job, run):
        if part is None:
            break
        parts.append(part)
    return "/".join(parts) + "/"


def _check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidArgumentError(
            f"{what} must be 1-200 characters of letters, digits and ._@:+- "
            f"(starting with a letter or digit), got {value!r}"
        )
    return value


def check_exclusive_puts(backend: Backend) -> None:
    """Refuse a store whose exclusive puts are not exclusive (claims rest on them).

    Raises:
        CoordinationError: the backend reports a problem
            (``Backend.exclusive_puts_problem``), e.g. an object store that
            ignores ``If-None-Match``.
    """
    problem = backend.exclusive_puts_problem()
    if problem is not None:
        raise CoordinationError(
            errno.ENOTSUP,
            f"refusing to claim work queue slices in {backend.url}: exclusive puts are not "
            f"exclusive there ({problem}), so two workers could claim the same slice and "
            "read it twice; use a store that keeps them exclusive (a local store; AWS S3 or "
            "MinIO, which enforce If-None-Match; on S3 stores coordination='single-writer' "
            "does not make a queue safe, its workers all write claims) or rank-sharded "
            "streams (DatasetRef.stream)",
        )


def _note_key(states: dict[int, ListedSlice], name: str) -> None:
    """Add what the key ``name`` (relative to its epoch's folder) says to ``states``."""
    m = _KEY.fullmatch(name)
    if m is None:
        return  # not ours; never fatal
    st = states.setdefault(int(m.group(1)), ListedSlice())
    if m.group(4):
        st.done = True
    elif m.group(3) is not None:
        gen, ms = int(m.group(2)), int(m.group(3))
        if gen > st.gen:
            st.gen, st.expires_ms = gen, ms
        elif gen == st.gen:
            st.expires_ms = max(st.expires_ms, ms)
    else:
        gen = int(m.group(2))
        if gen > st.gen:
            st.gen, st.expires_ms = gen, 0


class WorkQueue:
    """A job's queue of slices over a dataset. Build it with ``DatasetRef.work_queue``."""

    def __init__(
        self,
        ref: DatasetRef,
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
    ) -> None:
        self.ref = ref
        self.job = _check_name(job, "job name")
        self.attempt = "" if attempt == "" else _check_name(attempt, "attempt")
        if isinstance(resume, str | bytes):
            resume = WorkQueueState.from_json(resume)
        if resume is not None:
            if not isinstance(resume, WorkQueueState):
                raise InvalidArgumentError(f"resume must be a WorkQueueState, got {resume!r}")
            if resume.dataset != ref.fingerprint or resume.num_records != ref.num_records:
                raise InvalidArgumentError(
                    f"work queue state belongs to {resume.dataset!r} ({resume.num_records} "
                    f"records), not {ref.fingerprint!r} ({ref.num_records} records)"
                )
            num_slices, shuffle, seed = resume.num_slices, resume.shuffle, resume.seed
            epoch, num_epochs, block_window = resume.epoch, resume.num_epochs, resume.block_window
        self.num_slices = check_int("num_slices", num_slices, 1, _MAX_SLICES)
        self.seed = check_int("seed", seed, 0)
        self.epoch = check_int("epoch", epoch, 0)
        self.num_epochs = check_int("num_epochs", num_epochs, 1)
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, int | float):
            raise InvalidArgumentError(f"lease_seconds must be a number, got {lease_seconds!r}")
        if not 0.05 <= lease_seconds <= _MAX_LEASE:
            raise InvalidArgumentError(
                f"lease_seconds must be in [0.05, {_MAX_LEASE:g}], got {lease_seconds}"
            )
        self.lease_seconds = float(lease_seconds)
        if self.num_epochs > _MAX_EPOCHS:
            raise InvalidArgumentError(
                f"num_epochs must be <= {_MAX_EPOCHS}, got {self.num_epochs}; "
                "run longer training as several jobs"
            )
        template = ref.stream(shuffle=shuffle, seed=self.seed, epoch=self.epoch, num_epochs=1)
        self.shuffle = template.shuffle
        self.block_window = check_int(
            "block_window", template.block_window if block_window is None else block_window, 1
        )
        self.resumed_from = resume
        self.run = "fresh"
        if resume is not None:
            self.run = "r" + hashlib.sha256(resume.to_json().encode()).hexdigest()[:16]
        if self.attempt:
            # One start of the job: a restart with a new attempt never joins
            # an earlier start's claims and done slices.
            digest = hashlib.sha256(self.attempt.encode()).hexdigest()[:16]
            self.run += "-a" + digest
        self.prefix = queue_prefix(ref.dataset_id, ref.version, self.job, self.run)
        self._params: dict[str, Any] = {
            "dataset": ref.fingerprint,
            "num_records": ref.num_records,
            "num_slices": self.num_slices,
            "shuffle": self.shuffle.value,
            "seed": self.seed,
            "epoch": self.epoch,
            "num_epochs": self.num_epochs,
            "block_window": self.block_window,
        }
        if self.attempt:
            self._params["attempt"] = self.attempt
        if resume is not None:
            # Lets status and the command line rebuild this run from the store alone.
            self._params["resume"] = resume.to_json()
        self._checked = False

    def __repr__(self) -> str:
        return (
            f"WorkQueue({self.job!r} on {self.ref.dataset_id!r}/{self.ref.version!r}, "
            f"{self.num_slices} slices x {self.num_epochs} epochs from {self.epoch}, "
            f"shuffle={self.shuffle.name}, seed={self.seed})"
        )

    @property
    def backend(self) -> Any:
        """The storage backend holding the dataset and the queue's keys."""
        return self.ref.store.backend

    @property
    def epochs(self) -> range:
        """The absolute epoch numbers of the job."""
        return range(self.epoch, self.epoch + self.num_epochs)

    def epoch_positions(self, epoch: int) -> tuple[Interval, ...]:
        """Return the positions of ``epoch`` the job reads (all, or a resume's remainder)."""
        n = self.ref.num_records
        if self.resumed_from is not None:
            return complement(self.resumed_from.consumed_in(epoch), n)
        return ((0, n),) if n else ()

    def slice_intervals(self, epoch: int, index: int) -> tuple[Interval, ...]:
        """Return the positions of slice ``index`` of ``epoch`` (may be empty)."""
        return tuple(split_intervals(self.epoch_positions(epoch), self.num_slices, index, False))

    def check_job(self) -> None:
        """Create the job's parameter record, or check it matches this queue's.

        On an object store, first check (once per endpoint and bucket) that
        it enforces the conditional writes claims rest on.

        Raises:
            InvalidArgumentError: the job exists with other parameters.
            CoordinationError: the store ignores conditional writes.
        """
        if self._checked:
            return
        check_exclusive_puts(self.backend)
        key = self.prefix + "job.json"
        doc = json.dumps(self._params, sort_keys=True).encode()
        try:
            self.backend.put_exclusive(key, doc)
        except KeyExistsError:
            stored = self.read_json(key)
            if stored != self._params:
                if not isinstance(stored, dict):
                    raise CorruptCacheError(
                        f"work queue record {key!r} is not a JSON object"
                    ) from None
                diff = sorted(
                    k
                    for k in set(stored) | set(self._params)
                    if stored.get(k) != self._params.get(k)
                )
                theirs = {k: stored.get(k) for k in diff}
                ours = {k: self._params.get(k) for k in diff}
                raise InvalidArgumentError(
                    f"work queue job {self.job!r} already exists with other parameters "
                    f"{theirs} (this worker: {ours}); every worker must use the same "
                    "parameters; use a new job name or delete the old job"
                ) from None
        self._checked = True

    def read_json(self, key: str) -> Any:
        """Return the JSON value stored under ``key`` (``CorruptCacheError`` if it is not)."""
        return boundedjson.loads(
            self.backend.get(key), f"work queue key {key!r}", CorruptCacheError
        )

    def read_epoch(self, epoch: int) -> dict[int, ListedSlice]:
        """Return the state of every slice of ``epoch`` that has keys, from one listing."""
        base = f"{self.prefix}e{epoch}/"
        states: dict[int, ListedSlice] = {}
        for key in self.backend.list(base):
            _note_key(states, key[len(base) :])
        return states

    def read_run(self) -> dict[int, dict[int, ListedSlice]]:
        """Return the slice states of every epoch of the run that has keys, from one listing."""
        epochs: dict[int, dict[int, ListedSlice]] = {}
        for key in self.backend.list(self.prefix):
            folder, _, name = key[len(self.prefix) :].partition("/")
            m = _EPOCH_DIR.fullmatch(folder)
            if m is not None and int(m.group(1)) in self.epochs:
                _note_key(epochs.setdefault(int(m.group(1)), {}), name)
        return epochs

    def claim_expiry(self, epoch: int, index: int, gen: int) -> int:
        """Return the first lease expiry (ms) written in a claim's value."""
        return self.claim_record(epoch, index, gen)[1]

    def claim_record(
        self, epoch: int, index: int, gen: int, lease_seconds: float | None = None
    ) -> tuple[str, int]:
        """Return the worker and first lease expiry (ms) of a claim ("", 0 if it is gone).

        ``lease_seconds`` (default: this queue's) bounds a plausible expiry.
        """
        key = f"{self.prefix}e{epoch}/s{index:06d}.c{gen}"
        try:
            doc = self.read_json(key)
            worker = doc["worker"]
            if not isinstance(worker, str):
                raise TypeError(f"worker {worker!r:.50} is not a string")
            expiry = check_int("expires_ms", doc["expires_ms"], 0)
        except KeyNotFoundError:
            return "", 0
        except (InvalidArgumentError, KeyError, TypeError) as err:
            raise CorruptCacheError(
                f"work queue claim {key!r} is not valid: {err}; delete the job"
            ) from err
        self.check_expiry(expiry, key, lease_seconds)
        return worker, expiry

    def check_expiry(self, expiry_ms: int, key: str, lease_seconds: float | None = None) -> int:
        """Return a lease expiry, or raise if it lies absurdly far ahead (10 leases).

        ``lease_seconds`` defaults to this queue's; ``status`` passes the
        longest lease allowed, since a reopened run does not know its lease.

        Raises:
            CorruptCacheError: the expiry would keep the slice from every worker.
        """
        lease = self.lease_seconds if lease_seconds is None else lease_seconds
        if expiry_ms > int((time.time() + 10 * lease) * 1000):
            raise CorruptCacheError(
                f"work queue lease {key!r} expires at {expiry_ms} ms, more than 10 leases "
                f"({10 * lease:g} s) from now: a damaged key, a worker started with a "
                "longer lease_seconds, or a clock far ahead; delete the job"
            )
        return expiry_ms

    def done_record(self, epoch: int, index: int) -> str:
        """Return the worker of a slice's done marker ("" if it is gone).

        Raises:
            CorruptCacheError: the marker is not one a worker wrote for this slice.
        """
        key = f"{self.prefix}e{epoch}/s{index:06d}.done"
        try:
            doc = self.read_json(key)
        except KeyNotFoundError:
            return ""
        want = intervals_length(self.slice_intervals(epoch, index))
        if (
            not isinstance(doc, dict)
            or not isinstance(doc.get("worker"), str)
            or not is_int(doc.get("records"), allow_numpy=False)
            or doc["records"] != want
        ):
            raise CorruptCacheError(
                f"work queue done marker {key!r} is not valid (want a worker and "
                f"records={want}, got {doc!r:.100}); its slice would be skipped: delete the job"
            )
        return str(doc["worker"])

    def stream(self, worker: str, *, prefetch: int | None = None, wait: bool = True) -> QueueStream:
        """Return the stream of records this worker claims from the queue.

        Args:
            worker: a name for this worker (shown by ``status``), e.g. ``host3-rank1``.
            prefetch: batches read ahead on a background thread, as for ``stream``.
            wait: when no slice is free, wait while other workers hold the last
                ones and take over any whose lease expires (so a dead worker's
                slice is still read). Pass ``False`` in synchronous training:
                there a rank waiting for another's slice would block that
                rank's collectives, and a dead rank stops the job anyway.
        """
        _check_name(worker, "worker name")
        if not isinstance(wait, bool):
            raise InvalidArgumentError(f"wait must be True or False, got {wait!r}")
        self.check_job()
        return QueueStream(self, worker, prefetch=prefetch, wait=wait)

    def status(self) -> QueueStatus:
        """Return the job's progress: one listing, one read per done or claimed slice.

        Epochs without any key are summed up (``idle_epochs``), so the cost
        grows with the epochs that have started, not with ``num_epochs``.
        """
        with using(self.backend, self.prefix):
            return self._status()

    def _status(self) -> QueueStatus:
        now = int(time.time() * 1000)
        workers: dict[str, int] = {}
        per_epoch = []
        leases = []
        listed = self.read_run()
        shown = set(listed)
        if self.resumed_from is not None:  # epochs whose positions a resume cut down
            shown.update(e for e, _ in self.resumed_from.consumed if e in self.epochs)
        # Every other epoch has no key (all its slices free) and all its positions.
        idle_epochs = self.num_epochs - len(shown)
        n = self.ref.num_records
        full = ((0, n),) if n else ()
        per_idle = sum(
            1 for i in range(self.num_slices) if split_intervals(full, self.num_slices, i, False)
        )
        for e in sorted(shown):
            states = listed.get(e, {})
            counts = dict.fromkeys(("slices", "done", "claimed", "expired"), 0)
            for index in range(self.num_slices):
                if not self.slice_intervals(e, index):
                    continue
                counts["slices"] += 1
                st = states.get(index, ListedSlice())
                if st.done:
                    counts["done"] += 1
                    name = self.done_record(e, index) or "?"
                    workers[name] = workers.get(name, 0) + 1
                elif st.gen >= 0:
                    holder, first = self.claim_record(e, index, st.gen, _MAX_LEASE)
                    expiry = self.check_expiry(
                        st.expires_ms or first,
                        f"{self.prefix}e{e}/s{index:06d}.c{st.gen}",
                        _MAX_LEASE,
                    )
                    live = expiry > now
                    counts["claimed" if live else "expired"] += 1
                    leases.append(Lease(epoch=e, index=index, worker=holder, expires_ms=expiry))
            per_epoch.append(EpochCounts(epoch=e, **counts))
        return QueueStatus(
            job=self.job,
            run=self.run,
            epochs=self.epochs,
            per_epoch=tuple(per_epoch),
            workers=workers,
            leases=tuple(leases),
            now_ms=now,
            idle_epochs=idle_epochs,
            idle_slices=idle_epochs * per_idle if idle_epochs else 0,
        )

    def delete(self) -> None:
        """Remove every key of this job (all runs: fresh and resumed)."""
        self.backend.delete_prefix(queue_prefix(self.ref.dataset_id, self.ref.version, self.job))
        self._checked = False


class QueueStream(Stream):
    """A worker's records from a ``WorkQueue``. Build it with ``WorkQueue.stream``."""

    def __init__(
        self, queue: WorkQueue, worker: str, *, prefetch: int | None = None, wait: bool = True
    ) -> None:
        self.queue = queue
        self.worker = worker
        self.wait = wait
        self.claims = QueueAssignment(queue, worker)
        super().__init__(
            queue.ref,
            shard_rank=0,
            num_shards=1,
            shuffle=queue.shuffle,
            seed=queue.seed,
            epoch=queue.epoch,
            start_offset=0,
            drop_remainder=False,
            num_epochs=queue.num_epochs,
            block_window=queue.block_window,
            prefetch=prefetch,
            assignment=self.claims,
        )

    def __repr__(self) -> str:
        return f"QueueStream(worker {self.worker!r} of {self.queue!r})"

    @property
    def source(self) -> ChunkSource:
        """The chunk source, its look-ahead (object stores) capped at one slice."""
        if self._source is None:
            source = self.ref.make_source()
            cap = getattr(source, "cap_horizon", None)
            if cap is not None:
                cap(-(-self.num_records // self.queue.num_slices))
            self._source = source
        return self._source

    def group_factor(self, batch_size: int, target_bytes: int, most: int) -> int:
        """Gather one batch at a time: a bigger gather would claim slices ahead of need."""
        return 1

    def column_batches(self, batch_size: int, drop_remainder: bool = False) -> Iterator[Any]:
        """Yield column batches of claimed slices until every slice of the job is done.

        A round reads slices while any is free. When none is, everything this
        worker claimed has been handed out; it then waits (unless built with
        ``wait=False``) while other workers hold the last slices, and reads on
        if one of their leases expires.
        """
        with using(self.queue.backend, self.queue.prefix):
            try:
                while True:
                    yield from super().column_batches(batch_size, drop_remainder)
                    self.claims.finish_all()
                    if not self.wait or not self.claims.wait_for_work():
                        return
            finally:
                self.claims.close()

    def state(self, consumed: int) -> WorkQueueState:  # type: ignore[override]
        """Return this worker's part of the job's position after ``consumed`` records.

        Merge the states of all workers taken at one checkpoint with
        ``WorkQueueState.merge``; a resumed job starts from the merge.
        """
        consumed = check_int("consumed", consumed, 0)
        q = self.queue
        mine = self.claims.consumed(consumed)
        before = q.resumed_from
        merged: dict[int, list[Interval]] = {}
        for e in q.epochs:
            ivs = list(mine.get(e, ()))
            if before is not None:
                ivs.extend(before.consumed_in(e))
            if ivs:
                merged[e] = ivs
        return WorkQueueState(
            dataset=q.ref.fingerprint,
            num_records=q.ref.num_records,
            seed=q.seed,
            epoch=q.epoch,
            num_epochs=q.num_epochs,
            shuffle=q.shuffle,
            block_window=q.block_window,
            num_slices=q.num_slices,
            consumed=tuple((e, union(merged[e])) for e in sorted(merged)),
        )
