"""Cost of checking an LMDB file's structure before its first read.

Run: ``python -m benchmarks.lmdb_verify_cost [--mb 512] [--chunk-kb 64]``.

Builds a store of ``--mb`` MB in ``--chunk-kb`` KB chunks in a temporary
directory, then times ``lmdb.verify.verify`` on it (what the local backend
runs once per commit before reading) against reading every chunk once.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import lmdb.verify
import numpy as np

import yogastore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--chunk-kb", type=int, default=64)
    args = parser.parse_args()
    spec = {"x": yogastore.ComponentSpec(shape=(4096,), dtype="uint8")}
    n = args.mb * 256
    with tempfile.TemporaryDirectory() as tmp:
        store = yogastore.Store(tmp, chunk_bytes=args.chunk_kb << 10)
        ref = store.cache(
            "d",
            "1",
            lambda: ({"x": np.full(4096, i % 251, np.uint8)} for i in range(n)),
            spec=spec,
            progress=yogastore.NullProgress(),
        )
        path = Path(tmp) / "d" / "1"
        started = time.perf_counter()
        problems = lmdb.verify.verify(str(path))
        verify_s = time.perf_counter() - started
        assert not problems, problems
        started = time.perf_counter()
        total = sum(len(store.backend.get(c.key)) for c in ref.manifest.chunks)
        read_s = time.perf_counter() - started
        size = (path / "data.mdb").stat().st_size
        print(
            f"{size / 1e6:.0f} MB file, {len(ref.manifest.chunks)} chunks of {args.chunk_kb} KB: "
            f"verify {verify_s * 1e3:.1f} ms; get every chunk {read_s * 1e3:.1f} ms "
            f"({total / 1e6:.0f} MB, includes the verify of the first get)"
        )


if __name__ == "__main__":
    main()
