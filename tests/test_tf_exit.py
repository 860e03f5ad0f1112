"""A process ends while a ``to_tf_dataset`` iterator is still alive (real processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# One iterator, alive when the script ends straight after taking a batch: tf.data's
# read-ahead thread is then still in the generator. KIND picks the generator: groups
# of fixed-shape batches, groups of strings and ragged batches, records one at a time,
# or fixed-shape batches of a file cut short with the error not yet taken.
SCRIPT = r"""
import os, sys
import numpy as np
import tensorflow as tf
import yogastore

root, kind = sys.argv[1], sys.argv[2]
if kind == "late":
    # An exit handler of the caller's, registered before any generator ran, so it runs
    # after yogastore's: a dataset made there reads every record.
    import atexit
    def read_all_at_exit():
        ds = yogastore.Store(root).open("d", "1").stream(0, 1).to_tf_dataset(64)
        print("at exit", sum(int(tf.shape(b["x"])[0]) for b in ds), flush=True)
    atexit.register(read_all_at_exit)
rng = np.random.default_rng(0)
if kind in ("fixed", "cut", "idle", "late"):
    x = rng.integers(0, 256, (20000, 300), dtype=np.uint8)
    source = lambda: tf.data.Dataset.from_tensor_slices({"x": x})
else:
    sizes = rng.integers(0, 400, 5000)
    texts = [bytes(rng.integers(97, 123, int(n), dtype=np.uint8)) for n in sizes]
    tokens = tf.ragged.constant([list(range(int(n))) for n in rng.integers(0, 30, 5000)])
    source = lambda: tf.data.Dataset.from_tensor_slices({"s": texts, "t": tokens})
ref = yogastore.Store(root, chunk_bytes=1 << 16).cache("d", "1", source)
stream = ref.stream(0, 1, shuffle=True, seed=0)
it = iter(stream.to_tf_dataset(None if kind == "records" else 64))
batch = next(it)
if kind == "cut":
    batches = [next(it) for _ in range(2)]
    os.truncate(os.path.join(root, "d", "1", "data.mdb"), 8192)
if kind == "idle":  # a slow consumer: the read-ahead is full and idle, then one more batch
    import time
    for _ in range(3):
        time.sleep(0.3)
        batch = next(it)
print("ending", kind, flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["fixed", "fixed", "strings", "records", "cut", "idle", "late"])
def test_a_process_with_a_live_iterator_exits(tmp_path: Path, kind: str) -> None:
    # Before the generators were ended at exit, such a process hung in TensorFlow's
    # teardown of the iterator in most runs (5 of 6 with fixed-shape records).
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path), kind],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{kind}: the process did not exit within 120 s: {err.stderr!r}"[-3000:])
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    if kind == "late":
        assert lines[-2:] == ["ending late", "at exit 20000"], lines
    else:
        assert lines[-1] == f"ending {kind}"
