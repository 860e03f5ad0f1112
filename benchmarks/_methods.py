"""The measured methods (a)-(g) of one case; each returns one row as a dict.

Every method reads the same records. A tf.data pipeline is built once per method
and iterated once per timed run (as a training loop iterates it once per
epoch): runs include iterator start-up, not graph construction. Before its
timed runs each method makes one untimed pass that checks every record read
against the source data (labels, contents, byte sums); each timed run checks
its record count and label sum. A row whose checks fail says so in the table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    Case,
    Tally,
    Verifier,
    consume,
    huge_mapped_kib,
    in_base_pages,
    index_batches,
    io_read_chars,
    peak_rss_mib,
    plan_passes,
    repeat_runs,
    rss_mib,
    steady,
    stream_indices,
    tf_labels,
    tfrecord_batches,
    tfrecord_source,
    timed,
    verify_tf,
)

ROOT = Path(__file__).resolve().parent.parent
DATASET = "bench"


@dataclasses.dataclass
class Context:
    """Everything one case's methods share."""

    case: Case
    work: Path
    data: np.ndarray
    labels: np.ndarray
    tfrecord: Path
    store: Any
    ref: Any
    data_file: Path
    full_load_labels: np.ndarray | None = None


def _row(key: str, name: str, case: Case, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"key": key, "name": name, "error": None, "note": ""}
    row.update(fields)
    if row.get("rate") is not None:
        row["mb_per_s"] = row["rate"] * case.payload_bytes / 1e6
    return row


def error_row(key: str, name: str, case: Case, err: BaseException) -> dict[str, Any]:
    """Return the row of a method that failed: it says what went wrong, no number."""
    return _row(key, name, case, rate=None, error=f"{type(err).__name__}: {err}")


# (a) TFRecordDataset ------------------------------------------------------------------


def tfrecord_sequential(ctx: Context) -> dict[str, Any]:
    case = ctx.case
    name = "TFRecordDataset sequential, batched, decoded"
    verifier = Verifier(ctx.data)
    verify_tf(tfrecord_batches(ctx.tfrecord, case, 1), verifier)
    passes = plan_passes(
        case, case.records, lambda p: consume(tfrecord_batches(ctx.tfrecord, case, p), tf_labels)
    )
    expected = np.tile(ctx.labels, passes)
    ds = tfrecord_batches(ctx.tfrecord, case, passes)
    runs = repeat_runs(
        lambda: consume(ds, tf_labels),
        case.repeats,
        expected,
    )
    return _row(
        "a",
        name,
        case,
        **runs,
        passes=passes,
        read_per_epoch=_per_pass(runs["read_syscall_bytes"], passes),
        verified=verifier.result(ctx.labels),
    )


def _per_pass(total: int | None, passes: int) -> int | None:
    return None if total is None else total // passes


# (b) stream -> tf.data, in its own process --------------------------------------------


def stream_tf(ctx: Context) -> dict[str, Any]:
    """Run ``stream_tf_worker`` in a fresh process (clean peak RSS, no shared TF state)."""
    case = ctx.case
    cfg_path = ctx.work / "stream-tf.json"
    out_path = ctx.work / "stream-tf.out.json"
    cfg = {
        "case": dataclasses.asdict(case),
        "store": str(ctx.store.url),
        "data": str(ctx.data_file),
        "out": str(out_path),
    }
    cfg_path.write_text(json.dumps(cfg))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.read_throughput", "--worker", str(cfg_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"worker exited {proc.returncode}: {' | '.join(tail)}")
    row: dict[str, Any] = json.loads(out_path.read_text())
    return row


def stream_tf_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Body of (b): ``stream(...).to_tf_dataset(batch_size=B)`` in this process."""
    import yogastore

    case = Case(**{**cfg["case"], "shape": tuple(cfg["case"]["shape"])})
    import tensorflow  # noqa: F401 - counted in the baseline RSS, like any TF user

    rss_after_import = rss_mib()
    ref = yogastore.Store(cfg["store"]).open(DATASET, "1")
    span = case.rank_span()
    streams: list[Any] = []

    def dataset(epochs: int) -> Any:
        stream = ref.stream(
            shard_rank=case.shard_rank,
            num_shards=case.num_shards,
            shuffle=True,
            seed=case.seed,
            num_epochs=epochs,
        )
        streams.append(stream)
        return stream.to_tf_dataset(batch_size=case.batch_size)

    warm = consume(dataset(1), tf_labels).check(stream_indices(ref, case, 1))
    passes = plan_passes(case, span, lambda p: consume(dataset(p), tf_labels))
    first_epoch_stats = streams[0].stats()  # the first stream of ``ref`` fetched it all
    ds = dataset(passes)
    runs = repeat_runs(
        lambda: consume(ds, tf_labels), case.repeats, stream_indices(ref, case, passes)
    )
    peak = peak_rss_mib()
    breakdown = _rss_breakdown()
    data = np.load(cfg["data"], mmap_mode="r")
    verifier = Verifier(data)
    verify_tf(dataset(1), verifier)
    row = _row(
        "b",
        f"stream(shuffle, {case.num_shards} shards).to_tf_dataset({case.batch_size})",
        case,
        **runs,
        passes=passes,
        read_per_epoch=first_epoch_stats.get("bytes_fetched"),
        payload_per_epoch=span * case.payload_bytes,
        warm_up_ok=warm["ok"],
        verified=verifier.result(stream_indices(ref, case, 1)),
        peak_rss_mib=peak,
        rss_after_import_mib=rss_after_import,
        rss_breakdown_mib=breakdown,
    )
    row["note"] = "mapped chunk bytes (LMDB mmap); pages touched ~ payload"
    Path(cfg["out"]).write_text(json.dumps(row))
    return row


def _rss_breakdown() -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


# (c) stream.batches and (d) in-memory gather ------------------------------------------


def _stream(ctx: Context, epochs: int, ref: Any = None) -> Any:
    case = ctx.case
    return (ref or ctx.ref).stream(
        shard_rank=case.shard_rank,
        num_shards=case.num_shards,
        shuffle=True,
        seed=case.seed,
        num_epochs=epochs,
    )


def stream_numpy(ctx: Context) -> dict[str, Any]:
    case = ctx.case
    verifier = Verifier(ctx.data)
    # A fresh reference: a stream made while another of its reference lives fetches nothing.
    first = _stream(ctx, 1, ctx.ref.store.open(ctx.ref.dataset_id, ctx.ref.version))

    def check() -> None:
        for batch in first.batches(case.batch_size):
            verifier.add(batch["x"], batch["y"])

    check()
    stats = first.stats()
    passes = plan_passes(
        case,
        case.rank_span(),
        lambda p: consume(_stream(ctx, p).batches(case.batch_size), lambda b: b["y"]),
    )
    runs = repeat_runs(
        lambda: consume(_stream(ctx, passes).batches(case.batch_size), lambda b: b["y"]),
        case.repeats,
        stream_indices(ctx.ref, case, passes),
    )
    return _row(
        "c",
        f"stream(shuffle, {case.num_shards} shards).batches({case.batch_size}), numpy",
        case,
        **runs,
        passes=passes,
        read_per_epoch=stats.get("bytes_fetched"),
        verified=verifier.result(stream_indices(ctx.ref, case, 1)),
        note=map_pages_note(ctx.work),
    )


def map_pages_note(work: Path) -> str:
    """How much of the store's memory map the kernel mapped in 2 MiB pages (``FilePmdMapped``)."""
    rss, pmd = huge_mapped_kib(str(work / "store"))
    if not rss:
        return ""
    return f"store map {rss / 1024:,.0f} MiB resident, {pmd / 1024:,.0f} MiB of it in 2 MiB pages"


def numpy_gather(ctx: Context, base_pages: bool = False) -> dict[str, Any]:
    """(d) the same index batches gathered by numpy from memory; (d4) the same from a copy
    mapped in base pages (see ``in_base_pages``)."""
    case = ctx.case
    data, labels = ctx.data, ctx.labels
    if base_pages:
        data, labels = in_base_pages(data), in_base_pages(labels)
    verifier = Verifier(data)

    def check() -> None:
        for idx in index_batches(ctx.ref, case, 1):
            verifier.add(data[idx], labels[idx])

    passes = case.passes(case.rank_span(), timed(check))
    batches = list(index_batches(ctx.ref, case, passes))

    def run() -> Tally:
        tally = Tally()
        for idx in batches:
            _x = data[idx]
            tally.add(labels[idx])
        return tally

    runs = repeat_runs(run, case.repeats, np.concatenate(batches))
    return _row(
        "d4" if base_pages else "d",
        "(d) from memory mapped in 4 KiB pages"
        if base_pages
        else "in-memory numpy fancy-index gather (ceiling)",
        case,
        **runs,
        passes=passes,
        verified=verifier.result(stream_indices(ctx.ref, case, 1)),
        note="MADV_NOHUGEPAGE copy of (d)'s arrays"
        if base_pages
        else "same index batches as (b)/(c), indices precomputed",
    )


# (e) TensorFlow's own snapshot and sharding ---------------------------------------------


def snapshot_rows(ctx: Context) -> list[dict[str, Any]]:
    import tensorflow as tf

    case = ctx.case
    path = str(ctx.work / "tf-snapshot")
    start = time.perf_counter()
    tf.data.Dataset.save(tfrecord_source(ctx.tfrecord, case), path)
    save_seconds = time.perf_counter() - start
    disk = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    verifier = Verifier(ctx.data)
    verify_tf(tf.data.Dataset.load(path).batch(case.batch_size), verifier)
    ctx.full_load_labels = np.concatenate(verifier.labels)

    def load(shard: bool, passes: int) -> Any:
        ds = tf.data.Dataset.load(path)
        if shard:
            ds = ds.shard(case.num_shards, case.shard_rank)
        return steady(ds.repeat(passes).batch(case.batch_size).prefetch(tf.data.AUTOTUNE))

    passes = plan_passes(case, case.records, lambda p: consume(load(False, p), tf_labels))

    ds = load(False, passes)
    runs = repeat_runs(lambda: consume(ds, tf_labels), case.repeats, np.tile(ctx.labels, passes))
    rows = [
        _row(
            "e1",
            "Dataset.save + Dataset.load (TF snapshot), sequential",
            case,
            **runs,
            passes=passes,
            read_per_epoch=_per_pass(runs["read_syscall_bytes"], passes),
            verified=verifier.result(ctx.labels),
            save_seconds=save_seconds,
            disk_bytes=disk,
            note=f"save took {save_seconds:.2f}s",
        )
    ]
    shard_labels = ctx.full_load_labels[case.shard_rank :: case.num_shards]
    verifier = Verifier(ctx.data)
    verify_tf(load(True, 1), verifier)
    shard_passes = plan_passes(case, len(shard_labels), lambda p: consume(load(True, p), tf_labels))
    ds = load(True, shard_passes)
    runs = repeat_runs(
        lambda: consume(ds, tf_labels),
        case.repeats,
        np.tile(shard_labels, shard_passes),
    )
    rows.append(
        _row(
            "e2",
            f"Dataset.load().shard({case.num_shards}, {case.shard_rank})",
            case,
            **runs,
            passes=shard_passes,
            read_per_epoch=_per_pass(runs["read_syscall_bytes"], shard_passes),
            verified=verifier.result(shard_labels),
        )
    )
    shard_labels = ctx.labels[case.shard_rank :: case.num_shards]
    verifier = Verifier(ctx.data)
    single = tfrecord_batches(ctx.tfrecord, case, 1, shard=True)
    verify_tf(single, verifier)
    shard_passes = plan_passes(
        case,
        len(shard_labels),
        lambda p: consume(tfrecord_batches(ctx.tfrecord, case, p, shard=True), tf_labels),
    )
    ds = tfrecord_batches(ctx.tfrecord, case, shard_passes, shard=True)
    runs = repeat_runs(
        lambda: consume(ds, tf_labels),
        case.repeats,
        np.tile(shard_labels, shard_passes),
    )
    rows.append(
        _row(
            "e3",
            f"TFRecordDataset.shard({case.num_shards}, {case.shard_rank}), decoded",
            case,
            **runs,
            passes=shard_passes,
            read_per_epoch=_per_pass(runs["read_syscall_bytes"], shard_passes),
            verified=verifier.result(shard_labels),
        )
    )
    return rows


# (g) cache build vs plain iteration ------------------------------------------------------


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float], Any]:
    """Median seconds of ``repeats`` calls, each started with no dirty pages pending.

    ``os.sync()`` before every run keeps one run's writes (and the previous
    method's) from being flushed during the next one, for builds and plain
    iterations alike.
    """
    seconds, result = [], None
    for _ in range(repeats):
        os.sync()
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2], seconds, result


def build_rows(ctx: Context) -> list[dict[str, Any]]:
    """Cache build time against merely iterating the same source (the writer's batching)."""
    import tensorflow as tf

    case = ctx.case
    counter = iter(range(1_000_000))

    def sources() -> list[tuple[str, str, Callable[[], Any]]]:
        return [
            ("g", "TFRecord file, parsed per element", lambda: tfrecord_source(ctx.tfrecord, case)),
            (
                "g2",
                "in-memory tensors (from_tensor_slices)",
                lambda: steady(
                    tf.data.Dataset.from_tensor_slices({"x": ctx.data, "y": ctx.labels})
                ),
            ),
        ]

    rows = []
    for key, label, make in sources():

        def iterate(make: Callable[[], Any] = make) -> Tally:
            tally = Tally()
            for batch in make().batch(512).prefetch(2).as_numpy_iterator():
                tally.add(batch["y"])
            return tally

        names: list[str] = []

        def build(make: Callable[[], Any] = make, names: list[str] = names) -> int:
            names.append(f"build-{next(counter)}")
            return int(ctx.store.cache(names[-1], "1", make).num_records)

        it_s, it_all, tally = _timed(iterate, case.repeats)
        build_s, build_all, built = _timed(build, case.repeats)
        for name in names:  # deleted after timing: deleting files costs the file system too
            ctx.store.delete(name, "1")
        ok = tally.records == case.records and built == case.records
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
                build_all=build_all,
                ratio=build_s / it_s if it_s > 0 else math.inf,
                runs_ok=ok,
                verified={"ok": ok, "records": built, "expected_records": case.records},
                note=f"build {build_s:.2f}s, iterate {it_s:.2f}s",
            )
        )
    rows.append(_write_floor(ctx))
    return rows


def write_floor_file(block: bytes, nbytes: int, path: Path) -> float:
    """Seconds to write ``nbytes`` (``block`` repeated) to a new file at ``path`` and fsync it.

    A new file each time, as a build writes one: on a thin-provisioned disk (a
    cloud VM's) the first write to a block can cost several times a rewrite, and
    truncating and rewriting one file reuses the blocks it just freed.
    """
    start = time.perf_counter()
    written = 0
    with open(path, "xb") as f:
        while written < nbytes:
            written += f.write(block[: nbytes - written])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    if written != nbytes:
        raise RuntimeError(f"{path}: wrote {written} bytes, not {nbytes}")
    return seconds


def payload_block(data: np.ndarray) -> bytes:
    """Up to 4 MiB of the payload's own bytes (not compressible zeros) for a plain write."""
    return np.ascontiguousarray(data).reshape(-1)[: 4 << 20].tobytes() or b"\0"


def _write_floor(ctx: Context) -> dict[str, Any]:
    """Write the cache's bytes to a plain file and fsync it: what any build pays for its output."""
    case = ctx.case
    nbytes = int(ctx.ref.manifest.nbytes)
    block = payload_block(ctx.data)
    paths = [ctx.work / f"write-floor-{i}.bin" for i in range(case.repeats)]
    runs: list[float] = []
    try:
        for path in paths:
            path.unlink(missing_ok=True)
            os.sync()
            runs.append(write_floor_file(block, nbytes, path))
    finally:
        for path in paths:  # kept until every run is done, like the fixed cases' builds
            path.unlink(missing_ok=True)
    seconds = sorted(runs)[len(runs) // 2]
    return _row(
        "g3",
        "write + fsync of the same bytes to a new plain file",
        case,
        rate=case.records / seconds,
        records_per_run=case.records,
        write_seconds=seconds,
        write_all=runs,
        bytes_written=nbytes,
        runs_ok=True,
        verified={"ok": True, "bytes": nbytes, "expected_bytes": nbytes},
        note=f"{nbytes / 1e6:.1f} MB in {seconds:.2f}s",
    )


def read_chars_available() -> bool:
    return io_read_chars() is not None
