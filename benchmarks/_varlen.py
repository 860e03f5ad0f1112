"""Variable-length cases: ``images`` (random bytes 2-24 KiB + label), ``text`` (strings of
50-500 B + ragged int32 token ids + label) and ``jpeg`` (real JPEGs, read and decoded).

Rows of one case, side by side on the same records:

(a)  ``TFRecordDataset`` sequential, batched, ``parse_example``;
(e3) ``TFRecordDataset.shard(4, 0).shuffle(10000)``, batched, parsed (what users do today);
(b)  ``stream(shuffle, 4 shards).to_tf_dataset(256)``;
(a'), (e3'), (b') the same three datasets consumed inside TensorFlow (``Dataset.reduce``,
     as ``Model.fit`` takes its batches) instead of by a Python loop;
(b1) (b) with the library's string kernel switched off (strings as arrays of ``bytes``);
(b2) (b) in a fresh process over its first epochs (0-3), each a new stream: epochs the
     process never read, so it maps their pages and hashes their blocks for the first time
     (``benchmarks/_first_epochs.py``); (b)'s timed runs re-read epochs it read before;
(b0) (b)'s batches prepared in memory beforehand and handed to tf.data by ``from_generator``
     as (b) hands them over (no read: the ceiling of that hand-over);
(z)  one batch prepared as tensors and repeated, consumed by the same Python loop (no read,
     no hand-over: the floor the loop itself sets for (a), (e3), (b) and (b0));
(b0'), (z') the same two consumed in the graph, as (a'), (e3') and (b');
(c)  ``Stream.batches(256, strings=StringFormat.BUFFERS)`` (bytes + offsets);
(c2) ``Stream.batches(256)`` (numpy object arrays of ``bytes``);
(c3) ``Stream.batches(256, strings=StringFormat.RANGES)`` (the stored bytes in place, no copy);
(d)  the same index batches gathered from the records held in memory as values + offsets,
     with the same compiled range copy (the ceiling of any copying reader);
(d4) (d) from copies of its arrays mapped in 4 KiB pages (``_common.in_base_pages``);
(p)  Grain ``MapDataset`` over an ArrayRecord file: shuffled, rank 0 of 4, batched;
(h1)/(h2) (``jpeg`` only) (b)/(e3) followed by ``tf.io.decode_jpeg`` + resize to 64x64;
(k1)/(k2) (``images``) (a)/(b) while another process keeps one core busy
(the last three in ``benchmarks/_peers.py``);
(g)/(g2)/(g3) cache build from the TFRecord file / from in-memory tensors against
     iterating the same source plus writing + syncing the same bytes to a new plain file
     (one such write next to each build, before it or after it every other pair).

Every row's untimed pass checks each record's bytes against the source; each timed run
checks its record count and label sum.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    Case,
    Tally,
    consume,
    graph_consume,
    in_base_pages,
    index_batches,
    plan_passes,
    repeat_runs,
    steady,
    stream_indices,
    tf_labels,
)

DATASET = "bench"
SHUFFLE_BUFFER = 10000
#: Builds, each beside a plain write, per build row (at least; always an even number, so that
#: as many builds go before their write as after it).
BUILD_PAIRS = 6


def build_pairs(repeats: int) -> int:
    """Pairs of a build row: ``BUILD_PAIRS`` or ``repeats``, rounded up to an even number."""
    n = max(repeats, BUILD_PAIRS)
    return n + n % 2


@dataclasses.dataclass
class Records:
    """The case's records in memory: bytes ``x`` (values + offsets), tokens, labels."""

    x: np.ndarray
    x_off: np.ndarray
    labels: np.ndarray
    tok: np.ndarray | None = None
    tok_off: np.ndarray | None = None

    def x_at(self, i: int) -> bytes:
        return self.x[self.x_off[i] : self.x_off[i + 1]].tobytes()

    def tok_at(self, i: int) -> np.ndarray:
        assert self.tok is not None and self.tok_off is not None
        return self.tok[self.tok_off[i] : self.tok_off[i + 1]]

    @property
    def nbytes(self) -> int:
        return int(
            self.x.nbytes + self.labels.nbytes + (0 if self.tok is None else self.tok.nbytes)
        )


def _aligned_bytes(data: bytes, align: int = 64) -> np.ndarray:
    """``data`` copied into a uint8 array starting on an ``align``-byte boundary."""
    raw = np.empty(len(data) + align, np.uint8)
    start = -int(raw.__array_interface__["data"][0]) % align
    out = raw[start : start + len(data)]
    out[:] = np.frombuffer(data, np.uint8)
    return out


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def make_records(case: Case) -> Records:
    """Return the records of a variable-length case (reproducible)."""
    rng = np.random.default_rng(case.seed + 1)
    n = case.records
    labels = np.arange(n, dtype=np.int64)
    if case.kind == "images":
        lengths = rng.integers(2 << 10, (24 << 10) + 1, size=n)
        x = np.frombuffer(rng.bytes(int(lengths.sum())), np.uint8)
        return Records(x, _offsets(lengths), labels)
    if case.kind == "text":
        lengths = rng.integers(50, 501, size=n)
        x = rng.integers(32, 127, size=int(lengths.sum()), dtype=np.uint8)
        counts = lengths // 5  # a token every five characters
        tok = rng.integers(0, 50_000, size=int(counts.sum()), dtype=np.int32)
        return Records(x, _offsets(lengths), labels, tok, _offsets(counts))
    if case.kind == "jpeg":
        return _jpegs(case, rng)
    raise ValueError(f"not a variable-length case: {case.kind}")


#: Distinct JPEGs encoded for the jpeg case; more records repeat them in turn (encoding one
#: costs about 1 ms, and a reader reads each record's own bytes whatever they hold).
JPEG_DISTINCT = 4000


def _jpegs(case: Case, rng: np.random.Generator) -> Records:
    import tensorflow as tf

    images = []
    for _ in range(min(case.records, JPEG_DISTINCT)):
        h, w = (int(v) for v in rng.integers(64, 129, size=2))
        # Smooth gradients plus noise: compresses like a photo, not like pure noise.
        base = np.linspace(0, 255, h * w * 3).reshape(h, w, 3)
        noise = rng.integers(0, 64, size=(h, w, 3))
        image = ((base + noise) % 256).astype(np.uint8)
        images.append(tf.io.encode_jpeg(image, quality=90).numpy())
    images = [images[i % len(images)] for i in range(case.records)]
    lengths = np.array([len(b) for b in images], np.int64)
    x = np.frombuffer(b"".join(images), np.uint8)
    return Records(x, _offsets(lengths), np.arange(case.records, dtype=np.int64))


# Checks -------------------------------------------------------------------------------


class Checker:
    """Checks every record of an untimed pass against the source, byte for byte."""

    def __init__(self, recs: Records) -> None:
        self.recs = recs
        self.labels: list[np.ndarray] = []
        self.wrong = 0
        self.byte_sum = 0

    def add(self, labels: Any, xs: Iterable[bytes], toks: Iterable[Any] | None = None) -> None:
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
        self.labels.append(y)
        tok_list = list(toks) if toks is not None else [None] * len(y)
        for i, x, t in zip(y.tolist(), xs, tok_list, strict=True):
            self.byte_sum += len(x)
            ok = 0 <= i < len(self.recs.labels) and x == self.recs.x_at(i)
            if ok and t is not None:
                ok = np.array_equal(np.asarray(t), self.recs.tok_at(i))
            self.wrong += int(not ok)

    def result(self, expected: np.ndarray) -> dict[str, Any]:
        got = np.sort(np.concatenate(self.labels)) if self.labels else np.empty(0, np.int64)
        want = np.sort(np.asarray(expected, dtype=np.int64))
        lengths = np.diff(self.recs.x_off)
        expected_sum = int(lengths[want].sum()) if want.size else 0
        ok = bool(np.array_equal(got, want)) and self.wrong == 0
        return {
            "records": int(got.size),
            "expected_records": int(want.size),
            "labels_match": bool(np.array_equal(got, want)),
            "wrong_records": self.wrong,
            "byte_sum": self.byte_sum,
            "expected_byte_sum": expected_sum,
            "ok": ok and self.byte_sum == expected_sum,
        }


def check_tf(batches: Iterable[Any], checker: Checker, text: bool) -> None:
    for batch in batches:
        toks = batch["tokens"].to_list() if text else None
        checker.add(batch["y"].numpy(), batch["x"].numpy().tolist(), toks)


# TFRecord ------------------------------------------------------------------------------


def write_tfrecord(path: Path, recs: Records) -> None:
    import tensorflow as tf

    feature, train = tf.train.Feature, tf.train
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(len(recs.labels)):
            fields = {
                "x": feature(bytes_list=train.BytesList(value=[recs.x_at(i)])),
                "y": feature(int64_list=train.Int64List(value=[i])),
            }
            if recs.tok is not None:
                fields["tokens"] = feature(int64_list=train.Int64List(value=recs.tok_at(i)))
            example = train.Example(features=train.Features(feature=fields))
            writer.write(example.SerializeToString())


def _parse_batch(text: bool) -> Callable[[Any], dict[str, Any]]:
    import tensorflow as tf

    spec: dict[str, Any] = {
        "x": tf.io.FixedLenFeature([], tf.string),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }
    if text:
        spec["tokens"] = tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)

    def parse(serialized: Any) -> dict[str, Any]:
        parsed = tf.io.parse_example(serialized, spec)
        if text:
            parsed["tokens"] = tf.cast(parsed["tokens"], tf.int32)
        return parsed

    return parse


def tfrecord_batches(path: Path, case: Case, passes: int, shard_shuffle: bool = False) -> Any:
    """(a) sequential, or (e3) ``shard(4, rank).shuffle(10000)``; batched, then parsed."""
    import tensorflow as tf

    ds = tf.data.TFRecordDataset(str(path), buffer_size=4 << 20)
    if shard_shuffle:
        ds = ds.shard(case.num_shards, case.shard_rank).shuffle(SHUFFLE_BUFFER, seed=case.seed)
    ds = ds.repeat(passes).batch(case.batch_size)
    ds = ds.map(_parse_batch(case.kind == "text"), num_parallel_calls=tf.data.AUTOTUNE)
    return steady(ds.prefetch(tf.data.AUTOTUNE))


def tfrecord_source(path: Path, case: Case) -> Any:
    """The source every cache is built from: one parsed element per record."""
    import tensorflow as tf

    ds = tf.data.TFRecordDataset(str(path)).batch(512)
    ds = ds.map(_parse_batch(case.kind == "text"), num_parallel_calls=tf.data.AUTOTUNE)
    return steady(ds.unbatch())


def memory_source(recs: Records) -> Any:
    """The same records as in-memory tensors (``from_tensor_slices``)."""
    import tensorflow as tf

    xs = tf.constant([recs.x_at(i) for i in range(len(recs.labels))], tf.string)
    elements: dict[str, Any] = {"x": xs, "y": recs.labels}
    if recs.tok is not None:
        elements["tokens"] = tf.RaggedTensor.from_row_splits(recs.tok, recs.tok_off)
    return steady(tf.data.Dataset.from_tensor_slices(elements))


# Rows ---------------------------------------------------------------------------------


@dataclasses.dataclass
class VarContext:
    case: Case
    work: Path
    recs: Records
    tfrecord: Path
    store: Any
    ref: Any


def _row(key: str, name: str, case: Case, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"key": key, "name": name, "error": None, "note": ""}
    row.update(fields)
    if row.get("rate") is not None:
        row["mb_per_s"] = row["rate"] * case.payload_bytes / 1e6
    return row


def _stream(ctx: VarContext, epochs: int) -> Any:
    case = ctx.case
    return ctx.ref.stream(
        shard_rank=case.shard_rank,
        num_shards=case.num_shards,
        shuffle=True,
        seed=case.seed,
        num_epochs=epochs,
    )


def _python_consume(ds: Any) -> Tally:
    return consume(ds, tf_labels)


def _timed_tf_rows(
    ctx: VarContext,
    key: str,
    name: str,
    make: Callable[[int], Any],
    per_pass: np.ndarray,
    expected: Callable[[int], np.ndarray],
    in_graph: bool = False,
    **extra: Any,
) -> list[dict[str, Any]]:
    """The row ``key``, consumed by a Python loop; with ``in_graph`` also the row ``key'``.

    ``key'`` times the same dataset consumed inside TensorFlow (``Dataset.reduce`` of the
    record count and label sum, as ``Model.fit`` takes batches inside its step function),
    with no Python call per batch. Both rows share the one untimed pass that checks every
    record's bytes.
    """
    case = ctx.case
    checker = Checker(ctx.recs)
    check_tf(make(1), checker, case.kind == "text")
    verified = checker.result(per_pass)
    rows = []
    consumers: list[tuple[str, Callable[[Any], Tally]]] = [("", _python_consume)]
    if in_graph:
        consumers.append(("'", graph_consume))
    for suffix, run in consumers:
        passes = plan_passes(case, len(per_pass), lambda p: run(make(p)))  # noqa: B023
        ds = make(passes)
        runs = repeat_runs(lambda: run(ds), case.repeats, expected(passes))  # noqa: B023
        fields = {**runs, "passes": passes, "verified": verified, **extra}
        if suffix:
            fields["note"] = "consumed in the graph (Dataset.reduce)"
        rows.append(_row(key + suffix, name, case, **fields))
    return rows


def tfrecord_rows(
    ctx: VarContext, prefix: str = "", shard_shuffle: bool = True, in_graph: bool = True
) -> list[dict[str, Any]]:
    """(a) and (e3), each also consumed in the graph ((a'), (e3')) with ``in_graph``."""
    case = ctx.case
    labels = ctx.recs.labels
    shard = labels[case.shard_rank :: case.num_shards]
    rows = _timed_tf_rows(
        ctx,
        f"{prefix}a",
        "TFRecordDataset sequential, batched, parse_example",
        lambda p: tfrecord_batches(ctx.tfrecord, case, p),
        labels,
        lambda p: np.tile(labels, p),
        in_graph,
    )
    if shard_shuffle:
        rows += _timed_tf_rows(
            ctx,
            f"{prefix}e3",
            f"TFRecordDataset.shard({case.num_shards}, {case.shard_rank})"
            f".shuffle({SHUFFLE_BUFFER}), batched, parsed",
            lambda p: tfrecord_batches(ctx.tfrecord, case, p, shard_shuffle=True),
            shard,
            lambda p: np.tile(shard, p),
            in_graph,
        )
    return rows


def stream_tf_rows(ctx: VarContext, key: str = "b", in_graph: bool = True) -> list[dict[str, Any]]:
    """(b), and with ``in_graph`` (b') (the same stream consumed in the graph)."""
    case = ctx.case
    return _timed_tf_rows(
        ctx,
        key,
        f"stream(shuffle, {case.num_shards} shards).to_tf_dataset({case.batch_size})",
        lambda p: _stream(ctx, p).to_tf_dataset(batch_size=case.batch_size),
        stream_indices(ctx.ref, case, 1),
        lambda p: stream_indices(ctx.ref, case, p),
        in_graph,
    )


def stream_tf_objects_row(ctx: VarContext) -> dict[str, Any]:
    """(b1) (b) with the string kernel switched off: strings cross as arrays of ``bytes``."""
    case = ctx.case

    def make(p: int) -> Any:
        before = os.environ.get("YOGASTORE_TF_OPS")
        os.environ["YOGASTORE_TF_OPS"] = "0"  # read when the dataset is made
        try:
            return _stream(ctx, p).to_tf_dataset(batch_size=case.batch_size)
        finally:
            if before is None:
                del os.environ["YOGASTORE_TF_OPS"]
            else:
                os.environ["YOGASTORE_TF_OPS"] = before

    return _timed_tf_rows(
        ctx,
        "b1",
        "(b) without the string kernel (YOGASTORE_TF_OPS=0)",
        make,
        stream_indices(ctx.ref, case, 1),
        lambda p: stream_indices(ctx.ref, case, p),
        note="strings as numpy arrays of bytes",
    )[0]


FIRST_EPOCHS = 4  # (b2): the epochs a fresh process reads


def first_epochs_row(ctx: VarContext) -> dict[str, Any]:
    """(b2): (b) in a fresh process over its first ``FIRST_EPOCHS`` epochs, each new to it.

    (b)'s timed runs re-read epochs the process has read (and so checked) before; a training
    process meets every epoch once, and a rank of a global shuffle keeps meeting blocks it has
    not hashed yet for several epochs. Each of ``repeats`` fresh processes
    (``benchmarks/_first_epochs.py``, page cache warm, as for every row) reads epochs
    ``0 .. FIRST_EPOCHS-1``, each a new stream and dataset; the rate is their records over
    the seconds of their iterations, the median process's, whose per-epoch rates the note
    gives. Every epoch's record count and label sum are checked (its bytes come through
    (b)'s path, which (b)'s untimed pass checks byte for byte).
    """
    import json
    import subprocess
    import sys

    case = ctx.case
    expected = []
    for epoch in range(FIRST_EPOCHS):
        stream = ctx.ref.stream(
            case.shard_rank,
            case.num_shards,
            shuffle=True,
            seed=case.seed,
            epoch=epoch,
            num_epochs=1,
        )
        pieces = list(stream.record_indices(case.batch_size))
        idx = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
        expected.append((len(idx), int(ctx.recs.labels[idx].sum())))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks._first_epochs",
        str(ctx.store.url),
        DATASET,
        "1",
        str(case.shard_rank),
        str(case.num_shards),
        str(case.seed),
        str(case.batch_size),
        str(FIRST_EPOCHS),
    ]
    root = Path(__file__).resolve().parent.parent
    runs = []
    for _ in range(case.repeats):
        done = subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, timeout=900, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"(b2) reader failed: {done.stderr[-2000:]}")
        epochs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        ok = [(e["records"], e["label_sum"]) for e in epochs] == expected
        records = sum(e["records"] for e in epochs)
        seconds = sum(e["seconds"] for e in epochs)
        runs.append((records / seconds if seconds > 0 else 0.0, ok, records, epochs))
    runs.sort(key=lambda r: r[0])
    rate, _ok, records, epochs = runs[len(runs) // 2]
    all_ok = all(r[1] for r in runs)
    per_epoch = ", ".join(
        f"{e['records'] / e['seconds']:,.0f}" if e["seconds"] > 0 else "-" for e in epochs
    )
    return _row(
        "b2",
        f"(b), fresh process, its first {FIRST_EPOCHS} epochs (new streams)",
        case,
        rate=rate,
        rates=[r[0] for r in runs],
        records_per_run=records,
        runs_ok=all_ok,
        verified={"ok": all_ok, "what": "each epoch's record count and label sum"},
        epoch_rates=[e["records"] / e["seconds"] if e["seconds"] > 0 else None for e in epochs],
        note=f"records/s per epoch: {per_epoch}",
    )


def generator_ceiling_row(ctx: VarContext) -> list[dict[str, Any]]:
    """(b0) and (b0'): the datasets of ``ceiling_dataset``, timed as (b) and (b')."""
    make, order, k = ceiling_dataset(ctx)
    return _timed_tf_rows(
        ctx,
        "b0",
        f"(b)'s batches prepared in memory, handed over as (b) does ({k} per call)",
        make,
        order,
        lambda p: np.tile(order, p),
        in_graph=True,
        note="ceiling of the from_generator hand-over (no read, no check)",
    )


def ceiling_dataset(ctx: VarContext) -> tuple[Callable[[int], Any], np.ndarray, int]:
    """(b)'s batches gathered beforehand, handed to tf.data by ``from_generator``.

    Returns the dataset of ``passes`` passes (a function of them), the records of one pass
    and the batches per Python call.

    No reading, no checks, the same hand-over as (b): ``k`` batches per Python call (about
    32 MiB, at most 256 batches), strings as one aligned byte buffer (wrapped by TensorFlow,
    not copied) plus starts and lengths, cut by the library's TensorFlow kernel in a
    parallel map (as ``[k, batch]`` arrays of ``bytes`` when the kernel is not built),
    ragged tokens as values and row splits of ``k * batch`` rows, regrouped in the graph,
    split by ``unbatch``. What any reader that hands Python-held bytes to tf.data this way
    pays, so (b0)/(a) bounds (b)/(a), and (b0'), consumed in the graph, bounds (b').
    """
    import tensorflow as tf

    from yogastore.train import tf_ops
    from yogastore.train.tf_read import _VAR_MIN_DEPTH, _finish, _var_group_factor

    case = ctx.case
    text = case.kind == "text"
    recs = ctx.recs
    kernel = tf_ops.load()
    size = case.batch_size
    order = stream_indices(ctx.ref, case, 1)
    per_record = ctx.ref.manifest.nbytes / max(1, ctx.ref.num_records)
    k = _var_group_factor(ctx.ref, size)
    groups: list[tuple[Any, ...]] = []
    for start in range(0, len(order), size * k):
        idx = order[start : start + size * k]
        full = len(idx) // size * size
        for part, rows in ((idx[:full], size), (idx[full:], len(idx) - full)):
            if not len(part):
                continue
            xs = [recs.x_at(int(i)) for i in part]
            x: tuple[Any, ...]
            if kernel is not None:
                offsets = _offsets(np.array([len(v) for v in xs], np.int64))
                x = (_aligned_bytes(b"".join(xs)), offsets[:-1], np.diff(offsets))
            else:
                x = (np.array(xs, dtype=object).reshape(-1, rows),)
            item: tuple[Any, ...] = (np.int64(rows), *x, recs.labels[part].reshape(-1, rows))
            if text:
                toks = [recs.tok_at(int(i)) for i in part]
                splits = _offsets(np.array([len(t) for t in toks], np.int64))
                item += (np.concatenate(toks) if toks else np.empty(0, np.int32), splits)
            groups.append(item)
    x_specs = (
        (tf.TensorSpec([None], tf.uint8), *[tf.TensorSpec([None], tf.int64)] * 2)
        if kernel is not None
        else (tf.TensorSpec([None, None], tf.string),)
    )
    specs: tuple[Any, ...] = (
        tf.TensorSpec([], tf.int64),
        *x_specs,
        tf.TensorSpec([None, None], tf.int64),
    )
    if text:
        specs += (tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int64))

    def regroup(rows: Any, *w: Any) -> dict[str, Any]:
        if kernel is not None:
            x, w = tf.reshape(tf_ops.gather_bytes(w[0], w[1], w[2]), [-1, rows]), w[3:]
        else:
            x, w = w[0], w[1:]
        out = {"x": x, "y": w[0]}
        if text:
            flat = tf.RaggedTensor.from_row_splits(w[1], w[2], validate=False)
            out["tokens"] = tf.RaggedTensor.from_uniform_row_length(flat, rows, validate=False)
        return out

    group_bytes = round(per_record * size * k)

    def make(passes: int) -> Any:
        def generate() -> Iterator[tuple[Any, ...]]:
            for _ in range(passes):
                yield from groups

        # As to_tf_dataset: the kernel's map in parallel, whole groups read ahead (autotuner
        # off), the groups cut into batches as they are taken.
        ds = tf.data.Dataset.from_generator(generate, output_signature=specs)
        if kernel is not None:
            ds = ds.map(regroup, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        ds = _finish(ds, group_bytes, min_depth=_VAR_MIN_DEPTH)
        if kernel is None:
            ds = ds.map(regroup)
        return ds.unbatch()

    return make, order, k


def stream_numpy_rows(ctx: VarContext) -> list[dict[str, Any]]:
    import yogastore
    from benchmarks._methods import map_pages_note

    case = ctx.case
    text = case.kind == "text"
    rows = []
    formats = (
        ("c", yogastore.StringFormat.BUFFERS),
        ("c2", yogastore.StringFormat.OBJECTS),
        ("c3", yogastore.StringFormat.RANGES),
    )
    for key, fmt in formats:
        checker = Checker(ctx.recs)
        for batch in _stream(ctx, 1).batches(case.batch_size, strings=fmt):
            x = batch["x"]
            xs = x.tolist() if fmt is yogastore.StringFormat.OBJECTS else x.to_numpy().tolist()
            toks = batch["tokens"].to_list() if text else None
            checker.add(batch["y"], xs, toks)

        def run(p: int, fmt: Any = fmt) -> Tally:
            return consume(_stream(ctx, p).batches(case.batch_size, strings=fmt), lambda b: b["y"])

        passes = plan_passes(case, case.rank_span(), run)
        runs = repeat_runs(
            lambda passes=passes, run=run: run(passes),
            case.repeats,
            stream_indices(ctx.ref, case, passes),
        )
        rows.append(
            _row(
                key,
                f"stream(shuffle, {case.num_shards} shards).batches({case.batch_size}, "
                f"strings={fmt.name})",
                case,
                **runs,
                passes=passes,
                verified=checker.result(stream_indices(ctx.ref, case, 1)),
                note=map_pages_note(ctx.work) if key == "c" else "",
            )
        )
    return rows


def memory_gather_row(ctx: VarContext, base_pages: bool = False) -> dict[str, Any]:
    """(d) the same index batches, gathered from memory with the same compiled range copy.

    ``base_pages``: (d4), the same from copies of the records' arrays mapped in 4 KiB pages.
    """
    from yogastore.format.memory import copy_ranges

    case, recs = ctx.case, ctx.recs
    if base_pages:
        recs = Records(
            x=in_base_pages(recs.x),
            x_off=in_base_pages(recs.x_off),
            labels=in_base_pages(recs.labels),
            tok=None if recs.tok is None else in_base_pages(recs.tok),
            tok_off=None if recs.tok_off is None else in_base_pages(recs.tok_off),
        )
    x_len = np.diff(recs.x_off)
    t_len = np.diff(recs.tok_off) * 4 if recs.tok_off is not None else None
    x_buf = np.empty(int(x_len.max(initial=0)) * case.batch_size, np.uint8)
    t_buf = np.empty(
        int(t_len.max(initial=0)) * case.batch_size if t_len is not None else 0, np.uint8
    )
    if base_pages:  # numpy would ask for huge pages for these too
        x_buf, t_buf = in_base_pages(x_buf), in_base_pages(t_buf)
    tok_bytes = recs.tok.view(np.uint8) if recs.tok is not None else None

    def gather(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        lengths = x_len[idx]
        offsets = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        copy_ranges(x_buf, recs.x, recs.x_off[idx], lengths)
        if t_len is None or tok_bytes is None or recs.tok_off is None:
            return offsets, recs.labels[idx], None
        tl = t_len[idx]
        copy_ranges(t_buf, tok_bytes, recs.tok_off[idx] * 4, tl)
        splits = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(tl // 4, out=splits[1:])
        return offsets, recs.labels[idx], splits

    checker = Checker(recs)
    for idx in index_batches(ctx.ref, case, 1):
        offsets, y, splits = gather(idx)
        xs = [x_buf[a:b].tobytes() for a, b in itertools.pairwise(offsets)]
        toks = None
        if splits is not None:
            t = t_buf.view(np.int32)
            toks = [t[a:b] for a, b in itertools.pairwise(splits)]
        checker.add(y, xs, toks)

    def run_batches(batches: list[np.ndarray]) -> Tally:
        tally = Tally()
        for idx in batches:
            tally.add(gather(idx)[1])
        return tally

    # Planned like the other rows (an untimed probe, not the checking pass above).
    passes = plan_passes(
        case, case.rank_span(), lambda p: run_batches(list(index_batches(ctx.ref, case, p)))
    )
    batches = list(index_batches(ctx.ref, case, passes))
    runs = repeat_runs(lambda: run_batches(batches), case.repeats, np.concatenate(batches))
    return _row(
        "d4" if base_pages else "d",
        "(d) from memory mapped in 4 KiB pages"
        if base_pages
        else "in-memory values + offsets, same compiled range copy (ceiling)",
        case,
        **runs,
        passes=passes,
        verified=checker.result(stream_indices(ctx.ref, case, 1)),
        note="MADV_NOHUGEPAGE copies of (d)'s arrays"
        if base_pages
        else "same index batches as (b)/(c), indices precomputed",
    )


def loop_floor_row(ctx: VarContext) -> list[dict[str, Any]]:
    """(z) and (z'): one batch prepared as tensors, repeated by tf.data, and only consumed.

    A pass is the rank's number of records, as one batch of (b)'s first records
    (``Dataset.from_tensors``, the same structure as (b)'s batches: strings, labels and, for
    text, ragged token ids) repeated, and consumed by the same Python loop as (a), (e3) and
    (b). Nothing is read, parsed or handed over: what remains is what the loop pays per
    batch (the eager call, and for text decoding the ragged token ids from their variant
    form), so (z)/(a) bounds what any reader consumed this way can reach over (a). (z')
    consumes the same batches in the graph (``Dataset.reduce``), as (a'), (e3') and (b'):
    what that consumer pays per batch (a call of the reduce function), the same bound for
    them.
    """
    import tensorflow as tf

    case = ctx.case
    recs = ctx.recs
    order = stream_indices(ctx.ref, case, 1)
    size = min(case.batch_size, len(order))
    first = order[:size]

    def batch_of(idx: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {
            "x": tf.constant([recs.x_at(int(i)) for i in idx], tf.string),
            "y": tf.constant(recs.labels[idx]),
        }
        if case.kind == "text":
            toks = [recs.tok_at(int(i)) for i in idx]
            splits = _offsets(np.array([len(t) for t in toks], np.int64))
            values = np.concatenate(toks) if toks else np.empty(0, np.int32)
            out["tokens"] = tf.RaggedTensor.from_row_splits(values, splits)
        return out

    full, tail = divmod(len(order), size) if size else (0, 0)
    whole, rest = batch_of(first), batch_of(first[:tail])
    per_pass = np.resize(recs.labels[first], len(order))

    def make(passes: int) -> Any:
        one = tf.data.Dataset.from_tensors(whole).repeat(full)
        if tail:
            one = one.concatenate(tf.data.Dataset.from_tensors(rest))
        return steady(one.repeat(passes).prefetch(2))

    return _timed_tf_rows(
        ctx,
        "z",
        "nothing read: one prepared batch, repeated (from_tensors)",
        make,
        per_pass,
        lambda p: np.tile(per_pass, p),
        in_graph=True,
        note="floor of any reader consumed the same way (no read, no hand-over)",
    )


# Build --------------------------------------------------------------------------------------


def _sync_timed(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float], Any]:
    seconds, result = [], None
    for _ in range(repeats):
        os.sync()
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2], seconds, result


def build_rows(
    ctx: VarContext, floor_seconds: Callable[[], dict[str, Any]]
) -> list[dict[str, Any]]:
    """(g)/(g2) build against iterating the same source plus writing its bytes; (g3) the write.

    Each build is paired with a plain write of the cache's bytes to a new file, made
    just before it or (every other pair) just after it: next to each other in time, on
    a disk in much the same state. That is as close as a benchmark gets: on a
    thin-provisioned disk (a cloud VM's) a block written for the first time costs
    several times a rewrite, and whether a new file gets such blocks or ones freed
    before is up to the file system, for the build and the write alike (a pair can
    still split). Both files of a pair are deleted before the next pair. The order
    matters too: on this benchmark's machine a build right after a write often took
    longer than one right before it. So there is an even number of pairs (``build_pairs``), half of
    each order. The ratio is the mean of the two orders' medians of build / (median
    iteration + that pair's write), each order's also given; the row's note gives the
    medians of the builds and writes on their own. (g3) keeps all
    its files until its runs end, so it is not comparable with the paired writes.
    """
    from benchmarks._methods import payload_block, write_floor_file

    case = ctx.case
    floor = floor_seconds()
    nbytes = int(ctx.ref.manifest.nbytes)
    block = payload_block(ctx.recs.x)
    rows = []
    for key, label, make in (
        ("g", "TFRecord file, parsed", lambda: tfrecord_source(ctx.tfrecord, case)),
        ("g2", "in-memory tensors (from_tensor_slices)", lambda: memory_source(ctx.recs)),
    ):
        made = make()

        def iterate(made: Any = made) -> int:
            count = 0
            for batch in made.batch(512).prefetch(2):
                count += int(batch["y"].shape[0])
            return count

        def build(name: str, made: Any = made) -> int:
            return int(ctx.store.cache(name, "1", lambda: made).num_records)

        def discard(name: str, path: Path) -> None:
            path.unlink(missing_ok=True)
            if (name, "1") in ctx.store.versions():
                ctx.store.delete(name, "1")

        it_s, it_all, counted = _sync_timed(iterate, case.repeats)
        writes, builds, counts = [], [], []
        for i in range(build_pairs(case.repeats)):
            path, name = ctx.work / f"write-{key}-{i}.bin", f"build-{key}-{i}"
            discard(name, path)  # left by an interrupted run: a cache hit is no build
            try:
                # The write first, and every other pair the build first: neither always leads.
                for step in ("write", "build")[:: -1 if i % 2 else 1]:
                    os.sync()
                    if step == "write":
                        writes.append(write_floor_file(block, nbytes, path))
                    else:
                        start = time.perf_counter()
                        counts.append(build(name))
                        builds.append(time.perf_counter() - start)
            finally:  # each pair's files go before the next pair, which may reuse their blocks
                discard(name, path)
        built = min(counts, default=0)
        ok = counted == case.records and all(c == case.records for c in counts)
        build_s, write_s = statistics.median(builds), statistics.median(writes)
        pairs = [b / (it_s + w) for b, w in zip(builds, writes, strict=True)]
        # Pair i went write first when i is even (above): each order's median, then their mean.
        write_first, build_first = statistics.median(pairs[0::2]), statistics.median(pairs[1::2])
        rows.append(
            _row(
                key,
                f"cache build vs plain iteration: {label}",
                case,
                rate=case.records / build_s,
                records_per_run=case.records,
                iterate_seconds=it_s,
                iterate_all=it_all,
                build_seconds=build_s,
                build_all=builds,
                write_seconds=write_s,
                write_all=writes,
                ratio=build_s / it_s if it_s > 0 else math.inf,
                ratio_with_write=(write_first + build_first) / 2,
                ratio_write_first=write_first,
                ratio_build_first=build_first,
                runs_ok=ok,
                verified={"ok": ok, "records": built, "expected_records": case.records},
                note=f"build {build_s:.2f}s, iterate {it_s:.2f}s, write {write_s:.2f}s "
                f"(medians; each build beside a write of its own); build / (iteration + "
                f"write) {write_first:.2f} with the write first, {build_first:.2f} with the "
                "build first",
            )
        )
    rows.append(floor)
    return rows
