"""What one rank of many pays to start reading a local store: time, memory, bytes verified.

Run from the repository root::

    python -m benchmarks.scale                                   # 1e7 records {"id": int64}
    python -m benchmarks.scale --records 30000000
    python -m benchmarks.scale --record-bytes 16384 --records 65536   # 1 GiB of 16 KiB records

Builds a local store (in a temporary directory, or ``--store`` kept for the
next run) from numpy batches (``yogastore.Batches`` with ``spec=``, no
TensorFlow), then, in a
fresh process, opens it and reads rank
``--rank`` of ``--num-shards`` with a global shuffle through ``Stream.batches``.
It reports the build time; the open time; the first batch's latency; the
bytes the rank verified (``stream.stats()["bytes_verified"]``; older versions
without it verified every chunk they viewed whole, so their ``bytes_fetched``
is taken), the pages of the data file resident in the reading process (the
``Rss`` of its mapping in ``/proc/self/smaps``; kernels that map whole large
folios of the page cache per fault make this coarse) and the bytes of the data
file read from disk (the reader starts by dropping the file from the page
cache, ``posix_fadvise(DONTNEED)``, then counts its cached pages with
``mincore``; ``--warm`` skips the drop), after the open, the first batch and
the rank's whole epoch; the epoch's read time; the rate of the rank's next
epoch (a fresh order, start-up paid); and the reader's peak RSS (mapped file
pages included) and its anonymous memory (heap and buffers, not the page
cache's file pages, which every process of the machine shares) at the end.
``--baseline DIR`` also reads the same store with the yogastore checkout at
``DIR`` (another version, for a before/after table); the two alternate,
``--repeats`` fresh reader processes each, and every figure is the median.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

_DATASET = ("scale", "1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--records", type=int, default=10_000_000, help="records in the dataset")
    p.add_argument(
        "--record-bytes",
        type=int,
        default=0,
        help="bytes per record {'x': uint8[B]}; 0: records {'id': int64}",
    )
    p.add_argument(
        "--chunk-bytes", type=int, default=None, help="chunk size of the build (default: 4 MiB)"
    )
    p.add_argument("--num-shards", type=int, default=64)
    p.add_argument("--rank", type=int, default=17)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--store", type=Path, default=None, help="build here, or reuse (default: a temp dir)"
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="also read with the yogastore checkout at this path (same store, fresh process)",
    )
    p.add_argument(
        "--warm", action="store_true", help="leave the data file in the page cache (no drop)"
    )
    p.add_argument("--repeats", type=int, default=3, help="reader processes per version (median)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--read", type=Path, default=None, help=argparse.SUPPRESS)  # worker: root
    return p.parse_args(argv)


def _spec(record_bytes: int) -> dict[str, Any]:
    import yogastore

    if record_bytes:
        return {"x": yogastore.ComponentSpec(shape=(record_bytes,), dtype="uint8")}
    return {"id": yogastore.ComponentSpec(shape=(), dtype="int64")}


def _batches(n: int, record_bytes: int) -> Iterator[dict[str, Any]]:
    """The records in batches of about 8 MiB (``yogastore.Batches``)."""
    per = max(1, min(1 << 20, (8 << 20) // max(8, record_bytes)))
    if not record_bytes:
        for start in range(0, n, per):
            yield {"id": np.arange(start, min(n, start + per), dtype=np.int64)}
        return
    # Distinct bytes per record without generating a GiB of randomness: windows
    # of a random pool, each record's first 8 bytes its index.
    pool = np.random.default_rng(0).integers(0, 256, size=(64 << 20) + record_bytes, dtype=np.uint8)
    windows = np.lib.stride_tricks.sliding_window_view(pool, record_bytes)
    head = min(8, record_bytes)
    for start in range(0, n, per):
        ids = np.arange(start, min(n, start + per), dtype=np.int64)
        recs = windows[(ids * 4099) % (len(pool) - record_bytes)]
        recs[:, :head] = ids.view(np.uint8).reshape(len(ids), 8)[:, :head]
        yield {"x": recs}


def _mapped_rss(path: Path) -> int:
    """Return the bytes of ``path`` resident in this process's mappings of it."""
    total = 0
    inside = False
    target = str(path.resolve())
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                inside = len(head) >= 6 and head[5] == target
            elif inside and head and head[0] == "Rss:":
                total += int(head[1]) << 10
    return total


def _drop_cached(path: Path) -> None:
    """Ask the kernel to drop the file's clean pages from its page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached(path: Path) -> int:
    """Return the bytes of ``path`` in the page cache (``mincore`` of a fresh map)."""
    size = path.stat().st_size
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        address = np.frombuffer(m, dtype=np.uint8).ctypes.data
        pages = -(-size // page)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        resident = int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
    return resident * page


def _peak_rss() -> int:
    """Return this process's peak RSS (``VmHWM``: unlike ``ru_maxrss``, not inherited over exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    return 0


def _anonymous() -> int:
    """Return this process's anonymous memory (heap and buffers; file pages excluded).

    Pages of the data file a reader maps are the page cache's, shared by every
    process of the machine that reads them; what each rank adds is this.
    """
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) << 10
    return 0


def _verified(stats: dict[str, int]) -> int:
    if "bytes_verified" in stats:
        return int(stats["bytes_verified"])
    return int(stats["bytes_fetched"])  # whole chunks, each verified on first view


def read(args: argparse.Namespace) -> dict[str, Any]:
    """Open the store at ``args.read`` and read one rank's epoch (run in a fresh process)."""
    import yogastore

    data_file = Path(args.read, *_DATASET, "data.mdb")
    # From a cold page cache, what the file's cache holds later is what this
    # process made the kernel read (LMDB maps it without read-ahead).
    if not args.warm:
        _drop_cached(data_file)
    cold = _cached(data_file)
    started = time.perf_counter()
    ref = yogastore.Store(args.read).open(*_DATASET)
    opened = time.perf_counter() - started
    after_open = _cached(data_file)
    stream = ref.stream(args.rank, args.num_shards, shuffle=True, seed=0)
    started = time.perf_counter()
    batches = stream.batches(args.batch_size)
    first = next(batches)
    first_s = time.perf_counter() - started
    epoch_started = started
    after_first = stream.stats()
    rss_first = _mapped_rss(data_file)
    read_first = _cached(data_file)
    records = len(next(iter(first.values())))
    for batch in batches:
        records += len(next(iter(batch.values())))
    epoch_s = time.perf_counter() - epoch_started
    after_epoch = stream.stats()
    read_epoch = _cached(data_file)
    resident_epoch = _mapped_rss(data_file)
    # The steady rate: the next epoch (a fresh order) of the same rank, after start-up.
    started = time.perf_counter()
    again = 0
    for batch in ref.stream(args.rank, args.num_shards, shuffle=True, seed=0, epoch=1).batches(
        args.batch_size
    ):
        again += len(next(iter(batch.values())))
    steady = again / (time.perf_counter() - started)
    return {
        "open_s": opened,
        "first_batch_s": first_s,
        "records": records,
        "verified_first": _verified(after_first),
        "verified_epoch": _verified(after_epoch),
        "resident_first": rss_first,
        "resident_epoch": resident_epoch,
        "cached_before": cold,
        "read_open": after_open,
        "read_first": read_first,
        "read_epoch": read_epoch,
        "epoch_s": epoch_s,
        "steady_rate": steady,
        "peak_rss": _peak_rss(),
        "anonymous": _anonymous(),
        "file_bytes": data_file.stat().st_size,
    }


def _read_in(root: str, args: argparse.Namespace, baseline: Path | None) -> dict[str, Any]:
    """Run ``read`` in a fresh process, with the yogastore of ``baseline`` if given."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--read", root]
    cmd += ["--rank", str(args.rank), "--num-shards", str(args.num_shards)]
    cmd += ["--batch-size", str(args.batch_size)] + (["--warm"] if args.warm else [])
    # Both versions imported the same way (a path entry, not an editable
    # install's finder), so that import costs do not differ between them.
    checkout = baseline if baseline is not None else Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), env.get("PYTHONPATH", "")])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _median(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def _build(root: str, args: argparse.Namespace) -> tuple[Any, float]:
    import yogastore

    store = yogastore.Store(root)
    started = time.perf_counter()
    ref = store.cache(
        *_DATASET,
        lambda: yogastore.Batches(_batches(args.records, args.record_bytes)),
        spec=_spec(args.record_bytes),
        chunk_bytes=args.chunk_bytes,
        progress=yogastore.NullProgress(),
    )
    if ref.num_records != args.records:
        raise SystemExit(f"{root} holds {ref.num_records} records, not {args.records}")
    return ref, time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.read is not None:
        print(json.dumps(read(args)))
        return
    with contextlib.ExitStack() as stack:
        root = str(args.store) if args.store else stack.enter_context(tempfile.TemporaryDirectory())
        ref, build_s = _build(root, args)
        # Alternate the versions, fresh processes each time; medians per figure.
        samples: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
        for _ in range(args.repeats):
            if args.baseline is not None:
                samples["baseline"].append(_read_in(root, args, args.baseline))
            samples["this"].append(_read_in(root, args, None))
        runs = {name: _median(got) for name, got in samples.items() if got}
    chunks = ref.manifest.chunks
    data_bytes = sum(c.nbytes for c in chunks)
    index_bytes = sum(c.index_bytes for c in chunks)
    share = data_bytes / args.num_shards
    mib = 1 << 20
    what = f"{{'x': uint8[{args.record_bytes}]}}" if args.record_bytes else "{'id': int64}"
    print(
        f"{args.records:,} records {what}: {data_bytes / mib:,.0f} MiB in {len(chunks):,} chunks "
        f"(indexes {index_bytes / mib:,.1f} MiB); rank {args.rank} of {args.num_shards}, "
        f"global shuffle, batches of {args.batch_size}; its share {share / mib:,.1f} MiB; "
        f"build {build_s:.1f} s" + (" (store reused)" if args.store and build_s < 1 else "")
    )
    rows = [
        ("open", lambda r: f"{r['open_s'] * 1e3:.1f} ms"),
        ("first batch", lambda r: f"{r['first_batch_s'] * 1e3:.1f} ms"),
        ("verified after first batch", lambda r: f"{r['verified_first'] / mib:,.1f} MiB"),
        ("data file resident, first batch", lambda r: f"{r['resident_first'] / mib:,.1f} MiB"),
        ("data file in page cache, open", lambda r: f"{r['read_open'] / mib:,.1f} MiB"),
        ("data file in page cache, first batch", lambda r: f"{r['read_first'] / mib:,.1f} MiB"),
        ("verified after the epoch", lambda r: f"{r['verified_epoch'] / mib:,.1f} MiB"),
        ("data file resident, epoch", lambda r: f"{r['resident_epoch'] / mib:,.1f} MiB"),
        ("data file in page cache, epoch", lambda r: f"{r['read_epoch'] / mib:,.1f} MiB"),
        ("the rank's epoch, first batch included", lambda r: f"{r['epoch_s'] * 1e3:,.1f} ms"),
        ("next epoch, records/s", lambda r: f"{r['steady_rate']:,.0f}"),
        ("peak RSS of the reader", lambda r: f"{r['peak_rss'] / mib:,.0f} MiB"),
        ("anonymous memory at the end", lambda r: f"{r['anonymous'] / mib:,.0f} MiB"),
    ]
    print(f"  {'':<34}" + "".join(f"{name:>18}" for name in runs))
    for name, cell in rows:
        print(f"  {name:<34}" + "".join(f"{cell(r):>18}" for r in runs.values()))
    if args.json is not None:
        summary = {
            "records": args.records,
            "record_bytes": args.record_bytes or 8,
            "chunks": len(chunks),
            "data_bytes": data_bytes,
            "index_bytes": index_bytes,
            "build_s": build_s,
            "rank": args.rank,
            "num_shards": args.num_shards,
            "batch_size": args.batch_size,
            "runs": runs,
        }
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
