"""Keras ``fit`` with a ``StreamPosition``: advance it per batch and save checkpoints.

Re-exported as ``yogastore.distributed.PositionCallback``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras  # type: ignore[import-untyped]
import numpy as np
import tensorflow as tf

from storage_backends.errors import InvalidArgumentError

if TYPE_CHECKING:
    from yogastore.distributed import StreamPosition

__all__ = ["PositionCallback"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


class PositionCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Keras callback: advance a ``StreamPosition`` per batch and save checkpoints.

    ``manager`` should manage a ``tf.train.Checkpoint`` holding the model, its
    optimizer and ``position``. Keras 3 takes every epoch of one ``fit`` call
    to be as long as its first, so after restoring in the middle of an epoch
    finish that epoch with a ``fit`` call of its own::

        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer, data=position)
        manager = tf.train.CheckpointManager(ckpt, ckpt_dir, max_to_keep=2)
        ckpt.restore(manager.latest_checkpoint)
        callback = PositionCallback(position, manager, save_every=100)
        dataset = position.dataset(0, 1, 32)  # or a dataset_fn under a strategy
        if position.mid_epoch:
            model.fit(dataset, initial_epoch=position.epoch, epochs=position.epoch + 1,
                      callbacks=[callback])
        model.fit(dataset, initial_epoch=position.epoch, epochs=10, callbacks=[callback])

    Do not pass ``steps_per_epoch``: each epoch is one pass over the dataset.
    (Keras' own ``BackupAndRestore`` restarts at epoch boundaries only.)

    Args:
        position: the position the training data comes from.
        manager: saves the checkpoint (``None``: only advance the position).
        save_every: also save every this many steps (``None``: at epoch ends only).

    Raises:
        InvalidArgumentError: (from ``fit``) an epoch ended before its data
            did, which would put later epochs out of step with the data.
    """

    def __init__(
        self,
        position: StreamPosition,
        manager: tf.train.CheckpointManager | None = None,
        save_every: int | None = None,
    ) -> None:
        super().__init__()
        self.position = position
        self.manager = manager
        self.save_every = None if save_every is None else _positive("save_every", save_every)
        self._seen = 0
        self._since_save = 0
        self._data_epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._seen = 0
        self._data_epoch = self.position.epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # With steps_per_execution > 1 Keras reports only the last batch of each call.
        steps = batch + 1 - self._seen
        self._seen = batch + 1
        self.position.advance(steps)
        self._since_save += steps
        if self.manager is not None and self.save_every and self._since_save >= self.save_every:
            self.manager.save()
            self._since_save = 0

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.manager is not None:
            self.manager.save()
            self._since_save = 0
        stopped = bool(getattr(self.model, "stop_training", False))
        if self.position.epoch == self._data_epoch and not stopped:
            raise InvalidArgumentError(
                f"Keras epoch {epoch} ended after {self._seen} steps, before data epoch "
                f"{self._data_epoch} did ({self.position!r}); do not pass steps_per_epoch, "
                "and after restoring mid-epoch finish that epoch in a fit() call of its own "
                "(see PositionCallback)"
            )
