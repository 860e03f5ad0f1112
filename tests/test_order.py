"""Property tests of the ordering rules: permutation, shards, offsets, elastic resume."""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import yogastore
from yogastore.read.order import (
    BlockShuffleOrder,
    FeistelPermutation,
    GlobalShuffleOrder,
    Shuffle,
    _gather,
    remaining_after,
    split_intervals,
)

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
SPEC = yogastore.ComponentSpec(shape=(), dtype="int64")


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, yogastore.DatasetRef]]:
    """Datasets whose record i holds the value i, built lazily per size."""
    store = yogastore.Store(tmp_path_factory.mktemp("order-store"), chunk_bytes=256)
    cache: dict[int, yogastore.DatasetRef] = {}

    class Lazy(dict[int, yogastore.DatasetRef]):
        def __missing__(self, n: int) -> yogastore.DatasetRef:
            ref = store.cache(f"n{n}", "1", lambda: (np.int64(i) for i in range(n)), spec=SPEC)
            self[n] = ref
            return ref

    yield Lazy(cache)


def indices(stream: yogastore.Stream) -> list[int]:
    return [int(i) for batch in stream.record_indices(7) for i in batch]


def values(stream: yogastore.Stream) -> list[int]:
    return [int(v) for v in stream]


sizes = st.integers(min_value=0, max_value=300)
shards = st.integers(min_value=1, max_value=9)
seeds = st.integers(min_value=0, max_value=2**32)
shuffles = st.sampled_from([Shuffle.NONE, Shuffle.GLOBAL, Shuffle.BLOCK])


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 100, 255, 256, 257, 4097])
def test_feistel_is_a_bijection(n: int) -> None:
    for key in (0, 1, 12345):
        out = FeistelPermutation(n, key)(np.arange(n))
        assert sorted(out.tolist()) == list(range(n))


def test_feistel_is_keyed() -> None:
    a = FeistelPermutation(1000, 1)(np.arange(1000))
    b = FeistelPermutation(1000, 2)(np.arange(1000))
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, np.arange(1000))


def test_feistel_spreads_records_uniformly_over_positions() -> None:
    """Over many keys, each position draws each region of records equally often."""
    n, keys, bins = 1000, 400, 10
    counts = np.zeros((bins, bins))
    for key in range(keys):
        out = FeistelPermutation(n, key)(np.arange(n))
        np.add.at(counts, (np.arange(n) * bins // n, out * bins // n), 1)
    expected = n * keys / bins**2
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 81 degrees of freedom: the 99.99th percentile is about 135.
    assert chi2 < 135, f"position/record bins far from uniform: chi2={chi2:.1f}"


def test_feistel_picks_every_permutation_of_a_tiny_domain_about_equally() -> None:
    keys = 12000
    counts: dict[tuple[int, ...], int] = {}
    for key in range(keys):
        perm = tuple(FeistelPermutation(5, key)(np.arange(5)).tolist())
        counts[perm] = counts.get(perm, 0) + 1
    assert len(counts) == 120
    expected = keys / 120
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    # 119 degrees of freedom: the 99.99th percentile is about 185.
    assert chi2 < 185, f"permutations of 5 records far from uniform: chi2={chi2:.1f}"


def test_feistel_orders_of_consecutive_epochs_are_unrelated() -> None:
    n = 5000
    firsts = [GlobalShuffleOrder(n, seed=4, epoch=e).records(np.arange(n)) for e in range(6)]
    for a, b in itertools.pairwise(firsts):
        rho = np.corrcoef(a, b)[0, 1]
        assert abs(rho) < 0.06, f"orders of consecutive epochs correlate: {rho:.3f}"
    # Neighbouring positions do not map to neighbouring records.
    gaps = np.abs(np.diff(firsts[0]))
    assert np.median(gaps) > n / 5


def test_state_of_an_earlier_order_is_refused_clearly(
    refs: dict[int, yogastore.DatasetRef],
) -> None:
    old = refs[30].stream(0, 2, seed=1).state(consumed=2).to_json()
    old = old.replace('"yogastore_state":2', '"yogastore_state":1')
    with pytest.raises(yogastore.InvalidArgumentError, match="earlier yogastore"):
        yogastore.StreamState.from_json(old)


def test_billion_record_slice_needs_no_big_memory() -> None:
    n = 10**9
    order = GlobalShuffleOrder(n, seed=3, epoch=7)
    tracemalloc.start()
    out = order.records(np.arange(5 * 10**8, 5 * 10**8 + 4096))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(set(out.tolist())) == 4096
    assert out.min() >= 0 and out.max() < n
    assert peak < 4 << 20, f"slice of a 1e9 permutation used {peak} bytes"


@given(n=st.integers(0, 2000), seed=seeds, epoch=st.integers(0, 50), window=st.integers(1, 6))
@settings(max_examples=80, deadline=None)
def test_block_shuffle_is_a_permutation(n: int, seed: int, epoch: int, window: int) -> None:
    rng = np.random.default_rng(seed % 1000)
    sizes = []
    left = n
    while left:
        sizes.append(int(min(left, rng.integers(1, 60))))
        left -= sizes[-1]
    order = BlockShuffleOrder(sizes, seed, epoch, window)
    assert sorted(order.records(np.arange(n)).tolist()) == list(range(n))


def test_block_shuffle_keeps_windows_of_chunks_together() -> None:
    sizes = [10] * 20
    order = BlockShuffleOrder(sizes, seed=5, epoch=0, window=2)
    recs = order.records(np.arange(200))
    for w in range(10):
        chunks = set((recs[w * 20 : (w + 1) * 20] // 10).tolist())
        assert len(chunks) == 2, "a window of 20 positions must draw from exactly 2 chunks"
    other = BlockShuffleOrder(sizes, seed=5, epoch=1, window=2).records(np.arange(200))
    assert not np.array_equal(recs, other)


@given(n=sizes, num_shards=shards, seed=seeds, epoch=st.integers(0, 9), shuffle=shuffles)
@SETTINGS
def test_global_order_does_not_depend_on_sharding(
    refs: dict[int, yogastore.DatasetRef],
    n: int,
    num_shards: int,
    seed: int,
    epoch: int,
    shuffle: Shuffle,
) -> None:
    ref = refs[n]
    single = indices(ref.stream(shuffle=shuffle, seed=seed, epoch=epoch))
    assert sorted(single) == list(range(n))
    if shuffle is Shuffle.NONE:
        assert single == list(range(n))
    parts = [
        indices(ref.stream(r, num_shards, shuffle=shuffle, seed=seed, epoch=epoch))
        for r in range(num_shards)
    ]
    assert [i for p in parts for i in p] == single, "ranks take contiguous spans of one order"
    lengths = [len(p) for p in parts]
    assert max(lengths) - min(lengths) <= 1
    streams = [
        ref.stream(r, num_shards, shuffle=shuffle, seed=seed, epoch=epoch)
        for r in range(num_shards)
    ]
    assert [len(s) for s in streams] == lengths


@given(n=sizes, num_shards=shards, seed=seeds)
@SETTINGS
def test_drop_remainder_gives_equal_counts(
    refs: dict[int, yogastore.DatasetRef], n: int, num_shards: int, seed: int
) -> None:
    ref = refs[n]
    parts = [
        indices(ref.stream(r, num_shards, seed=seed, drop_remainder=True))
        for r in range(num_shards)
    ]
    assert {len(p) for p in parts} == {n // num_shards}
    seen = [i for p in parts for i in p]
    assert len(set(seen)) == len(seen)
    assert 0 <= n - len(seen) < num_shards


def test_reshuffle_changes_each_ranks_subset(refs: dict[int, yogastore.DatasetRef]) -> None:
    ref = refs[200]
    e0 = ref.stream(0, 2, seed=1, epoch=0, num_epochs=2)
    records = indices(e0)
    first, second = set(records[:100]), set(records[100:])
    assert sorted(first | set(indices(ref.stream(1, 2, seed=1, epoch=0)))) == list(range(200))
    assert first != second, "rank 0 must see a different subset in epoch 1"
    assert records[:100] != records[100:]


def test_values_match_record_indices(refs: dict[int, yogastore.DatasetRef]) -> None:
    ref = refs[57]
    stream = ref.stream(1, 3, seed=9, num_epochs=2)
    assert values(stream) == indices(stream)


@given(
    n=sizes,
    num_shards=shards,
    seed=seeds,
    k=st.integers(0, 700),
    drop=st.booleans(),
    shuffle=shuffles,
)
@SETTINGS
def test_start_offset_skips_exactly(
    refs: dict[int, yogastore.DatasetRef],
    n: int,
    num_shards: int,
    seed: int,
    k: int,
    drop: bool,
    shuffle: Shuffle,
) -> None:
    ref = refs[n]
    rank = seed % num_shards
    kwargs = dict(shuffle=shuffle, seed=seed, drop_remainder=drop, num_epochs=3)
    full = indices(ref.stream(rank, num_shards, **kwargs))  # type: ignore[arg-type]
    skipped = ref.stream(rank, num_shards, start_offset=k, **kwargs)  # type: ignore[arg-type]
    assert indices(skipped) == full[k:]
    assert len(skipped) == len(full[k:])


def _epoch_orders(ref: yogastore.DatasetRef, seed: int, shuffle: Shuffle, epoch: int) -> list[int]:
    return indices(ref.stream(shuffle=shuffle, seed=seed, epoch=epoch))


@given(
    n=sizes,
    shard_counts=st.lists(shards, min_size=2, max_size=3),
    seed=seeds,
    ks=st.lists(st.integers(0, 120), min_size=2, max_size=3),
    drop=st.booleans(),
    shuffle=shuffles,
)
@SETTINGS
def test_elastic_resume_composes(
    refs: dict[int, yogastore.DatasetRef],
    n: int,
    shard_counts: list[int],
    seed: int,
    ks: list[int],
    drop: bool,
    shuffle: Shuffle,
) -> None:
    """n ranks consume k each, resume on m ranks, consume k' each, resume on p ranks..."""
    ref = refs[n]
    first = shard_counts[0]
    streams = [
        ref.stream(r, first, shuffle=shuffle, seed=seed, drop_remainder=drop, num_epochs=1)
        for r in range(first)
    ]
    seen: list[int] = []
    state = None
    for step, count in enumerate(shard_counts):
        k = ks[step % len(ks)]
        if step:
            assert state is not None
            streams = [ref.resume(state, r, count, drop_remainder=drop) for r in range(count)]
        per_rank = [indices(s) for s in streams]
        lengths = [len(p) for p in per_rank]
        assert max(lengths, default=0) - min(lengths, default=0) <= 1
        if drop:
            assert len(set(lengths)) <= 1
        taken = [p[:k] for p in per_rank]
        flat = [i for p in per_rank for i in p]
        assert len(set(flat)) == len(flat), "ranks of one epoch are disjoint"
        assert not set(flat) & set(seen), "a resumed rank re-reads nothing already consumed"
        seen.extend(i for t in taken for i in t)
        # A rank whose span ended before k consumed all of it (and can say no more).
        states = [
            s.state(consumed=min(k, n)).to_json() for s, n in zip(streams, lengths, strict=True)
        ]
        if drop or k <= min(lengths):
            # Ranks that consumed the same count of this epoch agree on the state.
            assert len(set(states)) == 1, "every rank computes the same state"
        state = yogastore.StreamState.from_json(states[-1])
        if state.epoch > 0:
            break
    # Whatever remains, read by one last set of ranks, completes the epoch.
    assert state is not None
    if state.epoch == 0:
        rest = [indices(ref.resume(state, r, 2, drop_remainder=drop)) for r in range(2)]
        final = seen + [i for p in rest for i in p]
        order = _epoch_orders(ref, seed, shuffle, 0)
        assert len(set(final)) == len(final)
        if not drop:
            assert sorted(final) == sorted(order), "nothing skipped or repeated"
        else:
            assert set(final) <= set(order)


@given(n=st.integers(1, 200), m=shards, seed=seeds, shuffle=shuffles)
@SETTINGS
def test_resume_continues_with_following_epochs(
    refs: dict[int, yogastore.DatasetRef], n: int, m: int, seed: int, shuffle: Shuffle
) -> None:
    ref = refs[n]
    stream = ref.stream(0, 2, shuffle=shuffle, seed=seed)
    state = stream.state(consumed=n // 4)
    for r in range(m):
        resumed = ref.resume(state, r, m, num_epochs=3)
        first_len = len(ref.resume(state, r, m, num_epochs=1))
        later = indices(resumed)[first_len:]
        expected = indices(
            ref.stream(r, m, shuffle=shuffle, seed=seed, epoch=state.epoch + 1, num_epochs=2)
        )
        assert later == expected


def test_state_after_whole_epoch_points_at_next(refs: dict[int, yogastore.DatasetRef]) -> None:
    ref = refs[10]
    stream = ref.stream(0, 2, seed=1, num_epochs=2)
    state = stream.state(consumed=5)
    assert state.epoch == 1 and state.remaining == ((0, 10),)
    uneven = ref.stream(0, 3, seed=1)  # spans 3, 3, 4
    state = uneven.state(consumed=3)
    assert state.epoch == 0 and state.remaining_records == 1


def test_state_json_round_trip_and_validation(refs: dict[int, yogastore.DatasetRef]) -> None:
    ref = refs[30]
    state = ref.stream(1, 4, seed=2).state(consumed=3)
    assert yogastore.StreamState.from_json(state.to_json()) == state
    for bad in [
        "{}",
        "not json",
        '{"yogastore_state": 2}',
        state.to_json().replace('"yogastore_state":2', '"yogastore_state":1'),
        state.to_json().replace('"epoch":0', '"epoch":-1'),
    ]:
        with pytest.raises(yogastore.InvalidArgumentError):
            yogastore.StreamState.from_json(bad)
    other = refs[31]
    with pytest.raises(yogastore.InvalidArgumentError, match="belongs to"):
        other.resume(state, 0, 1)


def test_split_and_remaining_are_consistent() -> None:
    intervals = [(0, 3), (5, 9), (12, 13)]
    parts = [split_intervals(intervals, 3, r, False) for r in range(3)]
    assert parts == [[(0, 2)], [(2, 3), (5, 7)], [(7, 9), (12, 13)]]
    assert remaining_after(intervals, 3, False, 1) == [(1, 2), (5, 7), (8, 9), (12, 13)]


def test_empty_dataset_streams_are_empty(tmp_path: Path) -> None:
    # Streams of an empty dataset are empty whatever the sharding.
    store = yogastore.Store(tmp_path)
    ref = store.cache("empty", "1", lambda: iter([]), spec=SPEC)
    assert ref.num_records == 0
    assert list(ref.stream(2, 3, num_epochs=5)) == []
    assert len(ref.stream(2, 3, num_epochs=5)) == 0
    assert list(ref.stream(0, 1, num_epochs=None)) == []


# The compiled permutation loop must compute exactly the numpy definition: a
# stored StreamState names positions of this order, so any drift would make a
# resumed job read other records than the ones it skipped.


@pytest.mark.skipif(_gather is None, reason="compiled extension not built")
@pytest.mark.parametrize(
    "n",
    [
        2,
        3,
        5,
        8,
        100,
        65536,
        65537,
        100_003,
        2**31 + 1,
        2**32 - 1,
        2**32,
        2**32 + 1,
        2**40 + 7,
        2**62 + 5,
        2**63 - 1,
    ],
)
def test_compiled_feistel_equals_the_numpy_definition(n: int) -> None:
    rng = np.random.default_rng(n % 1000)
    x = np.arange(n) if n <= 5000 else rng.integers(0, n, size=5000)
    for key in (1, 2, 2**63 + 12345):
        perm = FeistelPermutation(n, key)
        compiled = perm(x)
        np.testing.assert_array_equal(compiled, perm.reference(x))
        assert compiled.dtype == np.int64 and compiled.min() >= 0 and compiled.max() < n


def test_shuffled_order_is_pinned() -> None:
    """Known images, so a change of the order's definition cannot go unnoticed."""
    assert GlobalShuffleOrder(10, 0, 0).records(np.arange(10)).tolist() == [
        4, 6, 0, 2, 7, 1, 8, 5, 9, 3,
    ]  # fmt: skip
    picks = np.array([0, 1, 2, 99999, 100002])
    assert GlobalShuffleOrder(100003, 7, 3).records(picks).tolist() == [
        9222, 99393, 30469, 86838, 33999,
    ]  # fmt: skip
    wide = GlobalShuffleOrder(2**40 + 7, 1, 2).records(np.array([0, 5, 2**40]))
    assert wide.tolist() == [946039774663, 559128636824, 881966724709]


@pytest.mark.parametrize("bad", [-1, 1000])
def test_feistel_refuses_inputs_outside_its_domain(bad: int) -> None:
    perm = FeistelPermutation(1000, 3)
    for evaluate in (perm, perm.reference):
        with pytest.raises(ValueError, match=r"\[0, 1000\)"):
            evaluate(np.array([0, bad]))


def test_feistel_keeps_the_shape_of_its_input() -> None:
    perm = FeistelPermutation(1000, 3)
    grid = np.arange(600).reshape(20, 30)
    for evaluate in (perm, perm.reference):
        assert evaluate(grid).shape == (20, 30)
        np.testing.assert_array_equal(evaluate(grid).reshape(-1), perm.reference(np.arange(600)))
        assert evaluate(5).shape == () and int(evaluate(5)) == int(perm.reference([5])[0])


@pytest.mark.skipif(_gather is None, reason="compiled extension not built")
def test_compiled_feistel_refuses_parameters_that_do_not_come_from_its_size() -> None:
    perm = FeistelPermutation(1000, 3)  # 10 bits: halves of 5 and 5, 32-bit words
    keys, x = perm._key_words, np.arange(8)

    def call(high: int, low: int, wide: bool, n: int, out: Any = None) -> None:
        _gather.feistel(np.empty(8, np.int64) if out is None else out, x, keys, high, low, wide, n)

    call(5, 5, False, 1000)  # the parameters FeistelPermutation derives
    for bad in [
        (31, 32, True, 2),  # n far below 2**(bits - 1): the walk would take ~2**61 rounds
        (5, 5, True, 1000),  # 64-bit words for a 10-bit domain
        (4, 6, False, 1000),  # halves that are not bits // 2 and the rest
        (2**31 - 1, 1, False, 1000),  # would overflow their sum
        (5, 5, False, 1025),  # more than the domain holds
    ]:
        with pytest.raises(ValueError, match="bad permutation parameters"):
            call(*bad)
    shared = np.zeros(9, np.int64)
    shared[:8] = x
    with pytest.raises(ValueError, match="overlaps"):
        _gather.feistel(shared[1:], shared[:-1], keys, 5, 5, False, 1000)
    inplace = x.copy()
    _gather.feistel(inplace, inplace, keys, 5, 5, False, 1000)  # exactly in place is fine
    np.testing.assert_array_equal(inplace, perm.reference(x))


def test_feistel_size_must_fit_int64() -> None:
    with pytest.raises(ValueError, match=r"2\*\*63"):
        FeistelPermutation(2**63, 1)
