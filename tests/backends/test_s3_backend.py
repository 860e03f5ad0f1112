from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import boto3
import numpy as np
import pytest
from botocore.awsrequest import AWSResponse

from storage_backends.errors import InvalidArgumentError, KeyExistsError, StorageError
from storage_backends.s3_backend import ENDPOINT_ENV, S3Backend
from tests.backends.contract import BackendContract
from tests.backends.s3_support import REGION

pytestmark = pytest.mark.s3


class TestS3Backend(BackendContract):
    @pytest.fixture
    def backend(self, mock_bucket: str) -> Iterator[S3Backend]:
        backend = S3Backend(f"s3://{mock_bucket}/some/prefix", lock_lease=2.0, lock_settle=0.01)
        yield backend
        backend.close()


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
        ("s3://bucket", {"no_such_option": 1}),
    ],
    ids=["no-bucket", "bad-bucket", "dotdot", "scheme", "parallel", "part", "lease", "unknown"],
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
    subprocess.run([sys.executable, "-c", code], check=True)


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


def test_stale_lock_is_taken_over_and_holder_fenced(mock_bucket: str) -> None:
    backend = S3Backend(f"s3://{mock_bucket}/p", lock_lease=0.6, lock_settle=0.01)
    other = S3Backend(f"s3://{mock_bucket}/p", lock_lease=0.6, lock_settle=0.01)
    stuck = backend.lock("ds/1")
    stuck.__enter__()
    stuck._stop.set()  # type: ignore[attr-defined]  # the holder hangs: no more renewals
    started = time.monotonic()
    with other.lock("ds/1", timeout=20):
        waited = time.monotonic() - started
        assert waited >= 0.6  # not before the lease ran out
        assert json.loads(other.get("ds/1.lock"))["owner"] == other._held["ds/1"].token
        stuck._stop.clear()  # type: ignore[attr-defined]
        stuck._renew_once()  # type: ignore[attr-defined]  # the old holder wakes up
        assert stuck.lost  # type: ignore[attr-defined]
        with pytest.raises(StorageError, match="lost the lock"):
            backend.put("ds/1/manifest.json", b"late")
        backend.put("elsewhere", b"fine")
    stuck.__exit__(None, None, None)
    assert not other.exists("ds/1.lock")
    assert not other.exists("ds/1/manifest.json")


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
