"""Where a cache build's time goes: cProfile of ``Store.cache`` next to plain iteration.

Run from the repository root::

    python -m benchmarks.profile_build                        # 2,000 images of 224x224x3
    python -m benchmarks.profile_build --records 20000 --shape 4096

The source is ``from_tensor_slices`` over random uint8 records plus an int64
label (the ``g2`` row of ``read_throughput``). It prints the median seconds of
iterating the source batched, the build's seconds, and the build's functions
by own time. Chunks are written on a thread of their own, so the main thread's
time waiting for them shows as ``acquire`` of a lock.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time

import numpy as np

from benchmarks._common import quiet_tensorflow, steady


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--shape", default="224,224,3", help="record shape, uint8")
    parser.add_argument("--top", type=int, default=12, help="functions to list")
    parser.add_argument("--work-dir", default=".", help="where the store is made (then deleted)")
    args = parser.parse_args(argv)
    quiet_tensorflow()
    import tensorflow as tf

    import yogastore

    shape = tuple(int(s) for s in args.shape.split(","))
    data = np.random.default_rng(0).integers(0, 256, size=(args.records, *shape), dtype=np.uint8)
    labels = np.arange(args.records, dtype=np.int64)

    def make() -> tf.data.Dataset:
        return steady(tf.data.Dataset.from_tensor_slices({"x": data, "y": labels}))

    def iterate() -> None:
        for _ in make().batch(512).prefetch(2).as_numpy_iterator():
            pass

    iterate()  # warm: TensorFlow's first pipeline pays one-time costs
    runs = []
    for _ in range(3):
        os.sync()
        start = time.perf_counter()
        iterate()
        runs.append(time.perf_counter() - start)
    iterate_s = sorted(runs)[1]
    with tempfile.TemporaryDirectory(dir=args.work_dir) as root:
        store = yogastore.Store(root)
        os.sync()
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        ref = store.cache("profiled", "1", make)
        profile.disable()
        build_s = time.perf_counter() - start
        size = ref.manifest.nbytes
    described = f"{args.records} records of {shape} uint8 + int64 label"
    print(f"{described}, {size / 1e6:.1f} MB ({size} bytes) cached")
    print(f"iterate {iterate_s:.2f}s (median of 3), build {build_s:.2f}s (profiled)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
