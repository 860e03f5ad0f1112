"""Horovod: every rank writes its part of the first pass, then reads its shard.

    horovodrun -np 2 --gloo -H localhost:2 --network-interface lo \\
        python examples/horovod_parallel_build.py --store /tmp/ys --out /tmp/hvd

Each rank takes ``source.shard(hvd.size(), hvd.rank())`` of a ``tf.data``
source, with its per-record work (here a small decode), and writes it to the
store; once every part is there one manifest commits the dataset and every
rank gets the same ``DatasetRef``. Each rank then reads its shard of epoch 0
(a fresh global order) through ``yogastore.distributed.horovod_stream``.

Each rank writes ``result-rank<r>.json`` (build id, record count, the ids it
read) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import _common


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for peers")
    return parser.parse_args()


def make_source(num_records: int) -> object:
    """A tf.data source whose records cost some work: features decoded from their id."""
    import tensorflow as tf

    def decode(i: tf.Tensor) -> dict[str, tf.Tensor]:
        x = tf.random.stateless_normal([_common.DIM], seed=tf.stack([i, tf.constant(0, tf.int64)]))
        return {"id": i, "x": x, "y": tf.cast(tf.reduce_sum(x) > 0, tf.int64)}

    return tf.data.Dataset.range(num_records).map(decode)


def main() -> int:
    args = parse_args()
    import horovod.tensorflow as hvd

    hvd.init()
    from yogastore import Store
    from yogastore import distributed as yd

    rank, size = hvd.rank(), hvd.size()
    store = Store(args.store)
    # The library shards the source: rank r writes source.shard(size, r).
    ref = yd.cache_parallel(
        store,
        "decoded",
        f"n{args.records}",
        lambda: make_source(args.records),
        timeout=args.timeout,
    )
    print(f"rank {rank}/{size}: {ref.num_records} records, build {ref.manifest.build_id}")
    ids = [
        int(i) for batch in yd.horovod_stream(ref, seed=args.seed).batches(64) for i in batch["id"]
    ]
    _common.write_json(
        os.path.join(args.out, f"result-rank{rank}.json"),
        {"build_id": ref.manifest.build_id, "num_records": ref.num_records, "ids": ids},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
