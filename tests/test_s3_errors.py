"""S3 failures: clear errors naming bucket and prefix, retries that hide transient faults."""

from __future__ import annotations

import errno
import random
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
from botocore.awsrequest import AWSResponse

import yogastore as y
from storage_backends.errors import (
    AccessDeniedError,
    BackendUnavailableError,
    KeyNotFoundError,
    StorageError,
)
from storage_backends.s3_backend import S3Backend
from tests.backends.s3_support import (
    SPEC,
    check_batch,
    create_bucket,
    fake_credentials,
    moto_endpoint,
    records,
)

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> str:
    fake_credentials(monkeypatch)
    return moto_endpoint()


@pytest.fixture
def bucket(endpoint: str) -> str:
    name = f"err-{uuid.uuid4().hex[:12]}"
    create_bucket(endpoint, name)
    return name


class Faults:
    """Answers a share of requests with an error instead of sending them."""

    def __init__(self, rate: float, status: int, code: str, seed: int = 0) -> None:
        self.rate = rate
        self.status = status
        self.code = code
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.sent = 0
        self.failed = 0

    def __call__(self, request: Any, **_: Any) -> AWSResponse | None:
        with self.lock:
            self.sent += 1
            if self.random.random() >= self.rate:
                return None
            self.failed += 1
        body = f"<Error><Code>{self.code}</Code><Message>injected</Message></Error>".encode()

        class Raw:
            def stream(self, **_: Any) -> Iterator[bytes]:
                yield body

        return AWSResponse(request.url, self.status, {"Content-Type": "application/xml"}, Raw())

    def install(self, backend: Any) -> None:
        backend.client.meta.events.register_first("before-send.s3", self)


def test_missing_bucket(endpoint: str, tmp_path: Path) -> None:
    store = y.Store("s3://no-such-bucket-here/team/data", endpoint_url=endpoint)
    with pytest.raises(BackendUnavailableError) as info:
        store.open("ds", "1")
    message = str(info.value)
    assert "no-such-bucket-here" in message and "team/data" in message
    assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
    assert not isinstance(info.value, PermissionError)  # missing, not forbidden
    with pytest.raises(BackendUnavailableError, match="no-such-bucket-here"):
        store.cache("ds", "1", lambda: records(3), spec=SPEC)


def test_access_denied(bucket: str, endpoint: str) -> None:
    backend = S3Backend(f"s3://{bucket}/secret", endpoint_url=endpoint)
    Faults(1.0, 403, "AccessDenied").install(backend)
    with pytest.raises(AccessDeniedError, match="access denied") as info:
        backend.get("ds/1/manifest.json")
    assert bucket in str(info.value) and "secret/" in str(info.value)
    assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
    # Code that knows nothing of yogastore can catch it as the built-in.
    assert isinstance(info.value, PermissionError)
    assert isinstance(info.value, BackendUnavailableError)
    assert info.value.errno == errno.EACCES


def test_no_credentials(bucket: str, endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = y.Store(f"s3://{bucket}/p", endpoint_url=endpoint)
    with pytest.raises(BackendUnavailableError, match="credentials") as info:
        store.open("ds", "1")
    assert isinstance(info.value, PermissionError)
    assert f"s3://{bucket}/p/" in str(info.value)
    assert isinstance(info.value.__cause__, botocore.exceptions.NoCredentialsError)


def test_unreachable_endpoint(endpoint: str) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = y.Store("s3://some-bucket/p", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=2)
    with pytest.raises(BackendUnavailableError, match="cannot reach") as info:
        store.open("ds", "1")
    assert "some-bucket" in str(info.value) and f"127.0.0.1:{port}" in str(info.value)
    assert isinstance(info.value.__cause__, botocore.exceptions.EndpointConnectionError)


def test_endpoint_that_never_answers_times_out(endpoint: str) -> None:
    # It accepts connections and reads requests but never answers: after read_timeout on
    # each of max_attempts attempts the error says so, not that the endpoint is unreachable.
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    try:
        store = y.Store(
            "s3://some-bucket/p",
            endpoint_url=f"http://127.0.0.1:{port}",
            max_attempts=2,
            read_timeout=0.5,
        )
        with pytest.raises(BackendUnavailableError, match="no answer within read_timeout") as info:
            store.open("ds", "1")
    finally:
        done.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()
    assert info.value.errno == errno.ETIMEDOUT and "2 attempts" in str(info.value)
    assert "some-bucket" in str(info.value) and f"127.0.0.1:{port}" in str(info.value)
    assert isinstance(info.value.__cause__, botocore.exceptions.ReadTimeoutError)
    assert len(held) >= 2  # every attempt got through


@pytest.mark.parametrize(
    ("status", "code"), [(503, "SlowDown"), (500, "InternalError")], ids=["throttled", "5xx"]
)
def test_errors_surface_after_the_retries(
    bucket: str, endpoint: str, status: int, code: str
) -> None:
    backend = S3Backend(f"s3://{bucket}/p", endpoint_url=endpoint, max_attempts=2)
    backend.put("k", b"value")
    faults = Faults(1.0, status, code)
    faults.install(backend)
    with pytest.raises(StorageError, match=f"after 2 attempt.*{code}") as info:
        backend.get("k")
    assert faults.sent == 2  # the first try and one retry
    assert not isinstance(info.value, BackendUnavailableError | KeyNotFoundError)
    assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)


def test_transient_faults_lose_and_duplicate_nothing(
    bucket: str, endpoint: str, tmp_path: Path
) -> None:
    store = y.Store(
        f"s3://{bucket}/flaky",
        endpoint_url=endpoint,
        chunk_bytes=32 << 10,
        cache_dir=tmp_path / "cache",
        lock_settle=0.0,
        max_attempts=10,
    )
    throttle = Faults(0.08, 503, "SlowDown", seed=1)
    throttle.install(store.backend)
    errors = Faults(0.04, 500, "InternalError", seed=2)
    errors.install(store.backend)
    ref = store.cache("ds", "1", lambda: records(240), spec=SPEC, progress=y.NullProgress())
    assert ref.num_records == 240
    for shuffle in (y.Shuffle.BLOCK, y.Shuffle.GLOBAL):
        seen: list[int] = []
        for rank in range(2):
            stream = store.open("ds", "1").stream(rank, 2, shuffle=shuffle, seed=7)
            for batch in stream.batches(16):
                seen += check_batch(batch)
        assert sorted(seen) == list(range(240))
    assert throttle.failed > 5 and errors.failed > 2
    # The build left exactly one committed version and no lock behind.
    keys = store.backend.list("")
    assert "ds/1/manifest.json" in keys
    assert not any(k.endswith(".lock") for k in keys)
    assert len([k for k in keys if "/c-" in k]) == len(ref.manifest.chunks)
