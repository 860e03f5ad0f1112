"""Strings and ragged records: how many batches ``to_tf_dataset`` hands over per Python call.

``python -m benchmarks.var_groups [--cases text,images] [--rounds 5]``

For each case (the records of ``read_throughput``'s case of that name, same default sizes,
built into a store from in-memory tensors), one process alternates, round after round:

(b8)  ``stream(shuffle, 4 shards).to_tf_dataset(256)`` handing over groups of about 8 MiB
      (at most 64 batches), the size before strings and ragged records got their own;
(b32) the same with this version's group size (``tf_read._VAR_GROUP_BYTES``, at most
      ``tf_read._VAR_MAX_GROUP`` batches);
(z)   one batch of the stream's records as tensors, repeated (no read, no hand-over);

each consumed by the same Python loop as ``read_throughput``'s (b) and (z), 4 epochs of rank
0's shard per run, the order of (b8) and (b32) swapped every round. One process for all, so
the rates are compared without the drift between processes this machine shows; each round
reads a new order (a new seed), and an untimed run of each group size comes first. Each run
checks its record count and label sum against the stream's own order.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _varlen
from benchmarks._common import Case, Tally, consume, stream_indices, tf_labels

SIZES = {"text": (2_200_000, 275 + 4 * 55), "images": (80_000, 13 << 10)}
EPOCHS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.var_groups", description=__doc__)
    p.add_argument("--cases", default="text,images", help="comma list of text,images")
    p.add_argument("--rounds", type=int, default=5, help="timed runs of each row")
    p.add_argument("--text-records", type=int, default=SIZES["text"][0])
    p.add_argument("--images-records", type=int, default=SIZES["images"][0])
    p.add_argument("--work-dir", type=Path, default=None, help="scratch dir (default: temp)")
    return p.parse_args(argv)


def _timed(make: Any, expected: np.ndarray) -> float:
    start = time.perf_counter()
    tally: Tally = consume(make(), tf_labels)
    seconds = time.perf_counter() - start
    check = tally.check(expected)
    if not check["ok"]:
        raise SystemExit(f"a run read the wrong records: {check}")
    return tally.records / seconds


def run_case(name: str, records: int, rounds: int, work: Path) -> dict[str, list[float]]:
    import tensorflow as tf

    import yogastore
    from yogastore.train import tf_read

    case = Case(name=name, records=records, shape=(), kind=name, mean_bytes=SIZES[name][1])
    recs = _varlen.make_records(case)
    ref = yogastore.Store(str(work / name)).cache(
        _varlen.DATASET, "1", lambda: _varlen.memory_source(recs)
    )
    sizes = {
        "b8": (8 << 20, 64),
        "b32": (tf_read._VAR_GROUP_BYTES, tf_read._VAR_MAX_GROUP),
    }

    def stream(seed: int) -> Any:
        return ref.stream(0, 4, shuffle=True, seed=seed, num_epochs=EPOCHS)

    def reader(row: str, seed: int) -> Any:
        def make() -> Any:
            # The bridge reads the group size when the dataset is made.
            tf_read._VAR_GROUP_BYTES, tf_read._VAR_MAX_GROUP = sizes[row]
            return stream(seed).to_tf_dataset(case.batch_size)

        return make

    first = next(iter(stream(0).to_tf_dataset(case.batch_size)))
    order = stream_indices(ref, case, EPOCHS)
    full = len(order) // case.batch_size
    floor_labels = np.tile(first["y"].numpy(), full)

    def floor() -> Any:
        return tf.data.Dataset.from_tensors(first).repeat(full).prefetch(2)

    rates: dict[str, list[float]] = {"b8": [], "b32": [], "z": []}
    try:
        for row in ("b8", "b32"):  # untimed: the first run of a process is slower
            _timed(reader(row, 0), order)
        for r in range(rounds):
            seed = r + 1
            expected = stream_indices(ref, dataclasses.replace(case, seed=seed), EPOCHS)
            for row in ("b8", "b32") if r % 2 == 0 else ("b32", "b8"):
                rates[row].append(_timed(reader(row, seed), expected))
            rates["z"].append(_timed(floor, floor_labels))
            print(
                f"  {name} round {r + 1}: "
                + ", ".join(f"({k}) {v[-1]:,.0f}" for k, v in rates.items()),
                flush=True,
            )
    finally:
        tf_read._VAR_GROUP_BYTES, tf_read._VAR_MAX_GROUP = sizes["b32"]
    return rates


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = {"text": args.text_records, "images": args.images_records}
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
            if name not in SIZES:
                raise SystemExit(f"unknown case {name!r}; choose from text, images")
            print(f"case {name}: {counts[name]:,} records, records/s per run", flush=True)
            rates = run_case(name, counts[name], args.rounds, Path(tmp))
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(f"  medians: (b8) {med['b8']:,.0f}, (b32) {med['b32']:,.0f}, (z) {med['z']:,.0f}")
            print(
                f"  (b32)/(b8) {med['b32'] / med['b8']:.2f}; (b8)/(z) {med['b8'] / med['z']:.2f}, "
                f"(b32)/(z) {med['b32'] / med['z']:.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
