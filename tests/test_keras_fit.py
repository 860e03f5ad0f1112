"""Keras fit with fixed training epochs: known cardinality, continuous data, one-call resume."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from yogastore import ComponentSpec, DatasetRef, InvalidArgumentError, Store  # noqa: E402
from yogastore.distributed import (  # noqa: E402
    EpochSize,
    PositionCallback,
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


def epoch_order(ref: DatasetRef, epoch: int) -> list[int]:
    stream = ref.stream(0, 1, seed=SEED, epoch=epoch, drop_remainder=True)
    return np.concatenate(list(stream.record_indices(1 << 20))).tolist()


@pytest.mark.parametrize(
    ("size", "steps"),
    [(EpochSize(), 10), (EpochSize(steps=4), 4), (EpochSize(records=24), 3), (None, -2)],
    ids=["data-epoch", "steps", "records", "none-unknown"],
)
def test_cardinality(tmp_path: Path, size: EpochSize | None, steps: int) -> None:
    position = StreamPosition(make_ref(tmp_path, 84), seed=SEED)  # 10 steps of 8
    ds = position.dataset(0, 1, 8, epoch_size=size)
    assert int(ds.cardinality()) == steps
    if size is not None:
        assert len(list(ds)) == steps


def test_epoch_size_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="not both"):
        EpochSize(steps=1, records=8)
    with pytest.raises(InvalidArgumentError, match=r"EpochSize\.steps"):
        EpochSize(steps=0)


def test_virtual_epochs_continue_across_data_epochs(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 80)  # 10 steps of 8 per data epoch
    position = StreamPosition(ref, seed=SEED)
    ds = position.dataset(0, 1, 8, epoch_size=EpochSize(steps=4))
    seen: list[int] = []
    for _ in range(6):  # 24 steps: data epochs 0 and 1 and 4 steps of epoch 2
        for batch in ds:
            seen.extend(batch["id"].numpy().tolist())
            position.advance()
    want = epoch_order(ref, 0) + epoch_order(ref, 1) + epoch_order(ref, 2)[:32]
    assert seen == want
    assert position.global_step == 24 and position.epoch == 2
    assert position.initial_epoch() == 6


def keras_run(ref: DatasetRef, ckpt_dir: Path, stop_after: int | None = None) -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.optimizer.build(model.trainable_variables)
    position = StreamPosition(ref, seed=SEED)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer, data=position)
    manager = tf.train.CheckpointManager(ckpt, str(ckpt_dir), max_to_keep=3)
    if manager.latest_checkpoint:
        ckpt.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    dataset = position.dataset(0, 1, 8, epoch_size=EpochSize(steps=4))
    dataset = dataset.map(lambda b: (b["x"], b["y"]))
    callbacks: list[Any] = [PositionCallback(position, manager)]
    if stop_after is not None:
        callbacks.append(_StopAt(position, stop_after))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            dataset,
            initial_epoch=position.initial_epoch(),
            epochs=6,
            callbacks=callbacks,
            verbose=0,
        )
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    return model, position, manager


class _StopAt(keras.callbacks.Callback):  # type: ignore[misc]
    """Stops training (as a crash would) once the position reaches a global step."""

    def __init__(self, position: StreamPosition, step: int) -> None:
        super().__init__()
        self.position, self.step = position, step

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.position.global_step >= self.step:
            self.model.stop_training = True


def test_fit_resumes_mid_epoch_in_one_call(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 80)
    full, full_position, _ = keras_run(ref, tmp_path / "full")
    assert full_position.global_step == 24  # 6 training epochs of 4 steps
    assert full_position.epoch == 2 and full_position.state() is not None

    # Interrupted at global step 14 (data epoch 1, step 4; training epoch 3, step 2).
    _, position, manager = keras_run(ref, tmp_path / "ckpt", stop_after=14)
    assert position.global_step == 14
    assert Path(manager.latest_checkpoint).name == "ckpt-14", "checkpoints named by step"
    # One fit call finishes the half-done epochs and stops at the planned step.
    resumed, position, manager = keras_run(ref, tmp_path / "ckpt")
    assert position.global_step == 24
    assert position.state() == full_position.state()
    assert Path(manager.latest_checkpoint).name == "ckpt-24"
    for a, b in zip(resumed.get_weights(), full.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_dataset_fn_under_mirrored_strategy_has_known_cardinality(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 80)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    position = StreamPosition(ref, seed=SEED)
    fn = dataset_fn(position, 8, strategy=strategy, epoch_size=EpochSize(steps=3))
    ds = fn(tf.distribute.InputContext(1, 0, 1))
    assert int(ds.cardinality()) == 3
    dist = strategy.distribute_datasets_from_function(fn)
    assert sum(1 for _ in dist) == 3
    # The README's recipe: fit under the strategy, one call, fixed epochs.
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    position = StreamPosition(ref, seed=SEED)
    fn = dataset_fn(position, 8, strategy=strategy, epoch_size=EpochSize())
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: fn(ctx).map(lambda b: (b["x"], b["y"]))
    )
    model.fit(
        dist,
        initial_epoch=position.initial_epoch(),
        epochs=2,
        callbacks=[PositionCallback(position)],
        verbose=0,
    )
    assert position.steps_per_epoch == 10 and position.global_step == 20
    assert position.epoch == 2 and not position.mid_epoch


def test_position_checks_ranks_on_first_dataset(tmp_path: Path) -> None:
    from yogastore import RankMismatchError

    ref = make_ref(tmp_path, 80)
    other_rank: list[np.ndarray] = []

    def remember(row: np.ndarray) -> np.ndarray:
        other_rank.append(row)
        return row[None]

    # The row another rank (with seed 6) contributes.
    StreamPosition(ref, seed=6, allgather=remember).dataset(1, 2, 8)
    calls: list[int] = []

    def gather(row: np.ndarray) -> np.ndarray:
        calls.append(1)
        return np.stack([row, other_rank[0]])

    position = StreamPosition(ref, seed=SEED, allgather=gather)
    with pytest.raises(RankMismatchError, match="dataset: ranks disagree on seed"):
        position.dataset(0, 2, 8)
    assert calls == [1], "one all-gather"
    agreeing = StreamPosition(ref, seed=6, allgather=gather)
    agreeing.dataset(0, 2, 8)
    agreeing.dataset(1, 2, 8)  # same layout: checked once
    assert calls == [1, 1]


def test_position_dataset_with_element_map_keeps_steps(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 80)
    plain = StreamPosition(ref, seed=SEED).dataset(0, 1, 8, epoch_size=EpochSize(steps=3))
    mapped = StreamPosition(ref, seed=SEED).dataset(
        0,
        1,
        8,
        epoch_size=EpochSize(steps=3),
        map_fn=lambda e: {"id": e["id"], "twice": 2 * e["id"]},
        num_parallel_calls=2,
    )
    assert int(mapped.cardinality()) == 3
    a = [b["id"].numpy().tolist() for b in plain]
    b = [(m["id"].numpy().tolist(), m["twice"].numpy().tolist()) for m in mapped]
    assert [ids for ids, _ in b] == a
    assert all(t == [2 * i for i in ids] for ids, t in b)


def test_dataset_fn_global_batch_must_split_over_replicas(tmp_path: Path) -> None:
    ref = make_ref(tmp_path, 80)
    fn = dataset_fn(StreamPosition(ref, seed=SEED), 8)
    with pytest.raises(InvalidArgumentError, match="global_batch_size=8 does not split evenly"):
        fn(tf.distribute.InputContext(1, 0, 3))
    ds = fn(tf.distribute.InputContext(2, 0, 4))  # 2 pipelines of 2 replicas of 2 records
    assert next(iter(ds))["id"].shape == [2]
