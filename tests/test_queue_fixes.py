"""Work queue runs, probes, leaks, leases and hostile keys (regressions of a review)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast

import pytest

import yogastore as y
from storage_backends import s3_probe
from tests.backends.s3_support import create_bucket, fake_credentials
from tests.backends.s3rver_support import s3rver
from tests.queue_support import SPEC, build, id_records
from yogastore.cli import main


def ids_of(stream: Any) -> list[int]:
    return [int(i) for b in stream.batches(10) for i in b["id"]]


def take(stream: Any, batches: int) -> tuple[Any, list[int]]:
    it = stream.batches(10)
    return it, [int(i) for _ in range(batches) for i in next(it)["id"]]


@pytest.fixture
def ref(store_dir: Path) -> y.DatasetRef:
    return build(str(store_dir), 200)


def test_each_restart_from_one_checkpoint_reads_the_rest_with_a_new_attempt(
    ref: y.DatasetRef,
) -> None:
    queue = ref.work_queue("j", num_slices=20, shuffle=False)
    first = queue.stream("w", prefetch=0)
    _, before = take(first, 5)
    checkpoint = first.state(50).to_json()
    first.claims.close()

    # A restart reads 100 records, then dies before its next checkpoint.
    crashed = ref.work_queue("j", resume=checkpoint, attempt="restart-1").stream("w", prefetch=0)
    _, lost = take(crashed, 10)
    crashed.claims.close()
    assert sorted(before + lost) == list(range(150))

    # Restarting again from the same checkpoint with a new attempt reads all it did not count.
    again = ref.work_queue("j", resume=checkpoint, attempt="restart-2")
    got = [int(i) for b in again.stream("w").batches(10) for i in b["id"]]
    assert sorted(before + got) == list(range(200))
    assert again.status().finished
    runs = [q.run for q in y.open_queue_runs(ref, "j")]  # reopened from job.json alone
    assert sorted(runs) == sorted({"fresh", crashed.queue.run, again.run})

    # The same attempt joins the crashed start: its done slices are not read again.
    joined = ref.work_queue("j", resume=checkpoint, attempt="restart-1")
    rest = [int(i) for b in joined.stream("w", wait=False).batches(10) for i in b["id"]]
    assert not set(rest) & set(lost) and set(rest) <= set(range(150, 200))


def test_a_fresh_restart_with_a_new_attempt_reads_everything(ref: y.DatasetRef) -> None:
    crashed = ref.work_queue("j", num_slices=20, attempt="1").stream("w", prefetch=0)
    take(crashed, 12)
    crashed.claims.close()
    again = ref.work_queue("j", num_slices=20, attempt="2")
    assert sorted(int(i) for b in again.stream("w").batches(10) for i in b["id"]) == list(
        range(200)
    )
    joined = ref.work_queue("j", num_slices=20, attempt="1").stream("w", wait=False)
    assert len([i for b in joined.batches(10) for i in b["id"]]) <= 80


@pytest.mark.parametrize("attempt", [None, "a/b", ".x", 3])
def test_bad_attempts_are_refused(ref: y.DatasetRef, attempt: Any) -> None:
    with pytest.raises(y.InvalidArgumentError, match="attempt"):
        ref.work_queue("j", attempt=attempt)


@pytest.mark.s3
def test_a_store_ignoring_conditional_writes_is_refused_before_any_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3rver accepts If-None-Match and ignores it: claims there would not be exclusive."""
    monkeypatch.setattr(s3_probe, "_VERDICTS", {})
    fake_credentials(monkeypatch)
    with s3rver(tmp_path / "s3rver", monkeypatch) as endpoint:
        create_bucket(endpoint, "yoga")
        url = "s3://yoga/q"
        # Only a single-writer store may build there; neither store may run a queue.
        writer = y.Store(url, endpoint_url=endpoint, coordination="single-writer")
        writer.cache("d", "1", lambda: id_records(50), spec=SPEC, progress=y.NullProgress())
        for coordination in ("single-writer", "probe"):
            store = y.Store(url, endpoint_url=endpoint, coordination=coordination)
            queue = store.open("d", "1").work_queue("j", num_slices=5)
            with pytest.raises(y.CoordinationError, match="If-None-Match") as info:
                queue.stream("w")
            assert endpoint in str(info.value) and "single-writer" in str(info.value)
        assert [k for k in writer.backend.list(".queues/")] == []  # not one claim written


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_finished_epochs_and_jobs_leave_no_files_open(ref: y.DatasetRef) -> None:
    q = ref.work_queue("warm-up", num_slices=2, num_epochs=2)
    assert len(ids_of(q.stream("w"))) == 400
    before = open_fds()
    for i in range(4):
        q = ref.work_queue(f"job-{i}", num_slices=2, num_epochs=10)
        assert len(ids_of(q.stream("w"))) == 2000
        assert q.status().finished
        abandoned = ref.work_queue(f"left-{i}", num_slices=4, num_epochs=3)
        it = cast(Generator[Any, None, None], abandoned.stream("w").batches(5))
        next(it)
        it.close()  # a job given up half-way releases its files too
    # Each epoch's files would stay open (3 descriptors each, 130 epochs here) if not closed.
    assert open_fds() - before <= 3


def test_a_hung_consumer_stops_renewing_and_learns_it_lost_its_slice(ref: y.DatasetRef) -> None:
    queue = ref.work_queue("j", num_slices=4, shuffle=False, lease_seconds=0.3)
    hung = queue.stream("hung", prefetch=0)
    it = hung.batches(10)
    first = [int(i) for i in next(it)["id"]]  # holds slice 0: [0, 50)
    other = queue.stream("other")
    got: list[int] = []
    t = threading.Thread(target=lambda: got.extend(ids_of(other)))
    t.start()
    t.join(60)  # the hung worker keeps its iterator but takes nothing meanwhile
    assert not t.is_alive(), "a stalled worker's lease kept its slice from the others"
    assert other.claims.takeovers == 1 and sorted(got) == list(range(200))
    rest = [int(i) for b in it for i in b["id"]]  # progress again: the loss is detected
    assert hung.claims.lost == 1
    assert sorted(first + rest) == list(range(50))
    assert queue.status().finished


def test_status_of_a_long_job_costs_what_its_started_epochs_cost(
    ref: y.DatasetRef, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = ref.work_queue("long", num_slices=4, num_epochs=1_000_000, shuffle=False)
    it = queue.stream("w", prefetch=0).batches(50)
    for _ in range(6):  # epoch 0 done, slice 0 of epoch 1 done (consumed on the next step)
        next(it)
    listings: list[str] = []
    backend = ref.store.backend
    original = backend.list

    def counted(prefix: str = "") -> Any:
        listings.append(prefix)
        return original(prefix)

    backend.list = counted  # type: ignore[method-assign]
    try:
        status = queue.status()
    finally:
        del backend.list
    assert len(listings) == 1  # one listing of the run, not one per epoch
    assert [(c.epoch, c.done) for c in status.per_epoch] == [(0, 4), (1, 1)]
    assert (status.idle_epochs, status.idle_slices) == (999_998, 4 * 999_998)
    assert (status.slices, status.done) == (4_000_000, 5)
    assert main(["queue", "status", "d", "1", "long", "--store", ref.store.url]) == 0
    assert "999998 epochs not started: 3999992 slices, all free" in capsys.readouterr().out


def test_num_epochs_is_bounded_also_in_a_stored_job(ref: y.DatasetRef) -> None:
    with pytest.raises(y.InvalidArgumentError, match="num_epochs"):
        ref.work_queue("j", num_epochs=1_000_001)
    queue = ref.work_queue("j", num_epochs=2)
    queue.check_job()
    key = queue.prefix + "job.json"
    doc = json.loads(bytes(ref.store.backend.get(key)))
    doc["num_epochs"] = 10**9
    ref.store.backend.put(key, json.dumps(doc).encode())
    with pytest.raises(y.CorruptCacheError, match="num_epochs"):
        y.open_queue_runs(ref, "j")


def test_bad_merge_and_lockstep_arguments_are_refused() -> None:
    with pytest.raises(y.InvalidArgumentError, match="WorkQueueState"):
        y.WorkQueueState.merge([None])  # type: ignore[list-item]
    with pytest.raises(y.InvalidArgumentError, match="iterable"):
        y.WorkQueueState.merge(None)  # type: ignore[arg-type]
    with pytest.raises(y.InvalidArgumentError, match="function"):
        y.lockstep([1, 2], 5)  # type: ignore[arg-type]
    with pytest.raises(y.InvalidArgumentError, match="iterable"):
        y.lockstep(None, bool)  # type: ignore[arg-type]
    # A reduction that says no rank has data while this one has a batch: not silent.
    with pytest.raises(y.InvalidArgumentError, match="any_rank_has_data"):
        list(y.lockstep([1, 2, 3], lambda flag: False))
    with pytest.raises(y.InvalidArgumentError, match="None"):
        list(y.lockstep([1, None, 3], bool))
    assert list(y.lockstep([1, 2], bool)) == [1, 2]


def test_a_state_listing_an_epoch_twice_is_refused(ref: y.DatasetRef) -> None:
    stream = ref.work_queue("j", num_slices=4, shuffle=False).stream("w", prefetch=0)
    take(stream, 3)
    doc = json.loads(stream.state(20).to_json())
    doc["consumed"] = doc["consumed"] + [[0, [[100, 110]]]]
    with pytest.raises(y.InvalidArgumentError, match="more than once"):
        y.WorkQueueState.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    ("suffix", "value", "match"),
    [
        (".done", b"garbage", "work queue key"),
        (".done", b'{"worker": "w", "records": 3}', "done marker"),
        (".c0", b'{"worker": 5, "expires_ms": 1}', "not a string"),
        (".c0", b'{"worker": "w", "expires_ms": 99999999999999999999}', "10 leases"),
        (".c0.l99999999999999", b"", "10 leases"),
    ],
    ids=["done-garbage", "done-wrong-count", "claim-worker-int", "claim-far", "lease-far"],
)
def test_damaged_queue_keys_are_errors_not_silent(
    ref: y.DatasetRef, suffix: str, value: bytes, match: str
) -> None:
    queue = ref.work_queue("j", num_slices=4, shuffle=False, lease_seconds=1)
    queue.check_job()
    ref.store.backend.put(f"{queue.prefix}e0/s000001{suffix}", value)
    with pytest.raises(y.CorruptCacheError, match=match):
        ids_of(queue.stream("w"))
    with pytest.raises(y.CorruptCacheError, match=match):
        queue.status()


@pytest.mark.parametrize(
    ("damage", "match"),
    [("list", "not a JSON object"), ("missing", "'shuffle'"), ("bad", "field 'shuffle'")],
)
def test_job_json_errors_name_the_field(ref: y.DatasetRef, damage: str, match: str) -> None:
    queue = ref.work_queue("j", num_slices=4)
    queue.check_job()
    key = queue.prefix + "job.json"
    doc: Any = json.loads(bytes(ref.store.backend.get(key)))
    if damage == "list":
        doc = [1, 2]
    elif damage == "missing":
        del doc["shuffle"]
    else:
        doc["shuffle"] = "sideways"
    ref.store.backend.put(key, json.dumps(doc).encode())
    with pytest.raises(y.CorruptCacheError, match=match):
        y.open_queue_runs(ref, "j")


def test_a_completed_resumed_job_counts_as_finished(ref: y.DatasetRef) -> None:
    queue = ref.work_queue("j", num_slices=4, shuffle=False, lease_seconds=0.2)
    first = queue.stream("w", prefetch=0)
    take(first, 3)
    checkpoint = first.state(30)
    first.claims.close()  # the first start crashed: its claim expires
    time.sleep(0.4)
    resumed = ref.work_queue("j", resume=checkpoint, attempt="2")
    assert len(ids_of(resumed.stream("w"))) == 170
    assert [q.status().finished for q in y.open_queue_runs(ref, "j")] == [False, True]
    removed = y.delete_queue_jobs(ref.store, "d", "1", finished_only=True)
    assert [j.job for j in removed] == ["j"] and y.list_queue_jobs(ref.store) == []
