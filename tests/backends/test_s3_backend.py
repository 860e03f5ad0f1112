from __future__ import annotations

import json
import logging
import multiprocessing
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3
import numpy as np
import pytest
from botocore.awsrequest import AWSResponse

from storage_backends.base import Backend
from storage_backends.contract import DATA, BackendContract
from storage_backends.errors import (
    InvalidArgumentError,
    KeyExistsError,
    LockLostError,
    LockTimeoutError,
    StorageError,
)
from storage_backends.s3_backend import ENDPOINT_ENV, S3Backend
from storage_backends.s3_lock import S3Lock
from tests.backends.s3_support import REGION

pytestmark = pytest.mark.s3


class TestS3Backend(BackendContract):
    @pytest.fixture
    def backend(self, mock_bucket: str) -> Iterator[S3Backend]:
        backend = S3Backend(f"s3://{mock_bucket}/some/prefix", lock_lease=2.0, lock_settle=0.01)
        yield backend
        backend.close()

    def reopen(self, backend: Backend) -> S3Backend:
        return S3Backend(backend.url, lock_lease=2.0, lock_settle=0.01)

    def lose_lock(self, backend: Backend, name: str) -> None:
        # Another process takes the lock over: its lock object names another owner.
        body = json.dumps({"owner": "someone-else", "lease": 30.0}).encode()
        backend.put(name + ".lock", body)


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        ("s3://my-bucket", "my-bucket", ""),
        ("s3://my-bucket/", "my-bucket", ""),
        ("s3://my-bucket/a", "my-bucket", "a/"),
        ("s3://my-bucket/a/b/", "my-bucket", "a/b/"),
    ],
    ids=["bare", "slash", "prefix", "nested"],
)
def test_url_parsing(aws: None, url: str, bucket: str, prefix: str) -> None:
    backend = S3Backend(url)
    assert (backend.bucket, backend.prefix) == (bucket, prefix)


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("s3://", {}),
        ("s3://Bad_Bucket/x", {}),
        ("s3://bucket/a/../b", {}),
        ("gs://bucket/x", {}),
        ("s3://bucket", {"max_parallel": 0}),
        ("s3://bucket", {"multipart_part_bytes": 1024}),
        ("s3://bucket", {"lock_lease": -1}),
        ("s3://bucket", {"lock_settle": True}),
        ("s3://bucket", {"lock_settle": "0.1"}),
        ("s3://bucket", {"no_such_option": 1}),
    ],
    ids=[
        "no-bucket",
        "bad-bucket",
        "dotdot",
        "scheme",
        "parallel",
        "part",
        "lease",
        "settle-bool",
        "settle-str",
        "unknown",
    ],
)
def test_invalid_url_or_option(aws: None, url: str, options: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        S3Backend(url, **options)


def test_endpoint_from_environment(aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:9")
    assert S3Backend("s3://bucket").endpoint_url == "http://127.0.0.1:9"
    explicit = S3Backend("s3://bucket", endpoint_url="http://127.0.0.1:10")
    assert explicit.endpoint_url == "http://127.0.0.1:10"
    assert explicit.client.meta.endpoint_url == "http://127.0.0.1:10"


def test_importing_packages_does_not_import_boto3() -> None:
    code = (
        "import sys, yogastore, storage_backends;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'moto')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_prefix_isolation(mock_bucket: str) -> None:
    one = S3Backend(f"s3://{mock_bucket}/one")
    two = S3Backend(f"s3://{mock_bucket}/one-two")
    whole = S3Backend(f"s3://{mock_bucket}")
    one.put("k", b"1")
    two.put("k", b"2")
    assert one.list("") == ["k"]
    assert whole.list("") == ["one-two/k", "one/k"]
    one.delete_prefix("k/")
    assert bytes(two.get("k")) == b"2"


def test_multipart_upload(mock_bucket: str) -> None:
    backend = S3Backend(
        f"s3://{mock_bucket}/mp", multipart_threshold=5 << 20, multipart_part_bytes=5 << 20
    )
    calls: list[str] = []
    backend.client.meta.events.register(
        "before-call.s3.*", lambda model, **_: calls.append(model.name)
    )
    data = np.random.default_rng(0).integers(0, 256, (11 << 20) + 123, dtype=np.uint8).tobytes()
    backend.put("big", data)
    assert calls.count("UploadPart") == 2  # the short tail is folded into the last part
    assert "CompleteMultipartUpload" in calls
    assert bytes(backend.get("big")) == data
    assert bytes(backend.get_range("big", (5 << 20) - 3, 10)) == data[(5 << 20) - 3 : (5 << 20) + 7]
    backend.put_exclusive("big-once", data)
    with pytest.raises(KeyExistsError):
        backend.put_exclusive("big-once", data[:100] * (60 << 10))


def test_retried_exclusive_put_that_had_landed(mock_bucket: str) -> None:
    """The first try landed but its answer was lost; the retry meets our own write."""
    backend = S3Backend(f"s3://{mock_bucket}/p")
    side = boto3.client("s3", region_name=REGION)
    state = {"armed": True}

    def lose_answer(request: Any, **_: Any) -> AWSResponse | None:
        if state["armed"] and request.method == "PUT" and "If-None-Match" in request.headers:
            state["armed"] = False
            side.put_object(Bucket=mock_bucket, Key="p/commit", Body=b"manifest")
            return _response(request.url, 500, "InternalError")
        return None

    backend.client.meta.events.register_first("before-send.s3", lose_answer)
    backend.put_exclusive("commit", b"manifest")
    assert not state["armed"]
    with pytest.raises(KeyExistsError):
        backend.put_exclusive("commit", b"manifest")


def _stall_renewals(monkeypatch: pytest.MonkeyPatch, lock: Any) -> threading.Event:
    """Make ``lock``'s renewal thread hang (stuck in retries, or the process paused)."""
    resume = threading.Event()

    def hang() -> bool:
        resume.wait(30)
        return False  # the thread ends when released: the test is over

    monkeypatch.setattr(lock, "_renew_once", hang)
    return resume


def test_holder_whose_lease_ran_out_is_fenced(
    mock_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder whose renewals stall is refused once its lease runs out, unaware of any takeover."""
    old = S3Backend(f"s3://{mock_bucket}/p", lock_lease=0.6, lock_settle=0.01)
    new = S3Backend(f"s3://{mock_bucket}/p", lock_lease=0.6, lock_settle=0.01)
    assert not old.exists("ds/1.lock") and not new.exists("ds/1.lock")  # clients made
    stuck = old.lock("ds/1")
    resume = _stall_renewals(monkeypatch, stuck)
    stuck.__enter__()
    try:
        old.put("ds/1/c-old-000000", b"written while the lease holds")
        started = time.monotonic()
        with new.lock("ds/1", timeout=20):
            assert time.monotonic() - started >= 0.6  # not before the lease ran out
            assert json.loads(new.get("ds/1.lock"))["owner"] == new._held["ds/1"].token
            new.put("ds/1/c-new-000000", b"new builder chunk")
            # The old holder resumes; its renewal thread has noticed nothing.
            assert not stuck.lost  # type: ignore[attr-defined]
            with pytest.raises(LockLostError, match="lease ran out") as info:
                old.put("ds/1/c-old-000001", b"late chunk")
            assert isinstance(info.value, StorageError)
            with pytest.raises(LockLostError):
                old.put_exclusive("ds/1/manifest.json", b'{"old": 1}')
            with pytest.raises(LockLostError):
                old.delete_prefix("ds/1/")
            old.put("elsewhere", b"fine")  # only the locked prefix is fenced
            new.put_exclusive("ds/1/manifest.json", b'{"new": 1}')
        assert bytes(new.get("ds/1/manifest.json")) == b'{"new": 1}'
        assert not new.exists("ds/1/c-old-000001")
        assert new.exists("ds/1/c-new-000000")
    finally:
        resume.set()
        stuck.__exit__(None, None, None)
    assert not new.exists("ds/1.lock")
    assert bytes(new.get("ds/1/manifest.json")) == b'{"new": 1}'


def test_commit_renews_the_lease_first(mock_bucket: str) -> None:
    """A takeover the holder's clock cannot see still stops its commit."""
    holder = S3Backend(f"s3://{mock_bucket}/p", lock_lease=30.0, lock_settle=0.0)
    side = boto3.client("s3", region_name=REGION)
    lock = holder.lock("ds/1")
    lock.__enter__()
    try:
        assert lock.valid()  # type: ignore[attr-defined]  # ~20 s of lease left by its clock
        holder.put("ds/1/c-a-000000", b"chunk")
        # Another process takes the lock over (say its clock ran ahead).
        body = json.dumps({"owner": "someone-else", "lease": 30.0}).encode()
        side.put_object(Bucket=mock_bucket, Key="p/ds/1.lock", Body=body)
        with pytest.raises(LockLostError, match="took the lock over"):
            holder.put_exclusive("ds/1/manifest.json", b"manifest")
        assert not holder.exists("ds/1/manifest.json")
        assert lock.lost  # type: ignore[attr-defined]
        with pytest.raises(LockLostError):
            holder.put("ds/1/c-a-000001", b"chunk")
    finally:
        lock.__exit__(None, None, None)
    assert json.loads(holder.get("ds/1.lock"))["owner"] == "someone-else"  # not released by us


def test_waiters_race_to_take_over_a_stale_lock(
    mock_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Of several waiters on a lock whose holder stopped renewing, exactly one takes it over."""
    url = f"s3://{mock_bucket}/p"
    dead = S3Backend(url, lock_lease=0.6, lock_settle=0.01).lock("ds/1")
    dead.__enter__()
    dead._stop.set()  # type: ignore[attr-defined]  # the holder died: no more renewals
    waiters = 4
    barrier = threading.Barrier(waiters)
    guard = threading.Lock()
    inside = overlaps = entries = 0
    errors: list[BaseException] = []

    def waiter() -> None:
        nonlocal inside, overlaps, entries
        backend = S3Backend(url, lock_lease=0.6, lock_settle=0.01)
        try:
            barrier.wait(timeout=10)
            with backend.lock("ds/1", timeout=30):
                with guard:
                    inside += 1
                    overlaps += inside > 1
                    entries += 1
                time.sleep(0.05)
                with guard:
                    inside -= 1
        except BaseException as err:  # surfaced below
            errors.append(err)

    caplog.set_level(logging.WARNING, logger="storage_backends.s3_lock")
    threads = [threading.Thread(target=waiter) for _ in range(waiters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    assert (entries, overlaps) == (waiters, 0)
    takeovers = [r for r in caplog.records if "took over the lock" in r.getMessage()]
    assert len(takeovers) == 1
    assert not dead.valid()  # type: ignore[attr-defined]


def test_failed_create_without_a_lock_object_backs_off(
    mock_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create refused while no lock object shows up waits with backoff and times out."""
    backend = S3Backend(f"s3://{mock_bucket}/p", lock_lease=2.0, lock_settle=0.0)
    creates = 0

    def refused(self: Any) -> bool:
        nonlocal creates
        creates += 1  # a store whose reads lag its writes, say
        return False

    monkeypatch.setattr(S3Lock, "_create", refused)
    monkeypatch.setattr(backend, "_head", lambda key: None)
    started = time.monotonic()
    with pytest.raises(LockTimeoutError), backend.lock("ds/1", timeout=0.5):
        pass
    assert 0.45 <= time.monotonic() - started < 5
    assert 2 <= creates <= 30  # not a busy loop


def test_takeover_meets_its_own_retried_write(mock_bucket: str) -> None:
    """A takeover that landed but whose answer was lost is recognised on the retry."""
    url = f"s3://{mock_bucket}/p"
    # Leases of 2 s: taking over costs one lease, mistaking its own write two.
    dead = S3Backend(url, lock_lease=2.0, lock_settle=0.0).lock("ds/1")
    dead.__enter__()
    dead._stop.set()  # type: ignore[attr-defined]
    waiter = S3Backend(url, lock_lease=2.0, lock_settle=0.0)
    side = boto3.client("s3", region_name=REGION)
    lost_answers = 0
    bodies: list[bytes] = []

    def keep_body(params: dict[str, Any], **_: Any) -> None:
        bodies.append(params["Body"])

    def lose_answer(request: Any, **_: Any) -> AWSResponse | None:
        nonlocal lost_answers
        if lost_answers or request.method != "PUT" or "If-Match" not in request.headers:
            return None
        lost_answers += 1
        side.put_object(Bucket=mock_bucket, Key="p/ds/1.lock", Body=bodies[-1])  # it lands...
        return _response(request.url, 500, "InternalError")  # ...but its answer is lost

    waiter.client.meta.events.register("provide-client-params.s3.PutObject", keep_body)
    waiter.client.meta.events.register_first("before-send.s3", lose_answer)
    started = time.monotonic()
    # Without recognising its own write the waiter would watch that new ETag for
    # another full lease before taking the lock "over" from itself.
    with waiter.lock("ds/1", timeout=3.5):
        assert lost_answers == 1
        assert json.loads(waiter.get("ds/1.lock"))["owner"] == waiter._held["ds/1"].token
        assert time.monotonic() - started < 3.5


@pytest.mark.parametrize(
    ("start", "length", "expected"),
    [(3, 4, b"3456"), (0, 10, DATA), (2, 10, None), (9, 1, b"9")],
    ids=["middle", "all", "past-end-same-length", "last-byte"],
)
def test_server_ignoring_range(
    mock_bucket: str, start: int, length: int, expected: bytes | None
) -> None:
    """A server that answers a ranged GET with the whole object is sliced, never trusted."""
    backend = S3Backend(f"s3://{mock_bucket}/p")
    backend.put("r", DATA)

    def drop_range(request: Any, **_: Any) -> None:
        if "Range" in request.headers:
            del request.headers["Range"]

    backend.client.meta.events.register_first("before-send.s3", drop_range)
    if expected is None:
        with pytest.raises(InvalidArgumentError, match="past the end"):
            backend.get_range("r", start, length)
    else:
        assert bytes(backend.get_range("r", start, length)) == expected


@pytest.mark.parametrize("short_answers", [1, 3], ids=["once", "every-attempt"])
def test_short_body(mock_bucket: str, monkeypatch: pytest.MonkeyPatch, short_answers: int) -> None:
    """A body shorter than its Content-Length is retried, and never returned."""
    backend = S3Backend(f"s3://{mock_bucket}/p", max_attempts=3)
    backend.put("k", DATA)
    original = backend._call
    reads = 0

    class Short:
        def __init__(self, body: Any) -> None:
            self.body = body

        def read(self) -> bytes:
            return bytes(self.body.read())[:-3]

        def close(self) -> None:
            self.body.close()

    def call(action: str, key: str | None, method: str, **kwargs: Any) -> Any:
        nonlocal reads
        resp = original(action, key, method, **kwargs)
        if method == "get_object":
            reads += 1
            if reads <= short_answers:
                resp["Body"] = Short(resp["Body"])
        return resp

    monkeypatch.setattr(backend, "_call", call)
    if short_answers < 3:
        assert bytes(backend.get("k")) == DATA
        assert reads == short_answers + 1
    else:
        with pytest.raises(StorageError, match="shorter than announced"):
            backend.get("k")
        assert reads == 3


def _use_after_fork(backend: S3Backend, conn: Any) -> None:
    try:
        ranges = [bytes(b) for b in backend.get_ranges("big", [(0, 4), (100, 4), (5000, 4)])]
        conn.send(("ok", ranges, sorted(backend._held)))
    except BaseException as err:
        conn.send(("error", repr(err), []))


@pytest.mark.timeout(60)
def test_backend_usable_after_fork(mock_bucket: str) -> None:
    """A fork child gets its own client, pool and lock; its parent's build locks are not its own."""
    backend = S3Backend(f"s3://{mock_bucket}/p", lock_settle=0.0)
    data = bytes(range(256)) * 40
    backend.put("big", data)
    backend.get_ranges("big", [(0, 10), (10, 10), (20, 10)])  # the parent's pool threads exist
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    with backend.lock("ds/1"):
        # A parent thread is inside the backend's own lock at the moment of fork.
        with backend._init_lock:
            child = ctx.Process(target=_use_after_fork, args=(backend, child_end))
            child.start()
        try:
            assert parent_end.poll(30), "the child hung"
            status, ranges, held = parent_end.recv()
            child.join(30)
        finally:
            if child.is_alive():
                child.kill()
        assert status == "ok", ranges
        assert ranges == [data[0:4], data[100:104], data[5000:5004]]
        assert held == []  # the parent's lock is renewed by the parent, not held by the child
        assert child.exitcode == 0
        assert backend._held["ds/1"].valid()
        assert bytes(backend.get_range("big", 7, 3)) == data[7:10]  # the parent is unaffected


def test_lock_released_on_error(mock_bucket: str) -> None:
    backend = S3Backend(f"s3://{mock_bucket}/p", lock_settle=0.0)
    with pytest.raises(RuntimeError), backend.lock("ds/2"):
        raise RuntimeError("build failed")
    assert not backend.exists("ds/2.lock")
    with backend.lock("ds/2", timeout=1):
        assert backend.exists("ds/2.lock")


def _response(url: str, status: int, code: str) -> AWSResponse:
    body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()

    class Raw:
        def stream(self, **_: Any) -> Iterator[bytes]:
            yield body

    return AWSResponse(url, status, {"Content-Type": "application/xml"}, Raw())
