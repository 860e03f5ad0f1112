"""Build once on S3 when a builder's lease runs out or another commit comes first.

A builder whose renewals hang is taken over; its late writes and its late
commit are refused, and what is committed stays readable. A builder or copier
whose commit meets a manifest it did not expect returns that manifest.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import yogastore as y
from storage_backends.errors import LockLostError
from storage_backends.s3_backend import S3Backend
from storage_backends.s3_lock import S3Lock
from tests.backends.s3_support import SPEC, check_batch, moto_bucket, records

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

BUCKET = "race-test"
URL = f"s3://{BUCKET}/race"
N = 300


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_bucket(monkeypatch, BUCKET) as name:
        yield name


def read_all(ref: y.DatasetRef) -> list[int]:
    ids: list[int] = []
    for batch in ref.stream(shuffle=False).batches(64):
        ids += check_batch(batch)
    return ids


def chunk_keys(backend: Any) -> list[str]:
    return [k for k in backend.list("ds/1/") if "/c-" in k]


class Gate:
    """A point where a builder stops until the test lets it go on."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def pause(self) -> None:
        self.reached.set()
        assert self.go.wait(30)


def stall_renewals(monkeypatch: pytest.MonkeyPatch, backend: Any) -> threading.Event:
    """Hang the renewal thread of every lock ``backend`` holds; return its release."""
    resume = threading.Event()
    original = S3Lock._renew_once

    def renew(self: S3Lock) -> bool:
        if self.store is backend:
            resume.wait(30)
            return False
        return original(self)

    monkeypatch.setattr(S3Lock, "_renew_once", renew)
    return resume


def run(results: dict[str, Any], name: str, store: y.Store, make: Callable[[], Any]) -> None:
    try:
        results[name] = store.cache("ds", "1", make, spec=SPEC, progress=y.NullProgress())
    except Exception as err:  # checked by the test
        results[name] = err


@pytest.mark.parametrize(
    "where",
    ["mid-build", "before-commit", "after-new-commit"],
    ids=["paused-mid-build", "paused-before-commit", "new-holder-committed-first"],
)
def test_builder_whose_lease_ran_out_cannot_commit(
    bucket: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Builder A stalls (renewals hang); B takes over; A's late writes never break the result.

    ``mid-build``: A resumes while B builds: A's next chunk is refused.
    ``before-commit``: A resumes before its manifest while B builds: the commit is refused.
    ``after-new-commit``: B committed first: A's commit is refused and A returns B's dataset.
    """
    # The old builder's renewals hang from the start, so its whole build must
    # fit in one lease: long enough for a loaded machine, short for the test.
    old, new = (
        y.Store(URL, chunk_bytes=16 << 10, lock_lease=4.0, lock_settle=0.0) for _ in range(2)
    )
    resume = stall_renewals(monkeypatch, old.backend)
    gate_old, gate_new = Gate(), Gate()

    def old_records() -> Iterator[dict[str, Any]]:
        for i, record in enumerate(records(N)):
            if where == "mid-build" and i == N // 2:
                gate_old.pause()
            yield record

    if where != "mid-build":
        commit = old.backend.put_exclusive

        def late_commit(key: str, data: bytes | memoryview) -> None:
            gate_old.pause()  # every chunk is uploaded; the manifest is next
            commit(key, data)

        monkeypatch.setattr(old.backend, "put_exclusive", late_commit)

    def new_records() -> Iterator[dict[str, Any]]:
        if where != "after-new-commit":
            gate_new.pause()
        yield from records(N)

    results: dict[str, Any] = {}
    threads = {
        "old": threading.Thread(target=run, args=(results, "old", old, old_records)),
        "new": threading.Thread(target=run, args=(results, "new", new, new_records)),
    }
    try:
        threads["old"].start()
        assert gate_old.reached.wait(30)
        old_chunks = chunk_keys(old.backend)
        assert old_chunks
        threads["new"].start()  # waits out the old holder's lease, then takes over
        if where == "after-new-commit":
            threads["new"].join(30)
            assert isinstance(results["new"], y.DatasetRef), results["new"]
        else:
            assert gate_new.reached.wait(30)  # the new holder builds
            assert set(old_chunks) <= set(chunk_keys(new.backend))  # nothing deleted first
        gate_old.go.set()
        threads["old"].join(30)
        gate_new.go.set()
        threads["new"].join(30)
    finally:
        gate_old.go.set()
        gate_new.go.set()
        resume.set()
        for thread in threads.values():
            thread.join(30)
    ref = results["new"]
    assert isinstance(ref, y.DatasetRef), ref
    if where == "after-new-commit":
        assert isinstance(results["old"], y.DatasetRef), results["old"]
        assert results["old"].manifest.build_id == ref.manifest.build_id
    else:
        assert isinstance(results["old"], LockLostError), results["old"]
        assert "lost the lock 'ds/1'" in str(results["old"])
    committed = y.Store(URL).open("ds", "1")
    assert committed.manifest.build_id == ref.manifest.build_id
    assert read_all(committed) == list(range(N))
    # The old build's chunks were swept after the new commit; the lock is gone.
    assert all(ref.manifest.build_id in k for k in chunk_keys(new.backend))
    assert not new.backend.exists("ds/1.lock")


def _commit_first(
    monkeypatch: pytest.MonkeyPatch, store: y.Store, keys: list[tuple[str, bytes]]
) -> None:
    """Before ``store`` writes its first chunk, write ``keys`` as another, lockless, writer."""
    side = S3Backend(URL)
    put = store.backend.put
    once = threading.Lock()
    done = False

    def first_put(key: str, data: bytes | memoryview) -> None:
        nonlocal done
        with once:
            if not done:
                done = True
                for other_key, value in keys[:-1]:
                    side.put(other_key, value)
                side.put_exclusive(*keys[-1])  # the manifest, last
        put(key, data)

    monkeypatch.setattr(store.backend, "put", first_put)


def test_build_meeting_another_commit_returns_it(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = y.Store(tmp_path / "local", chunk_bytes=16 << 10)
    theirs = local.cache("ds", "1", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    keys = [(c.key, bytes(local.backend.get(c.key))) for c in theirs.manifest.chunks]
    keys.append(("ds/1/manifest.json", theirs.manifest.to_json()))
    store = y.Store(URL, chunk_bytes=16 << 10, lock_settle=0.0)
    _commit_first(monkeypatch, store, keys)
    ref = store.cache("ds", "1", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    assert ref.manifest.build_id == theirs.manifest.build_id
    assert read_all(ref) == list(range(N))
    # This build's own chunks were swept: only theirs remain.
    assert sorted(chunk_keys(store.backend)) == sorted(c.key for c in theirs.manifest.chunks)


def test_copy_meeting_another_commit_returns_it(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = y.Store(tmp_path / "local", chunk_bytes=16 << 10)
    ref = local.cache("ds", "1", lambda: records(100), spec=SPEC, progress=y.NullProgress())
    remote = y.Store(URL, lock_settle=0.0)
    leftover = "ds/1/c-0123456789ab-000000"  # of a copy that died before its commit
    remote.backend.put(leftover, b"junk")
    other = dataclasses.replace(ref.manifest, created={"by": "another copier"})
    keys = [(c.key, bytes(local.backend.get(c.key))) for c in ref.manifest.chunks]
    keys.append(("ds/1/manifest.json", other.to_json()))
    _commit_first(monkeypatch, remote, keys)
    copied = local.copy("ds", "1", to=remote)
    assert copied.manifest.created == {"by": "another copier"}
    assert sorted(read_all(copied)) == list(range(100))
    assert not remote.backend.exists(leftover)
