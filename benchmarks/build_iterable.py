"""Build time of ``Store.cache`` over a numpy iterable (a Python generator with ``spec=``).

Run from the repository root::

    python -m benchmarks.build_iterable                 # 100,000 records, 5 builds
    python -m benchmarks.build_iterable --records 20000 --repeats 3

Each record is ``{"x": float32[32], "y": int64, "tokens": int32[1..16] (ragged)}``.
It prints the median and the spread of the build seconds (each build into a
new store in a temporary directory, with the default progress sink), and
the records per second of the median.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from benchmarks._common import quiet_tensorflow


def records(n: int) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(n, 32)).astype(np.float32)
    lengths = rng.integers(1, 17, size=n)
    for i in range(n):
        yield {
            "x": xs[i],
            "y": np.int64(i),
            "tokens": np.arange(lengths[i], dtype=np.int32),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work-dir", default=None, help="where the stores are made (then deleted)")
    args = parser.parse_args(argv)
    quiet_tensorflow()
    import yogastore

    spec = {
        "x": yogastore.ComponentSpec(shape=(32,), dtype="float32"),
        "y": yogastore.ComponentSpec(shape=(), dtype="int64"),
        "tokens": yogastore.ComponentSpec(shape=(None,), dtype="int32"),
    }
    times = []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(dir=args.work_dir) as root:
            store = yogastore.Store(root)
            started = time.perf_counter()
            ref = store.cache("bench", "1", lambda: records(args.records), spec=spec)
            times.append(time.perf_counter() - started)
            assert ref.num_records == args.records
            print(f"build {r}: {times[-1]:.3f} s", flush=True)
    median = statistics.median(times)
    print(
        f"{args.records} records: median {median:.3f} s (min {min(times):.3f}, max "
        f"{max(times):.3f}), {args.records / median:,.0f} records/s"
    )


if __name__ == "__main__":
    main()
