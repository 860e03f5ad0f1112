"""Which records a rank reads, and in which order: pure integer math, no I/O.

Vocabulary:

* A *position* is an index into epoch ``e``'s global order, ``0 <= p < N``.
* ``EpochOrder.records(positions)`` maps positions to record indices. The map
  is a bijection on ``[0, N)`` that depends only on ``(seed, epoch)`` (and, for
  block shuffle, on the chunk table), never on the number of shards.
* A rank's share of an epoch is a contiguous slice of a list of position
  *intervals*: ``[(0, N)]`` for a fresh epoch, or whatever remained when a
  resume state was taken. ``split_intervals`` cuts that list into
  ``num_shards`` contiguous spans whose sizes differ by at most one (or are
  equal, dropping fewer than ``num_shards`` positions, with ``drop_remainder``).
* ``remaining_after`` is the list of intervals still unread after every rank
  consumed ``k`` records of its span. Re-splitting it among a different number
  of ranks is elastic resume; it composes because its output is again a list
  of intervals.

The shuffled order is a keyed Feistel network over the next power of two
above ``N`` with cycle walking, so any slice of the permutation costs
O(slice) time and memory: nothing here grows with ``N``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from yogastore.arrays import IntArray

try:  # the compiled permutation loop; without it the numpy rounds below run
    from yogastore import _gather
except ImportError:  # pragma: no cover - the package builds it on install
    _gather = None  # type: ignore[assignment]

__all__ = [
    "KEY_LIMIT",
    "BlockShuffleOrder",
    "EpochOrder",
    "FeistelPermutation",
    "GlobalShuffleOrder",
    "Interval",
    "SequentialOrder",
    "Shuffle",
    "intervals_length",
    "remaining_after",
    "shard_bounds",
    "slice_intervals",
    "split_intervals",
]

Interval = tuple[int, int]

#: Seeds and epochs key the order as 64-bit words: both must be below this, or
#: two different values would give the same order (and a state that cannot be read back).
KEY_LIMIT = 1 << 64
_MASK64 = KEY_LIMIT - 1
_ROUNDS = 4  # at least
_ROUND_BITS = 48  # rounds * domain bits, at least


class Shuffle(enum.Enum):
    """How an epoch's order is drawn."""

    NONE = "none"
    """Records in index order, every epoch."""
    GLOBAL = "global"
    """A uniform-looking permutation of all records, new every epoch."""
    BLOCK = "block"
    """Chunk order permuted, records mixed within a window of chunks (object stores)."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _derive_key(*parts: int) -> int:
    key = 0x6A09E667F3BCC908
    for part in parts:
        key = _splitmix64(key ^ (part & _MASK64))
    return key


class FeistelPermutation:
    """A keyed bijection on ``[0, n)``, evaluated on any array of inputs.

    An unbalanced Feistel network over ``2**bits``, the smallest power of two
    holding ``n`` (at least 4): the halves have ``bits // 2`` and ``bits -
    bits // 2`` bits and swap sizes every round. Inputs that land outside
    ``[0, n)`` are encrypted again (cycle walking), fewer than two rounds on
    average since the domain is less than ``2 n``.

    ``reference`` is the definition in numpy; calls run the same rounds in the
    compiled ``yogastore._gather.feistel`` when it is built (identical images,
    checked by the tests).
    """

    def __init__(self, n: int, key: int) -> None:
        if not 0 <= n < 1 << 63:
            raise ValueError(f"permutation size must be in [0, 2**63), got {n}")
        self.n = n
        bits = max(2, (max(n, 1) - 1).bit_length())
        self._high = bits // 2  # bits of the left half at the start
        self._low = bits - self._high
        # Domains up to 2**32 are evaluated in 32-bit words (twice the numpy
        # throughput), larger ones in 64-bit words.
        wide = bits > 32
        self._dtype = np.dtype(np.uint64 if wide else np.uint32)
        self._word = 64 if wide else 32
        self._mul1 = self._dtype.type(0x9E3779B97F4A7C15 if wide else 0x9E3779B1)
        self._mul2 = self._dtype.type(0xBF58476D1CE4E5B9 if wide else 0x85EBCA6B)
        word_mask = (1 << self._word) - 1
        # Small domains need more rounds before the permutations a key picks
        # look uniform (halves of a few bits mix little per round).
        rounds = max(_ROUNDS, -(-_ROUND_BITS // bits))
        self._keys = [self._dtype.type(_derive_key(key, i) & word_mask) for i in range(rounds)]
        self._key_words = np.array(self._keys, dtype=np.uint64)

    def _encrypt(self, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        t = self._dtype.type
        left_bits, right_bits = self._high, self._low
        left = values >> t(right_bits)
        right = values & t((1 << right_bits) - 1)
        tmp = np.empty_like(values)
        mix = np.empty_like(values)
        half = t(self._word // 2)
        for key in self._keys:
            # Round function: a keyed multiply-xorshift hash of the right
            # half; its top ``left_bits`` bits are xored into the left.
            np.multiply(right, self._mul1, out=tmp)
            tmp ^= key
            np.right_shift(tmp, half, out=mix)
            tmp ^= mix
            tmp *= self._mul2
            np.right_shift(tmp, t(self._word - left_bits), out=tmp)
            left ^= tmp
            left, right = right, left
            left_bits, right_bits = right_bits, left_bits
        left <<= t(right_bits)
        left |= right
        return left

    def __call__(self, values: npt.ArrayLike) -> IntArray:
        """Return the images of ``values`` (each in ``[0, n)``)."""
        x = np.asarray(values, dtype=np.int64)
        if self.n <= 1 or _gather is None:
            return self.reference(x)
        flat = np.ascontiguousarray(x.reshape(-1))
        images = np.empty_like(flat)
        wide = self._word == 64
        _gather.feistel(images, flat, self._key_words, self._high, self._low, wide, self.n)
        return images.reshape(x.shape)

    def reference(self, values: npt.ArrayLike) -> IntArray:
        """Return the images of ``values`` computed with numpy (the definition)."""
        x = np.asarray(values, dtype=np.int64)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.n):
            raise ValueError(f"permutation inputs must lie in [0, {self.n})")
        if self.n <= 1:
            return x.copy()
        out = self._encrypt(x.reshape(-1).astype(self._dtype))
        if self.n != 1 << (self._high + self._low):  # else the whole domain: nothing to walk
            limit = self._dtype.type(self.n)
            outside = np.flatnonzero(out >= limit)
            while outside.size:
                out[outside] = self._encrypt(out[outside])
                outside = outside[out[outside] >= limit]
        return out.astype(np.int64).reshape(x.shape)


class EpochOrder:
    """Maps positions of one epoch to record indices."""

    num_records: int

    def records(self, positions: npt.ArrayLike) -> IntArray:
        """Return the record index at each position."""
        raise NotImplementedError


class SequentialOrder(EpochOrder):
    """Position ``p`` is record ``p``."""

    def __init__(self, num_records: int) -> None:
        self.num_records = num_records

    def records(self, positions: npt.ArrayLike) -> IntArray:
        return np.asarray(positions, dtype=np.int64).copy()


class GlobalShuffleOrder(EpochOrder):
    """A permutation of all records keyed by ``(seed, epoch)``."""

    def __init__(self, num_records: int, seed: int, epoch: int) -> None:
        self.num_records = num_records
        self._perm = FeistelPermutation(num_records, _derive_key(seed, epoch, 1))

    def records(self, positions: npt.ArrayLike) -> IntArray:
        return self._perm(positions)


class BlockShuffleOrder(EpochOrder):
    """Chunks in a permuted order; records mixed within windows of chunks.

    Args:
        chunk_sizes: records per chunk, in chunk order.
        seed: shuffle seed.
        epoch: epoch number.
        window: number of consecutive (permuted) chunks whose records are mixed.
    """

    def __init__(self, chunk_sizes: Sequence[int], seed: int, epoch: int, window: int) -> None:
        if window < 1:
            raise ValueError(f"block window must be >= 1, got {window}")
        sizes = np.asarray(chunk_sizes, dtype=np.int64)
        self.num_records = int(sizes.sum())
        first = np.concatenate([[0], np.cumsum(sizes)])[:-1]
        num_chunks = len(sizes)
        self._chunk_perm = FeistelPermutation(num_chunks, _derive_key(seed, epoch, 2))(
            np.arange(num_chunks)
        )
        self._first = first[self._chunk_perm]
        self._starts = np.concatenate([[0], np.cumsum(sizes[self._chunk_perm])])
        self._window = window
        self._seed = seed
        self._epoch = epoch

    def records(self, positions: npt.ArrayLike) -> IntArray:
        pos = np.asarray(positions, dtype=np.int64)
        out = np.empty_like(pos)
        if pos.size == 0:
            return out
        window_starts = self._starts[:: self._window]
        win = np.searchsorted(window_starts, pos, side="right") - 1
        for w in np.unique(win):
            sel = win == w
            lo = int(window_starts[w])
            hi = int(self._starts[min((int(w) + 1) * self._window, len(self._starts) - 1)])
            perm = FeistelPermutation(hi - lo, _derive_key(self._seed, self._epoch, 3, int(w)))
            mixed = lo + perm(pos[sel] - lo)
            j = np.searchsorted(self._starts, mixed, side="right") - 1
            out[sel] = self._first[j] + (mixed - self._starts[j])
        return out


def intervals_length(intervals: Sequence[Interval]) -> int:
    """Return the number of positions in ``intervals``."""
    return sum(b - a for a, b in intervals)


def slice_intervals(intervals: Sequence[Interval], lo: int, hi: int) -> list[Interval]:
    """Return the intervals holding items ``[lo, hi)`` of the concatenation."""
    out: list[Interval] = []
    offset = 0
    for a, b in intervals:
        n = b - a
        s, e = max(lo - offset, 0), min(hi - offset, n)
        if s < e:
            out.append((a + s, a + e))
        offset += n
        if offset >= hi:
            break
    return out


def shard_bounds(total: int, num_shards: int, rank: int, drop_remainder: bool) -> Interval:
    """Return rank ``rank``'s ``[lo, hi)`` slice of ``total`` items.

    Sizes differ by at most one; with ``drop_remainder`` all are ``total //
    num_shards`` and the last ``total % num_shards`` items belong to no rank.
    """
    if drop_remainder:
        q = total // num_shards
        return rank * q, (rank + 1) * q
    return rank * total // num_shards, (rank + 1) * total // num_shards


def split_intervals(
    intervals: Sequence[Interval], num_shards: int, rank: int, drop_remainder: bool
) -> list[Interval]:
    """Return rank ``rank``'s contiguous share of ``intervals``."""
    lo, hi = shard_bounds(intervals_length(intervals), num_shards, rank, drop_remainder)
    return slice_intervals(intervals, lo, hi)


def remaining_after(
    intervals: Sequence[Interval], num_shards: int, drop_remainder: bool, consumed: int
) -> list[Interval]:
    """Return what is left of ``intervals`` after each rank consumed ``consumed`` items.

    Ranks whose span is shorter than ``consumed`` are simply finished.
    Adjacent pieces are merged.
    """
    total = intervals_length(intervals)
    out: list[Interval] = []
    for rank in range(num_shards):
        lo, hi = shard_bounds(total, num_shards, rank, drop_remainder)
        for a, b in slice_intervals(intervals, min(lo + consumed, hi), hi):
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return out
