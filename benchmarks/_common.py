"""Shared pieces of the read benchmarks: cases, records, checks, tf.data pipelines.

TensorFlow is imported inside the functions that need it so that the YogaDL
worker (another virtual environment) and the table code stay light.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

#: The two features every TFRecord example holds.
FEATURES = ("x", "y")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark case: N records of a fixed uint8 shape (or, for ``kind`` images, text
    and jpeg, of variable length, ``mean_bytes`` on average) plus an int64 label."""

    name: str
    records: int
    shape: tuple[int, ...]
    kind: str = "fixed"
    mean_bytes: int = 0
    batch_size: int = 256
    num_shards: int = 4
    shard_rank: int = 0
    seed: int = 0
    read_bytes: int = 1024 << 20
    max_records: int = 600_000
    max_seconds: float = 2.5
    repeats: int = 3

    @property
    def record_bytes(self) -> int:
        return math.prod(self.shape) if self.kind == "fixed" else self.mean_bytes

    @property
    def payload_bytes(self) -> int:
        """Bytes of one record as delivered: the data plus its 8-byte label."""
        return self.record_bytes + 8

    def passes(self, per_pass: int, seconds_per_pass: float) -> int:
        """Return how many passes of ``per_pass`` records one timed run reads.

        Enough for ``read_bytes`` (at most ``max_records``), but no more than
        fit in ``max_seconds`` at the speed of an untimed pass that took
        ``seconds_per_pass``; always at least one.
        """
        want = min(self.read_bytes // self.payload_bytes, self.max_records)
        passes = math.ceil(want / max(per_pass, 1))
        if seconds_per_pass > 0:
            passes = min(passes, int(self.max_seconds / seconds_per_pass))
        return max(1, passes)

    def rank_span(self) -> int:
        """Records rank ``shard_rank`` reads per epoch (order module's contiguous spans)."""
        n, k, r = self.records, self.num_shards, self.shard_rank
        return (r + 1) * n // k - r * n // k

    def describe(self) -> str:
        what = list(self.shape) if self.kind == "fixed" else f"{self.kind}, mean"
        return (
            f"{self.records} records x {self.record_bytes} B {what} + int64 label, "
            f"batch {self.batch_size}, rank {self.shard_rank} of {self.num_shards}"
        )


def make_records(case: Case) -> np.ndarray:
    """Return the case's record data ``[N, *shape]`` (random bytes, reproducible)."""
    rng = np.random.default_rng(case.seed + 1)
    return rng.integers(0, 256, size=(case.records, *case.shape), dtype=np.uint8)


# Checks -------------------------------------------------------------------------------


class Tally:
    """What a timed run read: record count and sum of labels (cheap, per batch)."""

    def __init__(self) -> None:
        self.records = 0
        self.label_sum = 0

    def add(self, labels: np.ndarray) -> None:
        self.records += len(labels)
        self.label_sum += int(labels.sum())

    def check(self, expected_labels: np.ndarray) -> dict[str, Any]:
        ok = self.records == len(expected_labels) and self.label_sum == int(expected_labels.sum())
        return {
            "records": self.records,
            "expected_records": len(expected_labels),
            "label_sum": self.label_sum,
            "expected_label_sum": int(expected_labels.sum()),
            "ok": ok,
        }


class Verifier:
    """Checks every record read against the source data (one untimed pass)."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.row_sums = data.reshape(len(data), -1).sum(axis=1, dtype=np.uint64)
        self.labels: list[np.ndarray] = []
        self.byte_sum = 0
        self.wrong = 0

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        y = np.asarray(y, dtype=np.int64).reshape(-1)
        x = np.asarray(x).reshape(len(y), *self.data.shape[1:])
        self.labels.append(y)
        self.byte_sum += int(x.sum(dtype=np.uint64))
        if y.size and (y.min() < 0 or y.max() >= len(self.data)):
            self.wrong += len(y)
            return
        self.wrong += int(np.count_nonzero(np.any((x != self.data[y]).reshape(len(y), -1), axis=1)))

    def result(self, expected_labels: np.ndarray) -> dict[str, Any]:
        got = np.sort(np.concatenate(self.labels)) if self.labels else np.empty(0, np.int64)
        want = np.sort(np.asarray(expected_labels, dtype=np.int64))
        labels_match = bool(np.array_equal(got, want))
        expected_sum = int(self.row_sums[want].sum(dtype=np.uint64)) if want.size else 0
        return {
            "records": int(got.size),
            "expected_records": int(want.size),
            "labels_match": labels_match,
            "wrong_records": self.wrong,
            "byte_sum": self.byte_sum,
            "expected_byte_sum": expected_sum,
            "ok": labels_match and self.wrong == 0 and self.byte_sum == expected_sum,
        }


# Measuring ----------------------------------------------------------------------------


def io_read_chars() -> int | None:
    """Return this process's ``rchar`` (bytes through read syscalls), if known."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return None


def _status_mib(field: str) -> float | None:
    """Return a ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``) in MiB, or ``None``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mib() -> float:
    """Return the current resident set size in MiB."""
    now = _status_mib("VmRSS")
    return now if now is not None else peak_rss_mib()


def in_base_pages(a: np.ndarray) -> np.ndarray:
    """Return a copy of ``a`` in anonymous memory mapped in base pages (4 KiB on x86-64).

    numpy asks for transparent huge pages for arrays of 4 MiB or more
    (``MADV_HUGEPAGE``), so an in-memory ceiling gathers through few TLB entries.
    The copy is made in a mapping marked ``MADV_NOHUGEPAGE`` before its first
    touch: the same gather from it shows what huge pages are worth to the ceiling.
    """
    import mmap

    buf = mmap.mmap(-1, max(a.nbytes, 1))
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        buf.madvise(advice)
    out = np.frombuffer(buf, dtype=a.dtype, count=a.size).reshape(a.shape)
    out[...] = a
    return out


def huge_mapped_kib(path_part: str) -> tuple[int, int]:
    """Return (resident, in 2 MiB pages), in KiB, of the file mappings naming ``path_part``.

    From ``/proc/self/smaps`` (``Rss`` and ``FilePmdMapped``); ``(0, 0)`` where it
    cannot be read. A file's pages are mapped in 2 MiB pages only where the page
    cache holds them in 2 MiB folios, which is up to the kernel and how the file
    was written.
    """
    rss = pmd = 0
    mine = False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if "-" in parts[0] and not parts[0].endswith(":"):
            mine = len(parts) >= 6 and path_part in parts[-1]
        elif mine and parts[0] == "Rss:":
            rss += int(parts[1])
        elif mine and parts[0] == "FilePmdMapped:":
            pmd += int(parts[1])
    return rss, pmd


def peak_rss_mib() -> float:
    """Return this process's peak resident set size in MiB.

    ``VmHWM``: a worker started by fork and exec from a large benchmark process
    would report that process's size at the fork as its own ``ru_maxrss``.
    """
    peak = _status_mib("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def repeat_runs(run: Callable[[], Tally], repeats: int, expected: np.ndarray) -> dict[str, Any]:
    """Time ``run`` ``repeats`` times; every run must read exactly ``expected``."""
    rates, seconds, checks, rchars = [], [], [], []
    for _ in range(repeats):
        before = io_read_chars()
        start = time.perf_counter()
        tally = run()
        elapsed = time.perf_counter() - start
        after = io_read_chars()
        check = tally.check(expected)
        checks.append(check)
        seconds.append(elapsed)
        rates.append(tally.records / elapsed if elapsed > 0 else 0.0)
        if before is not None and after is not None:
            rchars.append(after - before)
    order = sorted(range(len(rates)), key=rates.__getitem__)
    mid = order[len(order) // 2]
    return {
        "records_per_run": checks[0]["records"],
        "seconds": seconds,
        "rates": rates,
        "rate": rates[mid],
        "best_rate": max(rates),
        "read_syscall_bytes": rchars[mid] if rchars else None,
        "runs_ok": all(c["ok"] for c in checks),
        "run_check": checks[mid],
    }


def plan_passes(case: Case, per_pass: int, run: Callable[[int], Any]) -> int:
    """Return the passes of one timed run, from an untimed probe of up to three passes.

    The probe runs after the method's checking pass, so it is warm; three
    passes in one pipeline keep its start-up cost from dominating the estimate.
    """
    probe = min(case.passes(per_pass, 0.0), 3)
    return case.passes(per_pass, timed(lambda: run(probe)) / probe)


def timed(fn: Callable[[], Any]) -> float:
    """Return the seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def consume(batches: Iterable[Any], label: Callable[[Any], np.ndarray]) -> Tally:
    """Read every batch, keeping only the record count and label sum."""
    tally = Tally()
    for batch in batches:
        tally.add(label(batch))
    return tally


def graph_consume(ds: Any) -> Tally:
    """Read every batch inside TensorFlow (``Dataset.reduce``): no Python call per batch.

    How ``Model.fit`` and a ``tf.function`` training loop take their batches; the Python
    loop of ``consume`` adds an eager call and the conversion of every batch to Python
    objects, which bounds fast readers at the same rate whatever they read.
    """
    import tensorflow as tf

    def add(acc: Any, batch: Any) -> Any:
        y = batch["y"]
        return acc[0] + tf.size(y, out_type=tf.int64), acc[1] + tf.reduce_sum(y)

    count, total = ds.reduce((np.int64(0), np.int64(0)), add)
    tally = Tally()
    tally.records = int(count)
    tally.label_sum = int(total)
    return tally


# tf.data pipelines over the TFRecord file -----------------------------------------


def write_tfrecord(path: Path, data: np.ndarray) -> None:
    """Write one ``tf.train.Example`` per record: raw bytes ``x`` and label ``y``."""
    import tensorflow as tf

    feature, train = tf.train.Feature, tf.train
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(len(data)):
            example = train.Example(
                features=train.Features(
                    feature={
                        "x": feature(bytes_list=train.BytesList(value=[data[i].tobytes()])),
                        "y": feature(int64_list=train.Int64List(value=[i])),
                    }
                )
            )
            writer.write(example.SerializeToString())


def _feature_spec() -> dict[str, Any]:
    import tensorflow as tf

    return {
        "x": tf.io.FixedLenFeature([], tf.string),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }


def steady(ds: Any) -> Any:
    """Return ``ds`` with the tf.data autotuner off, as ``Stream.to_tf_dataset`` sets it.

    TensorFlow's own pipelines get the same options as the stream's, so the
    comparison is like for like: on 2 cores the autotuner made runs of one
    pipeline alternate between two speeds; without it (a) is as fast or faster.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def tfrecord_batches(
    path: Path,
    case: Case,
    passes: int,
    shard: bool = False,
) -> Any:
    """TFRecordDataset read sequentially, batched, parsed and decoded to uint8 per batch."""
    import tensorflow as tf

    spec = _feature_spec()
    shape = list(case.shape)

    def parse(serialized: Any) -> dict[str, Any]:
        parsed = tf.io.parse_example(serialized, spec)
        x = tf.reshape(tf.io.decode_raw(parsed["x"], tf.uint8), [-1, *shape])
        return {"x": x, "y": parsed["y"]}

    ds = tf.data.TFRecordDataset(str(path), buffer_size=4 << 20)
    if shard:
        ds = ds.shard(case.num_shards, case.shard_rank)
    ds = ds.repeat(passes).batch(case.batch_size)
    return steady(ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE))


def tfrecord_source(path: Path, case: Case) -> Any:
    """The source dataset every cache is built from: one parsed element per record."""
    import tensorflow as tf

    spec = _feature_spec()
    shape = list(case.shape)

    def parse(serialized: Any) -> dict[str, Any]:
        parsed = tf.io.parse_single_example(serialized, spec)
        return {"x": tf.reshape(tf.io.decode_raw(parsed["x"], tf.uint8), shape), "y": parsed["y"]}

    return steady(
        tf.data.TFRecordDataset(str(path)).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    )


def tf_labels(batch: Any) -> np.ndarray:
    return np.asarray(batch["y"])


def verify_tf(batches: Iterable[Any], verifier: Verifier) -> None:
    for batch in batches:
        verifier.add(np.asarray(batch["x"]), np.asarray(batch["y"]))


def stream_indices(ref: Any, case: Case, epochs: int) -> np.ndarray:
    """Return the records rank ``shard_rank``'s stream reads in ``epochs`` epochs."""
    stream = ref.stream(
        shard_rank=case.shard_rank,
        num_shards=case.num_shards,
        shuffle=True,
        seed=case.seed,
        num_epochs=epochs,
    )
    pieces = list(stream.record_indices(case.batch_size))
    return np.concatenate(pieces) if pieces else np.empty(0, np.int64)


def index_batches(ref: Any, case: Case, epochs: int) -> Iterator[np.ndarray]:
    stream = ref.stream(
        shard_rank=case.shard_rank,
        num_shards=case.num_shards,
        shuffle=True,
        seed=case.seed,
        num_epochs=epochs,
    )
    return stream.record_indices(case.batch_size)


def quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
