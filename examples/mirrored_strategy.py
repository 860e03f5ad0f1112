"""MirroredStrategy + Keras ``fit``: replicas on logical CPU devices, checkpointed data position.

    python examples/mirrored_strategy.py --store /tmp/ys --out /tmp/mirrored \\
        --checkpoint-dir /tmp/mirrored/ckpt

splits the one CPU into ``--replicas`` logical devices and trains with
``MirroredStrategy`` on ``distribute_datasets_from_function`` fed by
``yogastore.distributed.dataset_fn`` (one input pipeline; its per-replica
batches go to the replicas in turn). ``PositionCallback`` advances the data
position after every batch and saves it with the model, so a rerun after a
crash continues with the batch after the last checkpoint.

Writes ``ids-rank0.jsonl`` (the sample ids of every per-replica batch, in the
order the replicas receive them) and ``result-rank0.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any

import _common


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU devices")
    parser.add_argument("--batch-size", type=int, default=16, help="records per replica per step")
    parser.add_argument("--checkpoint-dir", default=None, help="save and resume from here")
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    import tensorflow as tf

    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas
    )
    import keras

    from yogastore import distributed as yd

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    ref = _common.synthetic_dataset(args.store, args.records)
    position = yd.StreamPosition(ref, seed=args.seed)
    global_batch = args.batch_size * strategy.num_replicas_in_sync

    log = _common.IdLog(args.out, 0)
    lock = threading.Lock()

    def record(ids: Any, replica: Any, step: Any) -> None:
        with lock:  # the replicas run concurrently
            log.write(int(step) + 1, position.epoch, [ids.numpy()], replica=int(replica))

    class IdRecordingModel(keras.Model):  # type: ignore[misc]
        """Trains ``inner``; logs the sample ids each replica trains on."""

        def __init__(self, inner: keras.Model) -> None:
            super().__init__()
            self.inner = inner

        def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
            return self.inner(x, training=training)

        def train_step(self, data: Any) -> Any:
            x, y, ids = data
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            tf.py_function(record, [ids, replica, self.optimizer.iterations], [])
            return super().train_step((x, y))

    make_dataset = yd.dataset_fn(position, global_batch)

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        return make_dataset(context).map(lambda b: (b["x"], b["y"], b["id"]))

    dist_ds = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = IdRecordingModel(_common.make_model())
        model.compile(
            optimizer=keras.optimizers.SGD(args.lr),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.build((None, _common.DIM))
        model.optimizer.build(model.trainable_variables)

    manager = None
    if args.checkpoint_dir:
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer, data=position)
        manager = tf.train.CheckpointManager(ckpt, args.checkpoint_dir, max_to_keep=2)
        if manager.latest_checkpoint:
            ckpt.restore(manager.latest_checkpoint).assert_existing_objects_matched()
            print(f"resumed at epoch {position.epoch}: {position.state()}")

    callback = yd.PositionCallback(position, manager, save_every=args.save_every)
    losses: list[float] = []
    if position.mid_epoch and position.epoch < args.epochs:
        # Keras takes every epoch of a fit() call to be as long as the first:
        # finish the interrupted epoch on its own.
        history = model.fit(
            dist_ds,
            initial_epoch=position.epoch,
            epochs=position.epoch + 1,
            callbacks=[callback],
            shuffle=False,  # yogastore shuffles
            verbose=2,
        )
        losses += history.history.get("loss", [])
    history = model.fit(
        dist_ds,
        initial_epoch=position.epoch,
        epochs=args.epochs,
        callbacks=[callback],
        shuffle=False,
        verbose=2,
    )
    losses += history.history.get("loss", [])
    log.close()
    acc = _common.accuracy(model, ref)
    print(f"accuracy {acc:.3f}")
    _common.write_json(
        os.path.join(args.out, "result-rank0.json"),
        {
            "accuracy": acc,
            "epoch_losses": [float(v) for v in losses],
            "workers": 1,
            "replicas": strategy.num_replicas_in_sync,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
