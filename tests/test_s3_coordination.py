"""Conditional-write probe and single-writer opt-in: s3rver (ignores them) and moto (enforces)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import yogastore as y
from storage_backends import s3_probe
from tests.backends.fault_proxy import FaultProxy
from tests.backends.s3_support import (
    SPEC,
    check_batch,
    create_bucket,
    fake_credentials,
    moto_endpoint,
    records,
)
from tests.backends.s3rver_support import s3rver

pytestmark = pytest.mark.s3

N = 300
CHUNK = 16 << 10


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test probes afresh (verdicts are kept per endpoint and bucket)."""
    monkeypatch.setattr(s3_probe, "_VERDICTS", {})


@pytest.fixture
def s3rver_bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    fake_credentials(monkeypatch)
    with s3rver(tmp_path / "s3rver", monkeypatch) as endpoint:
        create_bucket(endpoint, "yoga")
        yield endpoint, "yoga"


@pytest.fixture
def moto_bucket(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    fake_credentials(monkeypatch)
    endpoint = moto_endpoint()
    bucket = f"coord-{uuid.uuid4().hex[:10]}"
    create_bucket(endpoint, bucket)
    return endpoint, bucket


def _store(endpoint: str, bucket: str, tmp_path: Path, **options: object) -> y.Store:
    return y.Store(
        f"s3://{bucket}/c",
        endpoint_url=endpoint,
        chunk_bytes=CHUNK,
        lock_settle=0.0,
        cache_dir=tmp_path / "read-cache",
        **options,
    )


def _check_all(ref: y.DatasetRef) -> None:
    for shuffle in (y.Shuffle.BLOCK, y.Shuffle.GLOBAL):
        ids: list[int] = []
        for rank in range(2):
            for batch in ref.stream(rank, 2, shuffle=shuffle, seed=1).batches(32):
                ids += check_batch(batch)
        assert sorted(ids) == list(range(N))


def test_s3rver_is_refused_before_building(s3rver_bucket: tuple[str, str], tmp_path: Path) -> None:
    endpoint, bucket = s3rver_bucket
    store = _store(endpoint, bucket, tmp_path)
    called = []

    def make() -> Iterator[dict[str, object]]:
        called.append(1)
        return records(N)

    with pytest.raises(y.CoordinationError, match="single-writer") as info:
        store.cache("ds", "1", make, spec=SPEC, progress=y.NullProgress())
    assert endpoint in str(info.value)
    assert "If-None-Match" in str(info.value)
    assert called == []  # refused before the dataset was even made
    assert [k for k in store.backend.list() if not k.startswith(".")] == []
    # The verdict is kept: a second build is refused without probing again.
    puts_before = s3_probe._VERDICTS.copy()
    with pytest.raises(y.CoordinationError):
        store.cache("ds", "1", make, spec=SPEC, progress=y.NullProgress())
    assert dict(s3_probe._VERDICTS) == puts_before


def test_s3rver_single_writer_builds_and_reads(
    s3rver_bucket: tuple[str, str], tmp_path: Path
) -> None:
    endpoint, bucket = s3rver_bucket
    writer = _store(endpoint, bucket, tmp_path, coordination="single-writer")
    assert writer.backend.coordinated is False
    # A leftover of an earlier build: with coordination not enforced it is kept.
    writer.backend.put("ds/1/c-deadbeef0000-000000", b"leftover")
    ref = writer.cache("ds", "1", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    assert "ds/1/c-deadbeef0000-000000" in writer.backend.list("ds/1/")
    _check_all(ref)
    # Reading never needs the probe: the default store opens and reads it.
    reader = _store(endpoint, bucket, tmp_path / "r")
    _check_all(reader.open("ds", "1"))
    assert not s3_probe._VERDICTS


def test_moto_enforces_and_builds(moto_bucket: tuple[str, str], tmp_path: Path) -> None:
    endpoint, bucket = moto_bucket
    store = _store(endpoint, bucket, tmp_path)
    assert s3_probe.probe_conditional_writes(store.backend) is None
    store.backend.put("ds/1/c-deadbeef0000-000000", b"leftover")
    ref = store.cache("ds", "1", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    assert dict(s3_probe._VERDICTS) == {(endpoint, bucket): None}
    # Coordination enforced: the leftover was swept after the commit; no probe key remains.
    assert "ds/1/c-deadbeef0000-000000" not in store.backend.list("ds/1/")
    assert not [k for k in store.backend.list() if k.startswith(".yogastore-probe")]
    _check_all(ref)


def test_coordination_option_is_checked(moto_bucket: tuple[str, str], tmp_path: Path) -> None:
    endpoint, bucket = moto_bucket
    with pytest.raises(y.InvalidArgumentError, match="coordination"):
        _store(endpoint, bucket, tmp_path, coordination="yolo")
    assert _store(endpoint, bucket, tmp_path, coordination=y.Coordination.SINGLE_WRITER)


def test_delete_objects_501_falls_back_to_single_deletes(
    moto_bucket: tuple[str, str], tmp_path: Path
) -> None:
    endpoint, bucket = moto_bucket
    with FaultProxy(endpoint, batch_delete=False) as proxy:
        store = _store(proxy.url, bucket, tmp_path, coordination="single-writer")
        for i in range(5):
            store.backend.put(f"gone/k{i}", b"x")
        store.backend.put("kept/k", b"x")
        store.backend.delete_prefix("gone/")
        assert proxy.counts["not_implemented"] == 1
        assert store.backend.list("gone/") == []
        assert store.backend.list("kept/") == ["kept/k"]


def _refused(operation: str, message: str) -> bool:
    return (
        f"refusing to {operation} in " in message
        and "If-None-Match" in message
        and "coordination='single-writer'" in message
        and "--coordination single-writer" in message
        and "build" not in message.split(":")[0]
    )


def test_s3rver_reads_need_no_probe_and_changes_say_how_to_proceed(
    s3rver_bucket: tuple[str, str], tmp_path: Path
) -> None:
    endpoint, bucket = s3rver_bucket
    writer = _store(endpoint, bucket, tmp_path, coordination="single-writer")
    writer.cache("ds", "1", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    writer.cache("ds", "2", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    writer.backend.put("dead/1/c-deadbeef0000-000000", b"a dead build's chunk")
    store = _store(endpoint, bucket, tmp_path / "r")
    # Reads, the look at the build lock included, work on the default store without a probe.
    assert not store.building("ds", "1") and not store.building("nothing", "1")
    with writer.backend.lock("ds/1", timeout=10):  # a single-writer build in progress
        assert store.building("ds", "1") and not store.building("ds", "2")
    assert not store.building("ds", "1")
    assert [(i.dataset_id, i.version) for i in store.list()] == [("ds", "1"), ("ds", "2")]
    assert not s3_probe._VERDICTS
    # Changes that rest on the locks are refused, naming what was asked and the way out.
    with pytest.raises(y.CoordinationError) as gc_info:
        store.gc()
    assert _refused("run gc", str(gc_info.value)), gc_info.value
    with pytest.raises(y.CoordinationError) as delete_info:
        store.delete("ds", "1")
    assert _refused("delete ds/1", str(delete_info.value)), delete_info.value
    assert endpoint in str(delete_info.value)
    assert store.backend.list("dead/1/") and store.open("ds", "1").num_records == N
    # With the single-writer opt-in both proceed, gc leaving a build in progress alone
    # though the store cannot make the locks exclusive.
    other = _store(endpoint, bucket, tmp_path / "o", coordination="single-writer")
    with other.backend.lock("dead/1", timeout=10):
        assert writer.gc() == []
    assert writer.backend.list("dead/1/")
    assert [(e.dataset_id, e.version) for e in writer.gc()] == [("dead", "1")]
    writer.delete("ds", "1")
    assert [(i.dataset_id, i.version) for i in store.list()] == [("ds", "2")]
    assert [k for k in writer.backend.list() if not k.startswith((".", "ds/2/"))] == []


def test_s3rver_cli_info_gc_delete(
    s3rver_bucket: tuple[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from yogastore.cli import main

    endpoint, bucket = s3rver_bucket
    writer = _store(endpoint, bucket, tmp_path, coordination="single-writer")
    writer.cache("ds", "1", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    writer.backend.put("dead/1/c-deadbeef0000-000000", b"a dead build's chunk")
    monkeypatch.setenv("YOGASTORE_S3_ENDPOINT_URL", endpoint)
    url = f"s3://{bucket}/c"
    capsys.readouterr()

    assert main(["--store", url, "info", "ds", "1"]) == 0
    out = capsys.readouterr().out
    assert f'"num_records": {N}' in out and '"build_in_progress": false' in out
    for argv, operation in ((["gc"], "run gc"), (["delete", "ds", "1"], "delete ds/1")):
        assert main(["--store", url, *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and _refused(operation, err), err
    assert main(["--store", url, "gc", "--coordination", "single-writer"]) == 0
    assert "removed uncommitted build of dead/1" in capsys.readouterr().out
    assert main(["--store", url, "delete", "--coordination", "single-writer", "ds", "1"]) == 0
    assert "deleted ds/1" in capsys.readouterr().out
    assert main(["--store", url, "info", "ds", "1"]) == 1
    assert "no dataset 'ds'" in capsys.readouterr().err
    assert [k for k in writer.backend.list() if not k.startswith(".")] == []
