"""A work queue's position and progress: what its workers consumed, what is done.

``WorkQueueState`` is the checkpointable part (JSON, like ``StreamState``):
the positions of each epoch the job's workers have consumed. ``QueueStatus``
is a read-only summary of the claims in the store.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable, Iterator, Sequence

from storage_backends.errors import InvalidArgumentError
from yogastore import boundedjson
from yogastore.checks import check_int, is_int
from yogastore.read.order import Interval, Shuffle, intervals_length

__all__ = [
    "EpochCounts",
    "Lease",
    "ListedSlice",
    "QueueStatus",
    "WorkQueueState",
    "complement",
    "prefix",
    "union",
]

_STATE_VERSION = 1
_MAX_STATE_BYTES = 64 << 20


def union(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """Return the sorted, merged union of ``intervals``."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[0] < i[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def complement(intervals: Sequence[Interval], n: int) -> tuple[Interval, ...]:
    """Return the positions of ``[0, n)`` outside ``intervals``."""
    out, last = [], 0
    for a, b in union(intervals):
        if last < a:
            out.append((last, a))
        last = b
    if last < n:
        out.append((last, n))
    return tuple(out)


@dataclasses.dataclass(slots=True)
class ListedSlice:
    """What one listing of a queue's keys says about one slice."""

    gen: int = -1  # highest claim generation, -1: never claimed
    expires_ms: int = 0  # latest lease expiry of that generation, 0: unknown
    done: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkQueueState:
    """Which positions of which epochs a job's workers have consumed.

    Take one per worker with ``QueueStream.state(consumed)`` at a checkpoint,
    combine the workers' states with ``merge``, and start the job again with
    ``ref.work_queue(job, resume=state)`` (any number of workers): nothing the
    state counts as consumed is read again, everything else is.
    """

    dataset: str
    num_records: int
    seed: int
    epoch: int
    num_epochs: int
    shuffle: Shuffle
    block_window: int
    num_slices: int
    consumed: tuple[tuple[int, tuple[Interval, ...]], ...]

    def __post_init__(self) -> None:
        for name in ("num_records", "seed", "epoch", "num_epochs", "block_window", "num_slices"):
            # Plain ints only: the state is written back as JSON as it is.
            check_int(f"state {name}", getattr(self, name), 0, allow_numpy=False)
        for e, intervals in self.consumed:
            if not self.epoch <= e < self.epoch + self.num_epochs:
                raise InvalidArgumentError(f"state names epoch {e} outside the job's epochs")
            last = 0
            for a, b in intervals:
                if not last <= a < b <= self.num_records:
                    raise InvalidArgumentError(
                        f"state intervals {intervals} of epoch {e} are not sorted, disjoint "
                        f"intervals within [0, {self.num_records})"
                    )
                last = b
        epochs = [e for e, _ in self.consumed]
        if len(set(epochs)) != len(epochs):
            twice = sorted({e for e in epochs if epochs.count(e) > 1})
            raise InvalidArgumentError(
                f"state lists epoch(s) {twice} more than once; each epoch appears once "
                "(merge the states of several workers with WorkQueueState.merge)"
            )

    def consumed_in(self, epoch: int) -> tuple[Interval, ...]:
        """Return the consumed positions of ``epoch``."""
        return dict(self.consumed).get(epoch, ())

    @property
    def remaining_records(self) -> int:
        """Records of the job's epochs not consumed yet."""
        done = sum(intervals_length(i) for _e, i in self.consumed)
        return self.num_records * self.num_epochs - done

    @classmethod
    def merge(cls, states: Iterable[WorkQueueState]) -> WorkQueueState:
        """Combine the states of all workers of one job (taken at one checkpoint).

        Raises:
            InvalidArgumentError: the states belong to different jobs or orders.
        """
        if isinstance(states, str | bytes) or not isinstance(states, Iterable):
            raise InvalidArgumentError(f"merge needs an iterable of states, got {states!r:.100}")
        states = list(states)
        if not states:
            raise InvalidArgumentError("merge needs at least one state")
        for s in states:
            if not isinstance(s, WorkQueueState):
                raise InvalidArgumentError(
                    f"merge needs WorkQueueState objects (QueueStream.state(...)), got {s!r:.100}"
                )
        first = states[0]
        for s in states[1:]:
            if dataclasses.replace(s, consumed=()) != dataclasses.replace(first, consumed=()):
                raise InvalidArgumentError(f"states of different jobs cannot merge: {s} vs {first}")
        by_epoch: dict[int, list[Interval]] = {}
        for s in states:
            for e, intervals in s.consumed:
                by_epoch.setdefault(e, []).extend(intervals)
        consumed = tuple((e, union(by_epoch[e])) for e in sorted(by_epoch))
        return dataclasses.replace(first, consumed=tuple((e, i) for e, i in consumed if i))

    def to_json(self) -> str:
        """Return the state as a JSON string."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc["shuffle"] = self.shuffle.value
        doc["consumed"] = [[e, [list(i) for i in ivs]] for e, ivs in self.consumed]
        return json.dumps({"yogastore_queue_state": _STATE_VERSION, **doc}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkQueueState:
        """Parse a state written by ``to_json``.

        Raises:
            InvalidArgumentError: the text is not a valid state.
        """
        if not isinstance(text, str | bytes) or len(text) > _MAX_STATE_BYTES:
            raise InvalidArgumentError("a work queue state is a JSON string of at most 64 MiB")
        doc = boundedjson.loads(text, "work queue state", InvalidArgumentError)
        try:
            if not isinstance(doc, dict) or doc.get("yogastore_queue_state") != _STATE_VERSION:
                raise ValueError("not a yogastore work queue state of a known version")
            consumed = []
            for e, ivs in doc["consumed"]:
                pairs = [(a, b) for a, b in ivs]
                if not all(is_int(v, allow_numpy=False) for v in itertools.chain([e], *pairs)):
                    raise ValueError("epochs and positions must be integers")
                consumed.append((e, tuple(pairs)))
            return cls(
                dataset=str(doc["dataset"]),
                num_records=doc["num_records"],
                seed=doc["seed"],
                epoch=doc["epoch"],
                num_epochs=doc["num_epochs"],
                shuffle=Shuffle(doc["shuffle"]),
                block_window=doc["block_window"],
                num_slices=doc["num_slices"],
                consumed=tuple(consumed),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise InvalidArgumentError(f"invalid work queue state {text!r:.200}: {err}") from err


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EpochCounts:
    """How many slices of one epoch are done, claimed (live lease), expired and free."""

    epoch: int
    slices: int
    done: int
    claimed: int
    expired: int

    @property
    def free(self) -> int:
        """Slices nobody has claimed yet."""
        return self.slices - self.done - self.claimed - self.expired


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Lease:
    """An unfinished slice's claim: who holds it and until when (Unix ms)."""

    epoch: int
    index: int
    worker: str
    expires_ms: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QueueStatus:
    """A job run's progress, from one listing of its keys.

    ``workers`` maps each worker to the number of slices it completed;
    ``claimed`` counts slices held under a live lease, ``expired`` those whose
    holder stopped renewing (they are taken over by the next claim);
    ``leases`` lists the claims of unfinished slices, live and expired.
    """

    job: str
    run: str
    epochs: range
    per_epoch: tuple[EpochCounts, ...]  # epochs with keys (or cut down by a resume)
    workers: dict[str, int]
    leases: tuple[Lease, ...]
    now_ms: int  # when the listing was taken, for judging the leases
    idle_epochs: int = 0  # the other epochs: no key yet, every slice free
    idle_slices: int = 0  # their slices

    @property
    def slices(self) -> int:
        """Slices of every epoch of the run (empty slices are not counted)."""
        return sum(c.slices for c in self.per_epoch) + self.idle_slices

    @property
    def done(self) -> int:
        """Slices whose records were all consumed."""
        return sum(c.done for c in self.per_epoch)

    @property
    def claimed(self) -> int:
        """Unfinished slices held under a live lease."""
        return sum(c.claimed for c in self.per_epoch)

    @property
    def expired(self) -> int:
        """Unfinished slices whose lease expired (the next claim takes them over)."""
        return sum(c.expired for c in self.per_epoch)

    @property
    def free(self) -> int:
        """Slices nobody has claimed yet."""
        return sum(c.free for c in self.per_epoch) + self.idle_slices

    @property
    def finished(self) -> bool:
        """Whether every slice of every epoch is done."""
        return self.done == self.slices


def prefix(intervals: Sequence[Interval], count: int) -> Iterator[Interval]:
    """Yield the first ``count`` positions of ``intervals`` as intervals."""
    for a, b in intervals:
        if count <= 0:
            return
        yield a, min(b, a + count)
        count -= b - a
