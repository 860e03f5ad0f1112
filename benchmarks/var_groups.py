"""Strings and ragged records: how many batches ``to_tf_dataset`` hands over per Python call.

``python -m benchmarks.var_groups [--cases text,images] [--rounds 5]``

For each case (the records of ``read_throughput``'s case of that name, same default sizes,
built into a store from in-memory tensors), one process alternates, round after round:

(b8)  ``stream(shuffle, 4 shards).to_tf_dataset(256)`` handing over groups of about 8 MiB
      (at most 64 batches) and reading two ahead, as before strings and ragged records got
      groups of their own;
(b32) the same with this version's groups (``tf_read._VAR_GROUP_BYTES``, at most
      ``tf_read._VAR_MAX_GROUP`` batches, ``tf_read._VAR_MIN_DEPTH`` read ahead);
(z)   one batch of the stream's records as tensors, repeated (no read, no hand-over);

each consumed by the same Python loop as ``read_throughput``'s (b) and (z), 4 epochs of rank
0's shard per run, the order of (b8) and (b32) swapped every round. One process for all, so
the rates are compared without the drift between processes this machine shows; each round
reads a new order (a new seed), and an untimed run of each group size comes first. Each run
checks its record count and label sum against the stream's own order.

Memory: a child process builds the store, so the reading process holds only what reading
takes. Each row reports the most anonymous memory (heap and buffers, ``RssAnon``) the
process held while it read, sampled every 16 batches. With both rows in one process the
second row's figure includes what the first left to the allocator; ``--rows b8`` and
``--rows b32`` in two processes compare them cleanly, and a single-row run also prints the
process's peak RSS (mapped file pages included).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _varlen
from benchmarks._common import Case, Tally, _status_mib, peak_rss_mib, stream_indices

SIZES = {"text": (2_200_000, 275 + 4 * 55), "images": (80_000, 13 << 10)}
EPOCHS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.var_groups", description=__doc__)
    p.add_argument("--cases", default="text,images", help="comma list of text,images")
    p.add_argument("--rounds", type=int, default=5, help="timed runs of each row")
    p.add_argument("--text-records", type=int, default=SIZES["text"][0])
    p.add_argument("--images-records", type=int, default=SIZES["images"][0])
    p.add_argument("--rows", default="b8,b32", help="comma list of b8,b32")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch dir (default: temp)")
    p.add_argument("--build", nargs=3, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _case(name: str, records: int) -> Case:
    return Case(name=name, records=records, shape=(), kind=name, mean_bytes=SIZES[name][1])


def build(directory: str, name: str, records: int) -> None:
    """Cache the case's records (as in-memory tensors) in a store at ``directory``."""
    import yogastore

    recs = _varlen.make_records(_case(name, records))
    yogastore.Store(directory).cache(_varlen.DATASET, "1", lambda: _varlen.memory_source(recs))


def _timed(make: Any, expected: np.ndarray, peak: list[int]) -> float:
    """Read ``make()`` once with the Python loop; raise its records/s; keep its peak memory."""
    tally = Tally()
    start = time.perf_counter()
    for i, batch in enumerate(make()):
        tally.add(np.asarray(batch["y"]))
        if i % 16 == 0:
            peak[0] = max(peak[0], int(_status_mib("RssAnon") or 0))
    seconds = time.perf_counter() - start
    check = tally.check(expected)
    if not check["ok"]:
        raise SystemExit(f"a run read the wrong records: {check}")
    return tally.records / seconds


def run_case(
    name: str, records: int, rounds: int, rows: list[str], work: Path
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Return each row's rates (records/s per round) and peak anonymous memory (MiB)."""
    import tensorflow as tf

    import yogastore
    from yogastore.train import tf_read

    case = _case(name, records)
    child = [sys.executable, "-m", "benchmarks.var_groups", "--build", str(work / name), name]
    subprocess.run([*child, str(records)], check=True)
    ref = yogastore.Store(str(work / name)).open(_varlen.DATASET, "1")
    sizes = {
        "b8": (8 << 20, 64, 2),
        "b32": (tf_read._VAR_GROUP_BYTES, tf_read._VAR_MAX_GROUP, tf_read._VAR_MIN_DEPTH),
    }

    def stream(seed: int) -> Any:
        return ref.stream(0, 4, shuffle=True, seed=seed, num_epochs=EPOCHS)

    def reader(row: str, seed: int) -> Any:
        def make() -> Any:
            # The bridge reads the group size when the dataset is made.
            tf_read._VAR_GROUP_BYTES, tf_read._VAR_MAX_GROUP, tf_read._VAR_MIN_DEPTH = sizes[row]
            return stream(seed).to_tf_dataset(case.batch_size)

        return make

    first = next(iter(stream(0).to_tf_dataset(case.batch_size)))
    order = stream_indices(ref, case, EPOCHS)
    full = len(order) // case.batch_size
    floor_labels = np.tile(first["y"].numpy(), full)

    def floor() -> Any:
        return tf.data.Dataset.from_tensors(first).repeat(full).prefetch(2)

    rates: dict[str, list[float]] = {row: [] for row in [*rows, "z"]}
    peaks = {row: [0] for row in rates}
    try:
        for row in rows:  # untimed: the first run of a process is slower
            _timed(reader(row, 0), order, peaks[row])
        for r in range(rounds):
            seed = r + 1
            expected = stream_indices(ref, dataclasses.replace(case, seed=seed), EPOCHS)
            for row in rows if r % 2 == 0 else rows[::-1]:
                rates[row].append(_timed(reader(row, seed), expected, peaks[row]))
            rates["z"].append(_timed(floor, floor_labels, peaks["z"]))
            print(
                f"  {name} round {r + 1}: "
                + ", ".join(f"({k}) {v[-1]:,.0f}" for k, v in rates.items()),
                flush=True,
            )
    finally:
        tf_read._VAR_GROUP_BYTES, tf_read._VAR_MAX_GROUP, tf_read._VAR_MIN_DEPTH = sizes["b32"]
    return rates, {row: p[0] for row, p in peaks.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build is not None:
        build(args.build[0], args.build[1], int(args.build[2]))
        return 0
    counts = {"text": args.text_records, "images": args.images_records}
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not rows or not set(rows) <= {"b8", "b32"} or len(set(rows)) < len(rows):
        raise SystemExit(f"--rows {args.rows!r}: give b8, b32 or both")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
            if name not in SIZES:
                raise SystemExit(f"unknown case {name!r}; choose from text, images")
            print(f"case {name}: {counts[name]:,} records, records/s per run", flush=True)
            rates, peaks = run_case(name, counts[name], args.rounds, rows, Path(tmp))
            med = {k: statistics.median(v) for k, v in rates.items()}
            print("  medians: " + ", ".join(f"({k}) {v:,.0f}" for k, v in med.items()))
            ratios = [f"({k})/(z) {med[k] / med['z']:.2f}" for k in rows]
            if len(rows) == 2:
                ratios.insert(0, f"(b32)/(b8) {med['b32'] / med['b8']:.2f}")
            print("  " + ", ".join(ratios))
            print(
                "  peak anonymous memory while reading: "
                + ", ".join(f"({k}) {v:,} MiB" for k, v in peaks.items()),
                flush=True,
            )
    if len(rows) == 1:
        peak_rss = peak_rss_mib()
        print(f"peak RSS of this process (mapped file pages included): {peak_rss:,.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
