"""Epoch makespan with one slow worker: static shards vs the dynamic work queue.

Run: ``python -m benchmarks.queue_makespan [--json out.json]``.

1. Makespan: ``--workers`` processes read one epoch of a cached dataset of
   record ids; each "trains" ``--step-ms`` per record (a sleep standing in for
   compute), worker 0 ``--slowdown`` times longer. With static shards every
   worker reads the same count, so the slow one sets the epoch's end; with
   the queue the fast ones take more slices. All start together (an event
   set after every worker has opened its stream); the makespan is the time
   from that start until every record is consumed (``exit_s``: until every
   worker left its loop; a queue worker that waits for the last slices sees
   the job end at its next poll, within 0.25 s). Both modes must read every
   record exactly once (checked). The queue workers also time what they
   spend claiming and finishing slices: its share of their busy time.
2. Claim rate: one process claims and finishes ``--claim-slices`` slices
   (no reading) on the local store and on a moto S3 server over HTTP on
   127.0.0.1: claims/s, and the share of the makespan run's epoch that
   ``--slices`` claims at that rate take per worker.

No timing is asserted anywhere: the goal column only compares.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

import yogastore as y
from yogastore.queue.claims import QueueAssignment

SPEC = {"id": y.ComponentSpec(shape=(), dtype="int64")}
CTX = multiprocessing.get_context("spawn")


def build(url: str, records: int, **options: Any) -> y.DatasetRef:
    store = y.Store(url, chunk_bytes=64 << 10, **options)
    return store.cache(
        "ids",
        str(records),
        lambda: ({"id": np.int64(i)} for i in range(records)),
        spec=SPEC,
        progress=y.NullProgress(),
    )


def _timed(obj: Any, name: str, totals: list[float]) -> None:
    """Wrap method ``name`` of ``obj`` so its time adds to ``totals[0]``."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[0] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def worker(
    url: str, records: int, mode: str, rank: int, opts: dict[str, Any], go: Any, out: Any
) -> None:
    """Read one epoch (static shard ``rank`` or queue claims), sleeping per record."""
    ref = y.Store(url).open("ids", str(records))
    claim_time = [0.0]
    if mode == "static":
        stream: Any = ref.stream(rank, opts["workers"], seed=0, drop_remainder=False)
    else:
        queue = ref.work_queue(opts["job"], num_slices=opts["slices"], seed=0)
        stream = queue.stream(f"w{rank}")
        _timed(stream.claims, "_scan", claim_time)  # listing + exclusive put
        _timed(stream.claims, "_finish", claim_time)  # done marker + lease delete
    per_record = opts["step_ms"] / 1000 * (opts["slowdown"] if rank == 0 else 1.0)
    batches = stream.batches(opts["batch_size"])
    out.put(("ready", rank))
    go.wait()
    start = time.monotonic()
    ids: list[int] = []
    last = start
    for batch in batches:
        ids.extend(batch["id"].tolist())
        time.sleep(per_record * len(batch["id"]))
        last = time.monotonic()
    end = time.monotonic()  # a queue worker may wait a poll longer to see the job end
    claims = stream.claims.claims if mode == "queue" else 0
    out.put(("done", rank, start, end, ids, claim_time[0], claims, last))


def makespan(url: str, records: int, mode: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Run one epoch with ``opts["workers"]`` processes; return its figures."""
    go, out = CTX.Event(), CTX.Queue()
    procs = [
        CTX.Process(target=worker, args=(url, records, mode, r, opts, go, out))
        for r in range(opts["workers"])
    ]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=300)[0] == "ready"
    t0 = time.monotonic()
    go.set()
    done = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"{mode} worker exit code {p.exitcode}"
    done.sort(key=lambda d: d[1])
    counts = Counter(i for d in done for i in d[4])
    once = set(counts) == set(range(records)) and set(counts.values()) == {1}
    busy = sum(d[3] - d[2] for d in done)
    return {
        "mode": mode,
        "makespan_s": max(d[7] for d in done) - t0,  # until every record was consumed
        "exit_s": max(d[3] for d in done) - t0,  # until every worker had left its loop
        "records_per_worker": [len(d[4]) for d in done],
        "records_read": sum(counts.values()),
        "exactly_once": once,
        "claims": sum(d[6] for d in done),
        "claim_s": sum(d[5] for d in done),
        "claim_share": sum(d[5] for d in done) / busy if busy else 0.0,
    }


def claim_rate(ref: y.DatasetRef, slices: int) -> dict[str, Any]:
    """Claim and finish every slice of a new job in one process; return claims/s."""
    queue = ref.work_queue(f"rate-{uuid.uuid4().hex[:8]}", num_slices=slices, shuffle=False)
    queue.check_job()
    claims = QueueAssignment(queue, "bench")
    start = time.perf_counter()
    taken = 0
    for _epoch, intervals in claims.spans():
        claims.consume(sum(b - a for a, b in intervals))
        taken += 1
    elapsed = time.perf_counter() - start
    claims.close()
    done = queue.status().done
    queue.delete()
    return {"claims": taken, "done": done, "seconds": elapsed, "claims_per_s": taken / elapsed}


def moto_store(tmp: str) -> tuple[Any, str]:
    """Start a moto S3 server on 127.0.0.1; return it and a bucket URL (env set for children)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("YOGASTORE_S3_ENDPOINT_URL", endpoint),
    ):
        os.environ[name] = value
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket="queue-bench"
    )
    return server, "s3://queue-bench/store"


def run(args: argparse.Namespace) -> dict[str, Any]:
    opts = {
        "workers": args.workers,
        "slices": args.slices,
        "step_ms": args.step_ms,
        "slowdown": args.slowdown,
        "batch_size": args.batch_size,
    }
    result: dict[str, Any] = {"options": {**opts, "records": args.records}}
    with tempfile.TemporaryDirectory(prefix="queue-bench-") as tmp:
        url = str(Path(tmp) / "store")
        ref = build(url, args.records)
        static = makespan(url, args.records, "static", opts)
        queue = makespan(url, args.records, "queue", {**opts, "job": "makespan"})
        result["static"], result["queue"] = static, queue
        result["ratio"] = static["makespan_s"] / queue["makespan_s"]
        result["claim_rate"] = {"local": claim_rate(ref, args.claim_slices)}
        if not args.no_s3:
            server, s3_url = moto_store(tmp)
            try:
                s3_ref = build(s3_url, args.records, lock_settle=0.0)
                result["claim_rate"]["moto"] = claim_rate(s3_ref, args.claim_slices)
            finally:
                server.stop()
        # Each worker claims about slices/workers slices an epoch.
        per_worker = args.slices / args.workers
        for rate in result["claim_rate"].values():
            rate["epoch_share"] = per_worker / rate["claims_per_s"] / queue["makespan_s"]
    return result


def table(result: dict[str, Any]) -> str:
    o = result["options"]
    lines = [
        f"{o['records']} records, {o['workers']} workers, {o['step_ms']} ms per record, "
        f"worker 0 {o['slowdown']}x slower, queue of {o['slices']} slices",
        f"{'mode':8}{'makespan s':>12}{'exit s':>8}{'records per worker':>28}{'exactly once':>14}",
    ]
    for mode in ("static", "queue"):
        r = result[mode]
        per = "/".join(str(n) for n in r["records_per_worker"])
        lines.append(
            f"{mode:8}{r['makespan_s']:12.2f}{r['exit_s']:8.2f}{per:>28}{r['exactly_once']!s:>14}"
        )
    q = result["queue"]
    lines.append(f"static / queue makespan: {result['ratio']:.2f}x (goal >= 1.8x)")
    lines.append(
        f"queue workers' time in claims: {q['claim_s']:.3f} s for {q['claims']} claims, "
        f"{q['claim_share']:.2%} of their busy time (goal < 1%)"
    )
    lines.append(f"{'store':8}{'claims/s':>10}{'share of epoch per worker':>28}")
    for name, rate in result["claim_rate"].items():
        lines.append(f"{name:8}{rate['claims_per_s']:10.1f}{rate['epoch_share']:>28.2%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slices", type=int, default=80, help="queue slices per epoch")
    parser.add_argument("--step-ms", type=float, default=1.0, help="work per record (fast)")
    parser.add_argument("--slowdown", type=float, default=3.0, help="worker 0's slowness")
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--claim-slices", type=int, default=100, help="claims timed per store")
    parser.add_argument("--no-s3", action="store_true", help="skip the moto server")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
