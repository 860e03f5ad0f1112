"""The dynamic work queue: claims, leases, takeovers, resume, real processes."""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore as y
from tests.backends.s3_support import shared_moto_bucket
from tests.queue_support import build, queue_worker, read_ids
from yogastore.queue.work_queue import lockstep
from yogastore.read import waits

CTX = multiprocessing.get_context("spawn")


def ids_of(stream: Any, batch: int = 10) -> list[int]:
    return [int(i) for b in stream.batches(batch) for i in b["id"]]


@pytest.fixture
def ref(store_dir: Path) -> y.DatasetRef:
    return build(str(store_dir), 1000)


@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
def test_one_worker_reads_the_streams_order_once_per_epoch(
    ref: y.DatasetRef, shuffle: bool
) -> None:
    queue = ref.work_queue("j", num_slices=7, shuffle=shuffle, seed=3, num_epochs=2)
    got = ids_of(queue.stream("w0"))
    want = ids_of(ref.stream(shuffle=shuffle, seed=3, num_epochs=2))
    assert got == want
    assert sorted(got[:1000]) == list(range(1000)) == sorted(got[1000:])
    status = queue.status()
    assert status.finished and status.slices == 14 and status.workers == {"w0": 14}
    # A second worker of a finished job gets nothing.
    assert ids_of(queue.stream("late")) == []


def test_threads_share_the_epoch_exactly_once(ref: y.DatasetRef) -> None:
    queue = ref.work_queue("j", num_slices=50, seed=1, num_epochs=2)
    results: dict[str, list[int]] = {}

    def work(name: str) -> None:
        results[name] = ids_of(queue.stream(name), batch=7)

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counts = collections.Counter(i for ids in results.values() for i in ids)
    assert set(counts) == set(range(1000)) and set(counts.values()) == {2}
    assert sum(queue.status().workers.values()) == 100


def test_jobs_are_independent_and_deletable(ref: y.DatasetRef) -> None:
    a = ref.work_queue("job-a", num_slices=5)
    b = ref.work_queue("job-b", num_slices=5)
    assert sorted(ids_of(a.stream("x"))) == list(range(1000))
    assert b.status().done == 0 and b.status().free == 5
    assert sorted(ids_of(b.stream("x"))) == list(range(1000))
    a.delete()
    assert a.status().done == 0 and b.status().finished
    assert [d.dataset_id for d in ref.store.list()] == ["d"]


def test_workers_must_agree_on_the_job(ref: y.DatasetRef) -> None:
    ref.work_queue("j", num_slices=5, seed=1).stream("a")
    with pytest.raises(y.InvalidArgumentError, match="seed"):
        ref.work_queue("j", num_slices=5, seed=2).stream("b")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_slices": 0},
        {"num_slices": True},
        {"lease_seconds": 0},
        {"num_epochs": 0},
        {"seed": -1},
    ],
    ids=["no-slices", "bool-slices", "zero-lease", "no-epochs", "negative-seed"],
)
def test_bad_arguments_are_refused(ref: y.DatasetRef, kwargs: dict[str, Any]) -> None:
    with pytest.raises(y.InvalidArgumentError):
        ref.work_queue("j", **kwargs)


@pytest.mark.parametrize(
    "name",
    ["", "a/b", "../x", "x" * 201, ".hidden"],
    ids=["empty", "slash", "dots", "long", "hidden"],
)
def test_bad_names_are_refused(ref: y.DatasetRef, name: str) -> None:
    with pytest.raises(y.InvalidArgumentError):
        ref.work_queue(name)
    with pytest.raises(y.InvalidArgumentError):
        ref.work_queue("j").stream(name)


def test_expired_lease_is_taken_over_and_read_whole(ref: y.DatasetRef) -> None:
    queue = ref.work_queue("j", num_slices=10, lease_seconds=0.3)
    dead = queue.stream("dead", prefetch=0)
    it = dead.batches(10)
    seen = [int(i) for _ in range(3) for i in next(it)["id"]]  # 30 of its 100
    dead.claims.close()  # stops renewing: as if the process had died
    time.sleep(0.5)
    alive = queue.stream("alive")
    got = ids_of(alive)
    assert alive.claims.takeovers == 1
    assert sorted(got) == list(range(1000))  # its slice was read again whole
    assert set(seen) <= set(got)
    assert queue.status().finished


def test_live_lease_is_not_taken(ref: y.DatasetRef) -> None:
    # The lease is renewed every lease/3; the margin must survive a loaded machine.
    queue = ref.work_queue("j", num_slices=10, lease_seconds=1.0)
    slow = queue.stream("slow", prefetch=0)
    it = slow.batches(10)
    first = [int(i) for i in next(it)["id"]]
    other = queue.stream("other")
    results: list[int] = []
    t = threading.Thread(target=lambda: results.extend(ids_of(other)))
    t.start()
    rest: list[int] = []
    for batch in it:  # slow steps for several lease periods: the renewer keeps the claim
        time.sleep(0.25)
        rest += [int(i) for i in batch["id"]]
    t.join(30)
    assert other.claims.takeovers == 0
    counts = collections.Counter(first + rest + results)
    assert set(counts) == set(range(1000)) and set(counts.values()) == {1}


def test_stream_without_wait_ends_while_another_holds_a_slice(ref: y.DatasetRef) -> None:
    queue = ref.work_queue("j", num_slices=4, lease_seconds=30, shuffle=False)
    holder = queue.stream("holder", prefetch=0)
    it = holder.batches(10)
    assert [int(i) for i in next(it)["id"]] == list(range(10))  # holds slice 0: [0, 250)
    rest = ids_of(queue.stream("sync", wait=False))  # would wait 30 s for slice 0 otherwise
    assert sorted(rest) == list(range(250, 1000))
    assert queue.status().claimed == 1
    assert len([i for b in it for i in b["id"]]) == 240
    assert queue.status().finished


def test_a_worker_waiting_for_a_slice_stops_when_the_process_exits(
    ref: y.DatasetRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    # to_tf_dataset's exit handler calls waits.end_waits: a generator waiting for another
    # worker's slice must then stop, or tf.data's teardown waits for it. (end_waits would
    # end every wait of this test process: the count it raises is raised for this test.)
    queue = ref.work_queue("j", num_slices=4, lease_seconds=30, shuffle=False)
    holder = queue.stream("holder", prefetch=0)
    it = holder.batches(10)
    next(it)  # holds slice 0: [0, 250)
    waiter = queue.stream("waiter", prefetch=0)
    got: list[int] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            got.extend(ids_of(waiter))
        except BaseException as err:
            errors.append(err)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while waiter.claims.claims < 3 and time.monotonic() < deadline:  # slices 1-3 read
        time.sleep(0.01)
    time.sleep(0.3)  # now waiting for slice 0 (for 30 s, until its lease expired)
    monkeypatch.setattr(waits, "_generation", waits.current() + 1)
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], waits.ProcessExiting), errors
    assert queue.status().claimed == 1  # slice 0, still the holder's
    monkeypatch.undo()  # (the holder's waits would end too)
    assert len([i for b in it for i in b["id"]]) == 240
    assert queue.status().finished


def test_resume_from_a_checkpoint_with_fewer_workers(ref: y.DatasetRef) -> None:
    queue = ref.work_queue("j", num_slices=16, seed=9, num_epochs=2)
    streams = [queue.stream(f"w{r}", prefetch=0) for r in range(4)]
    iters = [s.batches(10) for s in streams]
    before: list[int] = []
    taken = [0] * 4
    for step in range(23):  # interleaved steps, uneven per worker
        for r in range(4 if step < 20 else 2):
            before += [int(i) for i in next(iters[r])["id"]]
            taken[r] += 10
    states = [s.state(taken[r]) for r, s in enumerate(streams)]
    merged = y.WorkQueueState.merge(states)
    assert merged.remaining_records == 2000 - len(before)
    text = merged.to_json()
    for s in streams:
        s.claims.close()

    resumed = ref.work_queue("j", resume=text)
    results: dict[int, list[int]] = {}
    workers = [resumed.stream(f"v{r}") for r in range(3)]
    threads = [
        threading.Thread(target=lambda r=r: results.__setitem__(r, ids_of(workers[r])))
        for r in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = [i for ids in results.values() for i in ids]
    counts = collections.Counter(before + after)
    assert set(counts) == set(range(1000)) and set(counts.values()) == {2}
    # A state of the resumed job still counts what the first run consumed.
    final = y.WorkQueueState.merge(w.state(len(results[r])) for r, w in enumerate(workers))
    assert final.remaining_records == 0


def test_state_json_is_checked(ref: y.DatasetRef) -> None:
    with pytest.raises(y.InvalidArgumentError):
        y.WorkQueueState.from_json("[" * 100_000)
    with pytest.raises(y.InvalidArgumentError):
        y.WorkQueueState.from_json('{"yogastore_queue_state": 1}')
    state = ref.work_queue("j").stream("w").state(0)
    assert y.WorkQueueState.from_json(state.to_json()) == state
    other = build(str(Path(ref.store.url).parent / "other"), 10)
    with pytest.raises(y.InvalidArgumentError, match="belongs to"):
        other.work_queue("j", resume=state)


def test_lockstep_keeps_every_rank_stepping_until_all_are_done() -> None:
    # Three ranks with 2, 5 and 3 batches; "any rank has data" is a max all-reduce.
    lengths = [2, 5, 3]
    steps = []
    for n in lengths:
        step = iter(range(1, 100))
        # The max all-reduce of "has data": true while the longest rank has batches.
        steps.append(list(lockstep(range(n), lambda f, s=step: next(s) <= max(lengths))))
    assert [len(s) for s in steps] == [5, 5, 5]
    assert steps[0] == [0, 1, None, None, None]


# Real processes ----------------------------------------------------------------


def run_workers(
    url: str, tmp_path: Path, options: dict[str, Any], delays: list[float], victim: int | None
) -> dict[str, list[int]]:
    job = f"job-{uuid.uuid4().hex[:6]}"
    procs = {}
    for w, delay in enumerate(delays):
        out = str(tmp_path / f"w{w}.ids")
        stall = 55 if w == victim else None
        procs[w] = CTX.Process(
            target=queue_worker, args=(url, job, f"w{w}", out, options, delay, stall)
        )
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + 180
    try:
        while not all((tmp_path / f"w{w}.ids.ready").exists() for w in procs):
            assert time.monotonic() < deadline and all(p.exitcode is None for p in procs.values())
            time.sleep(0.05)
        (tmp_path / "go").touch()
        if victim is not None:
            stalled = tmp_path / f"w{victim}.ids.stalled"
            while not stalled.exists():
                assert time.monotonic() < deadline and procs[victim].exitcode is None
                time.sleep(0.05)
            os.kill(procs[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
        for w, p in procs.items():
            p.join(max(deadline - time.monotonic(), 1))
            assert p.exitcode == (-signal.SIGKILL if w == victim else 0), (w, p.exitcode)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    return {f"w{w}": read_ids(tmp_path / f"w{w}.ids") for w in procs}


def check_slow_and_killed(got: dict[str, list[int]], n: int, slice_len: int) -> None:
    counts = collections.Counter(i for ids in got.values() for i in ids)
    assert set(counts) == set(range(n))  # every record consumed
    repeats = {i for i, c in counts.items() if c > 1}
    assert max(counts.values()) <= 2
    # Only the killed worker's unfinished slice is read twice.
    victim = got["w3"]
    assert repeats <= set(victim[len(victim) - len(victim) % slice_len :])
    assert len(repeats) <= slice_len
    fast = [len(got[w]) for w in ("w0", "w1")]
    assert len(got["w2"]) < 0.75 * min(fast)  # the 3x slower worker took clearly fewer


@pytest.mark.multiprocess
def test_processes_slow_and_killed_worker_local(store_dir: Path, tmp_path: Path) -> None:
    n = 3000
    build(str(store_dir), n)
    options = {"num_slices": 30, "lease_seconds": 1.5, "shuffle": True, "seed": 4}
    got = run_workers(str(store_dir), tmp_path, options, [0.02, 0.02, 0.06, 0.02], victim=3)
    check_slow_and_killed(got, n, 100)


@pytest.mark.multiprocess
@pytest.mark.s3
def test_processes_slow_and_killed_worker_s3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{shared_moto_bucket(monkeypatch, 'q')}/store"
    n = 2000
    build(url, n)
    # Requests to a moto server in the test process are slow (tens of ms): a
    # lease must outlast a few of them under load.
    options = {"num_slices": 40, "lease_seconds": 5.0, "shuffle": True, "seed": 4}
    got = run_workers(url, tmp_path, options, [0.1, 0.1, 0.3, 0.1], victim=3)
    check_slow_and_killed(got, n, 50)


@pytest.mark.multiprocess
def test_eight_processes_contending_never_share_a_slice(store_dir: Path, tmp_path: Path) -> None:
    n = 2000
    build(str(store_dir), n)
    options = {"num_slices": 200, "lease_seconds": 30, "shuffle": False}
    got = run_workers(str(store_dir), tmp_path, options, [0.0] * 8, victim=None)
    counts = collections.Counter(i for ids in got.values() for i in ids)
    assert set(counts) == set(range(n)) and set(counts.values()) == {1}
    assert sum(1 for ids in got.values() if ids) >= 2  # they really contended
    assert np.all(np.diff(sorted(counts)) == 1)
