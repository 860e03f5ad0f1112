"""Rows beside the readers: Grain + ArrayRecord (p), decode_jpeg (h1/h2), contention (k1/k2)."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from benchmarks._common import consume, plan_passes, repeat_runs, steady, stream_indices, tf_labels
from benchmarks._varlen import (
    Checker,
    Records,
    VarContext,
    _row,
    _stream,
    tfrecord_batches,
)

JPEG_SIDE = 64


# Grain + ArrayRecord ----------------------------------------------------------------------


def _pack(recs: Records, i: int) -> bytes:
    x = recs.x_at(i)
    tok = recs.tok_at(i).tobytes() if recs.tok is not None else b""
    return struct.pack("<qi", int(recs.labels[i]), len(x)) + x + tok


def _unpack(raw: bytes) -> tuple[int, bytes, np.ndarray]:
    label, n = struct.unpack_from("<qi", raw)
    return label, raw[12 : 12 + n], np.frombuffer(raw, np.int32, offset=12 + n)


GRAIN_RECORDS = 5_000


def grain_row(ctx: VarContext) -> dict[str, Any]:
    """(p) Grain's MapDataset over ArrayRecord: shuffled, this rank's slice, batched."""
    case = ctx.case
    name = "Grain MapDataset(ArrayRecord).shuffle()[rank slice].batch, numpy"
    try:
        import grain
        from array_record.python.array_record_module import ArrayRecordWriter
    except ImportError as err:
        return _row(
            "p", name, case, rate=None, note=f"not measured: {err} (pip install '.[bench]')"
        )
    path = ctx.work / "records.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for i in range(len(ctx.recs.labels)):
        writer.write(_pack(ctx.recs, i))
    writer.close()
    source = grain.sources.ArrayRecordDataSource([str(path)])
    n = len(source)
    lo, hi = case.shard_rank * n // case.num_shards, (case.shard_rank + 1) * n // case.num_shards

    def batch_fn(raws: list[bytes]) -> dict[str, Any]:
        parsed = [_unpack(r) for r in raws]
        return {
            "y": np.array([p[0] for p in parsed], np.int64),
            "x": [p[1] for p in parsed],
            "tokens": [p[2] for p in parsed],
        }

    # Its first GRAIN_RECORDS of the rank's shuffled slice at most, and only the whole batches
    # of them that the untimed checking pass reads in the case's seconds per run: every record
    # a random read all the same, at thousands of records per second for images and a few
    # hundred or less for 2.2 million texts.
    hi = min(hi, lo + GRAIN_RECORDS)

    def dataset() -> Any:
        # The same shuffle every pass: its records are then known for the checks.
        ds = grain.MapDataset.source(source).shuffle(seed=case.seed)[lo:hi]
        return ds.batch(case.batch_size, batch_fn=batch_fn)

    def passes_of(p: int) -> Iterator[dict[str, Any]]:
        for _ in range(p):
            yield from dataset()

    checker = Checker(ctx.recs)
    text = case.kind == "text"
    start, read = time.perf_counter(), 0
    for batch in dataset():
        checker.add(batch["y"], batch["x"], batch["tokens"] if text else None)
        read += len(batch["y"])
        if time.perf_counter() - start > case.max_seconds:
            break
    hi = lo + read  # the timed passes read these records (dataset() slices up to hi)
    expected_one = np.concatenate(checker.labels)
    distinct = len(np.unique(expected_one)) == hi - lo == len(expected_one)
    passes = plan_passes(case, hi - lo, lambda p: consume(passes_of(p), lambda b: b["y"]))
    runs = repeat_runs(
        lambda: consume(passes_of(passes), lambda b: b["y"]),
        case.repeats,
        np.tile(expected_one, passes),
    )
    verified = checker.result(expected_one)
    verified["ok"] = verified["ok"] and distinct
    return _row(
        "p",
        name,
        case,
        **runs,
        passes=passes,
        verified=verified,
        note=f"grain {getattr(grain, '__version__', '?')}, worker_count 0, {hi - lo} records",
    )


# Decoding and contention -----------------------------------------------------------------


def _decode(batch: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    def one(raw: Any) -> Any:
        image = tf.io.decode_jpeg(raw, channels=3)
        return tf.cast(tf.image.resize(image, [JPEG_SIDE, JPEG_SIDE]), tf.uint8)

    images = tf.map_fn(
        one, batch["x"], fn_output_signature=tf.TensorSpec([JPEG_SIDE, JPEG_SIDE, 3], tf.uint8)
    )
    return {"image": images, "y": batch["y"]}


def decode_rows(ctx: VarContext) -> list[dict[str, Any]]:
    """(h1) stream -> tf.data -> decode_jpeg + resize; (h2) TFRecord shard+shuffle, same map."""
    import tensorflow as tf

    case = ctx.case
    shard = ctx.recs.labels[case.shard_rank :: case.num_shards]
    pipelines = [
        (
            "h1",
            "(b) + map(decode_jpeg + resize 64x64)",
            lambda p: _stream(ctx, p).to_tf_dataset(batch_size=case.batch_size),
            lambda p: stream_indices(ctx.ref, case, p),
            case.rank_span(),
        ),
        (
            "h2",
            "(e3) + map(decode_jpeg + resize 64x64)",
            lambda p: tfrecord_batches(ctx.tfrecord, case, p, shard_shuffle=True),
            lambda p: np.tile(shard, p),
            len(shard),
        ),
    ]
    rows = []
    for key, name, make, expected, per_pass in pipelines:

        def decoded(p: int, make: Callable[[int], Any] = make) -> Any:
            ds = make(p).map(_decode, num_parallel_calls=tf.data.AUTOTUNE)
            return steady(ds.prefetch(2))

        first = next(iter(decoded(1)))
        ok = first["image"].shape[1:] == (JPEG_SIDE, JPEG_SIDE, 3)
        passes = plan_passes(case, per_pass, lambda p, d=decoded: consume(d(p), tf_labels))
        ds = decoded(passes)
        runs = repeat_runs(lambda ds=ds: consume(ds, tf_labels), case.repeats, expected(passes))
        rows.append(
            _row(
                key,
                name,
                case,
                **runs,
                passes=passes,
                verified={"ok": bool(ok), "decoded_shape": list(first["image"].shape)},
            )
        )
    return rows


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """Keep one core busy in another process (a stand-in for the training step)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True:\n    pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        proc.kill()
        proc.wait()


def contended_rows(
    ctx: Any, tfrecord_row: Callable[[], dict[str, Any]], stream_row: Callable[[], dict[str, Any]]
) -> list[dict[str, Any]]:
    """(k1) TFRecord sequential and (k2) stream -> tf.data, with one core kept busy."""
    rows = []
    with busy_core():
        for key, fn in (("k1", tfrecord_row), ("k2", stream_row)):
            row = fn()
            row["key"] = key
            row["name"] = f"under load: {row['name']}"
            rows.append(row)
    return rows
