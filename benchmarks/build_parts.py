"""Parts of a cache build timed on their own: the local backend's puts, string encoding, threads.

Run from the repository root::

    python -m benchmarks.build_parts                       # both parts, puts into /dev/shm
    python -m benchmarks.build_parts --part puts --puts 250 --value-mb 4.4 --dir /some/disk

``puts``: the local (LMDB) backend puts ``--puts`` values of ``--value-mb`` MB, each its own
commit as a build puts its chunks, in three fresh processes:

* ``no TensorFlow``: the process never imports it;
* ``after from_generator``: the process first iterates a ``tf.data.Dataset.from_generator``,
  which sets the C library's ``M_TRIM_THRESHOLD`` for the whole process (TensorFlow logs
  "Memory patch applied: M_TRIM_THRESHOLD=128 kb was set"; the row says whether the child's
  log named ``M_TRIM_THRESHOLD``). Setting it also fixes
  glibc's threshold for serving a ``malloc`` with a fresh mapping at 128 KiB, so each of
  LMDB's multi-megabyte page buffers is mapped anew and faulted in page by page;
* ``after from_generator, thresholds raised``: the same, then ``mallopt`` raises both
  thresholds again (32 MiB and 64 MiB). yogastore does not do this: it would change the
  allocator of the user's whole process.

Each process also writes the same bytes to a plain file in the same directory, value by
value and unsynced like the puts, as the cost of one copy into the page cache. By default
the directory is ``/dev/shm`` (memory, so a disk's speed does not blur the copies); give
``--dir`` for a disk.

``strings``: about ``--strings-mb`` MB of distinct ``bytes`` strings encoded
(``ChunkBuilder``) into chunks of the default 4 MiB, from slabs of 512 strings (the first
pass's batches), each chunk into one buffer used before (as a build reuses the buffer of a
chunk already put), with the strings taken as pieces of their own and joined into one piece
first (the build takes them as pieces from 2 KiB on average), best of ``--repeats``:
image-like strings of 2-24 KiB, and strings of 512 B, 2, 4, 8 and 16 KiB (``--sizes``). The
chunks are checked to be byte for byte the same both ways. This part runs in the calling
process, without TensorFlow, or with ``--after-from-generator`` after iterating a
``from_generator`` dataset as above.

``build``: ``--builds`` builds of ``--build-records`` image-like records (2-24 KiB strings plus
an int64 label, from in-memory tensors: the ``g2`` row of ``read_throughput``'s ``images``
case) into the local backend in ``--dir``, in two fresh processes, one that has not used
``from_generator`` and one that has. For each build: its seconds, the seconds the putting
thread spent inside the backend's puts, and the CPU seconds of the calling thread, which
iterates the source and encodes the chunks meanwhile; the process's median iteration of
the source (``batch(512)``) is printed beside them. An untimed build comes first (the
first in a process pays one-time costs), and each build's dataset is deleted before the next.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

_MODES = {
    "tf-unused": "without from_generator",
    "plain": "no TensorFlow",
    "tf": "after from_generator",
    "tf-mallopt": "after from_generator, thresholds raised",
}
_TRIM_LOG = "M_TRIM_THRESHOLD"
_ROOT = Path(__file__).resolve().parent.parent  # where ``-m benchmarks`` imports from
_SLAB = 512  # strings per slab: the first pass batches 512 records


def _apply_mode(mode: str) -> None:
    if mode == "plain":
        return
    import tensorflow as tf

    ds = tf.data.Dataset.from_generator(
        lambda: iter([np.int64(1)]), output_signature=tf.TensorSpec([], tf.int64)
    )
    for _ in ds:
        pass
    if mode == "tf-mallopt":
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        if not (
            libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 64 << 20)
        ):
            raise SystemExit("mallopt refused the thresholds")


def _puts_child(mode: str, tmp: Path, puts: int, value_bytes: int) -> dict[str, Any]:
    """Run in a fresh process: time the puts and the plain write into ``tmp``, return them.

    The parent makes ``tmp`` and removes it, also when this process is killed.
    """
    from storage_backends.lmdb_backend import LmdbBackend

    _apply_mode(mode)
    value = np.random.default_rng(0).integers(0, 256, value_bytes, dtype=np.uint8).tobytes()
    backend = LmdbBackend(str(tmp / "store"))
    seconds = []
    for i in range(puts):
        start = time.perf_counter()
        backend.put(f"chunks/{i:06d}", value)
        seconds.append(time.perf_counter() - start)
    if backend.get(f"chunks/{puts - 1:06d}") != value:
        raise SystemExit("the last value put did not read back")
    backend.close()
    start = time.perf_counter()
    with open(tmp / "plain.bin", "wb") as f:
        for _ in range(puts):
            f.write(value)
    return {"put_seconds": seconds, "write_seconds": time.perf_counter() - start}


def _build_child(mode: str, tmp: Path, records: int, builds: int) -> dict[str, Any]:
    """Run in a fresh process: time ``builds`` builds into ``tmp``, return the figures."""
    import threading

    import tensorflow as tf

    import yogastore
    from benchmarks._common import Case
    from benchmarks._varlen import make_records, memory_source
    from storage_backends.lmdb_backend import LmdbBackend

    # The images case's records and (g2) source of read_throughput (one dataset, made once).
    case = Case(name="images", records=records, shape=(), kind="images")
    made = memory_source(make_records(case))

    def source() -> tf.data.Dataset:
        return made

    if mode == "tf":
        _apply_mode("tf")
    iterations = []
    for _ in range(3):
        start = time.perf_counter()
        for _batch in source().batch(512).prefetch(2):
            pass
        iterations.append(time.perf_counter() - start)
    in_puts = [0.0]
    lock = threading.Lock()
    put = LmdbBackend._put

    def timed_put(self: Any, key: str, data: Any) -> None:
        start = time.perf_counter()
        try:
            put(self, key, data)
        finally:
            with lock:
                in_puts[0] += time.perf_counter() - start

    LmdbBackend._put = timed_put  # type: ignore[method-assign]
    store = yogastore.Store(str(tmp / "store"))
    store.cache("warm", "1", source)  # untimed: the process's first build pays one-time costs
    store.delete("warm", "1")
    out: dict[str, Any] = {"iterate": statistics.median(iterations), "builds": []}
    for i in range(builds):
        in_puts[0] = 0.0
        os.sync()
        cpu, start = time.thread_time(), time.perf_counter()
        ref = store.cache(f"build-{i}", "1", source)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        if ref.num_records != records:
            raise SystemExit(f"build {i} cached {ref.num_records} records of {records}")
        out["builds"].append({"seconds": wall, "in_puts": in_puts[0], "calling_cpu": cpu})
        store.delete(f"build-{i}", "1")
    return out


def _child(kind: str, mode: str, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Run ``--child-<kind> mode`` in a fresh process in a directory of its own, removed after."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    tmp = Path(tempfile.mkdtemp(dir=args.dir, prefix="build-parts-"))
    cmd = [sys.executable, "-m", "benchmarks.build_parts", f"--child-{kind}", mode]
    cmd += ["--dir", str(tmp), "--puts", str(args.puts), "--value-mb", str(args.value_mb)]
    cmd += ["--build-records", str(args.build_records), "--builds", str(args.builds)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=_ROOT)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode:
        raise SystemExit(f"{_MODES[mode]}: the child failed:\n{proc.stderr[-2000:]}")
    seen = "yes" if _TRIM_LOG in proc.stderr else "no"
    return json.loads(proc.stdout.strip().splitlines()[-1]), seen


def _run_builds(args: argparse.Namespace) -> list[str]:
    lines = [
        f"build: {args.builds} builds of {args.build_records} records of 2-24 KiB strings + "
        f"int64 label from in-memory tensors into {args.dir} (fresh process per mode; s)",
        f"{'process':28s} {'iterate':>8s} {'build':>7s} {'in puts':>8s} {'calling CPU':>12s}"
        "  tf.data set M_TRIM_THRESHOLD",
    ]
    for mode in ("tf-unused", "tf"):
        out, seen = _child("build", mode, args)
        for build in out["builds"]:
            lines.append(
                f"{_MODES[mode]:28s} {out['iterate']:8.3f} {build['seconds']:7.3f} "
                f"{build['in_puts']:8.3f} {build['calling_cpu']:12.3f}  {seen}"
            )
    return lines


def _run_puts(args: argparse.Namespace) -> list[str]:
    value_bytes = int(args.value_mb * 1e6)
    lines = [
        f"puts: {args.puts} values of {value_bytes:,} bytes, one commit each, into "
        f"{args.dir} (fresh process per row)",
        f"{'process':42s} {'ms/put':>8s} {'GB/s':>6s} {'first':>7s}  {'plain write GB/s':>16s}"
        "  tf.data set M_TRIM_THRESHOLD",
    ]
    for mode in ("plain", "tf", "tf-mallopt"):
        label = _MODES[mode]
        out, seen = _child("puts", mode, args)
        put_s = out["put_seconds"]
        median = statistics.median(put_s)
        nbytes = value_bytes * args.puts
        lines.append(
            f"{label:42s} {median * 1e3:8.2f} {value_bytes / median / 1e9:6.2f} "
            f"{put_s[0] * 1e3:7.2f}  {nbytes / out['write_seconds'] / 1e9:16.2f}  {seen}"
        )
    return lines


def _encode_seconds(
    strings: list[bytes], own_piece_bytes: int, repeats: int, chunk_bytes: int
) -> tuple[float, str]:
    """Best seconds of encoding ``strings`` into chunks, and a digest of the chunks."""
    import hashlib

    from yogastore.format import encode
    from yogastore.format.layout import ColumnSpec

    cols = [ColumnSpec("bytes", "string", ()), ColumnSpec("fixed", "int64", ())]
    buffers = [bytearray()]

    def into(length: int) -> bytearray:  # one buffer reused, as a build reuses a put chunk's
        if len(buffers[0]) < length:
            buffers[0] = bytearray(length + (1 << 20))
        return buffers[0]

    # Chunks of about chunk_bytes, each of slabs of _SLAB strings (the first pass's batches).
    # A chunk ends at the string that brings it to chunk_bytes, as the writer cuts them.
    chunks: list[list[list[bytes]]] = [[[]]]
    size = 0
    for string in strings:
        if size >= chunk_bytes:
            chunks.append([[]])
            size = 0
        if len(chunks[-1][-1]) == _SLAB:
            chunks[-1].append([])
        chunks[-1][-1].append(string)
        size += len(string)
    saved = encode._OWN_PIECE_BYTES
    encode._OWN_PIECE_BYTES = own_piece_bytes
    try:
        best, digest = float("inf"), ""
        for _ in range(repeats):
            hasher = hashlib.sha256()
            elapsed = 0.0
            for slabs in chunks:
                builder = encode.ChunkBuilder(cols)
                start = time.perf_counter()
                for slab in slabs:
                    n = len(slab)
                    shapes = np.ones((n, 0), np.int64)
                    builder.add_slab(encode.Slab(n, ((shapes, slab), np.arange(n, dtype=np.int64))))
                out = builder.encode(into)
                elapsed += time.perf_counter() - start
                hasher.update(out)
                del out
            best, digest = min(best, elapsed), hasher.hexdigest()
    finally:
        encode._OWN_PIECE_BYTES = saved
    return best, digest


def _run_strings(args: argparse.Namespace) -> list[str]:
    from yogastore.format.encode import _OWN_PIECE_BYTES
    from yogastore.store import DEFAULT_CHUNK_BYTES

    rng = np.random.default_rng(0)
    total = args.strings_mb * 1_000_000
    sets = [("2-24 KiB", rng.integers(2 << 10, (24 << 10) + 1, total // (13 << 10)))]
    for size in args.sizes:
        sets.append((f"{size} B", np.full(total // size, size)))
    lines = [
        f"strings: about {args.strings_mb} MB of distinct strings encoded into chunks of "
        f"{DEFAULT_CHUNK_BYTES / 2**20:.0f} MiB from slabs of {_SLAB}, best of {args.repeats}"
        + (", after from_generator" if args.after_from_generator else ""),
        f"{'strings':12s} {'count':>7s} {'MB':>6s} {'as pieces ms':>13s} {'joined ms':>10s} "
        f"{'build takes':>12s}",
    ]
    for label, lengths in sets:
        blob = rng.bytes(int(lengths.sum()))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        strings = [blob[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
        pieces_s, pieces = _encode_seconds(strings, 0, args.repeats, DEFAULT_CHUNK_BYTES)
        joined_s, joined = _encode_seconds(strings, 1 << 62, args.repeats, DEFAULT_CHUNK_BYTES)
        if pieces != joined:
            raise SystemExit(f"{label}: the two ways encoded different chunks")
        takes = "pieces" if lengths.mean() >= _OWN_PIECE_BYTES else "joined"
        lines.append(
            f"{label:12s} {len(lengths):7d} {len(blob) / 1e6:6.1f} {pieces_s * 1e3:13.1f} "
            f"{joined_s * 1e3:10.1f} {takes:>12s}"
        )
    return lines


def _sizes(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {value!r}") from None


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that the temporary directories are removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "puts", "strings", "build"), default="all")
    parser.add_argument("--puts", type=int, default=250, help="values put per process")
    parser.add_argument("--value-mb", type=float, default=4.4, help="MB per value")
    parser.add_argument("--dir", type=Path, default=None, help="where the puts go")
    parser.add_argument("--strings-mb", type=int, default=48, help="MB of strings per set")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=[512, 2048, 4096, 8192, 16384],
        help="comma-separated string lengths of the uniform sets, bytes",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--after-from-generator",
        action="store_true",
        help="encode the strings after tf.data's from_generator set the allocator",
    )
    parser.add_argument("--build-records", type=int, default=80_000, help="records per build")
    parser.add_argument("--builds", type=int, default=5, help="builds per process")
    parser.add_argument("--child-build", choices=("tf-unused", "tf"), help=argparse.SUPPRESS)
    parser.add_argument("--child-puts", choices=tuple(_MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.puts, args.strings_mb, args.repeats, args.build_records, args.builds) < 1:
        parser.error(
            "--puts, --strings-mb, --repeats, --build-records and --builds must be positive"
        )
    if not math.isfinite(args.value_mb) or int(args.value_mb * 1e6) < 1:
        parser.error("--value-mb must be a finite number of at least 0.000001")
    if not args.sizes or any(not 1 <= size <= args.strings_mb * 1_000_000 for size in args.sizes):
        parser.error("--sizes must be lengths from 1 byte to --strings-mb")
    if args.after_from_generator and args.part == "puts":
        parser.error("--after-from-generator applies to the strings part")
    if args.dir is None:
        args.dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not an existing directory")
    if not os.access(args.dir, os.W_OK | os.X_OK):
        parser.error(f"--dir {args.dir} is not writable")
    args.dir = args.dir.resolve()  # the children run from the repository root
    if args.child_puts:
        out = _puts_child(args.child_puts, args.dir, args.puts, int(args.value_mb * 1e6))
        print(json.dumps(out))
        return 0
    if args.child_build:
        print(json.dumps(_build_child(args.child_build, args.dir, args.build_records, args.builds)))
        return 0
    signal.signal(signal.SIGTERM, _on_sigterm)
    lines: list[str] = []
    if args.part in ("all", "puts"):
        lines += _run_puts(args)
    if args.part in ("all", "strings"):
        if args.after_from_generator:
            _apply_mode("tf")
        lines += ([""] if lines else []) + _run_strings(args)
    if args.part in ("all", "build"):
        lines += ([""] if lines else []) + _run_builds(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
