"""First-pass progress off a terminal: bytes so far in every line, a line per batch."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

import yogastore
from yogastore.build.progress import LineProgress

LINE = re.compile(r": (\d+)/(\d+) records, [\d.]+%, ([\d.]+) (B|KB|MB), ")


def _build(
    tmp_path: Path, make: Any, spec: Any = None, total: int = 100
) -> list[tuple[int, float]]:
    """Cache ``make()`` with a line per update; return (records, bytes) of each periodic line."""
    ticks = iter(range(10**6))
    out = io.StringIO()
    progress = LineProgress(
        "caching p/1", total, interval=0.5, stream=out, clock=lambda: next(ticks)
    )
    yogastore.Store(tmp_path).cache("p", "1", make, spec=spec, progress=progress)
    lines = out.getvalue().strip().splitlines()
    done = f"caching p/1: {total}/{total} records, 100.0%"
    assert lines[-1].startswith(done) and "done in" in lines[-1]
    scale = {"B": 1, "KB": 1e3, "MB": 1e6}
    rows = []
    for line in lines[:-1]:
        match = LINE.search(line)
        assert match, line
        rows.append((int(match[1]), float(match[3]) * scale[match[4]]))
    return rows


def test_fixed_tf_source_counts_in_full_batches(tmp_path: Path) -> None:
    def make() -> tf.data.Dataset:
        ds = tf.data.Dataset.range(1300)
        return ds.map(lambda i: {"x": tf.fill([8], tf.cast(i, tf.float32))})

    rows = _build(tmp_path, make, total=1300)
    assert [n for n, _ in rows] == [512, 1024, 1300], "batches of 512, then the rest"
    # 32 bytes per record; sizes are printed to 0.1 KB.
    assert all(b >= 32 * n - 50 for n, b in rows), "each line shows the bytes of its records"
    ref = yogastore.Store(tmp_path).open("p", "1")
    got = [float(e["x"][0]) for e in ref.stream(shuffle=False)]
    assert got == [float(i) for i in range(1300)], "records in order, none lost at batch edges"


def test_text_tf_source_shows_bytes_before_the_first_chunk(tmp_path: Path) -> None:
    def make() -> tf.data.Dataset:
        return tf.data.Dataset.range(100).map(lambda i: tf.strings.as_string(i))

    rows = _build(tmp_path, make)
    assert rows[0][0] == 100, "one batch"
    assert all(b > 0 for _, b in rows), "no line says 0 B"
    assert [n for n, _ in rows] == sorted(n for n, _ in rows)
    ref = yogastore.Store(tmp_path).open("p", "1")
    assert [bytes(e) for e in ref.stream(shuffle=False)] == [str(i).encode() for i in range(100)]


def test_iterable_source_shows_bytes_per_record(tmp_path: Path) -> None:
    spec = yogastore.ComponentSpec(shape=(4,), dtype="int64")
    rows = _build(tmp_path, lambda: [np.full(4, i, np.int64) for i in range(100)], spec)
    assert rows[0][0] == 1
    assert rows[0][1] >= 32 and rows[-1][1] > rows[0][1], "bytes grow with the records"
