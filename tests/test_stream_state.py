"""Seeds and resume states: every accepted seed round-trips; state() is arithmetic, not a walk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import yogastore
from yogastore import ComponentSpec
from yogastore.read.assignment import StaticAssignment
from yogastore.read.stream import StreamState

SPEC = ComponentSpec(shape=(), dtype="int64")
TOP = 2**64 - 1  # the largest seed (and epoch) accepted


@pytest.fixture
def ref(tmp_path: Path) -> yogastore.DatasetRef:
    store = yogastore.Store(tmp_path)
    return store.cache(
        "s",
        "1",
        lambda: [np.int64(i) for i in range(37)],
        spec=SPEC,
        progress=yogastore.NullProgress(),
    )


def _ids(stream: yogastore.Stream) -> list[int]:
    return [int(x) for x in stream]


@pytest.mark.parametrize(
    "kwargs",
    [{"seed": 2**64}, {"seed": 5 + 2**64}, {"seed": 2**70}, {"epoch": 2**64}],
    ids=["seed=2**64", "seed=5+2**64", "seed=2**70", "epoch=2**64"],
)
def test_seed_and_epoch_beyond_64_bits_refused(
    ref: yogastore.DatasetRef, kwargs: dict[str, int]
) -> None:
    with pytest.raises(yogastore.InvalidArgumentError, match=r"\[0, 2\*\*64\)"):
        ref.stream(shuffle=True, **kwargs)
    with pytest.raises(yogastore.InvalidArgumentError, match=r"seed|epoch"):
        ref.work_queue("job", **kwargs)


def test_largest_seed_round_trips_and_differs_from_zero(ref: yogastore.DatasetRef) -> None:
    stream = ref.stream(0, 1, shuffle=True, seed=TOP, epoch=TOP)
    order = _ids(stream)
    assert order != _ids(ref.stream(0, 1, shuffle=True, seed=0, epoch=TOP))
    state = StreamState.from_json(stream.state(consumed=10).to_json())
    assert (state.seed, state.epoch) == (TOP, TOP)
    assert _ids(ref.resume(state, 0, 1)) == order[10:]


def test_state_with_seed_beyond_64_bits_refused(ref: yogastore.DatasetRef) -> None:
    text = ref.stream(0, 1, shuffle=True, seed=7).state(consumed=3).to_json()
    with pytest.raises(yogastore.InvalidArgumentError, match="seed"):
        StreamState.from_json(text.replace('"seed":7', f'"seed":{2**64}'))


def test_stream_position_seed_checked_at_the_call(ref: yogastore.DatasetRef) -> None:
    from yogastore.distributed import StreamPosition

    with pytest.raises(yogastore.InvalidArgumentError, match="seed"):
        StreamPosition(ref, seed=2**70)
    position = StreamPosition(ref, seed=TOP)
    restored = StreamPosition(ref)
    restored.deserialize(position.serialize())
    assert restored.state().seed == TOP


def test_state_of_a_huge_count_is_arithmetic(ref: yogastore.DatasetRef) -> None:
    stream = ref.stream(1, 3, shuffle=True, seed=2, num_epochs=None)
    per_epoch = len(ref.stream(1, 3, num_epochs=1))
    big = 10**8 + 5
    far, near = stream.state(consumed=big), stream.state(consumed=big - 1000 * per_epoch)
    assert far.epoch == near.epoch + 1000
    assert far.remaining == near.remaining
    whole = ref.stream(0, 1, shuffle=True, num_epochs=None)
    top = whole.state(consumed=TOP * 37)  # the last epoch a state holds, at its start
    assert (top.epoch, top.remaining) == (TOP, ((0, 37),))
    with pytest.raises(yogastore.InvalidArgumentError, match="epoch 18446744073709551616"):
        whole.state(consumed=TOP * 37 + 37)
    with pytest.raises(yogastore.InvalidArgumentError, match="consumed=10000000000000000000000000"):
        stream.state(consumed=10**25)


def _walk(a: StaticAssignment, consumed: int, at_end: bool) -> tuple[int, int]:
    """The definition of ``locate``: step through the epochs one by one."""
    k, left = 0, consumed
    while at_end or a.num_epochs is None or k < a.num_epochs:
        length = a.epoch_length(k)
        if left < length or (at_end and left == length) or (length == 0 and k > 0):
            return k, left
        left -= length
        k += 1
    return k, left


@pytest.mark.parametrize("num_records", [0, 1, 5, 7])
@pytest.mark.parametrize("num_epochs", [None, 0, 1, 3])
def test_locate_matches_walking_the_epochs(num_records: int, num_epochs: int | None) -> None:
    firsts = [None, (), ((1, 3),), ((0, 2), (4, 5))]
    for first in [f for f in firsts if not f or f[-1][1] <= num_records]:
        for num_shards, drop in [(1, False), (2, False), (3, False), (3, True)]:
            for rank in range(num_shards):
                a = StaticAssignment(
                    num_records=num_records,
                    shard_rank=rank,
                    num_shards=num_shards,
                    drop_remainder=drop,
                    num_epochs=num_epochs,
                    first_intervals=first,
                )
                for consumed in range(30):
                    for at_end in (False, True):
                        assert a.locate(consumed, at_end=at_end) == _walk(a, consumed, at_end)


def test_state_refuses_more_records_than_the_stream_yields(ref: yogastore.DatasetRef) -> None:
    # 37 records on 2 ranks: spans of 18 and 19. Batches of 7 take 3 steps on both ranks, so
    # steps * batch_size (21) counts records that neither rank read; taken as consumed, they
    # would mark 3 records of each span of the next epoch as read.
    streams = [ref.stream(r, 2, shuffle=True, seed=0) for r in range(2)]
    assert [len(s) for s in streams] == [18, 19]
    assert [sum(1 for _ in s.batches(7)) for s in streams] == [3, 3]
    for s in streams:
        with pytest.raises(
            yogastore.InvalidArgumentError, match=rf"consumed=21 is more than the {len(s)} records"
        ):
            s.state(consumed=21)
    # What the ranks did read: rank 1, which read the most, gives the next epoch whole.
    end = streams[1].state(consumed=19)
    assert (end.epoch, end.remaining) == (1, ((0, 37),))
    assert sorted(_ids(ref.resume(end, 0, 1))) == list(range(37))
    # Mid-epoch, every rank the same count: the rest of the epoch, exactly once.
    mid = streams[0].state(consumed=7)
    read = [i for s in streams for i in _ids(s)[:7]]
    rest = [i for r in range(3) for i in _ids(ref.resume(mid, r, 3))]
    assert sorted(read + rest) == list(range(37))
    # The bound is the stream's length: several epochs, a resumed stream; none when endless.
    three = ref.stream(1, 2, shuffle=True, seed=0, num_epochs=3)
    assert three.state(consumed=len(three)).epoch == 3
    with pytest.raises(yogastore.InvalidArgumentError, match="more than the"):
        three.state(consumed=len(three) + 1)
    resumed = ref.resume(mid, 0, 3)
    with pytest.raises(yogastore.InvalidArgumentError, match=rf"more than the {len(resumed)} "):
        resumed.state(consumed=len(resumed) + 1)
    endless = ref.stream(0, 2, shuffle=True, seed=0, num_epochs=None)
    assert endless.state(consumed=21).epoch == 1
