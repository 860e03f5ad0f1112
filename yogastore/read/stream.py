"""A rank's stream of records: order + reader + assembly, with prefetch.

``Stream`` is what ``DatasetRef.stream`` and ``DatasetRef.resume`` return. It
is a finite (or, with ``num_epochs=None``, endless) sequence of records: the
rank's span of each epoch's global order, epoch after epoch. Iterating yields
numpy elements; ``batches`` yields numpy batches (the fast path);
``to_tf_dataset`` hands the same batches to ``tf.data``; ``state`` says where
the stream is after ``k`` records so it can be resumed exactly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from storage_backends.errors import InvalidArgumentError
from yogastore import boundedjson
from yogastore.arrays import IntArray
from yogastore.checks import check_int, is_int
from yogastore.format import StringFormat
from yogastore.read import waits
from yogastore.read.assemble import batch_components, batch_length, element_components, slice_batch
from yogastore.read.assignment import Assignment, StaticAssignment
from yogastore.read.order import (
    KEY_LIMIT,
    BlockShuffleOrder,
    EpochOrder,
    GlobalShuffleOrder,
    Interval,
    SequentialOrder,
    Shuffle,
    intervals_length,
    slice_intervals,
)
from yogastore.spec import STRING, Kind, Schema, row_bytes

if TYPE_CHECKING:
    from yogastore.read.reader import ChunkSource, ReadStats
    from yogastore.store import DatasetRef

__all__ = ["Stream", "StreamState", "fixed_numeric", "splittable"]

# Version 2: the shuffled order is the unbalanced Feistel network of order.py;
# version-1 states named positions of another permutation.
_STATE_VERSION = 2
_INTERNAL_BATCH = 256
_REMOTE_PREFETCH = 2  # batches read ahead by default from object stores
_GATHER_BYTES = 2 << 20  # small fixed-shape batches are gathered this many at once
_MAX_GATHER_GROUP = 64
_ORDER_PIECE = 16384  # positions mapped to records per call of the epoch order


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StreamState:
    """Where an epoch stands: which positions of it are not consumed yet.

    Small and JSON-serialisable; take it with ``Stream.state(consumed=k)`` and
    resume with ``DatasetRef.resume(state, shard_rank, num_shards)``, with any
    number of shards.
    """

    dataset: str
    num_records: int
    seed: int
    epoch: int
    shuffle: Shuffle
    block_window: int
    remaining: tuple[Interval, ...]

    def __post_init__(self) -> None:
        last = 0
        for a, b in self.remaining:
            if not (last <= a < b <= self.num_records):
                raise InvalidArgumentError(
                    f"resume state intervals {self.remaining} are not sorted, disjoint "
                    f"intervals within [0, {self.num_records})"
                )
            last = b
        if self.epoch < 0 or self.block_window < 1 or self.num_records < 0:
            raise InvalidArgumentError(f"resume state has invalid numbers: {self}")
        check_int("resume state seed", self.seed, 0, KEY_LIMIT - 1)
        check_int("resume state epoch", self.epoch, 0, KEY_LIMIT - 1)

    @property
    def remaining_records(self) -> int:
        """How many records of the epoch are still to be read (by all ranks)."""
        return intervals_length(self.remaining)

    def to_json(self) -> str:
        """Return the state as a JSON string."""
        return json.dumps(
            {
                "yogastore_state": _STATE_VERSION,
                "dataset": self.dataset,
                "num_records": self.num_records,
                "seed": self.seed,
                "epoch": self.epoch,
                "shuffle": self.shuffle.value,
                "block_window": self.block_window,
                "remaining": [list(i) for i in self.remaining],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> StreamState:
        """Parse a state written by ``to_json``.

        Raises:
            InvalidArgumentError: the text is not a valid state.
        """
        try:
            doc = boundedjson.loads(text, "stream state", InvalidArgumentError)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            version = doc.get("yogastore_state")
            if version == 1:
                raise ValueError(
                    "state version 1 was written by an earlier yogastore whose shuffled "
                    "order differs; it cannot resume at the exact next record"
                )
            if version != _STATE_VERSION:
                raise ValueError("not a yogastore stream state of a known version")
            ints = [doc[k] for k in ("num_records", "seed", "epoch", "block_window")]
            pairs = [tuple(p) for p in doc["remaining"]]
            if not all(
                is_int(v, allow_numpy=False) for v in [*ints, *itertools.chain.from_iterable(pairs)]
            ) or any(len(p) != 2 for p in pairs):
                raise ValueError("numbers must be integers and intervals pairs")
            return cls(
                dataset=str(doc["dataset"]),
                num_records=doc["num_records"],
                seed=doc["seed"],
                epoch=doc["epoch"],
                shuffle=Shuffle(doc["shuffle"]),
                block_window=doc["block_window"],
                remaining=tuple((int(a), int(b)) for a, b in pairs),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise InvalidArgumentError(f"invalid stream state {text!r:.200}: {err}") from err


def fixed_numeric(schema: Schema) -> bool:
    """Whether every component is a fixed-shape tensor of numbers (no strings).

    Such batches are plain arrays that can be grouped and sliced; strings
    take the path that hands them over as buffers.
    """
    return bool(schema.components) and all(c.fixed and c.dtype != STRING for c in schema.components)


def splittable(schema: Schema) -> bool:
    """Whether batches of ``schema`` split into smaller batches by slicing.

    True when every component is a fixed-shape tensor (strings too) or a ragged
    component whose records have ragged rank 0 (a batch then has one row splits array).
    """
    return bool(schema.components) and all(
        c.fixed or (c.kind is Kind.RAGGED and c.ragged_rank == 0) for c in schema.components
    )


class Stream:
    """One rank's records, epoch after epoch. Build it with ``DatasetRef.stream``."""

    def __init__(
        self,
        ref: DatasetRef,
        *,
        shard_rank: int,
        num_shards: int,
        shuffle: Shuffle,
        seed: int,
        epoch: int,
        start_offset: int,
        drop_remainder: bool,
        num_epochs: int | None,
        block_window: int,
        first_intervals: tuple[Interval, ...] | None = None,
        prefetch: int | None = None,
        assignment: Assignment | None = None,
    ) -> None:
        self.num_shards = check_int("num_shards", num_shards, 1)
        self.shard_rank = check_int("shard_rank", shard_rank, 0)
        if self.shard_rank >= self.num_shards:
            raise InvalidArgumentError(f"shard_rank {shard_rank} must be < num_shards {num_shards}")
        # Seeds and epochs key the order modulo 2**64: larger ones would alias.
        self.seed = check_int("seed", seed, 0, KEY_LIMIT - 1)
        self.epoch = check_int("epoch", epoch, 0, KEY_LIMIT - 1)
        self.start_offset = check_int("start_offset", start_offset, 0)
        self.num_epochs = None if num_epochs is None else check_int("num_epochs", num_epochs, 0)
        self.block_window = check_int("block_window", block_window, 1)
        self.prefetch = None if prefetch is None else check_int("prefetch", prefetch, 0)
        if not isinstance(shuffle, Shuffle):
            raise InvalidArgumentError(f"shuffle must be a Shuffle, got {shuffle!r}")
        self.shuffle = shuffle
        self.drop_remainder = bool(drop_remainder)
        self.ref = ref
        self.num_records = ref.num_records
        self.static: StaticAssignment | None = None
        if assignment is None:
            assignment = self.static = StaticAssignment(
                num_records=self.num_records,
                shard_rank=self.shard_rank,
                num_shards=self.num_shards,
                drop_remainder=self.drop_remainder,
                num_epochs=self.num_epochs,
                start_offset=self.start_offset,
                first_intervals=first_intervals,
            )
        self.assignment = assignment
        self._source: ChunkSource | None = None
        self._readers = 0  # iterations of a tf.data dataset of this stream under way
        self._readers_lock = threading.Lock()
        self._stats: ReadStats | None = None  # the counters of a released source

    def __repr__(self) -> str:
        return (
            f"Stream({self.ref.dataset_id!r}/{self.ref.version!r}, rank {self.shard_rank} of "
            f"{self.num_shards}, shuffle={self.shuffle.name}, seed={self.seed}, "
            f"epoch={self.epoch}, offset={self.start_offset}, epochs={self.num_epochs})"
        )

    # Positions -------------------------------------------------------------------

    def order(self, epoch: int) -> EpochOrder:
        """Return the global order of ``epoch`` (positions -> record indices)."""
        if self.shuffle is Shuffle.NONE:
            return SequentialOrder(self.num_records)
        if self.shuffle is Shuffle.GLOBAL:
            return GlobalShuffleOrder(self.num_records, self.seed, epoch)
        sizes = [c.count for c in self.ref.manifest.chunks]
        return BlockShuffleOrder(sizes, self.seed, epoch, self.block_window)

    def __len__(self) -> int:
        length = self.assignment.length()
        if length is None:
            raise TypeError(
                "this stream's length is not known in advance (num_epochs=None, "
                "or records claimed from a work queue)"
            )
        return length

    def _record_pieces(self, piece: int = _INTERNAL_BATCH * 4) -> Iterator[IntArray]:
        """Yield this stream's record indices in order, in pieces of at most ``piece``."""
        for k, intervals in self.assignment.spans():
            order = self.order(self.epoch + k)
            length = intervals_length(intervals)
            for pos in range(0, length, piece):
                positions = np.concatenate(
                    [
                        np.arange(a, b, dtype=np.int64)
                        for a, b in slice_intervals(intervals, pos, min(pos + piece, length))
                    ]
                )
                yield order.records(positions)

    def record_indices(self, batch_size: int) -> Iterator[IntArray]:
        """Yield this rank's record indices in batches of ``batch_size`` (last may be short)."""
        batch_size = check_int("batch_size", batch_size, 1)
        # A shuffled order costs a fixed overhead per call (cycle walking), so
        # map positions many batches at a time and hand out slices.
        carry: IntArray | None = None
        for piece in self._record_pieces(max(_ORDER_PIECE, batch_size)):
            if carry is not None:
                piece = np.concatenate([carry, piece])
                carry = None
            full = len(piece) - len(piece) % batch_size
            for start in range(0, full, batch_size):
                yield piece[start : start + batch_size]
            if full < len(piece):
                carry = piece[full:]
        if carry is not None:
            yield carry

    # Reading ---------------------------------------------------------------------

    @property
    def source(self) -> ChunkSource:
        """The chunk source this stream reads through (created on first use)."""
        source = self._source
        if source is None:
            with self._readers_lock:  # two iterations starting at once make one source
                source = self._source
                if source is None:
                    source = self.ref.make_source()
                    if self._stats is not None:  # counters run on across released sources
                        source.stats = self._stats
                    self._source = source
        return source

    @contextlib.contextmanager
    def released_after(self) -> Iterator[None]:
        """Read within this block; when the last such block ends, release the chunk source.

        ``tf.data.Dataset.from_generator`` keeps its generators, and so their
        stream, as long as the process lives; a generator that reads within
        this block leaves behind no buffers, chunk views or read threads
        (an object store's) once its iteration ends, only the stream's
        arguments. The next iteration makes a new source; batches already
        handed over keep the memory they use.
        """
        with self._readers_lock:
            self._readers += 1
        try:
            yield
        finally:
            source = None
            with self._readers_lock:
                self._readers -= 1
                if self._readers == 0:
                    source, self._source = self._source, None
                    if source is not None:
                        self._stats = source.stats
            if source is not None:
                self.ref.release_source(source)

    def column_batches(self, batch_size: int, drop_remainder: bool = False) -> Iterator[Any]:
        """Yield ``(records, column batches)``, reading ahead on a background thread."""
        return self._column_batches(batch_size, drop_remainder)

    def strings_in_place(self) -> bool:
        """Whether batches can leave strings where they lie (local stores; see ``StringRanges``).

        Only through this class's own ``column_batches``: a subclass may give
        batches a meaning of their own.
        """
        return bool(getattr(self.source, "gathers_in_place", False)) and (
            type(self).column_batches is Stream.column_batches
        )

    def _column_batches(
        self, batch_size: int, drop_remainder: bool = False, in_place: bool = False
    ) -> Iterator[Any]:
        indices: Iterator[IntArray] = self.record_indices(batch_size)
        if drop_remainder:
            indices = (r for r in indices if len(r) == batch_size)
        return self._gathered(indices, in_place)

    def _batch_groups(
        self, batch_size: int, k: int, in_place: bool, drop_remainder: bool = False
    ) -> Iterator[Any]:
        """Yield ``(records, column batches)`` of 1, 2, 4, ... ``k`` batches (``k > 1``).

        With ``k == 1``, batch by batch through ``column_batches`` (strings in place
        through this class's own). ``k > 1`` only where ``column_batches`` is this
        class's own; ``drop_remainder`` then is the caller's to apply.
        """
        if k > 1:
            return self._gathered(self._ramped_indices(batch_size, k), in_place)
        if in_place:
            return self._column_batches(batch_size, drop_remainder, True)
        return self.column_batches(batch_size, drop_remainder)

    def _ramped_indices(self, batch_size: int, k: int) -> Iterator[IntArray]:
        """This rank's records in groups of 1, 2, 4, ... up to ``k`` batches.

        The first batch then costs one batch's gather (and its first
        checks), not a whole group's, and the groups soon reach full size.
        Groups are cut from the order's pieces directly (views, no batch by
        batch slicing); every group but the last holds whole batches.
        """
        want = 1
        if type(self).record_indices is not Stream.record_indices:  # a subclass's own order
            group: list[IntArray] = []
            for records in self.record_indices(batch_size):
                group.append(records)
                if len(group) == want:
                    yield np.concatenate(group)
                    group, want = [], min(k, want * 2)
            if group:
                yield np.concatenate(group)
            return
        carry: IntArray | None = None
        for piece in self._record_pieces(max(_ORDER_PIECE, batch_size * k)):
            if carry is not None:
                piece = np.concatenate([carry, piece])
                carry = None
            start = 0
            while len(piece) - start >= want * batch_size:
                stop = start + want * batch_size
                yield piece[start:stop]
                start = stop
                want = min(k, want * 2)
            if start < len(piece):
                carry = piece[start:]
        if carry is not None:
            yield carry

    def _gathered(self, indices: Iterator[IntArray], in_place: bool = False) -> Iterator[Any]:
        source = self.source
        gather = source.gather
        if in_place:  # sources that say so (gathers_in_place) take the keyword
            gather = functools.partial(source.gather, in_place=True)  # type: ignore[call-arg]
        plan = getattr(source, "plan", None)  # sources that look ahead (remote reads)
        if plan is not None:
            indices = plan(indices)
        depth = self.prefetch
        if depth is None:  # remote reads wait on the network; local ones only copy
            depth = _REMOTE_PREFETCH if plan is not None else 0
        consume = self.assignment.consume
        if depth == 0:
            for records in indices:
                yield records, gather(records)
                consume(len(records))
            return
        # Daemon workers, and waits that end at exit: see yogastore.read.waits.
        born = waits.current()
        pool = waits.DaemonPool(1, "yogastore", born)
        try:
            window: list[tuple[IntArray, concurrent.futures.Future[Any]]] = []
            for records in indices:
                window.append((records, pool.submit(gather, records)))
                if len(window) > depth:
                    records0, fut = window.pop(0)
                    yield records0, waits.result(fut, born)
                    consume(len(records0))
            for records0, fut in window:
                yield records0, waits.result(fut, born)
                consume(len(records0))
        finally:
            pool.shutdown(wait=True)  # queued gathers finish, as they always did

    def __iter__(self) -> Iterator[Any]:
        schema = self.ref.schema
        for _records, cols in self.column_batches(_INTERNAL_BATCH):
            for i in range(len(cols[0]) if cols else 0):
                yield schema.pack(element_components(schema, cols, i))

    def group_factor(self, batch_size: int, target_bytes: int, most: int) -> int:
        """Return how many batches to gather at once: about ``target_bytes``, at most ``most``.

        Only for schemas whose components all have a fixed shape and are not
        strings (1 otherwise),
        and only when ``column_batches`` is this class's own: a subclass may
        give batches of ``batch_size`` a meaning of their own (steps, padding).
        """
        schema = self.ref.schema
        if not fixed_numeric(schema):
            return 1
        if type(self).column_batches is not Stream.column_batches:
            return 1
        size = max(1, batch_size * row_bytes(schema))
        return max(1, min(most, round(target_bytes / size)))

    def batches(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        *,
        strings: StringFormat = StringFormat.OBJECTS,
    ) -> Iterator[Any]:
        """Yield numpy batches of ``batch_size`` records (the fast path).

        Fixed-shape components are stacked arrays ``[B, ...]``; ragged and
        sparse components are ``RaggedValue``/``SparseValue`` with a leading
        batch dimension, as ``tf.data.Dataset.batch`` would make them.
        Strings are numpy object arrays of ``bytes``, or with
        ``strings=StringFormat.BUFFERS`` a ``StringBuffer`` each: all bytes in
        one array plus offsets, without a Python object per string; with
        ``StringFormat.RANGES`` a ``StringRanges``: from a local store a
        read-only view of the stored bytes with each string's start and length,
        not copied at all (from others, the copied bytes).
        From local stores, small fixed-shape batches are gathered several at a
        time (about ``_GATHER_BYTES``) and handed out as views, which spreads
        the fixed cost of a gather over many batches.
        """
        batch_size = check_int("batch_size", batch_size, 1)
        if not isinstance(strings, StringFormat):
            raise InvalidArgumentError(f"strings must be a StringFormat, got {strings!r}")
        schema = self.ref.schema
        where = self.ref.manifest.where
        k = self.group_factor(batch_size, _GATHER_BYTES, _MAX_GATHER_GROUP)
        if k == 1 and splittable(schema) and type(self).column_batches is Stream.column_batches:
            # Strings and ragged rows: gather about _GATHER_BYTES at once and slice.
            per_record = self.ref.manifest.nbytes / max(1, self.num_records)
            if per_record > 0:  # an empty dataset has no chunks
                k = max(1, min(_MAX_GATHER_GROUP, round(_GATHER_BYTES / (per_record * batch_size))))
        if getattr(self.source, "plan", None) is not None:
            k = 1  # remote reads plan and cache per batch; they read ahead already
        # References to a batch are dropped before the next gather, so a
        # consumer that does not keep batches gets the same (cache-warm)
        # pooled buffer back every time.
        in_place = strings is StringFormat.RANGES and self.strings_in_place()
        groups = self._batch_groups(batch_size, k, in_place, drop_remainder)
        numeric = fixed_numeric(schema)  # every component a plain array: slice each
        if k == 1:
            for _records, cols in groups:
                batch = schema.pack(batch_components(schema, cols, where, strings))
                del cols
                yield batch
                del batch
            return
        for _records, cols in groups:
            arrays = batch_components(schema, cols, where, strings)
            del cols
            n = batch_length(schema, arrays)
            for start in range(0, n, batch_size):
                stop = min(start + batch_size, n)
                if drop_remainder and stop - start < batch_size:
                    return  # only the stream's last batch can be short
                if in_place and start:  # views of the file: it must not have shrunk since
                    self.source.check_mapped()  # type: ignore[attr-defined]
                if numeric:
                    batch = schema.pack([a[start:stop] for a in arrays])
                else:
                    batch = schema.pack(slice_batch(schema, arrays, start, stop))
                yield batch
                del batch
            del arrays

    def to_tf_dataset(
        self,
        batch_size: int | None = None,
        drop_remainder: bool = False,
        *,
        map_fn: Any = None,
        num_parallel_calls: int | None = None,
        batching: Any = None,
        padded_shapes: Any = None,
        padding_values: Any = None,
    ) -> Any:
        """Return a ``tf.data.Dataset`` of this stream (batched if ``batch_size``).

        Without ``map_fn`` its ``element_spec`` equals the cached dataset's
        (batched like ``Dataset.batch(batch_size, drop_remainder)``).

        Args:
            batch_size: records per batch (``None``: one record per element).
            drop_remainder: leave out a last, smaller batch.
            map_fn: a per-record function (e.g. decoding), applied before
                batching, in order; batch ``i`` holds the same records as
                without it.
            num_parallel_calls: records ``map_fn`` runs on at once (default
                ``tf.data.AUTOTUNE``).
            batching: a ``yogastore.train.tf_map.Batching``: ``DENSE`` (default),
                ``PADDED`` or ``RAGGED`` for variable-length dense components.
            padded_shapes: passed to ``padded_batch`` (``PADDED``).
            padding_values: passed to ``padded_batch`` (``PADDED``).

        Raises:
            InvalidArgumentError: an argument is invalid (checked here, not
                when the dataset is first iterated).
        """
        from yogastore.train import tf_map

        return tf_map.to_tf_dataset(
            self,
            batch_size,
            drop_remainder,
            map_fn=map_fn,
            num_parallel_calls=num_parallel_calls,
            batching=tf_map.Batching.DENSE if batching is None else batching,
            padded_shapes=padded_shapes,
            padding_values=padding_values,
        )

    def stats(self) -> dict[str, int]:
        """Return read counters: records, batches, bytes fetched, requests, cache hits."""
        source = self._source
        if source is not None:
            return source.stats.as_dict()
        return self._stats.as_dict() if self._stats is not None else {}

    # Position --------------------------------------------------------------------

    def state(self, consumed: int) -> StreamState:
        """Return where this stream stands after yielding ``consumed`` records.

        The state assumes every rank consumed the same number of records of
        the current epoch (true in synchronous training); it lists every
        position of the epoch no rank has consumed yet. Computed in constant
        time whatever ``consumed``.

        Raises:
            InvalidArgumentError: ``consumed`` is negative, more than the
                records a stream of ``num_epochs`` epochs yields (``len``), or so
                large that the epoch it reaches is beyond what a state can hold
                (2**64).
        """
        consumed = check_int("consumed", consumed, 0)
        length = self.assignment.length()  # None: endless, or claimed from a work queue
        if length is not None and consumed > length:
            # Counted on, the surplus would mark records of a later epoch consumed.
            raise InvalidArgumentError(
                f"consumed={consumed} is more than the {length} record"
                f"{'' if length == 1 else 's'} this stream yields "
                f"(rank {self.shard_rank} of {self.num_shards} of {self.ref.manifest.where}, "
                f"{self.num_epochs} epoch(s)); pass the records this rank consumed: steps * "
                "batch_size counts a short last batch as full"
            )
        if self.static is None:
            raise TypeError(
                f"{type(self.assignment).__name__} streams keep their position in their own state"
            )
        k, remaining = self.static.remaining(consumed)
        if self.epoch + k >= KEY_LIMIT:
            raise InvalidArgumentError(
                f"consumed={consumed} reaches epoch {self.epoch + k} of {self.ref.manifest.where} "
                f"({self.num_records} records per epoch), beyond the last epoch a state "
                "can hold (2**64 - 1); pass the records consumed by this rank"
            )
        return StreamState(
            dataset=self.ref.fingerprint,
            num_records=self.num_records,
            seed=self.seed,
            epoch=self.epoch + k,
            shuffle=self.shuffle,
            block_window=self.block_window,
            remaining=remaining,
        )
