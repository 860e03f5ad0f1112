"""Child processes of the parallel first pass tests (importable by spawned children)."""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

import yogastore as y

SPEC = {
    "id": y.ComponentSpec(shape=(), dtype="int64"),
    "blob": y.ComponentSpec(shape=(), dtype="string"),
}


def blob(i: int) -> bytes:
    return b"%06d" % i * (1 + i % 37)


def records(n: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {"id": np.int64(i), "blob": blob(i)}


def strided_order(n: int, num_ranks: int) -> list[int]:
    """The record order of a parallel build of ``records(n)`` over ``num_ranks`` ranks."""
    return [i for rank in range(num_ranks) for i in range(rank, n, num_ranks)]


def read_all(ref: y.DatasetRef) -> list[int]:
    """Return the ids in stored order, checking every blob against its id."""
    ids: list[int] = []
    for batch in ref.stream(shuffle=False).batches(128):
        got = [int(i) for i in batch["id"]]
        assert [bytes(b) for b in batch["blob"]] == [blob(i) for i in got]
        ids += got
    return ids


def part_records(counter: str, n: int, rank: int, num_ranks: int, delay: float) -> Any:
    """Rank ``rank``'s records of ``records(n)``, noting the call in ``counter``."""
    with open(counter, "a") as f:
        f.write(f"{rank}\n")
    for i in range(rank, n, num_ranks):
        if delay:
            time.sleep(delay)
        yield {"id": np.int64(i), "blob": blob(i)}


def rank_worker(
    queue: Any,
    url: str,
    rank: int,
    num_ranks: int,
    n: int,
    options: dict[str, Any],
) -> None:
    """Take part in a parallel build and report what this rank got.

    ``options``: ``whole`` (make_dataset returns every record; the library
    strides it), ``attempt`` (default ``"a1"``), ``counter``, ``delay``
    (seconds per record of this rank), ``timeout``, ``store`` (Store keywords).
    """
    try:
        store = y.Store(url, chunk_bytes=4 << 10, **options.get("store", {}))
        counter = options.get("counter", os.devnull)
        delay = options.get("delay", 0.0)

        def part(r: int, k: int) -> Any:
            return part_records(counter, n, r, k, delay)

        ref = store.cache_parallel(
            "ds",
            "1",
            (lambda: records(n)) if options.get("whole") else part,
            rank=rank,
            num_ranks=num_ranks,
            attempt=options.get("attempt", "a1"),
            spec=SPEC,
            progress=y.NullProgress(),
            timeout=options.get("timeout", 60.0),
        )
        queue.put(("ok", rank, ref.manifest.to_json(), read_all(ref)))
    except y.BuildTimeoutError as err:
        queue.put(("timeout", rank, str(err), None))
    except BaseException:
        queue.put(("error", rank, traceback.format_exc(), None))
        raise


def two_ranks(
    store: y.Store, source: Any, attempt: str, dataset_id: str = "ds", **options: Any
) -> list[y.DatasetRef]:
    """Run ranks 0 and 1 of one attempt in threads; return their refs."""
    refs: dict[int, y.DatasetRef] = {}
    options.setdefault("spec", SPEC)

    def rank(r: int) -> None:
        refs[r] = store.cache_parallel(
            dataset_id, "1", source, rank=r, num_ranks=2, attempt=attempt,
            progress=y.NullProgress(), timeout=30, **options,
        )  # fmt: skip

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [refs[0], refs[1]]
