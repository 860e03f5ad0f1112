"""Keras ``fit`` with a ``StreamPosition``: advance it per batch and save checkpoints.

Re-exported as ``yogastore.distributed.PositionCallback``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras  # type: ignore[import-untyped]
import tensorflow as tf

from storage_backends.errors import InvalidArgumentError
from yogastore.checks import check_int

if TYPE_CHECKING:
    from yogastore.distributed import StreamPosition

__all__ = ["PositionCallback"]


class PositionCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Keras callback: advance a ``StreamPosition`` per batch and save checkpoints.

    ``manager`` should manage a ``tf.train.Checkpoint`` holding the model, its
    optimizer and ``position``; checkpoints are numbered by the position's
    global step (``ckpt-<step>``). Pass it on the rank that saves only
    (rank 0 under Horovod); every rank needs the callback to advance.

    With fixed training epochs (``epoch_size=EpochSize(...)``, recommended)
    one ``fit`` call does everything, also after restoring mid-epoch: the
    data continues exactly where the checkpoint left it, and training stops
    after ``epochs * steps_per_epoch`` global steps::

        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer, data=position)
        manager = tf.train.CheckpointManager(ckpt, ckpt_dir, max_to_keep=2)
        ckpt.restore(manager.latest_checkpoint)
        dataset = position.dataset(0, 1, 32, epoch_size=EpochSize())  # known cardinality
        model.fit(dataset, initial_epoch=position.initial_epoch(), epochs=10,
                  callbacks=[PositionCallback(position, manager, save_every=100)])

    Without ``epoch_size`` each Keras epoch is the rest of one data epoch,
    and Keras 3 takes every epoch of one ``fit`` call to be as long as its
    first: after a mid-epoch restore finish that epoch in a ``fit`` call of
    its own. Do not pass ``steps_per_epoch`` in either case.

    Args:
        position: the position the training data comes from.
        manager: saves the checkpoint (``None``: only advance the position).
        save_every: also save every this many steps (``None``: at epoch ends only).

    Raises:
        InvalidArgumentError: (from ``fit``, without ``epoch_size``) an epoch
            ended before its data did, which would put later epochs out of
            step with the data.
    """

    def __init__(
        self,
        position: StreamPosition,
        manager: tf.train.CheckpointManager | None = None,
        save_every: int | None = None,
    ) -> None:
        super().__init__()
        from yogastore.train.position import Position

        if not isinstance(position, Position):
            raise InvalidArgumentError(
                f"position must be a StreamPosition (yogastore.distributed), got {position!r:.100}"
            )
        if manager is not None and not isinstance(manager, tf.train.CheckpointManager):
            raise InvalidArgumentError(
                f"manager must be a tf.train.CheckpointManager or None, got {manager!r:.100}"
            )
        self.position = position
        self.manager = manager
        self.save_every = None if save_every is None else check_int("save_every", save_every, 1)
        self._seen = 0
        self._since_save = 0
        self._data_epoch = 0

    def _save(self) -> None:
        if self.manager is not None:
            self.manager.save(checkpoint_number=self.position.global_step)
        self._since_save = 0

    def _last_step(self) -> int | None:
        """The global step at which ``fit(epochs=...)`` ends, with fixed training epochs."""
        epochs = (getattr(self, "params", None) or {}).get("epochs")
        steps = self.position.steps_per_epoch
        return None if epochs is None or steps is None else int(epochs) * steps

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._seen = 0
        self._data_epoch = self.position.epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # With steps_per_execution > 1 Keras reports only the last batch of each call.
        steps = batch + 1 - self._seen
        self._seen = batch + 1
        self.position.advance(steps)
        self._since_save += steps
        if self.save_every and self._since_save >= self.save_every:
            self._save()
        last = self._last_step()
        if last is not None and self.position.global_step >= last:
            # Resumed mid-epoch: the last Keras epoch ends at the planned step.
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._save()
        if self.position.steps_per_epoch is not None:
            return  # fixed training epochs need not match data epochs
        stopped = bool(getattr(self.model, "stop_training", False))
        if self.position.epoch == self._data_epoch and not stopped:
            raise InvalidArgumentError(
                f"Keras epoch {epoch} ended after {self._seen} steps, before data epoch "
                f"{self._data_epoch} did ({self.position!r}); do not pass steps_per_epoch, "
                "and after restoring mid-epoch finish that epoch in a fit() call of its own "
                "(see PositionCallback), or use epoch_size=EpochSize()"
            )
