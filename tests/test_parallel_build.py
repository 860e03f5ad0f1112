"""The first pass across ranks (``Store.cache_parallel``), with real processes.

Three ranks on a local store and two on a moto server: every record once, in
the order of the parts; every rank gets the same manifest. A rank killed mid
part: the others fail at their timeout naming it, nothing is committed, and
a rerun of every rank redoes only the missing part. Intents of another
source are refused; ``list``, ``gc`` and ``delete`` deal with leftovers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore as y
from tests.backends.s3_support import shared_moto_bucket
from tests.parallel_support import (
    SPEC,
    blob,
    rank_worker,
    read_all,
    records,
    strided_order,
    two_ranks,
)
from yogastore.build.parallel import attempt_digest, held_rank_locks, intent_key

CTX = multiprocessing.get_context("spawn")
N = 600


def run_ranks(
    url: str, num_ranks: int, options: dict[int, dict[str, Any]] | None = None
) -> tuple[list[Any], list[Any]]:
    """Start one process per rank; return the processes and a queue of their reports."""
    queue = CTX.Queue()
    processes = [
        CTX.Process(
            target=rank_worker, args=(queue, url, r, num_ranks, N, (options or {}).get(r, {}))
        )
        for r in range(num_ranks)
    ]
    for p in processes:
        p.start()
    return processes, queue


def reports(queue: Any, count: int, timeout: float = 90) -> dict[int, tuple[str, Any, Any]]:
    out = {}
    deadline = time.monotonic() + timeout
    for _ in range(count):
        status, rank, value, ids = queue.get(timeout=max(deadline - time.monotonic(), 1))
        assert status != "error", value
        out[rank] = (status, value, ids)
    return out


def finish(processes: list[Any]) -> None:
    for p in processes:
        p.join(30)
        if p.is_alive():
            p.kill()


def check_committed(results: dict[int, tuple[str, Any, Any]], num_ranks: int) -> None:
    """Every rank committed or adopted one manifest holding every record once, in part order."""
    assert sorted(results) == list(range(num_ranks))
    assert {status for status, _, _ in results.values()} == {"ok"}
    docs = [json.loads(value) for _, value, _ in results.values()]
    for doc in docs:
        del doc["created"]  # who wrote it
    assert all(doc == docs[0] for doc in docs)
    assert all(ids == strided_order(N, num_ranks) for _, _, ids in results.values())
    keys = [c["key"] for c in docs[0]["chunks"]]
    assert any("-r0-" in k for k in keys) and any(f"-r{num_ranks - 1}-" in k for k in keys)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_three_ranks_on_a_local_store(store_dir: Path) -> None:
    processes, queue = run_ranks(str(store_dir), 3, {r: {"whole": True} for r in range(3)})
    try:
        check_committed(reports(queue, 3), 3)
    finally:
        finish(processes)
    store = y.Store(store_dir)
    ref = store.open("ds", "1")
    assert [(d.dataset_id, d.num_records) for d in store.list()] == [("ds", N)]
    # The winner removed the intent and the parts; nothing else is left.
    assert set(store.backend.list("ds/1/")) == ref.manifest.keys()
    assert not list(store_dir.glob("ds/*..n*"))  # the rank locks went with their ranks
    # A committed version is a hit: no source is read.
    again = store.cache_parallel(
        "ds", "1", lambda r, n: iter(()), rank=1, num_ranks=3, attempt="a2", spec=SPEC, timeout=0
    )
    assert again.manifest.build_id == ref.manifest.build_id


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killed_rank_fails_the_build_and_a_new_attempt_writes_every_part(
    store_dir: Path, tmp_path: Path
) -> None:
    counter = tmp_path / "calls.txt"
    slow = {"counter": str(counter), "delay": 0.05, "timeout": 3.0}
    fast = {"counter": str(counter), "timeout": 3.0}
    processes, queue = run_ranks(str(store_dir), 3, {0: fast, 1: fast, 2: slow})
    store = y.Store(store_dir)
    try:
        deadline = time.monotonic() + 60
        while not [k for k in store.backend.list("ds/1/") if "-r2-" in k]:
            assert time.monotonic() < deadline, "rank 2 never wrote a chunk"
            time.sleep(0.05)
        os.kill(processes[2].pid, signal.SIGKILL)
        results = reports(queue, 2)
    finally:
        finish(processes)
    for rank in (0, 1):
        status, message, _ = results[rank]
        assert status == "timeout"
        assert "ranks [2]" in message and "ds/1" in message
    keys = store.backend.list("ds/1/")
    assert "ds/1/manifest.json" not in keys
    assert sum(k.endswith(".json") and "/part-" in k for k in keys) == 2
    assert store.list() == []  # nothing visible without every part
    with pytest.raises(y.DatasetNotFoundError):
        store.open("ds", "1")

    # All ranks again, as a new attempt: every part is written again (the
    # parts of the failed attempt may come from another source).
    processes, queue = run_ranks(
        str(store_dir), 3, {r: {"counter": str(counter), "attempt": "a2"} for r in range(3)}
    )
    try:
        check_committed(reports(queue, 3), 3)
    finally:
        finish(processes)
    assert sorted(counter.read_text().split()) == ["0", "0", "1", "1", "2", "2"]
    ref = store.open("ds", "1")
    assert set(store.backend.list("ds/1/")) == ref.manifest.keys()


@pytest.mark.s3
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_ranks_on_s3(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{shared_moto_bucket(monkeypatch, 'par')}/store"
    fast_locks = {"store": {"lock_settle": 0.0, "lock_lease": 3.0, "lock_poll": 0.2}}
    processes, queue = run_ranks(url, 2, {r: {**fast_locks, "whole": True} for r in range(2)})
    try:
        check_committed(reports(queue, 2), 2)
    finally:
        finish(processes)
    store = y.Store(url)
    ref = store.open("ds", "1")
    assert set(store.backend.list("ds/1/")) == ref.manifest.keys()
    assert not any(k.endswith(".lock") for k in store.backend.list(""))


def one_rank_times_out(store: y.Store, source: Any = None, **options: Any) -> None:
    """Rank 0 of 2 (attempt "a1") writes its part and gives up waiting for rank 1."""
    with pytest.raises(y.BuildTimeoutError, match=r"ranks \[1\]"):
        store.cache_parallel(
            "ds",
            "1",
            source or (lambda: records(50)),
            rank=0,
            num_ranks=2,
            attempt="a1",
            spec=SPEC,
            progress=y.NullProgress(),
            timeout=0.1,
            **options,
        )


def shifted(n: int, offset: int) -> Any:
    for i in range(n):
        yield {"id": np.int64(offset + i), "blob": blob(offset + i)}


def test_a_new_attempt_never_uses_parts_of_a_failed_one(store_dir: Path) -> None:
    """A failed attempt's part (old source, no fingerprint) stays out of the new build."""
    store = y.Store(store_dir)
    one_rank_times_out(store)  # records 0..49, part 0 written
    refs = two_ranks(store, lambda: shifted(50, 10_000), "a2")  # the source changed
    assert refs[0].manifest.build_id == refs[1].manifest.build_id
    assert sorted(read_all(refs[0])) == list(range(10_000, 10_050))
    assert set(store.backend.list("ds/1/")) == refs[0].manifest.keys()  # a1 swept


def test_a_rank_started_twice_in_one_attempt_is_refused(store_dir: Path) -> None:
    store = y.Store(store_dir)
    one_rank_times_out(store)
    with pytest.raises(y.StaleCacheError, match="part 0 of 2 of attempt 'a1' is written"):
        one_rank_times_out(store)
    # Ranks that split the source themselves cannot join an attempt that strides it.
    with pytest.raises(y.StaleCacheError, match="split by every n-th element"):
        store.cache_parallel(
            "ds", "1", lambda r, n: shifted(5, r), rank=1, num_ranks=2, attempt="a1",
            spec=SPEC, timeout=0.1,
        )  # fmt: skip


def test_a_source_function_with_optional_parameters_returns_the_whole_source(
    store_dir: Path,
) -> None:
    def make_dataset(count: int = 30, base: int = 0) -> Any:
        return shifted(count, base)

    ref = y.Store(store_dir).cache_parallel(
        "ds", "1", make_dataset, rank=0, num_ranks=1, attempt="a1", spec=SPEC,
        progress=y.NullProgress(),
    )  # fmt: skip
    assert read_all(ref) == list(range(30))


def test_an_intent_of_another_source_is_refused(store_dir: Path) -> None:
    store = y.Store(store_dir)
    one_rank_times_out(store, fingerprint="v1")
    other_spec = {**SPEC, "id": y.ComponentSpec(shape=(), dtype="int32")}
    key = intent_key("ds", "1", 2, "a1")
    for spec, fingerprint, what in [
        (SPEC, "v2", "source fingerprint 'v1'"),
        (other_spec, "v1", "another schema"),
    ]:
        with pytest.raises(y.StaleCacheError, match="yogastore delete ds 1") as err:
            store.cache_parallel(
                "ds", "1", lambda: records(50), rank=1, num_ranks=2, attempt="a1", spec=spec,
                fingerprint=fingerprint, timeout=0.1,
            )  # fmt: skip
        assert key in str(err.value) and what in str(err.value)
    # Rank 1 of that attempt, late: rank 0 gave up, so its part is not trusted.
    with pytest.raises(y.StaleCacheError, match=r"ranks \[0\] were written by processes that"):
        store.cache_parallel(
            "ds", "1", lambda: records(50), rank=1, num_ranks=2, attempt="a1", spec=SPEC,
            fingerprint="v1", progress=y.NullProgress(),
        )  # fmt: skip
    assert store.list() == []
    refs = two_ranks(store, lambda: records(50), "a2", fingerprint="v1")
    assert read_all(refs[0]) == strided_order(50, 2)


def test_list_gc_and_delete_handle_leftovers(store_dir: Path) -> None:
    store = y.Store(store_dir, lock_timeout=0.5)
    one_rank_times_out(store)
    leftovers = store.backend.list("ds/1/")
    assert intent_key("ds", "1", 2, "a1") in leftovers
    assert store.list() == [] and store.versions() == [("ds", "1")]
    # A rank still running (its lock held) keeps gc and delete away.
    assert not store.building("ds", "1")
    with held_rank_locks(store.backend, "ds", "1", [(2, attempt_digest("a1"))], None):
        assert store.building("ds", "1")
        assert store.gc() == []
        with pytest.raises(y.LockTimeoutError):
            y.Store(store_dir, lock_timeout=0.2).delete("ds", "1")
    assert store.backend.list("ds/1/") == leftovers
    [entry] = store.gc()
    assert (entry.keys, entry.committed) == (len(leftovers), False)
    assert store.versions() == []

    one_rank_times_out(store)
    store.delete("ds", "1")
    assert store.versions() == []
    with pytest.raises(y.DatasetNotFoundError):
        store.delete("ds", "1")

    # Leftovers of a parallel build beside a committed version: gc takes them.
    store.cache("ds", "1", lambda: records(20), spec=SPEC, progress=y.NullProgress())
    store.backend.put(intent_key("ds", "1", 4, "x"), b"{}")
    [entry] = store.gc()
    assert entry.committed and entry.keys == 1
    assert [d.num_records for d in store.list()] == [20]


def test_tf_data_source_is_sharded_per_rank(store_dir: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    source = lambda: tf.data.Dataset.range(10)  # noqa: E731
    refs = two_ranks(y.Store(store_dir), source, "a1", dataset_id="tf", spec=None)
    assert refs[0].manifest.build_id == refs[1].manifest.build_id
    ids = [int(v) for b in refs[0].stream(shuffle=False).batches(4) for v in b]
    assert ids == [0, 2, 4, 6, 8, 1, 3, 5, 7, 9]


def test_worker_rank_of_a_strategy_cluster() -> None:
    tf = pytest.importorskip("tensorflow")
    from yogastore.distributed import worker_rank

    cluster = tf.train.ClusterSpec({"chief": ["a:1"], "worker": ["b:1", "c:1"]})
    for task_type, task_id, expected in [("chief", 0, (0, 3)), ("worker", 1, (2, 3))]:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster, task_type=task_type, task_id=task_id
        )
        assert worker_rank(types.SimpleNamespace(cluster_resolver=resolver)) == expected
    assert worker_rank(tf.distribute.OneDeviceStrategy("/cpu:0")) == (0, 1)


@pytest.mark.multiprocess
def test_benchmark_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from benchmarks import parallel_build

    parallel_build.main(["--records=40", "--rounds=1", f"--work-dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "1 builder(s)" in out and "2 builder(s)" in out and "x vs 1 builder" in out


def test_cache_and_cache_parallel_of_one_version_end_with_one_manifest(store_dir: Path) -> None:
    store = y.Store(store_dir)
    started = threading.Event()
    built: dict[str, Any] = {}

    def slow() -> Any:
        started.set()
        for record in records(40):
            time.sleep(0.01)
            yield record

    def single() -> None:
        built["cache"] = store.cache("ds", "1", slow, spec=SPEC, progress=y.NullProgress())

    thread = threading.Thread(target=single)
    thread.start()
    assert started.wait(30)
    # The rank waits for the build lock, then finds the committed version: a hit.
    ref = store.cache_parallel(
        "ds", "1", lambda: records(40), rank=0, num_ranks=1, attempt="a1", spec=SPEC, timeout=5
    )
    thread.join(30)
    assert ref.manifest.build_id == built["cache"].manifest.build_id
    assert not any("-r0-" in c.key for c in ref.manifest.chunks)  # no part was written
    assert read_all(ref) == list(range(40))
    assert set(store.backend.list("ds/1/")) == ref.manifest.keys()


def test_distributed_helper_names_the_attempt_and_explains_a_missing_horovod(
    store_dir: Path,
) -> None:
    tf = pytest.importorskip("tensorflow")
    from yogastore import distributed as yd

    store = y.Store(store_dir)
    ref = yd.cache_parallel(
        store, "ds", "1", lambda: records(20), strategy=tf.distribute.OneDeviceStrategy("/cpu:0"),
        spec=SPEC, progress=y.NullProgress(),
    )  # fmt: skip
    assert read_all(ref) == list(range(20))
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError:
        with pytest.raises(y.InvalidArgumentError, match="pass strategy="):
            yd.cache_parallel(store, "ds", "2", lambda: records(20), spec=SPEC)


def test_two_launches_at_once_end_with_one_dataset(store_dir: Path) -> None:
    """Rank locks are per attempt: concurrent launches do not wait for each other's ranks."""
    store = y.Store(store_dir)
    refs: dict[tuple[str, int], Any] = {}

    def rank(attempt: str, r: int) -> None:
        try:
            refs[attempt, r] = store.cache_parallel(
                "ds", "1", lambda: shifted(40, 0), rank=r, num_ranks=2, attempt=attempt,
                spec=SPEC, progress=y.NullProgress(), timeout=60,
            )  # fmt: skip
        except Exception as err:  # reported below
            refs[attempt, r] = err

    threads = [threading.Thread(target=rank, args=(a, r)) for a in ("x", "y") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(isinstance(v, y.DatasetRef) for v in refs.values()), refs
    assert len({v.manifest.build_id for v in refs.values()}) == 1
    assert sorted(read_all(refs["x", 0])) == list(range(40))
