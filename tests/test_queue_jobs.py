"""Work queue jobs in a store: status, listing, deletion, the ``queue`` command line."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import yogastore as y
from tests.backends.s3_support import create_bucket, fake_credentials
from tests.queue_support import SPEC, id_records
from yogastore.cli import main

N = 600


@pytest.fixture(params=["lmdb", "s3"], ids=["lmdb", "moto"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[y.Store]:
    if request.param == "lmdb":
        yield y.Store(str(tmp_path / "store"), chunk_bytes=8 << 10)
        return
    from moto import mock_aws

    fake_credentials(monkeypatch)
    with mock_aws():
        create_bucket(None, "queue-jobs")
        yield y.Store(
            "s3://queue-jobs/cache",
            chunk_bytes=8 << 10,
            lock_settle=0.0,
            cache_dir=tmp_path / "read-cache",
        )


def build(store: y.Store, version: str = "1") -> y.DatasetRef:
    return store.cache("d", version, lambda: id_records(N), spec=SPEC, progress=y.NullProgress())


def take(stream: y.QueueStream, batches: int) -> list[int]:
    it = stream.batches(10)
    return [int(i) for _ in range(batches) for i in next(it)["id"]]


def test_status_counts_done_claimed_expired_and_free(
    store: y.Store, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = build(store)
    queue = ref.work_queue("j", num_slices=6, num_epochs=2, lease_seconds=0.3, shuffle=False)
    finisher = queue.stream("fin", prefetch=0)
    take(finisher, 11)  # slice 0 (100 records) done, slice 1 claimed
    finisher.claims.close()  # stops renewing: slice 1's lease expires
    time.sleep(0.5)
    live = queue.stream("live", prefetch=0)
    take(live, 1)  # claims the next slice: the expired one is taken over first
    status = queue.status()
    # An object store's read-ahead may claim one slice more: count what is held.
    held = status.claimed
    assert (status.slices, status.done, status.expired) == (12, 1, 0) and held in (1, 2)
    assert status.free == 11 - held and not status.finished
    assert status.workers == {"fin": 1}
    assert [(c.epoch, c.done, c.claimed, c.free) for c in status.per_epoch] == [
        (0, 1, held, 5 - held),
        (1, 0, 0, 6),
    ]
    assert [(lease.index, lease.worker) for lease in status.leases][:1] == [(1, "live")]
    assert {lease.worker for lease in status.leases} == {"live"}
    live.claims.close()
    time.sleep(0.5)
    expired = queue.status()
    assert (expired.claimed, expired.expired) == (0, held)
    assert main(["queue", "status", "d", "1", "j", "--store", store.url]) == 0
    out = capsys.readouterr().out
    assert f"job j run fresh: 12 slices, 1 done, 0 claimed, {held} expired" in out
    assert "epoch 1: 6 slices, 0 done, 0 claimed, 0 expired, 6 free" in out
    assert "worker fin: 1 slices done" in out
    assert "slice 1 of epoch 0: live, EXPIRED" in out


def test_runs_are_listed_reopened_and_deleted(
    store: y.Store, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = build(store)
    finished = ref.work_queue("done-job", num_slices=4)
    assert len([i for b in finished.stream("a").batches(50) for i in b["id"]]) == N
    partial = ref.work_queue("half-job", num_slices=4, seed=5)
    first = partial.stream("a", prefetch=0)
    seen = take(first, 5)
    state = first.state(len(seen))
    first.claims.close()
    resumed = ref.work_queue("half-job", resume=state)
    resumed.stream("b", prefetch=0)  # creates the resumed run's record

    jobs = y.list_queue_jobs(store)
    assert [(j.job, j.runs) for j in jobs] == [
        ("done-job", ("fresh",)),
        ("half-job", ("fresh", resumed.run)),
    ]
    runs = y.open_queue_runs(ref, "half-job")
    assert [q.run for q in runs] == ["fresh", resumed.run]
    # The resumed run, rebuilt from the store alone, has the same slices.
    assert [runs[1].slice_intervals(0, i) for i in range(4)] == [
        resumed.slice_intervals(0, i) for i in range(4)
    ]
    assert runs[1].status().slices == resumed.status().slices == 4

    assert main(["queue", "list", "--store", store.url]) == 0
    out = capsys.readouterr().out
    assert "d\t1\tdone-job\truns: fresh\t" in out and "2 jobs" in out
    assert main(["queue", "delete", "d", "1", "--finished", "--store", store.url]) == 0
    assert "deleted job done-job" in capsys.readouterr().out
    assert [j.job for j in y.list_queue_jobs(store, "d", "1")] == ["half-job"]
    assert main(["queue", "delete", "d", "1", "half-job", "--store", store.url]) == 0
    assert y.list_queue_jobs(store) == []
    assert main(["queue", "status", "d", "1", "half-job", "--store", store.url]) == 1
    assert "no work queue job 'half-job'" in capsys.readouterr().err
    with pytest.raises(y.QueueJobNotFoundError):
        y.open_queue_runs(ref, "half-job")


def test_deleting_a_version_removes_its_queues(store: y.Store) -> None:
    one, two = build(store, "1"), build(store, "2")
    for ref in (one, two):
        queue = ref.work_queue("j", num_slices=3)
        assert len([i for b in queue.stream("w").batches(100) for i in b["id"]]) == N
    assert store.backend.list(".queues/d/1/")
    store.delete("d", "1")
    assert store.backend.list(".queues/d/1/") == []
    assert [(j.version, j.job) for j in y.list_queue_jobs(store)] == [("2", "j")]
    assert [d.version for d in store.list()] == ["2"]
    # A job of the same name over a rebuilt version starts afresh.
    rebuilt = build(store, "1")
    assert rebuilt.work_queue("j", num_slices=3).status().done == 0
