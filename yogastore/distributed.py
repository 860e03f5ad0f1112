"""Distributed training: per-rank input and a checkpointable data position.

* ``StreamPosition`` is where training stands in the data: the current epoch
  and the steps done in it. It is a ``tf.train`` trackable, so
  ``tf.train.Checkpoint(model=..., optimizer=..., data=position)`` saves and
  restores it with the model. Its ``dataset(shard_rank, num_shards,
  batch_size)`` is a ``tf.data.Dataset`` whose every iteration is the rest of
  the current epoch for that shard; ``advance()`` after each training step
  moves the position (and, after the epoch's last step, on to the next epoch).
* ``horovod_dataset`` / ``horovod_stream``: the same for ``hvd.rank()`` of
  ``hvd.size()``.
* ``cache_parallel``: the first pass on every process of the job, each writing
  its part (``Store.cache_parallel`` with ``worker_rank()`` filled in).
* ``dataset_fn``: the function ``strategy.distribute_datasets_from_function``
  wants; input pipeline ``i`` of ``n`` reads shard ``i`` of ``n``.
* ``PositionCallback`` (from ``yogastore.keras_callback``, imported with Keras
  on first use): the Keras side (advance per batch, save checkpoints).

The position's arithmetic needs no TensorFlow and lives in ``yogastore.train.position``
(equal steps per shard in ``yogastore.train.steps``); this module adds the ``tf.train``
and ``tf.data`` glue.

Every shard runs the same number of steps per epoch, because a synchronous
all-reduce hangs when one rank has a batch more than another: by default the
records that do not fill a whole step on every shard are left out of that
epoch (``Remainder.DROP``; fewer than ``num_shards * (records_per_step + 1)``
of them); ``Remainder.PAD`` instead fills each shard's last step with records
of that shard's span of the epoch (see ``Remainder.PAD``).

A saved position restores exactly: with the same number of shards every shard
reads the same batches an uninterrupted run would have read (padding
included); with a different number the shards together read exactly the
records of the epoch nobody has trained on yet, then continue with later
epochs as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

from storage_backends.errors import InvalidArgumentError
from yogastore.checks import check_int
from yogastore.train.launchers import (
    cache_parallel,
    dataset_fn,
    horovod_dataset,
    horovod_stream,
    worker_rank,
)
from yogastore.train.position import EpochRest, Position
from yogastore.train.steps import EpochSize, Remainder, check_epoch_has_step

if TYPE_CHECKING:
    from yogastore.keras_callback import PositionCallback

__all__ = [
    "EpochSize",
    "PositionCallback",
    "Remainder",
    "StreamPosition",
    "cache_parallel",
    "dataset_fn",
    "horovod_dataset",
    "horovod_stream",
    "worker_rank",
]


def __getattr__(name: str) -> Any:
    # Keras is imported on first use of the callback, not with this module.
    if name == "PositionCallback":
        from yogastore.keras_callback import PositionCallback

        return PositionCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StreamPosition(Position, tf.train.experimental.PythonState):  # type: ignore[misc]
    """Where distributed training stands in a dataset; checkpointable with ``tf.train``.

    The position is the current epoch plus what of it every shard has
    consumed, stored as a ``StreamState`` (see ``Stream.state``) so a restored
    position can be read by any number of shards. All shards must advance
    together: one ``advance()`` per synchronous training step.

    Usage::

        position = StreamPosition(ref, seed=1)
        ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, data=position)
        ckpt.restore(tf.train.latest_checkpoint(ckpt_dir))  # if there is one
        ds = position.dataset(rank, num_ranks, batch_size)
        for epoch in range(position.epoch, num_epochs):
            for batch in ds:  # the rest of the current epoch
                train_step(batch)
                position.advance()

    Restore before iterating a dataset of the position. The restored state
    (seed, shuffle, current epoch) wins over the constructor's arguments.

    Args:
        ref: the dataset.
        shuffle: as for ``DatasetRef.stream``.
        seed: shuffle seed; every rank must use the same.
        epoch: first epoch number (unless restored).
        remainder: ``Remainder.DROP`` (default) or ``Remainder.PAD``: how every
            shard gets the same number of steps.
        block_window: chunks mixed together by ``Shuffle.BLOCK``.
        prefetch: batches read ahead on a background thread (default: 2 for
            object stores, none for local memory-mapped reads).
        allgather: the ranks' all-gather (see ``yogastore.train.agreement``); when
            given, the first ``dataset`` call of each layout checks that all
            ranks agree on the dataset, seed, position and layout.

    Raises:
        InvalidArgumentError: an argument is out of range.
    """

    # Datasets ------------------------------------------------------------------------

    def dataset(
        self,
        shard_rank: int,
        num_shards: int,
        batch_size: int,
        *,
        batches_per_step: int = 1,
        epoch_size: EpochSize | None = None,
        **tf_options: Any,
    ) -> tf.data.Dataset:
        """Return shard ``shard_rank``'s batches, one epoch per iteration.

        Without ``epoch_size`` each iteration is the rest of the current data
        epoch (``steps_left(...) * batches_per_step`` batches; for custom
        loops). With an ``EpochSize`` (for Keras ``fit``) each iteration is
        exactly that many steps, continuing across data epochs, and the
        dataset's cardinality says so. Every batch holds exactly
        ``batch_size`` records and every shard yields as many batches (see
        ``Remainder``). The starting point is looked up when an iteration
        starts, so iterate the same dataset once per epoch (Keras ``fit``
        does). Shards sharing one position in one process must all start
        iterating before the first ``advance()`` of the epoch.

        Args:
            shard_rank: this shard, ``0 <= shard_rank < num_shards``.
            num_shards: number of shards reading in lockstep.
            batch_size: records per batch.
            batches_per_step: batches this shard feeds into one training step
                (e.g. replicas per input pipeline under ``tf.distribute``).
            epoch_size: fixed training epochs (see ``EpochSize``).
            **tf_options: ``map_fn``, ``num_parallel_calls``, ``batching``,
                ``padded_shapes``, ``padding_values`` (see ``Stream.to_tf_dataset``).

        Raises:
            InvalidArgumentError: an argument is out of range.
            RankMismatchError: (with ``allgather``) the ranks disagree.
        """
        num_shards = check_int("num_shards", num_shards, 1)
        shard_rank = check_int("shard_rank", shard_rank, 0)
        if shard_rank >= num_shards:
            raise InvalidArgumentError(f"shard_rank {shard_rank} must be < num_shards {num_shards}")
        batch_size = check_int("batch_size", batch_size, 1)
        batches_per_step = check_int("batches_per_step", batches_per_step, 1)
        if epoch_size is not None and not isinstance(epoch_size, EpochSize):
            raise InvalidArgumentError(f"epoch_size must be an EpochSize, got {epoch_size!r}")
        steps = None
        per_step = batch_size * batches_per_step
        check_epoch_has_step(self.ref.num_records, num_shards, per_step, self.remainder)
        if epoch_size is not None:
            steps = epoch_size.resolve(self.ref.num_records, num_shards, per_step, self.remainder)
        self.steps_per_epoch = steps
        if self.allgather is not None:
            self.check_ranks(
                self.allgather, num_shards, batch_size, batches_per_step, steps, "dataset"
            )
        live = EpochRest(self, shard_rank, num_shards, batches_per_step, steps)
        ds = live.to_tf_dataset(batch_size, drop_remainder=True, **tf_options)
        if steps is not None:
            ds = ds.apply(tf.data.experimental.assert_cardinality(steps * batches_per_step))
        return ds
