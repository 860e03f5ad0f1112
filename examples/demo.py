"""yogastore in one minute: cache once, stream 2 ranks in 2 processes, resume mid-epoch.

Run with ``make demo``. Uses the default store ($YOGASTORE_HOME or ~/.cache/yogastore).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

NUM_RECORDS = 20_000
NUM_RANKS = 2
BATCH = 256
SEED = 42


def build() -> None:
    import tensorflow as tf

    import yogastore
    from yogastore.synthetic import synthetic_images

    store = yogastore.Store()
    t0 = time.perf_counter()
    ref = store.cache(
        "synthetic-images",
        "1",
        lambda: tf.data.Dataset.from_tensor_slices(synthetic_images(NUM_RECORDS)),
    )
    print(
        f"cache: {ref.num_records} records, {ref.nbytes / 1e6:.1f} MB, "
        f"{len(ref.manifest.chunks)} chunks in {store.url} ({time.perf_counter() - t0:.2f}s)"
    )


def worker(rank: int) -> None:
    """One rank: stream its shard through tf.data and report the ids it saw."""
    import yogastore

    ref = yogastore.Store().open("synthetic-images", "1")
    stream = ref.stream(shard_rank=rank, num_shards=NUM_RANKS, shuffle=True, seed=SEED)
    ds = stream.to_tf_dataset(batch_size=BATCH)
    ids: list[int] = []
    t0 = time.perf_counter()
    for batch in ds:
        ids.extend(batch["id"].numpy().tolist())
    elapsed = time.perf_counter() - t0
    json.dump({"rank": rank, "ids": ids, "seconds": elapsed, "stats": stream.stats()}, sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank)
        return

    build()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r)], stdout=subprocess.PIPE, text=True
        )
        for r in range(NUM_RANKS)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"rank process failed with exit code {proc.returncode}")
        results.append(json.loads(out))
    all_ids: list[int] = []
    for r in results:
        rate = len(r["ids"]) / r["seconds"]
        print(
            f"rank {r['rank']}: {len(r['ids'])} records in {r['seconds']:.2f}s = "
            f"{rate:,.0f} records/s (tf.data, batch {BATCH}, global shuffle), "
            f"{r['stats']['bytes_fetched'] / 1e6:.1f} MB mapped"
        )
        all_ids.extend(r["ids"])
    disjoint = len(set(all_ids)) == len(all_ids)
    complete = sorted(all_ids) == list(range(NUM_RECORDS))
    print(f"shards disjoint: {disjoint}; complete: {complete}")
    if not (disjoint and complete):
        raise SystemExit("shard check failed")

    # Resume: both ranks consumed 3,000 records when the job stopped; restart on 3 ranks.
    import yogastore

    ref = yogastore.Store().open("synthetic-images", "1")
    consumed = 3_000
    state = ref.stream(0, NUM_RANKS, shuffle=True, seed=SEED).state(consumed=consumed)
    print(f"resume state after {consumed} records per rank: {state.to_json()}")
    before = {i for r in results for i in r["ids"][:consumed]}
    after: list[int] = []
    for rank in range(3):
        stream = ref.resume(
            yogastore.StreamState.from_json(state.to_json()), shard_rank=rank, num_shards=3
        )
        ids = [int(i) for b in stream.batches(BATCH) for i in b["id"]]
        print(f"  resumed rank {rank} of 3: {len(ids)} records")
        after.extend(ids)
    exact = not (before & set(after)) and sorted(before | set(after)) == list(range(NUM_RECORDS))
    exact = exact and len(after) == len(set(after))
    print(f"resume on 3 ranks reads exactly the {len(after)} unseen records: {exact}")
    if not exact:
        raise SystemExit("resume check failed")


if __name__ == "__main__":
    main()
