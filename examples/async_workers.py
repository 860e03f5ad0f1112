"""Independent workers of different speeds share one epoch through a work queue.

    python examples/async_workers.py                       # local store
    python examples/async_workers.py --store s3://bucket/prefix

starts ``--workers`` worker processes (worker 0 is ``--slowdown`` times
slower than the others) on one ``WorkQueue`` job over a cached dataset of
record ids. Each claims slices of the epoch's order until none is left, so
the fast workers read more; there is no server, the store's create-if-absent
writes are the only coordination. The launcher then prints how many records
and slices each worker took and checks that every record was consumed exactly
once (exit code 1 if not). Parameter-server style training reads the same way:
each worker applies its own updates, no collective step to wait for.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

import yogastore as y


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store", default=None, help="store URL (default: $YOGASTORE_HOME or ~/.cache/yogastore)"
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--slices", type=int, default=40, help="slices per epoch")
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument(
        "--step-ms", type=float, default=0.5, help="work per record of a fast worker (ms)"
    )
    parser.add_argument("--slowdown", type=float, default=3.0, help="worker 0's slowness")
    parser.add_argument("--job", default=None, help="job name (default: a new one per run)")
    parser.add_argument("--out", default=None, help="directory for the workers' id files")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # set by the launcher
    return parser.parse_args()


def dataset(store: str | None, records: int) -> y.DatasetRef:
    """Cache (once) a dataset whose record ``i`` is ``{"id": i}``."""
    spec = {"id": y.ComponentSpec(shape=(), dtype="int64")}
    return y.Store(store, chunk_bytes=32 << 10).cache(
        "async-ids",
        str(records),
        lambda: ({"id": np.int64(i)} for i in range(records)),
        spec=spec,
        progress=y.NullProgress(),
    )


def work(args: argparse.Namespace) -> None:
    """One worker: claim slices until the job is done, 'training' on each batch."""
    ref = dataset(args.store, args.records)
    queue = ref.work_queue(args.job, num_slices=args.slices, seed=1, lease_seconds=10)
    index = int(args.worker.removeprefix("w"))
    per_record = args.step_ms / 1000 * (args.slowdown if index == 0 else 1.0)
    ids: list[int] = []
    for batch in queue.stream(args.worker).batches(args.batch_size):
        ids.extend(int(i) for i in batch["id"])
        time.sleep(per_record * len(batch["id"]))  # stands in for a training step
    Path(args.out, f"{args.worker}.json").write_text(json.dumps(ids))


def launch(args: argparse.Namespace) -> int:
    """Start the workers, wait for them, print what each read and check the epoch."""
    ref = dataset(args.store, args.records)  # built once, before the workers start
    args.job = args.job or f"async-{uuid.uuid4().hex[:8]}"
    out = Path(args.out or tempfile.mkdtemp(prefix="async-workers-"))
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.argv[0], "--records", str(args.records), "--slices", str(args.slices)]
    argv += ["--batch-size", str(args.batch_size), "--step-ms", str(args.step_ms)]
    argv += ["--slowdown", str(args.slowdown), "--job", args.job, "--out", str(out)]
    argv += ["--store", args.store] if args.store else []
    start = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, *argv, "--worker", f"w{w}"]) for w in range(args.workers)
    ]
    codes = [p.wait() for p in procs]
    elapsed = time.perf_counter() - start
    if any(codes):
        print(f"workers failed: exit codes {codes}")
        return 1
    queue = ref.work_queue(args.job, num_slices=args.slices, seed=1)
    slices = queue.status().workers
    counts: collections.Counter[int] = collections.Counter()
    print(f"{'worker':8}{'speed':>8}{'records':>9}{'slices':>8}")
    for w in range(args.workers):
        ids = json.loads(Path(out, f"w{w}.json").read_text())
        counts.update(ids)
        speed = f"1/{args.slowdown:g}x" if w == 0 else "1x"
        print(f"w{w:<7}{speed:>8}{len(ids):>9}{slices.get(f'w{w}', 0):>8}")
    once = set(counts) == set(range(args.records)) and set(counts.values()) == {1}
    queue.delete()
    print(
        f"{args.records} records in {elapsed:.1f} s (process start included): "
        + ("each consumed exactly once" if once else "NOT each consumed exactly once")
    )
    return 0 if once else 1


def main() -> int:
    args = parse_args()
    if args.worker is not None:
        work(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
