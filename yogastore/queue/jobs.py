"""Work queue jobs kept in a store: list them, reopen a run, remove them.

A job's keys live under ``.queues/<dataset>/<version>/<job>/<run>/`` (the
layout is described in ``work_queue``). A run's ``job.json`` holds every
parameter that decides its slices (and the resume state it started from), so
a run can be reopened from the store alone: by ``yogastore queue status`` or
by a cleanup script that does not know how the job was started.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from storage_backends.errors import (
    CorruptCacheError,
    InvalidArgumentError,
    KeyNotFoundError,
    YogaStoreError,
)
from yogastore import boundedjson
from yogastore.format.manifest import validate_name
from yogastore.queue.work_queue import QUEUE_ROOT, WorkQueue, queue_prefix
from yogastore.read.order import Shuffle

if TYPE_CHECKING:
    from yogastore.store import DatasetRef, Store

__all__ = [
    "QueueJob",
    "QueueJobNotFoundError",
    "delete_queue_jobs",
    "list_queue_jobs",
    "open_queue_runs",
]


class QueueJobNotFoundError(YogaStoreError, FileNotFoundError):
    """No work queue job of that name exists for the dataset version."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QueueJob:
    """One job of ``list_queue_jobs``: its runs (``fresh`` and resumed) and key count."""

    dataset_id: str
    version: str
    job: str
    runs: tuple[str, ...]
    keys: int


def list_queue_jobs(
    store: Store, dataset_id: str | None = None, version: str | None = None
) -> list[QueueJob]:
    """Return the work queue jobs in ``store`` (of one dataset, or one version), sorted.

    One listing of the queue keys; jobs of deleted versions are listed too.
    """
    if dataset_id is not None:
        validate_name(dataset_id, "dataset id")
    if version is not None:
        if dataset_id is None:
            raise InvalidArgumentError("list_queue_jobs: a version needs a dataset id")
        validate_name(version, "version")
    found: dict[tuple[str, str, str], tuple[set[str], list[int]]] = {}
    for key in store.backend.list(queue_prefix(dataset_id, version)):
        parts = key.split("/")
        if len(parts) < 6 or parts[0] != QUEUE_ROOT:
            continue  # not a run's key; never fatal
        runs, count = found.setdefault((parts[1], parts[2], parts[3]), (set(), [0]))
        runs.add(parts[4])
        count[0] += 1
    return [
        QueueJob(dataset_id=d, version=v, job=j, runs=tuple(sorted(runs)), keys=count[0])
        for (d, v, j), (runs, count) in sorted(found.items())
    ]


def open_queue_runs(ref: DatasetRef, job: str) -> list[WorkQueue]:
    """Reopen every run of ``job`` over ``ref`` from the parameters stored with it.

    Fresh run first, then resumed runs by name. Use ``status()`` on each.

    Raises:
        QueueJobNotFoundError: the job has no run in the store.
        CorruptCacheError: a run's ``job.json`` is damaged.
    """
    jobs = [j for j in list_queue_jobs(ref.store, ref.dataset_id, ref.version) if j.job == job]
    if not jobs:
        raise QueueJobNotFoundError(
            f"no work queue job {job!r} for {ref.dataset_id}/{ref.version} in {ref.store.url}; "
            f"`yogastore queue list --store {ref.store.url}` names the jobs there"
        )
    return [_open_run(ref, job, run) for run in jobs[0].runs]


_FIELDS = ("num_slices", "shuffle", "seed", "epoch", "num_epochs", "block_window")


def _open_run(ref: DatasetRef, job: str, run: str) -> WorkQueue:
    key = queue_prefix(ref.dataset_id, ref.version, job, run) + "job.json"
    try:
        doc: Any = boundedjson.loads(ref.store.backend.get(key), key, CorruptCacheError)
    except KeyNotFoundError:
        raise CorruptCacheError(
            f"work queue run {key!r} has keys but no job.json; delete the job"
        ) from None
    if not isinstance(doc, dict):
        raise CorruptCacheError(
            f"work queue record {key!r} is not a JSON object (got {type(doc).__name__}); "
            "delete the job"
        )
    missing = [f for f in _FIELDS if f not in doc]
    if missing:
        raise CorruptCacheError(
            f"work queue record {key!r} lacks field(s) {missing}; delete the job"
        )
    try:
        shuffle = Shuffle(doc["shuffle"])
    except (TypeError, ValueError):
        raise CorruptCacheError(
            f"work queue record {key!r}: field 'shuffle' is not valid: {doc['shuffle']!r:.50}; "
            "delete the job"
        ) from None
    try:
        queue = WorkQueue(
            ref,
            job,
            num_slices=doc["num_slices"],
            shuffle=shuffle,
            seed=doc["seed"],
            epoch=doc["epoch"],
            num_epochs=doc["num_epochs"],
            block_window=doc["block_window"],
            resume=doc.get("resume"),
            attempt=doc.get("attempt", ""),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptCacheError(
            f"work queue record {key!r} is not valid: {err}; delete the job"
        ) from err
    if queue.run != run:
        raise CorruptCacheError(
            f"work queue record {key!r} describes run {queue.run!r}, not {run!r}; delete the job"
        )
    return queue


def delete_queue_jobs(
    store: Store,
    dataset_id: str,
    version: str,
    job: str | None = None,
    *,
    finished_only: bool = False,
) -> list[QueueJob]:
    """Remove the keys of ``job`` (or of every job) of a dataset version.

    Args:
        store: the store holding the dataset.
        dataset_id: the dataset.
        version: its version.
        job: one job, or ``None`` for every job of the version.
        finished_only: remove a job only when one of its runs has every
            slice done (a resumed run continues the runs before it, which
            stay unfinished) and no run holds a live claim (needs the version
            itself, to reopen the runs).

    Returns:
        The jobs removed.
    """
    removed = []
    for info in list_queue_jobs(store, dataset_id, version):
        if job is not None and info.job != job:
            continue
        if finished_only:
            ref = store.open(dataset_id, version)
            statuses = [q.status() for q in open_queue_runs(ref, info.job)]
            if not any(s.finished for s in statuses) or any(s.claimed for s in statuses):
                continue
        store.backend.delete_prefix(queue_prefix(dataset_id, version, info.job))
        removed.append(info)
    return removed
