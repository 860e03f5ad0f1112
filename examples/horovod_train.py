"""Horovod + TensorFlow: every rank streams its own shard of a cached dataset.

    horovodrun -np 2 --gloo -H localhost:2 --network-interface lo \\
        python examples/horovod_train.py --store /tmp/ys --out /tmp/hvd

Rank ``hvd.rank()`` of ``hvd.size()`` reads its shard of each epoch (a new
global order every epoch) through ``yogastore.distributed.horovod_dataset``;
every rank runs the same number of steps, so the gradient all-reduce never
waits for a rank that has run out of data. With ``--checkpoint-dir`` the data
position is saved with the model (by rank 0) and a rerun continues exactly
where the last checkpoint was taken, with any number of ranks.

Each rank writes ``ids-rank<r>.jsonl`` (the sample ids of every step) and
``result-rank<r>.json`` (accuracy, loss per epoch) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import _common


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="records per rank per step")
    parser.add_argument("--checkpoint-dir", default=None, help="save and resume from here")
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    import horovod.tensorflow as hvd

    hvd.init()
    import keras
    import tensorflow as tf

    from yogastore import distributed as yd

    rank, size = hvd.rank(), hvd.size()
    ref = _common.synthetic_dataset(args.store, args.records)
    position = yd.StreamPosition(ref, seed=args.seed)
    model = _common.make_model()
    # Scale the learning rate with the number of ranks: the global batch grows with it.
    optimizer = keras.optimizers.SGD(args.lr * size)
    optimizer.build(model.trainable_variables)

    manager = None
    if args.checkpoint_dir:
        ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, data=position)
        manager = tf.train.CheckpointManager(ckpt, args.checkpoint_dir, max_to_keep=2)
        if manager.latest_checkpoint:  # every rank reads the same checkpoint
            ckpt.restore(manager.latest_checkpoint).assert_existing_objects_matched()
            print(f"rank {rank}: resumed at epoch {position.epoch}, {position.state()}")
    # Start from rank 0's weights whatever happened before.
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    hvd.broadcast_variables([v.value for v in optimizer.variables], root_rank=0)

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        tape = hvd.DistributedGradientTape(tape)
        # Horovod keys gradients by tf.Variable; Keras 3 variables wrap one in `.value`.
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return hvd.allreduce(loss)

    dataset = yd.horovod_dataset(position, args.batch_size)
    log = _common.IdLog(args.out, rank)
    epoch_losses = []
    for epoch in range(position.epoch, args.epochs):
        losses = []
        for batch in dataset:  # the rest of this epoch, same step count on every rank
            losses.append(float(train_step(batch["x"], batch["y"])))
            position.advance()
            step = int(optimizer.iterations.numpy())
            log.write(step, epoch, [batch["id"]])
            if manager is not None and rank == 0 and step % args.save_every == 0:
                manager.save(checkpoint_number=step)
        epoch_losses.append(sum(losses) / max(len(losses), 1))
        if rank == 0:
            print(f"epoch {epoch}: loss {epoch_losses[-1]:.4f} ({len(losses)} steps per rank)")
    log.close()
    if manager is not None and rank == 0:
        manager.save(checkpoint_number=int(optimizer.iterations.numpy()))
    # Evaluate in parallel: each rank scores its shard (every record once:
    # no lockstep here, so no need to drop a remainder), then sum the counts.
    shard = yd.horovod_stream(ref, shuffle=False, drop_remainder=False)
    counts = hvd.allreduce(tf.constant(_common.count_correct(model, shard)), op=hvd.Sum)
    correct, evaluated = (int(c) for c in counts.numpy())
    acc = correct / evaluated
    print(f"rank {rank}: accuracy {acc:.3f} over {evaluated} records")
    _common.write_json(
        os.path.join(args.out, f"result-rank{rank}.json"),
        {"accuracy": acc, "evaluated": evaluated, "epoch_losses": epoch_losses, "workers": size},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
