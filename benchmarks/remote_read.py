"""Read throughput from S3 (a local moto server): the fault-free ranged and whole-chunk paths.

Builds one dataset on a ``ThreadedMotoServer`` on 127.0.0.1, then reads one
rank's share (of ``--shards``) with block and global shuffle, disk cache off,
``--repeats`` times each, and prints the median records/s, MB/s of records
delivered, requests and bytes fetched per run. Also times the block checksum
check alone (``BlockSums.bad_blocks`` over fetched bytes).

    python -m benchmarks.remote_read [--records 20000] [--record-bytes 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.remote_read", description=__doc__)
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--record-bytes", type=int, default=1024)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--chunk-kib", type=int, default=256)
    p.add_argument("--shuffles", default="block,global", help="comma list of block,global")
    p.add_argument(
        "--warm", action="store_true", help="time reads served by a warmed disk cache instead"
    )
    args = p.parse_args(argv)

    for name, value in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ[name] = value
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    import yogastore as y

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 255, size=(args.records, args.record_bytes), dtype=np.uint8)

    def items() -> Any:
        for i in range(args.records):
            yield {"id": np.int64(i), "x": payload[i]}

    spec = {
        "id": y.ComponentSpec(shape=(), dtype="int64"),
        "x": y.ComponentSpec(shape=(args.record_bytes,), dtype="uint8"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        cache_bytes = (1 << 30) if args.warm else 0
        store = y.Store(
            "s3://bench/b",
            endpoint_url=endpoint,
            cache_dir=Path(tmp),
            cache_bytes=cache_bytes,
            chunk_bytes=args.chunk_kib << 10,
        )
        store.cache("ds", "1", items, spec=spec, progress=y.NullProgress())
        for shuffle in [y.Shuffle(v.strip()) for v in args.shuffles.split(",") if v.strip()]:
            times, stats = [], {}
            for repeat in range(args.repeats + args.warm):
                ref = y.Store(
                    "s3://bench/b",
                    endpoint_url=endpoint,
                    cache_dir=Path(tmp),
                    cache_bytes=cache_bytes,
                ).open("ds", "1")
                # Warm: the same epoch each time, the first run (untimed) fills the cache.
                seed = 0 if args.warm else repeat
                stream = ref.stream(0, args.shards, shuffle=shuffle, seed=seed)
                started = time.perf_counter()
                n = 0
                for batch in stream.batches(args.batch_size):
                    n += len(batch["id"])
                if not (args.warm and repeat == 0):
                    times.append(time.perf_counter() - started)
                stats = stream.stats()
            t = statistics.median(times)
            rate = n * args.record_bytes / t / 1e6
            fetched = stats["bytes_fetched"] / 1e6
            print(
                f"{shuffle.value:6s} {n / t:10.0f} records/s {rate:8.1f} MB/s  "
                f"requests {stats['requests']}  fetched {fetched:.1f} MB  "
                f"hits {stats['cache_hits']}  "
                f"(median of {args.repeats}: {t:.2f} s)"
            )
    try:
        from yogastore.format.blocks import BlockSums, digest_blocks
    except ImportError:
        server.stop()
        return 0
    data = rng.integers(0, 255, size=64 << 20, dtype=np.uint8).tobytes()
    sums = BlockSums(digest_blocks([data], 4096), 0, 4096, len(data), "bench")
    started = time.perf_counter()
    assert not sums.bad_blocks(data, 0)
    t = time.perf_counter() - started
    print(f"block check (4 KiB blocks): {len(data) / t / 1e9:.2f} GB/s")
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
