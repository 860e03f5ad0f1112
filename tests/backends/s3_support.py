"""Helpers for the S3 tests: fake credentials, a moto server, a test dataset.

Functions here are importable by spawned child processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import yogastore as y

REGION = "us-east-1"

SPEC = {
    "id": y.ComponentSpec(shape=(), dtype="int64"),
    "img": y.ComponentSpec(shape=(), dtype="string"),
    "label": y.ComponentSpec(shape=(2,), dtype="int32"),
}

_server: Any = None
_server_lock = threading.Lock()


def fake_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point boto3 at fake credentials and away from any real configuration."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in (
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_ENDPOINT_URL",
        "YOGASTORE_S3_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)


def moto_endpoint() -> str:
    """Return the URL of a moto server on 127.0.0.1 (one per test process)."""
    global _server
    with _server_lock:
        if _server is None:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            _server = server
        host, port = _server.get_host_and_port()
    return f"http://{host}:{port}"


def create_bucket(endpoint: str | None, bucket: str) -> None:
    import boto3

    # A new session reads the credentials now set (boto3's default session
    # keeps the first ones it found for the life of the process).
    client = boto3.session.Session().client("s3", region_name=REGION, endpoint_url=endpoint)
    client.create_bucket(Bucket=bucket)


@contextlib.contextmanager
def moto_bucket(monkeypatch: pytest.MonkeyPatch, bucket: str) -> Iterator[str]:
    """Yield ``bucket``, created in moto's in-process S3 with fake credentials."""
    from moto import mock_aws

    fake_credentials(monkeypatch)
    with mock_aws():
        create_bucket(None, bucket)
        yield bucket


def shared_moto_bucket(monkeypatch: pytest.MonkeyPatch, prefix: str) -> str:
    """Create a bucket on the moto server that child processes reach too; return its name.

    Sets fake credentials and ``YOGASTORE_S3_ENDPOINT_URL`` (inherited by children).
    """
    fake_credentials(monkeypatch)
    endpoint = moto_endpoint()
    monkeypatch.setenv("YOGASTORE_S3_ENDPOINT_URL", endpoint)
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    create_bucket(endpoint, name)
    return name


def blob(i: int) -> bytes:
    """The ``img`` bytes of record ``i`` (varying length, content tied to ``i``)."""
    return (b"%08d" % i) * (400 + i % 123)


def records(n: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {
            "id": np.int64(i),
            "img": blob(i),
            "label": np.array([i % 7, -i], dtype=np.int32),
        }


def check_batch(batch: dict[str, Any]) -> list[int]:
    """Assert a batch holds exactly the values written for its ids; return the ids."""
    ids = [int(i) for i in batch["id"]]
    assert [bytes(v) for v in batch["img"]] == [blob(i) for i in ids]
    assert batch["label"].tolist() == [[i % 7, -i] for i in ids]
    return ids


# Child processes of the multi-process tests ------------------------------------


def _report(queue: Any, fn: Any, *args: Any) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))
        raise


def counted_records(counter: str, n: int, delay: float = 0.0) -> Iterator[dict[str, Any]]:
    """``records(n)``, noting the call in ``counter`` and optionally slowly."""
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    for i, record in enumerate(records(n)):
        if delay and i % 8 == 0:
            time.sleep(delay)
        yield record


def build_worker(queue: Any, barrier: Any, url: str, counter: str, n: int) -> None:
    """Build (or wait for) the dataset, then check every record."""

    def work() -> dict[str, Any]:
        store = y.Store(url, chunk_bytes=32 << 10, lock_lease=3.0, lock_poll=0.2)
        barrier.wait(timeout=60)
        ref = store.cache(
            "ds",
            "1",
            lambda: counted_records(counter, n, 0.05),
            spec=SPEC,
            progress=y.NullProgress(),
        )
        ids: list[int] = []
        for batch in ref.stream(shuffle=False).batches(64):
            ids += check_batch(batch)
        return {"build_id": ref.manifest.build_id, "ids_ok": ids == list(range(n))}

    _report(queue, work)


def slow_builder(url: str, counter: str, n: int) -> None:
    """Start building very slowly (the test kills this process mid-build)."""
    store = y.Store(url, chunk_bytes=16 << 10, lock_lease=1.5, upload_workers=2)
    store.cache(
        "ds", "1", lambda: counted_records(counter, n, 0.2), spec=SPEC, progress=y.NullProgress()
    )


def read_worker(
    queue: Any, barrier: Any, url: str, rank: int, num_shards: int, cache_root: str
) -> None:
    """Read this rank's share with both shuffles; then again from the shared disk cache."""

    def work() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for shuffle in (y.Shuffle.BLOCK, y.Shuffle.GLOBAL):
            cache_dir = os.path.join(cache_root, shuffle.value)
            ref = y.Store(url, cache_dir=cache_dir).open("ds", "1")
            for epoch in (0, 1):
                barrier.wait(timeout=60)  # every rank finished the previous pass
                stream = ref.stream(rank, num_shards, shuffle=shuffle, seed=11, epoch=epoch)
                ids: list[int] = []
                for batch in stream.batches(32):
                    ids += check_batch(batch)
                out[f"{shuffle.value}-{epoch}"] = {"ids": ids, **stream.stats()}
        return out

    _report(queue, work)
