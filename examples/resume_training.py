"""Crash and resume: restart from the last checkpoint at the exact data position.

    python examples/resume_training.py --workers 2 --store /tmp/ys --out /tmp/run1 \\
        --checkpoint-dir /tmp/ckpt --step-delay 0.2 &
    sleep 20; kill -9 -- -$!          # or any crash, mid-epoch
    python examples/resume_training.py --workers 2 ... --out /tmp/run2 --checkpoint-dir /tmp/ckpt
    python examples/resume_training.py --workers 1 ... --out /tmp/run3 --checkpoint-dir /tmp/ckpt

A MultiWorkerMirroredStrategy job (see ``multi_worker.py``) that saves the
model, the optimizer and the ``yogastore.distributed.StreamPosition`` every
``--save-every`` steps. A restarted job restores the newest checkpoint and
reads exactly the records nobody trained on yet in that epoch: with the same
number of workers each worker gets the batches it would have had without the
crash; with another number the remaining records are re-split among the
workers. Steps trained after the last checkpoint are lost with the crash and
trained again.

Each worker writes ``ids-rank<i>.jsonl`` (``step`` is the optimizer's global
step) and ``resumed-rank<i>.json`` (where it started) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import _common


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--workers", type=int, default=2, help="workers to start (launcher)")
    parser.add_argument("--batch-size", type=int, default=8, help="records per replica per step")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--save-every", type=int, default=2, help="steps between checkpoints")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds until launcher and workers give up"
    )
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    from yogastore import distributed as yd

    resolver = strategy.cluster_resolver
    rank = resolver.task_id
    ref = _common.synthetic_dataset(args.store, args.records)
    position = yd.StreamPosition(ref, seed=args.seed)
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    with strategy.scope():
        model = _common.make_model()
        optimizer = keras.optimizers.SGD(args.lr)
        optimizer.build(model.trainable_variables)

    # Every worker takes part in saving; only the chief (worker 0) writes
    # where the next run looks, the others write to a scratch directory.
    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, data=position)
    scratch = os.path.join(args.checkpoint_dir, f"scratch-worker{rank}")
    write_dir = args.checkpoint_dir if rank == 0 else scratch
    manager = tf.train.CheckpointManager(ckpt, write_dir, max_to_keep=2)
    latest = tf.train.latest_checkpoint(args.checkpoint_dir)
    if latest:
        ckpt.restore(latest).assert_existing_objects_matched()
    start_step = int(optimizer.iterations.numpy())
    _common.write_json(
        os.path.join(args.out, f"resumed-rank{rank}.json"),
        {
            "checkpoint": latest,
            "step": start_step,
            "epoch": position.epoch,
            "state": position.state().to_json(),
            "workers": strategy.num_replicas_in_sync,
        },
    )
    print(f"worker {rank}: starting at step {start_step}, epoch {position.epoch}")

    dist_ds = strategy.distribute_datasets_from_function(yd.dataset_fn(position, global_batch))

    train_step = _common.strategy_train_step(strategy, model, optimizer, global_batch)

    log = _common.IdLog(args.out, rank)
    for epoch in range(position.epoch, args.epochs):
        for batch in dist_ds:
            train_step(batch)
            position.advance()
            step = int(optimizer.iterations.numpy())
            log.write(step, epoch, strategy.experimental_local_results(batch["id"]))
            if step % args.save_every == 0:
                manager.save(checkpoint_number=step)
            time.sleep(args.step_delay)
        print(f"worker {rank}: finished epoch {epoch} at step {optimizer.iterations.numpy()}")
    manager.save(checkpoint_number=int(optimizer.iterations.numpy()))
    log.close()
    shutil.rmtree(scratch, ignore_errors=True)


def main() -> int:
    args = parse_args()
    if "TF_CONFIG" not in os.environ:
        return _common.launch_workers(__file__, sys.argv[1:], args.workers, args.timeout)
    _common.exit_after(args.timeout)  # bounds the wait for peers that never come
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
