"""Synchronous training over a work queue: every rank steps until all are done."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from storage_backends.errors import InvalidArgumentError

__all__ = ["lockstep"]

_END = object()


def lockstep(batches: Iterable[Any], any_rank_has_data: Callable[[bool], bool]) -> Iterator[Any]:
    """Yield batches while any rank still has one, ``None`` where this rank has none.

    Workers of a queue end an epoch after different numbers of steps; in
    synchronous training the ranks that ran out must keep joining the
    collective operations until every rank is done, or the others hang.
    ``any_rank_has_data(flag)`` is the one collective per step (for example a
    max all-reduce of ``flag`` across ranks). A ``None`` step should run the
    training step with zero weight (or call ``hvd.join()`` once and stop).
    Read the queue with ``queue.stream(worker, wait=False)``: a rank must not
    wait for a slice another rank holds while that rank waits in a collective.

    Raises:
        InvalidArgumentError: ``batches`` is not iterable or yields ``None``,
            ``any_rank_has_data`` is not callable, or it answers that no rank
            has data while this one has a batch (it must reduce across ranks).
    """
    if isinstance(batches, str | bytes) or not isinstance(batches, Iterable):
        raise InvalidArgumentError(f"lockstep: batches must be an iterable, got {batches!r:.100}")
    if not callable(any_rank_has_data):
        raise InvalidArgumentError(
            f"lockstep: any_rank_has_data must be a function (a max all-reduce of its flag "
            f"across ranks), got {any_rank_has_data!r:.100}"
        )
    return _lockstep(iter(batches), any_rank_has_data)


def _lockstep(it: Iterator[Any], any_rank_has_data: Callable[[bool], Any]) -> Iterator[Any]:
    exhausted = False
    while True:
        if exhausted:
            batch = None
        else:
            batch = next(it, _END)
            exhausted = batch is _END
            if exhausted:
                batch = None
            elif batch is None:
                raise InvalidArgumentError(
                    "lockstep: batches yielded None; None marks a rank without data"
                )
        if not any_rank_has_data(batch is not None):
            if batch is not None:
                raise InvalidArgumentError(
                    "lockstep: any_rank_has_data answered that no rank has data while this "
                    "rank has a batch (it returned a false value for True); it must "
                    "return whether any rank's flag is True (a max all-reduce)"
                )
            return
        yield batch
