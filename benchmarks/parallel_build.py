"""Build time of a CPU-bound first pass with 1 builder vs several (``Store.cache_parallel``).

Run from the repository root::

    python -m benchmarks.parallel_build                  # 4,000 records, 1 vs 2 builders
    python -m benchmarks.parallel_build --records 1000 --builders 1 2 4

Each record is ``{"id": int64, "img": uint8[64, 64, 3], "label": int64}``,
made by a per-record numpy "decode" costing about a millisecond (random
pixels, blurred by repeated FFT filtering), as parsing and decoding images
costs. Each configuration builds the same source into a new local store in a
temporary directory: ``k`` spawned processes, rank ``r`` computing and writing
records ``r, r + k, ...`` only (``make_dataset(rank, num_ranks)``). The time
is the wall clock from the first rank's start (after its imports) to the last
rank's return, i.e. the whole first pass including the wait and the commit.
Prints one line per configuration: seconds, records per second, the speed-up
over one builder, each builder's CPU seconds, and the machine's load average
(other work on the machine takes cores from the builders).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

SIDE = 64


def decode(i: int, rounds: int) -> np.ndarray:
    """Return image ``i``: deterministic pixels, low-pass filtered ``rounds`` times."""
    rng = np.random.default_rng(i)
    img = rng.random((SIDE, SIDE, 3))
    kernel = np.exp(-((np.fft.fftfreq(SIDE)[:, None] ** 2 + np.fft.fftfreq(SIDE) ** 2) * 40))
    for _ in range(rounds):
        img = np.real(np.fft.ifft2(np.fft.fft2(img, axes=(0, 1)) * kernel[..., None], axes=(0, 1)))
    return np.clip(img * 255, 0, 255).astype(np.uint8)


def part(n: int, rounds: int, rank: int, num_ranks: int) -> Iterator[dict[str, Any]]:
    for i in range(rank, n, num_ranks):
        img = decode(i, rounds)
        yield {"id": np.int64(i), "img": img, "label": np.int64(img.sum() % 10)}


def _rank(root: str, rank: int, num_ranks: int, n: int, rounds: int, out: Any) -> None:
    import yogastore as y

    spec = {
        "id": y.ComponentSpec(shape=(), dtype="int64"),
        "img": y.ComponentSpec(shape=(SIDE, SIDE, 3), dtype="uint8"),
        "label": y.ComponentSpec(shape=(), dtype="int64"),
    }
    store = y.Store(root)
    started, cpu = time.time(), time.process_time()
    ref = store.cache_parallel(
        "images",
        "1",
        lambda r, k: part(n, rounds, r, k),
        rank=rank,
        num_ranks=num_ranks,
        attempt="bench",  # every round builds into a new store
        spec=spec,
        progress=y.NullProgress(),
    )
    out.put(
        (
            rank,
            started,
            time.time(),
            ref.num_records,
            ref.manifest.build_id,
            time.process_time() - cpu,
        )
    )


def build(work: str, builders: int, n: int, rounds: int) -> tuple[float, list[float]]:
    """Build the source with ``builders`` processes into a new store.

    Returns:
        The wall-clock seconds, and the CPU seconds of each builder.
    """
    root = tempfile.mkdtemp(dir=work)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(root, r, builders, n, rounds, out)) for r in range(builders)
    ]
    try:
        for p in procs:
            p.start()
        reports = [out.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"a builder failed with exit code {p.exitcode}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if {r[3] for r in reports} != {n} or len({r[4] for r in reports}) != 1:
        raise SystemExit(f"builders disagree: {reports}")
    cpu = [r[5] for r in sorted(reports)]
    return max(r[2] for r in reports) - min(r[1] for r in reports), cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=8, help="FFT filter passes per record")
    parser.add_argument("--builders", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--work-dir", default=None, help="where the stores are made (then deleted)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core per builder, as measured
    decode(0, args.rounds)  # warm up
    t0 = time.perf_counter()
    for i in range(20):
        decode(i, args.rounds)
    per_record = (time.perf_counter() - t0) / 20
    print(
        f"{args.records} records of {SIDE}x{SIDE}x3 uint8, {args.rounds} FFT passes each "
        f"(~{per_record * 1e3:.2f} ms per record), {os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        base = None
        for k in args.builders:
            seconds, cpu = build(work, k, args.records, args.rounds)
            if k == 1:
                base = seconds
            speedup = f"{base / seconds:5.2f}x vs 1 builder" if base else ""
            print(
                f"{k} builder(s): {seconds:7.2f} s  {args.records / seconds:6.0f} records/s  "
                f"{speedup}  CPU s per builder {' '.join(f'{c:.1f}' for c in cpu)}  "
                f"load average {os.getloadavg()[0]:.1f}"
            )


if __name__ == "__main__":
    main()
