"""Per-rank datasets for Horovod and ``tf.distribute``, checked for rank agreement first.

Re-exported by ``yogastore.distributed``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from storage_backends.errors import InvalidArgumentError
from yogastore.checks import check_int
from yogastore.read.order import Shuffle
from yogastore.read.stream import Stream
from yogastore.train.agreement import check_agreement, horovod_allgather, strategy_allgather
from yogastore.train.steps import EpochSize

if TYPE_CHECKING:
    from yogastore.distributed import StreamPosition
    from yogastore.store import DatasetRef, Store

__all__ = ["cache_parallel", "dataset_fn", "horovod_dataset", "horovod_stream", "worker_rank"]


def worker_rank(strategy: tf.distribute.Strategy | None = None) -> tuple[int, int]:
    """Return (this process's rank, number of processes) of a Horovod or ``tf.distribute`` job.

    With ``strategy``: its cluster's tasks (chief first, then workers, in task
    order; a strategy without a cluster, such as ``MirroredStrategy``, is one
    process). Without: ``hvd.rank()`` and ``hvd.size()`` (call ``hvd.init()``
    first).
    """
    if strategy is None:
        try:
            import horovod.tensorflow as hvd
        except ImportError as err:
            raise InvalidArgumentError(
                "Horovod is not installed here: pass strategy= (a tf.distribute strategy), "
                "or call Store.cache_parallel with rank=, num_ranks= and attempt="
            ) from err
        return int(hvd.rank()), int(hvd.size())
    resolver = getattr(strategy, "cluster_resolver", None)
    cluster = resolver.cluster_spec().as_dict() if resolver is not None else {}
    tasks = [(kind, i) for kind in ("chief", "worker") for i in range(len(cluster.get(kind, [])))]
    if not tasks or resolver is None:
        return 0, 1
    me = (resolver.task_type, int(resolver.task_id))
    if me not in tasks:
        raise InvalidArgumentError(
            f"this task {me} is neither the chief nor a worker of the cluster {cluster}"
        )
    return tasks.index(me), len(tasks)


def cache_parallel(
    store: Store,
    dataset_id: str,
    version: str,
    make_dataset: Callable[..., Any],
    *,
    strategy: tf.distribute.Strategy | None = None,
    **options: Any,
) -> DatasetRef:
    """``store.cache_parallel`` with the rank and rank count of this job (see ``worker_rank``).

    Call it on every process of the job; each writes its part of the first
    pass and all return the same ``DatasetRef``. ``options`` are those of
    ``Store.cache_parallel`` (``spec``, ``fingerprint``, ``timeout``, ...);
    unless ``attempt`` is given, rank 0 draws a random one and every rank
    receives it (one all-gather over Horovod or the strategy), so each launch
    is a new attempt.
    """
    rank, num_ranks = worker_rank(strategy)
    if "attempt" not in options:
        token = np.array([secrets.randbits(63)], dtype=np.int64)
        if num_ranks > 1 and strategy is None:
            import horovod.tensorflow as hvd

            out = hvd.allgather(tf.constant(token), name="yogastore_attempt")
            token = np.asarray(out.numpy(), dtype=np.int64).reshape(-1)
        elif num_ranks > 1:
            token = np.asarray(strategy_allgather(strategy)(token), dtype=np.int64).reshape(-1)
        options["attempt"] = f"launch-{int(token[0]):016x}"
    return store.cache_parallel(
        dataset_id, version, make_dataset, rank=rank, num_ranks=num_ranks, **options
    )


def horovod_stream(
    ref: DatasetRef,
    *,
    shuffle: bool | Shuffle = True,
    seed: int = 0,
    epoch: int = 0,
    num_epochs: int | None = 1,
    drop_remainder: bool = True,
    check: bool = True,
) -> Stream:
    """Return the stream of the current Horovod rank (``hvd.rank()`` of ``hvd.size()``).

    ``drop_remainder`` defaults to ``True``: every rank gets exactly ``N //
    hvd.size()`` records per epoch, hence the same number of batches, which a
    synchronous all-reduce needs. Call ``hvd.init()`` first, then this on
    every rank: with ``check`` the ranks first verify (one all-gather) that
    they pass the same dataset and settings.

    Raises:
        RankMismatchError: the ranks disagree (the message names the setting).
    """
    import horovod.tensorflow as hvd

    stream = ref.stream(
        int(hvd.rank()),
        int(hvd.size()),
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        drop_remainder=drop_remainder,
        num_epochs=num_epochs,
    )
    if check:
        settings = {
            "dataset": ref.fingerprint,
            "num_records": ref.num_records,
            "shuffle": stream.shuffle.name,
            "seed": stream.seed,
            "epoch": stream.epoch,
            "num_epochs": num_epochs,
            "drop_remainder": drop_remainder,
            "num_shards": int(hvd.size()),
        }
        check_agreement(settings, horovod_allgather, "horovod_stream")
    return stream


def horovod_dataset(
    position: StreamPosition,
    batch_size: int,
    *,
    epoch_size: EpochSize | None = None,
    **tf_options: Any,
) -> tf.data.Dataset:
    """Return ``position.dataset`` for the current Horovod rank.

    Every rank yields the same number of batches of ``batch_size`` records
    (see ``Remainder``). Call ``hvd.init()`` first, then this on every rank:
    the ranks first verify (one all-gather) that they agree on the dataset,
    seed, position, batch size and epoch size.

    Args:
        position: the data position (restored from a checkpoint, or fresh).
        batch_size: records per rank per step.
        epoch_size: fixed training epochs for Keras ``fit`` (see ``EpochSize``).
        **tf_options: as for ``StreamPosition.dataset`` (``map_fn``, ``batching``, ...).

    Raises:
        RankMismatchError: the ranks disagree (the message names the setting).
    """
    import horovod.tensorflow as hvd

    rank, size = int(hvd.rank()), int(hvd.size())
    batch_size = check_int("batch_size", batch_size, 1)
    steps = None
    if epoch_size is not None and isinstance(epoch_size, EpochSize):
        steps = epoch_size.resolve(position.ref.num_records, size, batch_size, position.remainder)
    position.check_ranks(horovod_allgather, size, batch_size, 1, steps, "horovod_dataset")
    return position.dataset(rank, size, batch_size, epoch_size=epoch_size, **tf_options)


def _check_split(global_batch_size: int, replicas: int, pipelines: int) -> None:
    """Refuse a global batch that does not split evenly over replicas and pipelines."""
    if global_batch_size % replicas or replicas % pipelines:
        raise InvalidArgumentError(
            f"global_batch_size={global_batch_size} does not split evenly over {replicas} "
            f"replicas in {pipelines} input pipeline(s): pass a multiple of {replicas}"
        )


def dataset_fn(
    position: StreamPosition,
    global_batch_size: int,
    *,
    strategy: tf.distribute.Strategy | None = None,
    epoch_size: EpochSize | None = None,
    **tf_options: Any,
) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """Return a ``dataset_fn`` for ``strategy.distribute_datasets_from_function``.

    Input pipeline ``input_pipeline_id`` of ``num_input_pipelines`` reads that
    shard of the position's epoch in per-replica batches of
    ``input_context.get_per_replica_batch_size(global_batch_size)``; every
    pipeline yields the same number of whole steps (see ``Remainder``).
    Call ``position.advance()`` once per ``strategy.run`` step (or use
    ``PositionCallback`` with Keras ``fit``).

    Args:
        position: the shared data position.
        global_batch_size: records per step over all replicas.
        strategy: when given, every worker checks here, in one all-gather over
            the strategy's replicas, that all agree on the dataset, seed,
            position, batch size and epoch size (call it on every worker).
        epoch_size: fixed training epochs for Keras ``fit`` (see ``EpochSize``).
        **tf_options: as for ``StreamPosition.dataset`` (``map_fn``, ``batching``, ...).

    Raises:
        InvalidArgumentError: ``global_batch_size`` is not a positive integer, or
            (with ``strategy``, else when the function is called) not a
            multiple of the number of replicas.
        RankMismatchError: (with ``strategy``) the workers disagree.
    """
    global_batch_size = check_int("global_batch_size", global_batch_size, 1)
    if strategy is not None:
        _check_split(global_batch_size, int(strategy.num_replicas_in_sync), 1)
        steps = None
        if isinstance(epoch_size, EpochSize):
            steps = epoch_size.resolve(
                position.ref.num_records, 1, global_batch_size, position.remainder
            )
        # num_shards is not known before the input contexts exist: the global
        # batch and the epoch's step count stand for the layout.
        position.check_ranks(
            strategy_allgather(strategy), 0, global_batch_size, 0, steps, "dataset_fn"
        )

    def make(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        pipelines = input_context.num_input_pipelines
        replicas = input_context.num_replicas_in_sync
        _check_split(global_batch_size, replicas, pipelines)
        per_replica = input_context.get_per_replica_batch_size(global_batch_size)
        return position.dataset(
            input_context.input_pipeline_id,
            pipelines,
            per_replica,
            batches_per_step=replicas // pipelines,
            epoch_size=epoch_size,
            **tf_options,
        )

    return make
