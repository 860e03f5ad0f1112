"""Runs inside the YogaDL virtual environment: build its cache, then read it as documented.

Usage: ``<yogadl venv>/bin/python benchmarks/_yogadl_worker.py CONFIG.json`` with the
repository root on ``PYTHONPATH`` (only ``benchmarks._common``'s numpy helpers are used).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import Case, Verifier, peak_rss_mib, tfrecord_source


def main(cfg_path: str) -> None:
    cfg = json.loads(Path(cfg_path).read_text())
    case = Case(**{**cfg["case"], "shape": tuple(cfg["case"]["shape"])})
    import tensorflow as tf
    import yogadl
    import yogadl.storage
    import yogadl.tensorflow

    storage = yogadl.storage.LFSStorage(yogadl.storage.LFSConfigurations(cfg["storage"]))

    @storage.cacheable("bench", "1")
    def make() -> Any:
        return tfrecord_source(Path(cfg["tfrecord"]), case)

    start = time.perf_counter()
    ref = make()
    build_seconds = time.perf_counter() - start

    stream = ref.stream(
        shuffle=True,
        shuffle_seed=case.seed,
        shard_rank=case.shard_rank,
        num_shards=case.num_shards,
    )
    rank_keys = yogadl.shard_keys(
        keys=[f"{i:08}".encode("ascii") for i in range(len(ref))],
        shard_index=case.shard_rank,
        num_shards=case.num_shards,
        sequential=False,
        drop_shard_remainder=False,
    )
    limit = min(len(stream), cfg["max_records"])
    batches = math_ceil(limit, case.batch_size)
    ds = yogadl.tensorflow.make_tf_dataset(stream).batch(case.batch_size)
    ds = ds.take(batches).prefetch(tf.data.AUTOTUNE)
    data = np.load(cfg["data"], mmap_mode="r")
    verifier = Verifier(data)
    # Checking costs well under 1% of YogaDL's per-record time, so one pass both
    # times and verifies.
    start = time.perf_counter()
    for batch in ds:
        verifier.add(batch["x"].numpy(), batch["y"].numpy())
    seconds = time.perf_counter() - start
    got = np.concatenate(verifier.labels) if verifier.labels else np.empty(0, np.int64)
    allowed = {int(k) for k in rank_keys}
    labels_ok = len(set(got.tolist())) == len(got) and set(got.tolist()) <= allowed
    check = verifier.result(got)
    check["labels_match"] = labels_ok and check["records"] == min(
        len(stream), batches * case.batch_size
    )
    check["ok"] = check["ok"] and check["labels_match"]
    out = {
        "key": "f",
        "name": "YogaDL 0.1.4 make_tf_dataset(stream(shuffle, shards)).batch",
        "rate": len(got) / seconds if seconds > 0 else 0.0,
        "records_per_run": len(got),
        "seconds": [seconds],
        "build_seconds": build_seconds,
        "runs_ok": check["ok"],
        "verified": check,
        "peak_rss_mib": peak_rss_mib(),
        "yogadl_version": getattr(yogadl, "__version__", "0.1.4"),
        "tensorflow_version": tf.__version__,
        "error": None,
        "note": f"build {build_seconds:.2f}s; first {len(got)} records of its stream",
    }
    out["mb_per_s"] = out["rate"] * case.payload_bytes / 1e6
    Path(cfg["out"]).write_text(json.dumps(out))


def math_ceil(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    main(sys.argv[1])
