"""Command line for work queue jobs: ``yogastore queue {list,status,delete}``.

``status`` prints one line per run, one per epoch with keys (slices done,
claimed, expired, free), one for the epochs not started yet, the workers'
completed slices and every unfinished claim;
``delete`` removes a job's keys (``--finished``: only when a run has every
slice done and no run holds a live claim).
"""

from __future__ import annotations

import argparse
from typing import Any

from yogastore.queue.jobs import delete_queue_jobs, list_queue_jobs, open_queue_runs
from yogastore.queue.state import QueueStatus
from yogastore.store import Store

__all__ = ["add_queue_parser", "run_queue"]


def add_queue_parser(sub: Any, store_help: str) -> None:
    """Add the ``queue`` command and its subcommands to ``sub`` (argparse subparsers)."""
    queue = sub.add_parser("queue", help="list, show or delete work queue jobs")
    actions = queue.add_subparsers(dest="queue_command", required=True)
    listing = actions.add_parser("list", help="list the jobs (of a dataset or version)")
    listing.add_argument("dataset_id", nargs="?")
    listing.add_argument("version", nargs="?")
    status = actions.add_parser("status", help="a job's slices, workers and leases")
    delete = actions.add_parser("delete", help="remove a job's keys (or every job's)")
    for cmd in (listing, status, delete):
        cmd.add_argument("--store", default=argparse.SUPPRESS, help=store_help)
    for cmd in (status, delete):
        cmd.add_argument("dataset_id")
        cmd.add_argument("version")
    status.add_argument("job")
    delete.add_argument("job", nargs="?", help="default: every job of the version")
    delete.add_argument(
        "--finished",
        action="store_true",
        help="only jobs with a run whose every slice is done and no live claim",
    )


def _print_status(status: QueueStatus) -> None:
    print(
        f"job {status.job} run {status.run}: {status.slices} slices, {status.done} done, "
        f"{status.claimed} claimed, {status.expired} expired, {status.free} free"
        + (" (finished)" if status.finished else "")
    )
    for c in status.per_epoch:
        print(
            f"  epoch {c.epoch}: {c.slices} slices, {c.done} done, {c.claimed} claimed, "
            f"{c.expired} expired, {c.free} free"
        )
    if status.idle_epochs:
        print(f"  {status.idle_epochs} epochs not started: {status.idle_slices} slices, all free")
    for worker, count in sorted(status.workers.items()):
        print(f"  worker {worker}: {count} slices done")
    for lease in status.leases:
        left = (lease.expires_ms - status.now_ms) / 1000
        when = f"live for {left:.1f} s" if left > 0 else f"EXPIRED {-left:.1f} s ago"
        print(f"  slice {lease.index} of epoch {lease.epoch}: {lease.worker or '?'}, {when}")


def run_queue(store: Store, args: argparse.Namespace) -> int:
    """Run ``yogastore queue ...``; returns the exit code."""
    if args.queue_command == "list":
        jobs = list_queue_jobs(store, args.dataset_id, args.version)
        for job in jobs:
            print(
                f"{job.dataset_id}\t{job.version}\t{job.job}\t"
                f"runs: {','.join(job.runs)}\t{job.keys} keys"
            )
        print(f"{len(jobs)} jobs")
        return 0
    if args.queue_command == "status":
        ref = store.open(args.dataset_id, args.version)
        for queue in open_queue_runs(ref, args.job):
            _print_status(queue.status())
        return 0
    removed = delete_queue_jobs(
        store, args.dataset_id, args.version, args.job, finished_only=args.finished
    )
    for job in removed:
        print(f"deleted job {job.job} of {job.dataset_id}/{job.version} ({job.keys} keys)")
    print(f"{len(removed)} jobs deleted")
    return 0
