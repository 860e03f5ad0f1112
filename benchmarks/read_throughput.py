"""Read throughput of yogastore against TensorFlow's own readers and YogaDL, side by side.

Run from the repository root::

    python -m benchmarks.read_throughput                       # all cases, defaults
    python -m benchmarks.read_throughput --records 20000 --record-bytes 4096
    make bench BENCH_ARGS="--cases main --no-yogadl"

In one run, on the same records (random bytes plus an int64 label), per case:

(a) ``TFRecordDataset``, sequential, batched, parsed and decoded to uint8;
(b) ``stream(shuffle=True, num_shards=4, shard_rank=0).to_tf_dataset(batch_size=256)``,
    in a fresh process (its peak RSS is reported);
(c) the same stream through ``Stream.batches(256)`` (numpy, no TensorFlow);
(d) an in-memory numpy fancy-index gather of the same index batches (the ceiling);
(d4) the same from a copy of its arrays that the kernel maps in 4 KiB pages: numpy asks
    for transparent huge pages for arrays of 4 MiB or more, while a store's memory map
    gets 2 MiB pages only where the page cache holds the file in 2 MiB folios ((c)'s
    note says how much did);
(e) TensorFlow's ``Dataset.save`` + ``Dataset.load``, and ``shard(4, 0)`` of the
    snapshot and of the TFRecord file, with the bytes each rank reads;
(f) YogaDL 0.1.4 in its own virtual environment, same shuffle and shard;
(g) cache build time against merely iterating the same source dataset, and
    (g3) writing the same number of bytes to a new plain file with fsync (what any
    build pays for its output on this disk).

Cases: ``main`` (``--records`` x ``--record-bytes``), ``small`` (100-byte records)
and ``large`` (224x224x3 uint8 images, 150 KB); the variable-length cases ``images``,
``text`` and ``jpeg`` have rows of their own (see ``benchmarks/_varlen.py``), and
``main`` and ``images`` are also read while another process keeps one core busy
((k1)/(k2), ``--no-contended`` skips them). Every method is checked against the
source data; each timed run reads at least ``--read-mib`` in whole epochs or passes
(fewer for slow methods: ``--max-seconds-per-run``). Rates are the median of
``--repeats`` runs. Results go to a table on stdout and to JSON (``benchmarks/results/``
or ``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _methods, _peers, _varlen, _yogadl
from benchmarks._common import Case, make_records, quiet_tensorflow, write_tfrecord

RESULTS = Path(__file__).resolve().parent / "results"

#: (label, numerator row, denominator row or None for the row's own ratio, comparison, target).
TARGETS = (
    ("(b) tf.data / (a) TFRecordDataset", "b", "a", ">=", 2.0),
    ("(c) batches / (d) numpy gather", "c", "d", ">=", 0.6),
    ("(b) tf.data / (f) YogaDL", "b", "f", ">=", 50.0),
    ("(g) build / plain iteration", "g", None, "<=", 1.5),
)
CONTENDED_TARGET = ("(k2) / (k1), one core busy", "k2", "k1", ">=", 1.5)
VAR_TARGETS = (
    ("(b) tf.data / (a) TFRecordDataset", "b", "a", ">=", 2.0),
    ("(b) tf.data / (e3) shard+shuffle", "b", "e3", ">=", 5.0),
    ("(b') / (a'), consumed in the graph", "b'", "a'", ">=", 2.0),
    ("(b') / (e3'), consumed in the graph", "b'", "e3'", ">=", 5.0),
    ("(c) batches / (d) memory gather", "c", "d", ">=", 0.6),
    ("(c) batches / (p) Grain+ArrayRecord", "c", "p", ">=", 2.0),
    ("(g) build / (iteration + write)", "g", None, "<=", 1.5),
    ("(g2) build / (iteration + write)", "g2", None, "<=", 1.5),
)
VAR_KINDS = ("images", "text", "jpeg")
# Ratios printed beside the targets, with none of their own: how far the same consumer gets
# with nothing to read ((z), (z')) and with the hand-over alone ((b0), (b0')).
VAR_BOUNDS = (
    ("(z) / (a), the Python loop alone", "z", "a"),
    ("(z') / (a'), the graph's consumer alone", "z'", "a'"),
    ("(b0) / (e3), the hand-over alone", "b0", "e3"),
    ("(b0') / (e3'), the hand-over alone", "b0'", "e3'"),
    ("(b2) / (e3), a fresh process's first epochs", "b2", "e3"),
    ("(c) / (d4), the ceiling in 4 KiB pages", "c", "d4"),
)
#: The same for the fixed-shape cases.
BOUNDS = (("(c) / (d4), the ceiling in 4 KiB pages", "c", "d4"),)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.read_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--records", type=int, default=262144, help="records of the main case (1 GiB)")
    p.add_argument("--record-bytes", type=int, default=4096, help="bytes per main-case record")
    p.add_argument("--small-records", type=int, default=100000, help="records of 100 B")
    p.add_argument("--large-records", type=int, default=2000, help="images of 224x224x3")
    p.add_argument("--images-records", type=int, default=80000, help="images of 2-24 KiB (1 GiB)")
    p.add_argument("--text-records", type=int, default=2_200_000, help="texts of 50-500 B (1 GiB)")
    p.add_argument(
        "--jpeg-records",
        type=int,
        default=160_000,
        help="real JPEGs, 64-128 px (1 GiB; 4,000 distinct ones repeated)",
    )
    p.add_argument(
        "--cases",
        default="main,small,large,images,text,jpeg",
        help="comma list of main,small,large,images,text,jpeg",
    )
    p.add_argument("--no-contended", action="store_true", help="skip rows (k1)/(k2)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--num-shards", type=int, default=4)
    p.add_argument("--shard-rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (median)")
    p.add_argument("--read-mib", type=int, default=1024, help="at least this much per timed run")
    p.add_argument("--max-records-per-run", type=int, default=600_000)
    p.add_argument(
        "--max-seconds-per-run",
        type=float,
        default=2.5,
        help="fewer passes for slow methods (estimated from the untimed pass)",
    )
    p.add_argument("--no-yogadl", action="store_true", help="skip (f) YogaDL")
    p.add_argument("--yogadl-venv", type=Path, default=_yogadl.default_venv())
    p.add_argument(
        "--yogadl-max-records",
        type=int,
        default=10000,
        help="YogaDL reads at most this many records of its stream",
    )
    p.add_argument("--json", type=Path, default=None, help="result file (default: results/)")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch dir (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch dir")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _check_sizes(args: argparse.Namespace) -> None:
    """Refuse sizes no case can be measured at, naming the option."""
    for option, least in (
        ("batch_size", 1),
        ("num_shards", 1),
        ("shard_rank", 0),
        ("repeats", 1),
        ("read_mib", 1),
        ("max_records_per_run", 1),
    ):
        if getattr(args, option) < least:
            flag = "--" + option.replace("_", "-")
            raise SystemExit(f"{flag} {getattr(args, option)}: must be at least {least}")
    if args.shard_rank >= args.num_shards:
        raise SystemExit(
            f"--shard-rank {args.shard_rank}: must be below --num-shards {args.num_shards}"
        )
    if not args.max_seconds_per_run > 0:
        raise SystemExit(f"--max-seconds-per-run {args.max_seconds_per_run}: must be above 0")


def build_cases(args: argparse.Namespace) -> list[Case]:
    _check_sizes(args)
    common = {
        "batch_size": args.batch_size,
        "num_shards": args.num_shards,
        "shard_rank": args.shard_rank,
        "seed": args.seed,
        "read_bytes": args.read_mib << 20,
        "max_records": args.max_records_per_run,
        "max_seconds": args.max_seconds_per_run,
        "repeats": args.repeats,
    }
    shapes = {
        "main": (args.records, (args.record_bytes,)),
        "small": (args.small_records, (100,)),
        "large": (args.large_records, (224, 224, 3)),
    }
    # Mean payload bytes of the variable-length cases (uniform lengths, see _varlen).
    var = {
        "images": (args.images_records, 13 << 10),
        "text": (args.text_records, 275 + 4 * 55),
        "jpeg": (args.jpeg_records, 0),
    }
    cases = []
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        if name in var:
            records, mean = var[name]
            case = Case(name=name, records=records, shape=(), kind=name, mean_bytes=mean, **common)
        elif name in shapes:
            records, shape = shapes[name]
            case = Case(name=name, records=records, shape=shape, **common)
        else:
            raise SystemExit(f"unknown case {name!r}; choose from {', '.join([*shapes, *var])}")
        if case.rank_span() < 1:
            flag = "--records" if name == "main" else f"--{name}-records"
            raise SystemExit(
                f"{flag} {records}: rank {args.shard_rank} of {args.num_shards} would read no "
                f"record of case {name}; give at least {args.num_shards}"
            )
        cases.append(case)
    return cases


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_case(
    case: Case, args: argparse.Namespace, work: Path, yogadl: tuple[Any, str]
) -> dict[str, Any]:
    import yogastore

    if case.kind in VAR_KINDS:
        return run_var_case(case, args, work)
    log(f"case {case.name}: {case.describe()}")
    work.mkdir(parents=True, exist_ok=True)
    data = make_records(case)
    labels = np.arange(case.records, dtype=np.int64)
    data_file = work / "x.npy"
    np.save(data_file, data)
    tfrecord = work / "records.tfrecord"
    write_tfrecord(tfrecord, data)
    store = yogastore.Store(str(work / "store"))
    start = time.perf_counter()
    ref = store.cache(_methods.DATASET, "1", lambda: _methods.tfrecord_source(tfrecord, case))
    first_build = time.perf_counter() - start
    ctx = _methods.Context(case, work, data, labels, tfrecord, store, ref, data_file)
    rows: list[dict[str, Any]] = []
    steps = [
        ("a", "TFRecordDataset", lambda: [_methods.tfrecord_sequential(ctx)]),
        ("b", "stream -> tf.data", lambda: [_methods.stream_tf(ctx)]),
        ("c", "stream.batches", lambda: [_methods.stream_numpy(ctx)]),
        ("d", "numpy gather", lambda: [_methods.numpy_gather(ctx)]),
        ("d4", "numpy gather, 4 KiB pages", lambda: [_methods.numpy_gather(ctx, base_pages=True)]),
        ("e", "TF snapshot and shard", lambda: _methods.snapshot_rows(ctx)),
        ("f", "YogaDL", lambda: [_yogadl_row(ctx, args, yogadl)]),
        ("g", "cache build", lambda: _methods.build_rows(ctx)),
    ]
    targets = TARGETS
    if case.name == "main" and not args.no_contended:
        steps.append(
            (
                "k",
                "under load",
                lambda: _peers.contended_rows(
                    ctx,
                    lambda: _methods.tfrecord_sequential(ctx),
                    lambda: _methods.stream_tf(ctx),
                ),
            )
        )
        targets = (*TARGETS, CONTENDED_TARGET)
    for key, label, fn in steps:
        log(f"  ({key}) {label}")
        rows.extend(_run_step(key, label, case, fn))
    return {
        "case": dataclasses.asdict(case),
        "record_bytes": case.record_bytes,
        "payload_bytes": case.payload_bytes,
        "dataset_bytes": int(ref.nbytes),
        "chunks": len(ref.manifest.chunks),
        "tfrecord_bytes": tfrecord.stat().st_size,
        "first_build_seconds": first_build,
        "rows": rows,
        "targets": evaluate_targets(rows, targets),
        "bounds": evaluate_bounds(rows, BOUNDS),
    }


def run_var_case(case: Case, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The rows of a variable-length case (``images``, ``text``, ``jpeg``)."""
    import types

    import yogastore

    work.mkdir(parents=True, exist_ok=True)
    recs = _varlen.make_records(case)
    mean = (recs.nbytes - recs.labels.nbytes) // max(1, case.records)
    case = dataclasses.replace(case, mean_bytes=int(mean))
    log(f"case {case.name}: {case.describe()}")
    tfrecord = work / "records.tfrecord"
    _varlen.write_tfrecord(tfrecord, recs)
    store = yogastore.Store(str(work / "store"))
    start = time.perf_counter()
    ref = store.cache(_varlen.DATASET, "1", lambda: _varlen.tfrecord_source(tfrecord, case))
    first_build = time.perf_counter() - start
    ctx = _varlen.VarContext(case, work, recs, tfrecord, store, ref)
    shim = types.SimpleNamespace(case=case, ref=ref, data=recs.x, work=work)
    steps: list[tuple[str, str, Any]] = [
        ("a", "TFRecord", lambda: _varlen.tfrecord_rows(ctx)),
        ("b", "stream -> tf.data", lambda: _varlen.stream_tf_rows(ctx)),
        ("b1", "stream -> tf.data, no kernel", lambda: [_varlen.stream_tf_objects_row(ctx)]),
        ("b2", "stream -> tf.data, first epochs", lambda: [_varlen.first_epochs_row(ctx)]),
        ("b0", "from_generator ceiling", lambda: _varlen.generator_ceiling_row(ctx)),
        ("z", "loop floor", lambda: _varlen.loop_floor_row(ctx)),
        ("c", "stream.batches", lambda: _varlen.stream_numpy_rows(ctx)),
        ("d", "memory gather", lambda: [_varlen.memory_gather_row(ctx)]),
        ("d4", "memory gather, 4 KiB pages", lambda: [_varlen.memory_gather_row(ctx, True)]),
        ("p", "Grain + ArrayRecord", lambda: [_peers.grain_row(ctx)]),
    ]
    if case.kind == "jpeg":
        steps.append(("h", "decode_jpeg + resize", lambda: _peers.decode_rows(ctx)))
    targets = VAR_TARGETS
    if case.kind == "images" and not args.no_contended:
        steps.append(
            (
                "k",
                "under load",
                lambda: _peers.contended_rows(
                    ctx,
                    lambda: _varlen.tfrecord_rows(ctx, shard_shuffle=False, in_graph=False)[0],
                    lambda: _varlen.stream_tf_rows(ctx, in_graph=False)[0],
                ),
            )
        )
        targets = (*VAR_TARGETS, CONTENDED_TARGET)
    steps.append(
        ("g", "cache build", lambda: _varlen.build_rows(ctx, lambda: _methods._write_floor(shim)))
    )
    rows: list[dict[str, Any]] = []
    for key, label, fn in steps:
        log(f"  ({key}) {label}")
        rows.extend(_run_step(key, label, case, fn))
    return {
        "case": dataclasses.asdict(case),
        "record_bytes": case.record_bytes,
        "payload_bytes": case.payload_bytes,
        "dataset_bytes": int(ref.nbytes),
        "chunks": len(ref.manifest.chunks),
        "tfrecord_bytes": tfrecord.stat().st_size,
        "first_build_seconds": first_build,
        "rows": rows,
        "targets": evaluate_targets(rows, targets),
        "bounds": evaluate_bounds(rows, VAR_BOUNDS),
    }


def evaluate_bounds(
    rows: list[dict[str, Any]], bounds: tuple[tuple[str, str, str], ...]
) -> list[dict[str, Any]]:
    """Return the ratios ``bounds`` names (``None`` where a row has no rate)."""
    rate = {r["key"]: r.get("rate") for r in rows}
    out = []
    for label, num, den in bounds:
        a, b = rate.get(num), rate.get(den)
        out.append({"bound": label, "value": a / b if a and b else None})
    return out


def _run_step(key: str, label: str, case: Case, fn: Any) -> list[dict[str, Any]]:
    try:
        rows: list[dict[str, Any]] = fn()
        return rows
    except Exception as err:  # one broken method must not hide the others
        return [_methods.error_row(key, label, case, err)]


def _yogadl_row(
    ctx: _methods.Context, args: argparse.Namespace, yogadl: tuple[Any, str]
) -> dict[str, Any]:
    python, how = yogadl
    name = "YogaDL 0.1.4 make_tf_dataset(stream(shuffle, shards)).batch"
    if args.no_yogadl:
        return {
            "key": "f",
            "name": name,
            "rate": None,
            "error": None,
            "skipped": "--no-yogadl",
            "note": "skipped (--no-yogadl)",
        }
    if python is None:
        return {
            "key": "f",
            "name": name,
            "rate": None,
            "error": None,
            "skipped": how,
            "note": f"not measured: {how}",
        }
    row = _yogadl.run_yogadl(
        python,
        dataclasses.asdict(ctx.case),
        ctx.work,
        ctx.tfrecord,
        ctx.data_file,
        args.yogadl_max_records,
    )
    row["venv"] = how
    return row


def evaluate_targets(
    rows: list[dict[str, Any]], targets: tuple[tuple[Any, ...], ...] = TARGETS
) -> list[dict[str, Any]]:
    by_key = {r["key"]: r for r in rows}
    out = []
    for label, num, den, op, target in targets:
        a = by_key.get(num)
        b = by_key.get(den) if den else None
        value: float | None = None
        why = ""
        if den is None and a is not None:
            value = a.get("ratio_with_write" if "write" in label else "ratio")
        elif a is not None and b is not None and a.get("rate") and b.get("rate"):
            value = a["rate"] / b["rate"]
        if value is None:
            missing = [k for k in (num, den) if k and not (by_key.get(k) or {}).get("rate")]
            why = f"not measured ({', '.join(missing)})"
        checks_ok = all((by_key.get(k) or {}).get("runs_ok", False) for k in (num, den) if k)
        met = (
            value is not None and checks_ok and (value >= target if op == ">=" else value <= target)
        )
        out.append(
            {
                "target": label,
                "value": value,
                "op": op,
                "goal": target,
                "met": met,
                "why": why or ("" if checks_ok else "a check of the rows failed"),
            }
        )
    return out


def _fmt_bytes(n: Any) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def format_case(result: dict[str, Any]) -> str:
    case = result["case"]
    lines = [
        "",
        f"== case {case['name']}: {case['records']} records x {result['record_bytes']} B "
        f"(+8 B label), batch {case['batch_size']}, rank {case['shard_rank']} of "
        f"{case['num_shards']}; yogastore {result['chunks']} chunks "
        f"{_fmt_bytes(result['dataset_bytes'])}, TFRecord {_fmt_bytes(result['tfrecord_bytes'])}",
        f"{'':6}{'method':<58}{'records':>9}{'records/s':>12}{'MB/s':>9}"
        f"{'read/rank/epoch':>17}{'peak RSS':>10}  checks",
    ]
    for r in result["rows"]:
        rate = r.get("rate")
        rss = r.get("peak_rss_mib")
        if r.get("error"):
            status = f"ERROR {r['error']}"
        elif rate is None:
            status = r.get("note", "")
        else:
            ok = r.get("runs_ok") and (r.get("verified") or {}).get("ok")
            status = ("ok" if ok else "FAILED") + (f"; {r['note']}" if r.get("note") else "")
        records = str(r.get("records_per_run", "-")) if rate else "-"
        per_s = f"{rate:,.0f}" if rate else "-"
        mbps = f"{r.get('mb_per_s', 0):,.1f}" if rate else "-"
        rss_text = f"{rss:,.0f} MiB" if rss else "-"
        key = f"({r['key']})"
        lines.append(
            f"{key:<6}{r['name'][:57]:<58}{records:>9}{per_s:>12}{mbps:>9}"
            f"{_fmt_bytes(r.get('read_per_epoch')):>17}{rss_text:>10}  {status}"
        )
    lines.append("targets:")
    for t in result["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        verdict = "MET" if t["met"] else "NOT MET"
        extra = f" ({t['why']})" if t["why"] else ""
        lines.append(
            f"    {t['target']:<40} = {value:>8}   target {t['op']} {t['goal']:g}: {verdict}{extra}"
        )
    if result.get("bounds"):
        lines.append("bounds (no target):")
        for b in result["bounds"]:
            value = "n/a" if b["value"] is None else f"{b['value']:.2f}"
            lines.append(f"    {b['bound']:<40} = {value:>8}")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    import os

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import tensorflow as tf

        info["tensorflow"] = tf.__version__
    except ImportError:
        pass
    info["numpy"] = np.__version__
    return info


def main(argv: list[str] | None = None) -> int:
    quiet_tensorflow()
    args = parse_args(argv)
    if args.worker is not None:
        _methods.stream_tf_worker(json.loads(args.worker.read_text()))
        return 0
    cases = build_cases(args)
    started = time.perf_counter()
    yogadl: tuple[Any, str] = (None, "skipped (--no-yogadl)")
    if not args.no_yogadl:
        yogadl = _yogadl.ensure_venv(args.yogadl_venv, log)
        log(f"YogaDL environment: {yogadl[1]}")
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="yogastore-bench-"))
    results = []
    try:
        for case in cases:
            result = run_case(case, args, root / case.name, yogadl)
            print(format_case(result), flush=True)
            results.append(result)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    doc = {
        "command": " ".join(["python -m benchmarks.read_throughput", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "yogadl_venv": yogadl[1],
        "seconds": time.perf_counter() - started,
        "cases": results,
    }
    path = args.json or RESULTS / f"read_throughput-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"\nmachine: {doc['machine']}\nwall time {doc['seconds']:.0f}s; JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
