"""Each S3 request is tried ``max_attempts`` times, whatever other requests of the client do.

botocore's standard retry mode shares one retry quota per client (500 units, 14 per
retry after a connection error, given back only on success). With many requests in
flight on one client, an endpoint away for a moment spent it and every further request
failed at its first attempt. These tests drive many parallel requests through one
``S3Backend`` and a proxy in front of a moto server that drops the connection,
unanswered, on the first attempts of every request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import multiprocessing
import sys
import types
import uuid
from typing import Any

import pytest

from storage_backends import s3_retries
from storage_backends.errors import BackendUnavailableError
from storage_backends.s3_backend import S3Backend
from tests.backends.fault_proxy import FaultProxy
from tests.backends.s3_support import create_bucket, fake_credentials, moto_endpoint

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

# botocore's retry quota: 500 units, 14 per retry after a connection error.
_QUOTA_RETRIES = 500 // 14
_QUOTA_REACHED = "retry quota reached"


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the moto server holding ``blob`` (fake credentials set)."""
    fake_credentials(monkeypatch)
    name = f"retries-{uuid.uuid4().hex[:10]}"
    create_bucket(moto_endpoint(), name)
    direct = S3Backend(f"s3://{name}/p", endpoint_url=moto_endpoint())
    direct.put("blob", bytes(range(256)) * 64)
    direct.close()
    return name


def _read_in_parallel(backend: S3Backend, count: int, threads: int) -> list[bytes | BaseException]:
    """Read ``count`` small ranges of ``blob`` with ``threads`` in flight; return each outcome."""

    def read(i: int) -> bytes | BaseException:
        try:
            return bytes(backend.get_range("blob", i % 256 * 16, 16))
        except BackendUnavailableError as err:
            return err

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(read, range(count)))


def test_parallel_requests_each_get_their_attempts(bucket: str) -> None:
    """96 reads in flight, each answered at its third attempt of 8: every one succeeds.

    With botocore's shared quota the 192 retries (14 units each, 2688 units for a quota of
    500) ran it dry and reads failed after 1 or 2 attempts, reported as 8.
    """
    drops, count = 2, 96
    assert count * drops > 2 * _QUOTA_RETRIES  # far more retries in all than the quota held
    with FaultProxy(moto_endpoint(), target=r"/blob$", drops=drops) as proxy:
        backend = S3Backend(f"s3://{bucket}/p", endpoint_url=proxy.url, max_parallel=32)
        try:
            outcomes = _read_in_parallel(backend, count, 32)
        finally:
            backend.close()
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    made = collections.Counter(proxy.attempts.values())
    assert not failed, (
        f"{len(failed)} of {count} reads failed although each needed {drops + 1} attempts of "
        f"{backend.options.max_attempts}; attempts made per read: {dict(made)}; first: {failed[0]}"
    )
    expected = bytes(range(256)) * 64
    assert outcomes == [expected[i % 256 * 16 : i % 256 * 16 + 16] for i in range(count)]
    assert made == {drops + 1: count}


def test_unanswered_requests_each_tried_max_attempts(bucket: str) -> None:
    """48 reads in flight that never get an answer: each tried exactly max_attempts times."""
    attempts, count = 3, 48
    assert count * (attempts - 1) > 2 * _QUOTA_RETRIES
    with FaultProxy(moto_endpoint(), target=r"/blob$", drops=10**9) as proxy:
        backend = S3Backend(
            f"s3://{bucket}/p", endpoint_url=proxy.url, max_parallel=count, max_attempts=attempts
        )
        try:
            outcomes = _read_in_parallel(backend, count, count)
        finally:
            backend.close()
    assert all(isinstance(o, BackendUnavailableError) for o in outcomes)
    assert all(f"after {attempts} attempts" in str(o) for o in outcomes)
    made = collections.Counter(proxy.attempts.values())
    assert made == {attempts: count}, f"attempts made per read: {dict(made)}"


# The installed botocore, without a network ------------------------------------------------


def _retry_delays(client: Any, attempt: int, times: int) -> list[Any]:
    """Ask the client's retry handlers ``times`` about a GET whose connection broke."""
    import botocore.exceptions as bce
    from botocore.hooks import first_non_none_response

    operation = client.meta.service_model.operation_model("GetObject")
    delays = []
    for _ in range(times):
        responses = client.meta.events.emit(
            "needs-retry.s3.GetObject",
            response=None,
            endpoint=None,
            operation=operation,
            attempts=attempt,
            caught_exception=bce.ConnectionClosedError(endpoint_url="http://127.0.0.1:9"),
            request_dict={"context": {}},
        )
        delays.append(first_non_none_response(responses))
    return delays


def _offline_backend(**options: Any) -> S3Backend:
    # Port 9 (discard) is never contacted: only the client's event handlers run.
    return S3Backend("s3://retries/p", endpoint_url="http://127.0.0.1:9", **options)


def test_installed_botocore_retries_without_quota(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's handler keeps retrying long after a shared quota would be spent.

    This fails loudly when an upgrade of botocore changes what ``s3_retries`` replaces.
    """
    fake_credentials(monkeypatch)
    caplog.set_level(logging.DEBUG, logger="botocore.retries")
    caplog.set_level(logging.DEBUG, logger=s3_retries.__name__)
    backend = _offline_backend(max_attempts=4)
    delays = _retry_delays(backend.client, attempt=1, times=10 * _QUOTA_RETRIES)
    assert all(isinstance(d, float) and 0 <= d <= 20 for d in delays), delays
    # botocore's own conditions still apply: the 4th attempt of 4 is the last.
    assert _retry_delays(backend.client, attempt=4, times=1) == [None]
    assert _QUOTA_REACHED not in caplog.text.lower()
    assert not [r for r in caplog.records if r.name == s3_retries.__name__]


def _forked_child(backend: S3Backend, conn: Any) -> None:
    try:
        delays = _retry_delays(backend.client, attempt=1, times=3 * _QUOTA_RETRIES)
        conn.send(("ok", sum(d is None for d in delays), len(delays)))
    except BaseException as err:
        conn.send(("error", repr(err), 0))


@pytest.mark.multiprocess
def test_client_made_after_fork_retries_without_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork child's new client gets per-request retries too."""
    fake_credentials(monkeypatch)
    backend = _offline_backend()
    parent_client = backend.client
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_forked_child, args=(backend, child_end))
    child.start()
    try:
        assert parent_end.poll(60), "the child hung"
        status, refused, asked = parent_end.recv()
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    assert status == "ok", refused
    assert (refused, asked) == (0, 3 * _QUOTA_RETRIES)
    assert backend.client is parent_client  # the parent keeps its own


def test_unexpected_botocore_keeps_its_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """If botocore's retry classes are not what ``s3_retries`` expects, clients still work.

    They keep botocore's default handler (shared quota), and this is logged once.
    """
    import botocore.retries
    from botocore.retries import standard

    fake_credentials(monkeypatch)
    # A botocore whose standard module lacks a class s3_retries builds on (botocore's
    # own client code keeps the real module it imported).
    changed = types.ModuleType(standard.__name__)
    changed.__dict__.update({k: v for k, v in vars(standard).items() if k != "RetryQuotaChecker"})
    monkeypatch.setitem(sys.modules, standard.__name__, changed)
    monkeypatch.setattr(botocore.retries, "standard", changed)
    monkeypatch.setattr(s3_retries, "_fallback_logged", False)
    caplog.set_level(logging.DEBUG, logger=s3_retries.__name__)
    first, second = _offline_backend(max_attempts=4), _offline_backend(max_attempts=4)
    delays = _retry_delays(first.client, attempt=1, times=2 * _QUOTA_RETRIES)
    second.client  # noqa: B018 - made on first use
    assert None in delays  # botocore's own quota ran out: its default handler is in place
    notes = [r for r in caplog.records if r.name == s3_retries.__name__]
    assert len(notes) == 1 and "shared retry quota" in notes[0].getMessage()
