"""Horovod + Keras 3 ``model.fit``: each rank trains on its shard, resumable by step.

    horovodrun -np 2 --gloo -H localhost:2 --network-interface lo \\
        python examples/horovod_keras.py --store /tmp/ys --out /tmp/hvdk --checkpoint-dir /tmp/ck

Horovod 0.28.1's ``horovod.tensorflow.keras`` does not work with Keras 3
(``DistributedOptimizer``, ``BroadcastGlobalVariablesCallback`` and
``LearningRateWarmupCallback`` rely on Keras 2 internals). The three pieces
that matter are small enough to write here:

* gradients averaged over ranks inside the optimizer's ``apply`` (which
  ``fit``'s train step calls), so every rank applies the same update;
* a callback that broadcasts rank 0's weights and optimizer state once,
  when training begins (also after a restore);
* ``PositionCallback`` advancing the data position every step, with the
  checkpoint manager given to rank 0 only (the one that writes).

``horovod_dataset(..., epoch_size=EpochSize())`` checks that every rank
agrees on the dataset, seed, position and batch size, and gives the dataset
a known cardinality; a rerun restores the last checkpoint (model, optimizer,
data position) and finishes the training in one ``fit`` call.

Each rank writes ``result-rank<r>.json`` (global step, weights, accuracy).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import _common


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="records per rank per step")
    parser.add_argument("--checkpoint-dir", default=None, help="save and resume from here")
    parser.add_argument("--save-every", type=int, default=5, help="steps between checkpoints")
    return parser.parse_args()


def allreduce_optimizer(optimizer: Any, hvd: Any) -> Any:
    """Return ``optimizer`` with gradients averaged over all ranks in ``apply``."""
    base = type(optimizer)

    class AllReduce(base):  # type: ignore[misc, valid-type]
        def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
            grads = [
                None if g is None else hvd.allreduce(g, op=hvd.Average, name=f"grad_{i}")
                for i, g in enumerate(grads)
            ]
            return super().apply(grads, trainable_variables)

    return AllReduce.from_config(optimizer.get_config())


def broadcast_callback(hvd: Any) -> Any:
    """Return a callback broadcasting rank 0's model and optimizer variables once."""
    import keras

    class Broadcast(keras.callbacks.Callback):  # type: ignore[misc]
        done = False

        def on_train_begin(self, logs: Any = None) -> None:
            if self.done:
                return
            # Horovod wants tf.Variables; Keras 3 variables wrap one in `.value`.
            hvd.broadcast_variables([v.value for v in self.model.variables], root_rank=0)
            hvd.broadcast_variables([v.value for v in self.model.optimizer.variables], 0)
            self.done = True

    return Broadcast()


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
    optimizer = allreduce_optimizer(keras.optimizers.SGD(args.lr * size), hvd)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    optimizer.build(model.trainable_variables)

    manager = None
    if args.checkpoint_dir:
        ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, data=position)
        latest = tf.train.latest_checkpoint(args.checkpoint_dir)
        if latest:  # every rank restores the same checkpoint (the data position too)
            ckpt.restore(latest).assert_existing_objects_matched()
            print(f"rank {rank}: resumed at global step {position.global_step}")
        if rank == 0:  # one writer
            manager = tf.train.CheckpointManager(ckpt, args.checkpoint_dir, max_to_keep=2)

    dataset = yd.horovod_dataset(position, args.batch_size, epoch_size=yd.EpochSize())
    dataset = dataset.map(lambda b: (b["x"], b["y"]))
    callbacks = [
        broadcast_callback(hvd),
        yd.PositionCallback(position, manager, save_every=args.save_every),
    ]
    history = model.fit(
        dataset,
        initial_epoch=position.initial_epoch(),
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=2 if rank == 0 else 0,
    )
    shard = yd.horovod_stream(ref, shuffle=False, drop_remainder=False)
    counts = hvd.allreduce(tf.constant(_common.count_correct(model, shard)), op=hvd.Sum)
    correct, evaluated = (int(c) for c in counts.numpy())
    print(f"rank {rank}: accuracy {correct / evaluated:.3f}, global step {position.global_step}")
    _common.write_json(
        os.path.join(args.out, f"result-rank{rank}.json"),
        {
            "accuracy": correct / evaluated,
            "evaluated": evaluated,
            "global_step": position.global_step,
            "steps_per_epoch": position.steps_per_epoch,
            "state": position.state().to_json(),
            "weights": [w.tolist() for w in model.get_weights()],
            "losses": [float(x) for x in history.history.get("loss", [])],
            "workers": size,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
