"""Worker processes of the work queue tests (importable by spawned children)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import yogastore as y

SPEC = {"id": y.ComponentSpec(shape=(), dtype="int64")}


def id_records(n: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {"id": np.int64(i)}


def build(url: str, n: int) -> y.DatasetRef:
    store = y.Store(url, chunk_bytes=8 << 10)
    return store.cache("d", "1", lambda: id_records(n), spec=SPEC, progress=y.NullProgress())


def queue_worker(
    url: str,
    job: str,
    worker: str,
    out: str,
    options: dict[str, Any],
    delay: float = 0.0,
    stall_after: int | None = None,
) -> None:
    """Read ``worker``'s claims of ``job`` in batches of 10, appending ids to ``out``.

    With ``stall_after``, the worker stops (sleeps) once it has consumed that
    many records and writes ``out + ".stalled"``: the test then kills it.
    """
    ref = y.Store(url).open("d", "1")
    stream = ref.work_queue(job, **options).stream(worker, prefetch=0)
    # Start together: process start-up times differ more than the reading does.
    Path(out + ".ready").touch()
    go = Path(out).parent / "go"
    while not go.exists():
        time.sleep(0.01)
    taken = 0
    with open(out, "a") as f:
        for batch in stream.batches(10):
            f.write(json.dumps([int(i) for i in batch["id"]]) + "\n")
            f.flush()
            taken += len(batch["id"])
            if stall_after is not None and taken >= stall_after:
                Path(out + ".stalled").write_text(str(os.getpid()))
                time.sleep(600)
            if delay:
                time.sleep(delay)
    Path(out + ".done").write_text(str(taken))


def read_ids(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [i for line in path.read_text().splitlines() for i in json.loads(line)]
