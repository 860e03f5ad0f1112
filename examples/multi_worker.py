"""MultiWorkerMirroredStrategy: every worker streams its own shard of a cached dataset.

    python examples/multi_worker.py --workers 2 --store /tmp/ys --out /tmp/mw

starts two worker processes on this machine (``TF_CONFIG`` on 127.0.0.1 at
free ports); started with ``TF_CONFIG`` already set, the script is one worker.
Input pipeline ``i`` of ``n`` reads shard ``i`` of each epoch through
``yogastore.distributed.dataset_fn``, so no worker reads another's records,
and every worker runs the same number of steps. Keras 3 ``Model.fit`` does not
run under this strategy in TF 2.21, hence the custom training loop.

Each worker writes ``ids-rank<i>.jsonl`` (the sample ids of every step) and
``result-rank<i>.json`` (accuracy, loss per epoch) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import _common


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--workers", type=int, default=2, help="workers to start (launcher)")
    parser.add_argument("--batch-size", type=int, default=16, help="records per replica per step")
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds until launcher and workers give up"
    )
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    import tensorflow as tf

    # The strategy must exist before any other TensorFlow op runs.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    from yogastore import distributed as yd

    rank = strategy.cluster_resolver.task_id
    ref = _common.synthetic_dataset(args.store, args.records)
    position = yd.StreamPosition(ref, seed=args.seed)
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    with strategy.scope():
        model = _common.make_model()
        optimizer = keras.optimizers.SGD(args.lr)
    dist_ds = strategy.distribute_datasets_from_function(yd.dataset_fn(position, global_batch))

    train_step = _common.strategy_train_step(strategy, model, optimizer, global_batch)

    log = _common.IdLog(args.out, rank)
    epoch_losses = []
    for epoch in range(position.epoch, args.epochs):
        losses = []
        for batch in dist_ds:  # the rest of this epoch, same step count on every worker
            losses.append(float(train_step(batch)))
            position.advance()
            ids = strategy.experimental_local_results(batch["id"])
            log.write(int(optimizer.iterations.numpy()), epoch, ids)
        epoch_losses.append(sum(losses) / max(len(losses), 1))
        print(f"worker {rank}: epoch {epoch} loss {epoch_losses[-1]:.4f} ({len(losses)} steps)")
    log.close()
    acc = _common.accuracy(model, ref)
    print(f"worker {rank}: accuracy {acc:.3f}")
    _common.write_json(
        os.path.join(args.out, f"result-rank{rank}.json"),
        {"accuracy": acc, "epoch_losses": epoch_losses, "workers": strategy.num_replicas_in_sync},
    )


def main() -> int:
    args = parse_args()
    if "TF_CONFIG" not in os.environ:
        return _common.launch_workers(__file__, sys.argv[1:], args.workers, args.timeout)
    _common.exit_after(args.timeout)  # bounds the wait for peers that never come
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
