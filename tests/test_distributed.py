"""yogastore.distributed in one process: shards, equal steps, checkpointed position, Keras."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from yogastore import (  # noqa: E402
    ComponentSpec,
    DatasetRef,
    InvalidArgumentError,
    Store,
    StreamState,
)
from yogastore.distributed import (  # noqa: E402
    PositionCallback,
    Remainder,
    StreamPosition,
    dataset_fn,
)

SEED = 5
SPEC = {
    "id": ComponentSpec(shape=(), dtype="int64"),
    "x": ComponentSpec(shape=(2,), dtype="float32"),
    "y": ComponentSpec(shape=(), dtype="int64"),
}


def make_ref(root: Path, num_records: int) -> DatasetRef:
    def records() -> Any:
        rng = np.random.default_rng(0)
        for i in range(num_records):
            x = rng.normal(size=2).astype(np.float32)
            yield {"id": np.int64(i), "x": x, "y": np.int64(x[0] + x[1] > 0)}

    return Store(root, chunk_bytes=512).cache("toy", f"n{num_records}", records, spec=SPEC)


def ids_of(dataset: Any) -> list[np.ndarray]:
    return [batch["id"].numpy() for batch in dataset]


def expected_span(ref: DatasetRef, shard: int, shards: int, epoch: int, count: int) -> np.ndarray:
    """The first ``count`` records of a shard's epoch, straight from the order module."""
    stream = ref.stream(shard, shards, seed=SEED, epoch=epoch, drop_remainder=True)
    got = np.concatenate(list(stream.record_indices(max(count, 1))))
    return got[:count]


def save(position: StreamPosition, path: Path) -> str:
    return str(tf.train.Checkpoint(data=position).save(str(path / "ckpt")))


def restore(ref: DatasetRef, path: str, **kwargs: Any) -> StreamPosition:
    position = StreamPosition(ref, **kwargs)
    tf.train.Checkpoint(data=position).restore(path).assert_consumed()
    return position


# dataset_fn -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("records", "pipelines", "replicas", "global_batch"),
    [
        (103, 2, 2, 8),  # two workers, one replica each
        (100, 1, 2, 8),  # MirroredStrategy: one pipeline feeds two replicas
        (257, 3, 6, 12),  # three workers with two replicas each
        (64, 4, 4, 16),  # everything divides
    ],
    ids=["2x1-uneven", "1x2-mirrored", "3x2-uneven", "4x1-exact"],
)
def test_dataset_fn_gives_disjoint_complete_shards(
    tmp_path: Path, records: int, pipelines: int, replicas: int, global_batch: int
) -> None:
    ref = make_ref(tmp_path, records)
    position = StreamPosition(ref, seed=SEED)
    make = dataset_fn(position, global_batch)
    per_replica = global_batch // replicas
    per_step = global_batch // pipelines
    steps = (records // pipelines) // per_step
    seen: list[np.ndarray] = []
    for pipeline in range(pipelines):
        context = tf.distribute.InputContext(
            num_input_pipelines=pipelines,
            input_pipeline_id=pipeline,
            num_replicas_in_sync=replicas,
        )
        ds = make(context)
        assert ds.element_spec["x"].shape.as_list() == [per_replica, 2]
        batches = ids_of(ds)
        # Every pipeline runs the same number of whole steps.
        assert len(batches) == steps * (replicas // pipelines)
        assert all(len(b) == per_replica for b in batches)
        got = np.concatenate(batches)
        np.testing.assert_array_equal(
            got, expected_span(ref, pipeline, pipelines, 0, steps * per_step)
        )
        seen.append(got)
    everything = np.concatenate(seen)
    assert len(set(everything.tolist())) == len(everything), "a record went to two shards"
    assert set(everything.tolist()) <= set(range(records))
    # Complete, minus what does not fill a whole step on every shard.
    assert records - len(everything) < pipelines * (per_step + 1)
    assert position.steps_left(pipelines, per_replica, replicas // pipelines) == steps


def test_dataset_fn_rejects_a_global_batch_that_does_not_split(tmp_path: Path) -> None:
    position = StreamPosition(make_ref(tmp_path, 20))
    context = tf.distribute.InputContext(3, 0, 3)
    with pytest.raises(ValueError):
        dataset_fn(position, 8)(context)


# Epochs and steps ----------------------------------------------------------------------


def test_each_iteration_is_the_next_epoch_in_a_new_order(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 60)
    position = StreamPosition(ref, seed=SEED)
    ds = position.dataset(0, 1, 6)
    epochs = []
    for epoch in range(3):
        assert position.epoch == epoch
        ids = []
        for batch in ds:
            ids.append(batch["id"].numpy())
            position.advance()
        epochs.append(np.concatenate(ids))
        assert sorted(epochs[-1].tolist()) == list(range(60))
    assert position.epoch == 3
    assert not np.array_equal(epochs[0], epochs[1])
    np.testing.assert_array_equal(epochs[1], expected_span(ref, 0, 1, 1, 60))


def test_an_interrupted_iteration_continues_where_it_stopped(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 40)
    position = StreamPosition(ref, seed=SEED)
    ds = position.dataset(0, 1, 4)
    first = []
    for batch in ds:
        first.append(batch["id"].numpy())
        position.advance()
        if len(first) == 3:
            break
    rest = ids_of(ds)
    np.testing.assert_array_equal(np.concatenate(first + rest), expected_span(ref, 0, 1, 0, 40))


def test_pad_remainder_repeats_own_records_to_equal_steps(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 103)
    position = StreamPosition(ref, seed=SEED, remainder=Remainder.PAD)
    shards = [np.concatenate(ids_of(position.dataset(r, 2, 8))) for r in range(2)]
    # ceil(ceil(103 / 2) / 8) = 7 steps of 8 on both shards.
    assert [len(s) for s in shards] == [56, 56]
    assert set(np.concatenate(shards).tolist()) == set(range(103))
    for rank, got in enumerate(shards):
        own = ref.stream(rank, 2, seed=SEED)
        own_ids = np.concatenate(list(own.record_indices(64)))
        np.testing.assert_array_equal(got[: len(own_ids)], own_ids)
        np.testing.assert_array_equal(got[len(own_ids) :], own_ids[: 56 - len(own_ids)])
    position.advance(7)
    assert position.epoch == 1 and not position.mid_epoch


def test_pad_remainder_with_fewer_records_than_shards(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 3)
    position = StreamPosition(ref, seed=SEED, remainder=Remainder.PAD)
    shards = [ids_of(position.dataset(r, 4, 1)) for r in range(4)]
    assert [len(s) for s in shards] == [1, 1, 1, 1]  # one step each, none left without data
    assert set(np.concatenate([b for s in shards for b in s]).tolist()) == {0, 1, 2}


def test_advance_needs_an_iterated_dataset(tmp_path: Path) -> None:
    position = StreamPosition(make_ref(tmp_path, 10))
    with pytest.raises(InvalidArgumentError, match="advance"):
        position.advance()


def test_advance_carries_steps_into_the_epochs_after_at_once(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 10)  # 3 steps of 3 records an epoch, one shard
    position = StreamPosition(ref, seed=SEED)
    for _ in position.dataset(0, 1, 3):
        pass
    position.advance(4)  # the epoch's 3 steps, then one of epoch 1
    assert (position.epoch, position.step, position.global_step) == (1, 1, 4)
    np.testing.assert_array_equal(
        np.concatenate(ids_of(position.dataset(0, 1, 3))), expected_span(ref, 0, 1, 1, 9)[3:]
    )
    position.advance(2 + 3 * 10**15)  # the rest of epoch 1, then 10**15 whole epochs
    assert (position.epoch, position.step) == (2 + 10**15, 0)
    before = position.serialize()
    with pytest.raises(InvalidArgumentError, match=r"beyond the last epoch a position can hold"):
        position.advance(2**70)
    assert position.serialize() == before  # a refused advance changes nothing


def test_a_whole_epoch_with_no_step_is_refused(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 10)
    position = StreamPosition(ref, seed=SEED)
    for shards, batch in ((1, 11), (3, 4)):
        with pytest.raises(InvalidArgumentError, match="a whole epoch of 10 records makes no step"):
            position.dataset(0, shards, batch)
    assert len(ids_of(StreamPosition(ref, remainder=Remainder.PAD).dataset(0, 3, 4))) == 1


@pytest.mark.parametrize("bad", [None, "toy", 3], ids=str)
def test_position_and_callback_refuse_what_is_not_theirs(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="ref must be a DatasetRef"):
        StreamPosition(bad)
    with pytest.raises(InvalidArgumentError, match="position must be a"):
        PositionCallback(bad)
    position = StreamPosition(make_ref(tmp_path, 10))
    with pytest.raises(InvalidArgumentError, match="manager must be a"):
        PositionCallback(position, manager="ckpt")
    with pytest.raises(InvalidArgumentError, match="not an object"):
        position.deserialize("null" if bad is None else "[]")


@pytest.mark.parametrize(
    ("shard", "shards", "batch"), [(2, 2, 4), (-1, 2, 4), (0, 0, 4), (0, 2, 0)], ids=str
)
def test_dataset_rejects_bad_arguments(tmp_path: Path, shard: int, shards: int, batch: int) -> None:
    position = StreamPosition(make_ref(tmp_path, 10))
    with pytest.raises(InvalidArgumentError):
        position.dataset(shard, shards, batch)


# Checkpointed position ------------------------------------------------------------------


def take(position: StreamPosition, shards: int, batch: int, steps: int | None) -> list[np.ndarray]:
    """Run ``steps`` lockstep steps (None: to the end of the epoch); return ids per shard."""
    iterators = [iter(position.dataset(r, shards, batch)) for r in range(shards)]
    got: list[list[np.ndarray]] = [[] for _ in range(shards)]
    done = 0
    while steps is None or done < steps:
        try:
            batches = [next(it)["id"].numpy() for it in iterators]
        except StopIteration:
            break
        for r, b in enumerate(batches):
            got[r].append(b)
        position.advance()
        done += 1
    return [np.concatenate(g) if g else np.empty(0, np.int64) for g in got]


def unseen_records(ref: DatasetRef, state: StreamState) -> set[int]:
    """The records of ``state``'s epoch nobody has read yet, straight from the order module."""
    order = ref.stream(seed=SEED).order(state.epoch)
    return set(
        np.concatenate([order.records(np.arange(a, b)) for a, b in state.remaining]).tolist()
    )


def test_checkpoint_round_trips_the_position(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 101)
    position = StreamPosition(ref, seed=SEED)
    take(position, 2, 5, 3)
    path = save(position, tmp_path)
    restored = restore(ref, path, seed=999)  # the checkpoint's seed wins
    assert restored.state() == position.state()
    assert restored.epoch == 0 and restored.mid_epoch
    assert position.state().remaining_records == 101 - 1 - 2 * 15  # one record never fits


@pytest.mark.parametrize("resume_shards", [2, 1, 3], ids=["same", "fewer", "more"])
def test_restore_reads_exactly_the_unseen_records(tmp_path: Path, resume_shards: int) -> None:
    records, shards, batch, steps = 203, 2, 5, 4
    ref = make_ref(tmp_path, records)
    before = take(StreamPosition(ref, seed=SEED), shards, batch, None)  # reference run
    position = StreamPosition(ref, seed=SEED)
    first = take(position, shards, batch, steps)
    state = position.state()
    restored = restore(ref, save(position, tmp_path))
    rest = take(restored, resume_shards, batch, None)
    assert restored.epoch == 1, "the resumed run finishes the epoch"

    unseen = unseen_records(ref, state)
    trained_first = np.concatenate(first)
    trained_rest = np.concatenate(rest)
    assert not set(trained_first.tolist()) & unseen
    assert len(set(trained_rest.tolist())) == len(trained_rest), "a record was read twice"
    assert set(trained_rest.tolist()) <= unseen
    resumed_steps = (state.remaining_records // resume_shards) // batch
    assert (
        len(unseen) - len(trained_rest)
        == state.remaining_records - resume_shards * resumed_steps * batch
    )
    assert len(unseen) - len(trained_rest) < resume_shards * (batch + 1)
    if resume_shards == shards:
        # Same shard count: each shard reads exactly what it would have without the restart.
        for r in range(shards):
            np.testing.assert_array_equal(np.concatenate([first[r], rest[r]]), before[r])
    # The following epoch is a whole fresh one for the new shard count.
    nxt = take(restored, resume_shards, batch, None)
    for r in range(resume_shards):
        count = (records // resume_shards) // batch * batch
        np.testing.assert_array_equal(nxt[r], expected_span(ref, r, resume_shards, 1, count))


def pad_source(ref: DatasetRef, shard: int, shards: int, epoch: int) -> np.ndarray:
    """What ``Remainder.PAD`` pads a shard with: its span of the whole epoch (or the epoch)."""
    stream = ref.stream(shard, shards, seed=SEED, epoch=epoch)
    if len(stream) == 0:
        stream = ref.stream(seed=SEED, epoch=epoch)
    return np.concatenate(list(stream.record_indices(64)))


@pytest.mark.parametrize(
    ("records", "batch", "steps", "resume_shards"),
    [(103, 8, 2, 2), (103, 8, 2, 1), (103, 8, 2, 3), (20, 3, 3, 4)],
    ids=["same", "fewer", "more", "more-shards-than-records-left"],
)
def test_pad_restore_reads_the_unseen_records_and_pads_from_the_shard(
    tmp_path: Path, records: int, batch: int, steps: int, resume_shards: int
) -> None:
    shards = 2
    ref = make_ref(tmp_path, records)
    before = take(StreamPosition(ref, seed=SEED, remainder=Remainder.PAD), shards, batch, None)
    position = StreamPosition(ref, seed=SEED, remainder=Remainder.PAD)
    first = take(position, shards, batch, steps)
    state = position.state()
    restored = restore(ref, save(position, tmp_path), seed=SEED, remainder=Remainder.PAD)
    rest = take(restored, resume_shards, batch, None)
    assert restored.epoch == 1, "the resumed run finishes the epoch"

    # Equal steps on every shard, as many as the longest share of the rest needs.
    longest = -(-state.remaining_records // resume_shards)
    assert [len(r) for r in rest] == [-(-longest // batch) * batch] * resume_shards
    unseen = unseen_records(ref, state)
    assert not set(np.concatenate(first).tolist()) & unseen
    assert unseen <= set(np.concatenate(rest).tolist()), "an unseen record was not read"
    padded = 0
    for r in range(resume_shards):
        # The shard's share of the unseen records, then padding from its own span.
        pieces = list(ref.resume(state, r, resume_shards).record_indices(64))
        share = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
        np.testing.assert_array_equal(rest[r][: len(share)], share)
        padding = rest[r][len(share) :]
        padded += len(padding)
        span = pad_source(ref, r, resume_shards, 0)
        np.testing.assert_array_equal(padding, np.resize(span, len(padding)))
    assert padded == resume_shards * len(rest[0]) - state.remaining_records > 0
    if resume_shards == shards:
        # Same shard count: each shard reads exactly what it would have without the
        # restart, padding included.
        for r in range(shards):
            np.testing.assert_array_equal(np.concatenate([first[r], rest[r]]), before[r])


def test_pad_restore_after_an_elastic_restore_is_exact_again(tmp_path: Path) -> None:
    # Padding depends on the epoch, shard count and rank only, so a second
    # restore with the count of the first restore continues that run exactly.
    ref = make_ref(tmp_path, 103)
    pad: dict[str, Any] = {"seed": SEED, "remainder": Remainder.PAD}
    position = StreamPosition(ref, **pad)
    take(position, 2, 8, 2)
    (tmp_path / "a").mkdir()
    path = save(position, tmp_path / "a")
    uninterrupted = take(restore(ref, path, **pad), 3, 8, None)
    elastic = restore(ref, path, **pad)
    first = take(elastic, 3, 8, 1)
    (tmp_path / "b").mkdir()
    again = restore(ref, save(elastic, tmp_path / "b"), **pad)
    rest = take(again, 3, 8, None)
    assert [len(u) for u in uninterrupted] == [24, 24, 24]  # 71 left: 23 + 1 padding on shard 0
    for r in range(3):
        np.testing.assert_array_equal(np.concatenate([first[r], rest[r]]), uninterrupted[r])


def test_elastic_restores_compose(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 240)
    position = StreamPosition(ref, seed=SEED)
    trained = list(take(position, 3, 4, 5))
    for shards, steps in [(2, 6), (4, 2), (1, None)]:
        (tmp_path / str(shards)).mkdir()
        position = restore(ref, save(position, tmp_path / str(shards)))
        trained += take(position, shards, 4, steps)
    ids = np.concatenate(trained).tolist()
    assert len(ids) == len(set(ids)) == 240  # every step count divides: nothing dropped
    assert position.epoch == 1


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["0-first", "1-first"])
def test_shards_of_one_process_skip_an_epoch_rest_with_no_whole_step_alike(
    tmp_path: Path, order: tuple[int, int]
) -> None:
    # Restored with 4 of 10 records left, which make no step of 2 shards x 3: every shard
    # read in this process skips to the next epoch in the same iteration, as one process per
    # shard would; none reads the next epoch early, so none reads it twice.
    ref = make_ref(tmp_path, 10)
    first = StreamPosition(ref, seed=SEED)
    for _ in first.dataset(0, 1, 3):
        pass
    first.advance(2)
    position = StreamPosition(ref, seed=SEED)
    position.deserialize(first.serialize())
    assert [ids_of(position.dataset(r, 2, 3)) for r in order] == [[], []]
    assert position.epoch == 1
    datasets = [position.dataset(r, 2, 3) for r in range(2)]
    for _ in range(2):  # a skip is one iteration's: the next ones read epoch 1 alike
        got = [np.concatenate(ids_of(datasets[r])) for r in order]
        for r, ids in zip(order, got, strict=True):
            np.testing.assert_array_equal(ids, expected_span(ref, r, 2, 1, 3))
    position.advance(1)
    assert position.epoch == 2
    # After the skip an advance ends it: shard 1 alone now begins epoch 2, not the empty rest.
    np.testing.assert_array_equal(
        np.concatenate(ids_of(position.dataset(1, 2, 3))), expected_span(ref, 1, 2, 2, 3)
    )


def test_restore_rejects_a_position_of_another_dataset(tmp_path: Path) -> None:
    ref = make_ref(tmp_path / "a", 30)
    other = make_ref(tmp_path / "b", 31)
    path = save(StreamPosition(ref), tmp_path)
    with pytest.raises(InvalidArgumentError, match="belongs to"):
        tf.train.Checkpoint(data=StreamPosition(other)).restore(path)


@pytest.mark.parametrize("text", [b"", b"{}", b'{"yogastore_position": 1}', b"\xff"], ids=str)
def test_deserialize_rejects_garbage(tmp_path: Path, text: bytes) -> None:
    position = StreamPosition(make_ref(tmp_path, 10))
    with pytest.raises(InvalidArgumentError):
        position.deserialize(text)


def test_mirrored_strategy_checkpoint_restores_position(tmp_path: Path) -> None:
    # tf.distribute variables and the position share one checkpoint.
    ref = make_ref(tmp_path, 48)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    position = StreamPosition(ref, seed=SEED)
    with strategy.scope():
        step = tf.Variable(0, dtype=tf.int64)
    dist = strategy.distribute_datasets_from_function(dataset_fn(position, 8))
    for _ in zip(range(2), dist, strict=False):
        step.assign_add(1)
        position.advance()
    path = tf.train.Checkpoint(step=step, data=position).save(str(tmp_path / "m"))
    again = StreamPosition(ref)
    with strategy.scope():
        step2 = tf.Variable(0, dtype=tf.int64)
    tf.train.Checkpoint(step=step2, data=again).restore(path)
    assert int(step2.numpy()) == 2 and again.state() == position.state()


# Keras ----------------------------------------------------------------------------------


class Stopper(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch + 1 == self.after:
            self.model.stop_training = True


class Counter(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.per_epoch: dict[int, int] = {}

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.per_epoch[self._epoch] = batch + 1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch


def keras_setup(ref: DatasetRef, ckpt_dir: Path) -> tuple[Any, StreamPosition, Any, Any]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.optimizer.build(model.trainable_variables)
    position = StreamPosition(ref, seed=SEED)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer, data=position)
    manager = tf.train.CheckpointManager(ckpt, str(ckpt_dir), max_to_keep=1)
    if manager.latest_checkpoint:
        ckpt.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    dataset = position.dataset(0, 1, 8).map(lambda b: (b["x"], b["y"]))
    return model, position, manager, dataset


def test_keras_callback_resumes_mid_epoch(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 80)  # 10 steps of 8 per epoch
    model, position, manager, dataset = keras_setup(ref, tmp_path / "ckpt")
    callback = PositionCallback(position, manager, save_every=2)
    model.fit(dataset, epochs=3, callbacks=[callback, Stopper(after=4)], verbose=0)
    assert position.epoch == 0 and position.mid_epoch
    saved_state = position.state()
    saved_weights = [w.copy() for w in model.get_weights()]

    model, position, manager, dataset = keras_setup(ref, tmp_path / "ckpt")
    assert position.state() == saved_state
    for a, b in zip(model.get_weights(), saved_weights, strict=True):
        np.testing.assert_array_equal(a, b)
    counter = Counter()
    callback = PositionCallback(position, manager, save_every=3)
    assert position.mid_epoch
    model.fit(
        dataset,
        initial_epoch=position.epoch,
        epochs=position.epoch + 1,
        callbacks=[callback, counter],
        verbose=0,
    )
    model.fit(
        dataset, initial_epoch=position.epoch, epochs=3, callbacks=[callback, counter], verbose=0
    )
    assert counter.per_epoch == {0: 6, 1: 10, 2: 10}
    assert position.epoch == 3 and not position.mid_epoch
    # (optimizer.iterations is no step count here: Keras 3 adds one at each end of data.)


def test_keras_callback_refuses_epochs_out_of_step_with_the_data(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 80)
    model, position, manager, dataset = keras_setup(ref, tmp_path / "ckpt")
    callback = PositionCallback(position, manager)
    with pytest.raises(InvalidArgumentError, match="before data epoch"):
        model.fit(dataset, epochs=2, steps_per_epoch=3, callbacks=[callback], verbose=0)


def test_position_callback_is_imported_on_first_use() -> None:
    code = (
        "import sys\n"
        "import yogastore.distributed as yd\n"
        "assert 'yogastore.keras_callback' not in sys.modules\n"
        "assert not hasattr(yd, 'NoSuchName')\n"
        "from yogastore.distributed import PositionCallback\n"
        "assert PositionCallback is sys.modules['yogastore.keras_callback'].PositionCallback\n"
        "import yogastore.train.position\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_position_arithmetic_needs_no_tensorflow() -> None:
    code = (
        "import sys\n"
        "import yogastore.train.position, yogastore.train.steps\n"
        "assert 'tensorflow' not in sys.modules, 'yogastore.train.position imported TensorFlow'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
