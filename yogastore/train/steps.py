"""Steps per epoch: how every shard gets the same number of steps, and fixed training epochs."""

from __future__ import annotations

import dataclasses
import enum

from storage_backends.errors import InvalidArgumentError
from yogastore.checks import check_int

__all__ = ["EpochSize", "Remainder", "check_epoch_has_step", "steps_for"]


class Remainder(enum.Enum):
    """What to do with records that do not fill a whole step on every shard."""

    DROP = "drop"
    """Leave them out of this epoch (each epoch's new order leaves out other records)."""
    PAD = "pad"
    """Fill each shard's last step with the first records of its span of the epoch.

    Shard ``r`` of ``n`` pads with the first records (cycled if needed) of
    what it reads of a whole, fresh epoch split ``n`` ways, i.e. of
    ``ref.stream(r, n, epoch=e)``; a shard with no records in that split
    (fewer records than shards) pads from the start of the epoch's order. So
    padding depends only on the epoch, the shard count and the rank: a
    restore with the same count pads exactly as the uninterrupted run. After
    a restore with another count, shard ``r`` reads its share of the records
    nobody has trained on yet, then pads with the first records of its span
    of the epoch split the new number of ways (records that may have been
    trained on before the restore); every shard runs ``ceil(longest share /
    records per step)`` steps, also a shard whose share is empty.
    """


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EpochSize:
    """A training epoch (Keras' epoch) of a fixed size, independent of the data's epochs.

    A dataset made with an ``EpochSize`` yields exactly that many steps on
    every iteration and has that cardinality: the data continues where the
    previous iteration stopped, across data epochs (each still a full pass
    in its own order). Give at most one of ``steps`` and ``records``;
    neither means the steps of one full data epoch.

    Args:
        steps: steps per training epoch.
        records: records per training epoch over all shards (rounded down
            to whole steps, at least one).
    """

    steps: int | None = None
    records: int | None = None

    def __post_init__(self) -> None:
        if self.steps is not None and self.records is not None:
            raise InvalidArgumentError("EpochSize takes steps or records, not both")
        for name in ("steps", "records"):
            value = getattr(self, name)
            if value is not None:
                check_int(f"EpochSize.{name}", value, 1)

    def resolve(
        self, num_records: int, num_shards: int, per_step: int, remainder: Remainder
    ) -> int:
        """Return the steps per training epoch for this layout."""
        if self.steps is not None:
            return self.steps
        if self.records is not None:
            return max(1, self.records // (num_shards * per_step))
        steps = steps_for(num_records, num_shards, per_step, remainder)
        if steps == 0:
            raise InvalidArgumentError(
                f"{num_records} records make no whole step of {num_shards} shards x "
                f"{per_step} records"
            )
        return steps


def steps_for(total: int, num_shards: int, per_step: int, remainder: Remainder) -> int:
    """Return the steps every shard runs over ``total`` records (equal on every shard)."""
    if remainder is Remainder.DROP:
        return (total // num_shards) // per_step
    longest = -(-total // num_shards)
    return -(-longest // per_step)


def check_epoch_has_step(
    num_records: int, num_shards: int, per_step: int, remainder: Remainder
) -> None:
    """Refuse a layout in which a whole epoch of ``num_records`` makes no step.

    Raises:
        InvalidArgumentError: naming the records, the layout and why.
    """
    if steps_for(num_records, num_shards, per_step, remainder) > 0:
        return
    if num_records == 0:
        why = "the dataset has no records"
    else:
        why = (
            "Remainder.DROP leaves every record out; use a smaller batch, fewer shards or "
            "Remainder.PAD"
        )
    raise InvalidArgumentError(
        f"a whole epoch of {num_records} records makes no step of {num_shards} shards x "
        f"{per_step} records ({why})"
    )
