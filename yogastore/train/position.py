"""Where training stands in the data, without TensorFlow: epoch, steps, shards' rest.

``Position`` is the arithmetic and bookkeeping of ``yogastore.distributed.StreamPosition``
(which adds the ``tf.train`` checkpoint hooks and ``tf.data`` datasets): the current
epoch, the steps every shard has done in it, one step count for every shard (see
``yogastore.train.steps``), what is left after a restore with any number of shards, and the
position as JSON. ``EpochRest`` is the stream a position's dataset reads: every pass
is the rest of the position's epoch, or a fixed number of steps.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from storage_backends.errors import InvalidArgumentError
from yogastore import boundedjson
from yogastore.arrays import IntArray
from yogastore.checks import check_int
from yogastore.read.order import KEY_LIMIT, Shuffle
from yogastore.read.stream import Stream, StreamState
from yogastore.store import DEFAULT_BLOCK_WINDOW, DatasetRef
from yogastore.train.agreement import AllGather, check_agreement
from yogastore.train.steps import Remainder, steps_for

__all__ = ["EpochRest", "Position"]

logger = logging.getLogger(__name__)

_POSITION_VERSION = 1


class Position:
    """The data position of ``StreamPosition`` without TensorFlow (see there for the arguments).

    All shards must advance together: one ``advance()`` per synchronous
    training step.
    """

    def __init__(
        self,
        ref: DatasetRef,
        *,
        shuffle: bool | Shuffle = True,
        seed: int = 0,
        epoch: int = 0,
        remainder: Remainder = Remainder.DROP,
        block_window: int = DEFAULT_BLOCK_WINDOW,
        prefetch: int | None = None,
        allgather: AllGather | None = None,
    ) -> None:
        if not isinstance(ref, DatasetRef):
            raise InvalidArgumentError(
                f"ref must be a DatasetRef (from Store.cache or Store.open), got {ref!r:.100}"
            )
        if not isinstance(remainder, Remainder):
            raise InvalidArgumentError(f"remainder must be a Remainder, got {remainder!r}")
        probe = ref.stream(0, 1, shuffle=shuffle, seed=seed, epoch=epoch, block_window=block_window)
        self.ref = ref
        self.remainder = remainder
        self.prefetch = None if prefetch is None else check_int("prefetch", prefetch, 0)
        self._lock = threading.Lock()
        self._start = self._fresh(probe.shuffle, probe.seed, probe.epoch, probe.block_window)
        self._layout: tuple[int, int] | None = None  # (num_shards, records per shard per step)
        self._segment_steps = 0
        self._steps = 0
        self._global_step = 0
        # An epoch rest with no whole step, skipped by one shard's iteration: the layout, the
        # skipped start, and the shards of this process still to begin that same iteration.
        self._skipped: tuple[tuple[int, int], StreamState, set[int]] | None = None
        self.allgather = allgather
        self._checked: set[tuple[Any, ...]] = set()
        self.steps_per_epoch: int | None = None  # of the last dataset made with an EpochSize

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.ref.dataset_id!r}, epoch={self.epoch}, step={self.step}, "
            f"remaining={self._start.remaining_records}, layout={self._layout})"
        )

    def _fresh(self, shuffle: Shuffle, seed: int, epoch: int, block_window: int) -> StreamState:
        n = self.ref.num_records
        return StreamState(
            dataset=self.ref.fingerprint,
            num_records=n,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            block_window=block_window,
            remaining=((0, n),) if n else (),
        )

    # Reading the position -----------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch being read (it moves on after the epoch's last ``advance``)."""
        with self._lock:
            return self._start.epoch

    @property
    def step(self) -> int:
        """Steps advanced in the current epoch since it began or the position was restored."""
        with self._lock:
            return self._steps

    @property
    def global_step(self) -> int:
        """Steps advanced since training began (saved in checkpoints; names them)."""
        with self._lock:
            return self._global_step

    def initial_epoch(self) -> int:
        """Return ``fit``'s ``initial_epoch``: global steps // steps per training epoch.

        Raises:
            InvalidArgumentError: no dataset with an ``EpochSize`` was made yet.
        """
        if self.steps_per_epoch is None:
            raise InvalidArgumentError(
                "initial_epoch() needs a dataset made with epoch_size=EpochSize(...) first"
            )
        return self.global_step // self.steps_per_epoch

    @property
    def mid_epoch(self) -> bool:
        """Whether part of the current epoch has been consumed (e.g. restored mid-epoch)."""
        with self._lock:
            return bool(self._steps) or self._start.remaining_records < self.ref.num_records

    def state(self) -> StreamState:
        """Return the exact data position as a ``StreamState`` (JSON-serialisable)."""
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> StreamState:
        if self._steps == 0 or self._layout is None:
            return self._start
        num_shards, per_step = self._layout
        stream = self.ref.resume(
            self._start,
            0,
            num_shards,
            drop_remainder=self.remainder is Remainder.DROP,
            num_epochs=1,
        )
        return stream.state(consumed=self._steps * per_step)

    def steps_left(self, num_shards: int, batch_size: int, batches_per_step: int = 1) -> int:
        """Return the steps left in the current epoch when read by ``num_shards`` shards.

        The same for every shard; the whole epoch's step count when
        ``mid_epoch`` is false.
        """
        num_shards = check_int("num_shards", num_shards, 1)
        per_step = check_int("batch_size", batch_size, 1) * check_int(
            "batches_per_step", batches_per_step, 1
        )
        total = self.state().remaining_records
        return steps_for(total, num_shards, per_step, self.remainder)

    # Moving the position ------------------------------------------------------------

    def advance(self, steps: int = 1) -> None:
        """Record that every shard finished ``steps`` more training steps.

        After the last step of the epoch the position moves to the start of
        the next epoch; steps beyond it count in the epochs that follow, each
        a fresh epoch of the same layout (computed at once, whatever the count).

        Raises:
            InvalidArgumentError: no dataset of this position has been
                iterated yet, so the step size is unknown; or the steps run
                past an epoch that has no whole step, or beyond the last epoch
                a position can hold (2**64 - 1). The position is unchanged.
        """
        steps = check_int("steps", steps, 0)
        with self._lock:
            if self._layout is None:
                raise InvalidArgumentError(
                    "advance() before any dataset of this position was iterated; iterate "
                    "position.dataset(...) (or a dataset_fn dataset) first"
                )
            total = self._steps + steps
            if total < self._segment_steps:
                self._steps = total
            else:
                start = self._start
                if self._segment_steps == 0:
                    raise InvalidArgumentError(
                        f"advanced past the end of epoch {start.epoch}, which has no "
                        f"whole step for layout {self._layout}"
                    )
                num_shards, per_step = self._layout
                left = total - self._segment_steps
                per_epoch = steps_for(self.ref.num_records, num_shards, per_step, self.remainder)
                if per_epoch == 0 and left:
                    raise InvalidArgumentError(
                        f"advanced past the end of epoch {start.epoch + 1}: a whole epoch of "
                        f"{self.ref.num_records} records makes no step of {num_shards} shards "
                        f"x {per_step} records"
                    )
                skipped, left = divmod(left, per_epoch) if per_epoch else (0, 0)
                epoch = start.epoch + 1 + skipped
                if epoch >= KEY_LIMIT:
                    raise InvalidArgumentError(
                        f"advance({steps}) from epoch {start.epoch} reaches epoch {epoch}, "
                        "beyond the last epoch a position can hold (2**64 - 1)"
                    )
                self._start = self._fresh(start.shuffle, start.seed, epoch, start.block_window)
                self._segment_steps = per_epoch
                self._steps = left
            if steps:
                self._skipped = None
            self._global_step += steps

    def _next_epoch_locked(self) -> None:
        s = self._start
        self._start = self._fresh(s.shuffle, s.seed, s.epoch + 1, s.block_window)
        if self._layout is not None:
            num_shards, per_step = self._layout
            self._segment_steps = steps_for(
                self._start.remaining_records, num_shards, per_step, self.remainder
            )

    def _begin(self, shard_rank: int, num_shards: int, per_step: int) -> tuple[StreamState, int]:
        """Start shard ``shard_rank``'s iteration: return the epoch's rest and its step count.

        A rest that makes no whole step gives 0 steps and moves the position on to the next
        epoch; every other shard of this process that begins the same iteration (before the
        next ``advance``) gets the same empty rest, as it would in a process of its own.
        """
        layout = (num_shards, per_step)
        with self._lock:
            skipped = self._skipped
            if skipped is not None and skipped[0] == layout and shard_rank in skipped[2]:
                skipped[2].discard(shard_rank)
                return skipped[1], 0
            self._skipped = None
            if self._steps:
                # A new iteration continues where the previous one stopped.
                self._start = self._state_locked()
                self._steps = 0
            steps = steps_for(self._start.remaining_records, num_shards, per_step, self.remainder)
            self._layout = layout
            self._segment_steps = steps
            if steps == 0:
                logger.warning(
                    "epoch %d has no whole step left for %d shards x %d records (%d remain); "
                    "skipping to the next epoch",
                    self._start.epoch,
                    num_shards,
                    per_step,
                    self._start.remaining_records,
                )
                start = self._start
                self._skipped = (layout, start, set(range(num_shards)) - {shard_rank})
                self._next_epoch_locked()
                return start, 0
            return self._start, self._segment_steps

    # Checkpointing (as tf.train.experimental.PythonState wants) ----------------------

    def serialize(self) -> str:
        """Return the position as JSON (called by ``tf.train.Checkpoint.save``)."""
        with self._lock:
            state = self._state_locked()
            doc = {
                "yogastore_position": _POSITION_VERSION,
                "state": json.loads(state.to_json()),
                "remainder": self.remainder.value,
                "global_step": self._global_step,
            }
        return json.dumps(doc, separators=(",", ":"))

    def deserialize(self, string_value: Any) -> None:
        """Restore a position written by ``serialize`` (called by ``Checkpoint.restore``).

        Raises:
            InvalidArgumentError: the value is not a position of this dataset.
        """
        if hasattr(string_value, "numpy"):
            string_value = string_value.numpy()
        text = string_value
        try:
            doc = boundedjson.loads(text, "stream position", InvalidArgumentError)
            if not isinstance(doc, dict):
                raise ValueError(f"a JSON {type(doc).__name__}, not an object")
            if doc.get("yogastore_position") != _POSITION_VERSION:
                raise ValueError("not a yogastore position of a known version")
            state = StreamState.from_json(json.dumps(doc["state"]))
            remainder = Remainder(doc.get("remainder", self.remainder.value))
            global_step = doc.get("global_step", 0)
            check_int("global_step", global_step, 0, allow_numpy=False, error=ValueError)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise InvalidArgumentError(f"invalid stream position {text!r:.200}: {err}") from err
        if state.dataset != self.ref.fingerprint or state.num_records != self.ref.num_records:
            raise InvalidArgumentError(
                f"checkpointed position belongs to {state.dataset!r} ({state.num_records} "
                f"records), not {self.ref.fingerprint!r} ({self.ref.num_records} records)"
            )
        if remainder is not self.remainder:
            logger.warning(
                "restored position used remainder=%s; continuing with remainder=%s",
                remainder.name,
                self.remainder.name,
            )
        with self._lock:
            old = self._start
            if (old.seed, old.shuffle, old.block_window) != (
                state.seed,
                state.shuffle,
                state.block_window,
            ):
                logger.warning(
                    "restored position has seed=%d shuffle=%s block_window=%d; it replaces "
                    "seed=%d shuffle=%s block_window=%d",
                    state.seed,
                    state.shuffle.name,
                    state.block_window,
                    old.seed,
                    old.shuffle.name,
                    old.block_window,
                )
            self._start = state
            self._steps = 0
            self._global_step = global_step
            self._layout = None
            self._segment_steps = 0
            self._skipped = None

    def check_ranks(
        self,
        allgather: AllGather,
        num_shards: int,
        batch_size: int,
        batches_per_step: int = 1,
        steps_per_epoch: int | None = None,
        what: str = "StreamPosition",
    ) -> None:
        """Check, in one all-gather, that every rank reads this position the same way.

        Done once per layout. Call it on every rank at the same point.

        Raises:
            RankMismatchError: naming the settings that differ.
        """
        key = (num_shards, batch_size, batches_per_step, steps_per_epoch)
        if key in self._checked:
            return
        state = self.state()
        settings = {
            "dataset": self.ref.fingerprint,
            "num_records": self.ref.num_records,
            "seed": state.seed,
            "shuffle": state.shuffle.name,
            "block_window": state.block_window,
            "epoch": state.epoch,
            "position": [list(map(int, iv)) for iv in state.remaining],
            "global_step": self.global_step,
            "remainder": self.remainder.value,
            "num_shards": num_shards,
            "batch_size": batch_size,
            "batches_per_step": batches_per_step,
            "steps_per_epoch": steps_per_epoch,
        }
        check_agreement(settings, allgather, what)
        self._checked.add(key)


class EpochRest(Stream):
    """A stream whose every pass is the rest of a position's epoch, or a fixed step count.

    ``to_tf_dataset`` builds its generator on ``column_batches``; overriding
    that one method makes the dataset re-read the position on each iteration.
    """

    def __init__(
        self,
        position: Position,
        shard_rank: int,
        num_shards: int,
        batches_per_step: int,
        epoch_steps: int | None = None,
    ) -> None:
        start = position.state()
        super().__init__(
            position.ref,
            shard_rank=shard_rank,
            num_shards=num_shards,
            shuffle=start.shuffle,
            seed=start.seed,
            epoch=start.epoch,
            start_offset=0,
            drop_remainder=position.remainder is Remainder.DROP,
            num_epochs=1,
            block_window=start.block_window,
            first_intervals=start.remaining,
            prefetch=position.prefetch,
        )
        self.position = position
        self.batches_per_step = batches_per_step
        self.epoch_steps = epoch_steps

    def column_batches(self, batch_size: int, drop_remainder: bool = False) -> Iterator[Any]:
        position = self.position
        per_step = batch_size * self.batches_per_step
        start, steps = position._begin(self.shard_rank, self.num_shards, per_step)
        if self.epoch_steps is None:
            yield from self._segment(start, steps * self.batches_per_step, batch_size)
            return
        # Fixed training epochs: continue through data epochs as advance() will.
        left = self.epoch_steps * self.batches_per_step
        while left > 0:
            take = min(left, steps * self.batches_per_step)
            if take:
                segment = self._segment(start, steps * self.batches_per_step, batch_size)
                try:
                    yield from itertools.islice(segment, take)
                finally:
                    segment.close()
                left -= take
            elif start.remaining_records == position.ref.num_records:
                raise InvalidArgumentError(
                    f"a whole epoch makes no step of {self.num_shards} shards x {per_step} records"
                )
            start = position._fresh(start.shuffle, start.seed, start.epoch + 1, start.block_window)
            steps = steps_for(
                start.remaining_records, self.num_shards, per_step, position.remainder
            )

    def _segment(
        self, start: StreamState, count: int, batch_size: int
    ) -> Generator[Any, None, None]:
        """Yield this shard's ``count`` batches of the epoch part ``start`` describes."""
        if count == 0:
            return
        position = self.position
        drop = position.remainder is Remainder.DROP
        stream = position.ref.resume(
            start,
            self.shard_rank,
            self.num_shards,
            drop_remainder=drop,
            num_epochs=1,
            prefetch=position.prefetch,
        )
        tail = np.empty(0, dtype=np.int64)
        done = 0
        batches = stream.column_batches(batch_size)
        try:
            for records, cols in batches:
                if done == count:
                    break
                if len(records) < batch_size:
                    tail = records
                    break
                yield records, cols
                done += 1
        finally:
            # Stop the read-ahead thread now, not when the generator is collected.
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        if done < count:
            if drop:  # the step count fits the shortest shard, so this is a bug
                raise RuntimeError(
                    f"shard {self.shard_rank} ran out after {done} of {count} batches"
                )
            fresh = position._fresh(start.shuffle, start.seed, start.epoch, start.block_window)
            yield from _padding(stream, fresh, tail, batch_size, (count - done) * batch_size)


def _padding(
    stream: Stream, fresh: StreamState, tail: IntArray, batch_size: int, total: int
) -> Iterator[Any]:
    """Yield ``total`` records: ``tail``, then padding as ``Remainder.PAD`` defines it.

    ``fresh`` is the whole epoch, so the padding does not depend on where
    the epoch was resumed (a resumed shard's own span is only its rest).
    """
    ref = stream.ref
    span = ref.resume(fresh, stream.shard_rank, stream.num_shards, num_epochs=1, prefetch=0)
    if len(span) == 0:
        # Fewer records than shards: this shard's span is empty.
        span = ref.resume(fresh, 0, 1, num_epochs=1, prefetch=0)
    need = total - len(tail)
    head = next(span.record_indices(min(len(span), need)))
    records = np.concatenate([tail, np.resize(head, need)])
    source = stream.source  # the chunk source the shard already reads through
    for lo in range(0, len(records), batch_size):
        piece = records[lo : lo + batch_size]
        yield piece, source.gather(piece)
