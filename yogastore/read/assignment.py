"""Who reads which positions: the seam between the epoch order and a stream.

An ``Assignment`` tells a ``Stream`` which positions of which epoch to read
next, and hears back how many records the stream's consumer has taken. The
ordering math (positions -> records) stays in ``order.py``; an assignment only
hands out position intervals. Two implementations exist:

* ``StaticAssignment``: rank ``r`` of ``n`` reads a fixed contiguous span of
  every epoch (the default of ``DatasetRef.stream``; pure arithmetic).
* ``yogastore.queue.work_queue.QueueAssignment``: a worker claims slices of each
  epoch from a queue kept in the store, so fast workers read more.

Rules every assignment follows:

* ``spans()`` yields ``(k, intervals)`` pairs: epoch index ``k`` (0 is the
  stream's first epoch) and sorted, disjoint position intervals, in the order
  the stream reads them. The stream asks for the next pair only after it has
  read every record of the previous one.
* ``consume(n)`` is called after the stream's consumer has taken ``n`` more
  records; an assignment may record progress then (never earlier: a record
  read ahead but not taken is not consumed).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

from yogastore.read.order import (
    Interval,
    intervals_length,
    remaining_after,
    slice_intervals,
    split_intervals,
)

__all__ = ["Assignment", "Span", "StaticAssignment"]

#: An epoch index (0 = the stream's first epoch) and position intervals of it.
Span = tuple[int, tuple[Interval, ...]]


class Assignment(abc.ABC):
    """Which positions a stream reads next, and what its consumer has taken."""

    @abc.abstractmethod
    def spans(self) -> Iterator[Span]:
        """Yield ``(epoch index, position intervals)`` in reading order."""

    def consume(self, count: int) -> None:  # noqa: B027 - optional hook
        """Note that the stream's consumer took ``count`` more records."""

    def length(self) -> int | None:
        """Return the number of records the stream yields, if known in advance."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release anything held (claims, threads); the stream is done."""


class StaticAssignment(Assignment):
    """Rank ``shard_rank`` of ``num_shards`` reads a contiguous span of each epoch.

    Args:
        num_records: records per epoch.
        shard_rank: this rank.
        num_shards: ranks sharing each epoch.
        drop_remainder: give every rank exactly ``len // num_shards`` positions.
        num_epochs: epochs to read; ``None`` reads forever.
        start_offset: skip this many of the rank's positions first.
        first_intervals: positions of the first epoch (a resume state's
            remainder); ``None`` means all of it.
    """

    def __init__(
        self,
        *,
        num_records: int,
        shard_rank: int,
        num_shards: int,
        drop_remainder: bool,
        num_epochs: int | None,
        start_offset: int = 0,
        first_intervals: tuple[Interval, ...] | None = None,
    ) -> None:
        self.num_records = num_records
        self.shard_rank = shard_rank
        self.num_shards = num_shards
        self.drop_remainder = drop_remainder
        self.num_epochs = num_epochs
        self.start_offset = start_offset
        self._first = first_intervals

    def epoch_intervals(self, k: int) -> tuple[Interval, ...]:
        """Return the positions of epoch index ``k`` shared by all ranks."""
        if k == 0 and self._first is not None:
            return self._first
        return ((0, self.num_records),) if self.num_records else ()

    def epoch_span(self, k: int) -> list[Interval]:
        """Return this rank's positions of epoch index ``k``."""
        return split_intervals(
            self.epoch_intervals(k), self.num_shards, self.shard_rank, self.drop_remainder
        )

    def epoch_length(self, k: int) -> int:
        """Return how many positions this rank reads of epoch index ``k``."""
        return intervals_length(self.epoch_span(k))

    def locate(self, consumed: int, *, at_end: bool = False) -> tuple[int, int]:
        """Return ``(epoch index, offset in its span)`` after ``consumed`` records.

        With ``at_end`` a count that ends exactly at the end of an epoch's span
        stays in that epoch (offset = its length) instead of moving on; that
        is where a resume state is taken.
        """

        # Constant time whatever ``consumed``: epoch 0 may be a resume state's
        # remainder, and every later epoch has the same length.
        def reads(k: int) -> bool:
            return at_end or self.num_epochs is None or k < self.num_epochs

        left = consumed
        if not reads(0):
            return 0, left
        length = self.epoch_length(0)
        if left < length or (at_end and left == length):
            return 0, left
        left -= length
        if not reads(1):
            return 1, left
        length = self.epoch_length(1)
        if length == 0:
            return 1, left
        if at_end:  # the first epoch whose span ends at or after ``left``
            skip = max(0, -(-left // length) - 1)
        else:  # the first epoch whose span ends after ``left``
            skip = left // length
            if self.num_epochs is not None:
                skip = min(skip, self.num_epochs - 1)
        return 1 + skip, left - skip * length

    def spans(self) -> Iterator[Span]:
        k, offset = self.locate(self.start_offset)
        while self.num_epochs is None or k < self.num_epochs:
            span = self.epoch_span(k)
            length = intervals_length(span)
            if length == 0 and k > 0:
                return  # every later epoch is empty too
            rest = tuple(slice_intervals(span, offset, length))
            if rest:
                yield k, rest
            k, offset = k + 1, 0

    def length(self) -> int | None:
        if self.num_epochs is None:
            return None
        total = sum(self.epoch_length(k) for k in range(min(self.num_epochs, 1)))
        if self.num_epochs > 1:
            total += (self.num_epochs - 1) * self.epoch_length(1)
        return max(total - self.start_offset, 0)

    def remaining(self, consumed: int) -> tuple[int, tuple[Interval, ...]]:
        """Return ``(epoch index, positions no rank consumed)`` after ``consumed`` each.

        Assumes every rank consumed the same number of records (synchronous
        training). A rank that finished its span may still see other ranks'
        last records; an epoch with nothing left gives way to the next one.
        """
        k, left = self.locate(self.start_offset + consumed, at_end=True)
        rest = tuple(
            remaining_after(self.epoch_intervals(k), self.num_shards, self.drop_remainder, left)
        )
        if not rest:
            return k + 1, self.epoch_intervals(k + 1)
        return k, rest
