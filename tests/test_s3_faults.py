"""Reads through a fault-injecting proxy: every record exact, or CorruptCacheError; never wrong."""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore as y
from storage_backends.errors import CorruptCacheError
from tests.backends.fault_proxy import FaultProxy
from tests.backends.s3_support import (
    SPEC,
    check_batch,
    create_bucket,
    fake_credentials,
    moto_endpoint,
    records,
)
from yogastore.read.diskcache import _META, DiskCache, _digest
from yogastore.read.read_options import ReadOptions
from yogastore.read.remote import RemoteChunkSource

pytestmark = pytest.mark.s3

N = 800
CHUNK = 64 << 10
RANKS = 4
# 503s and resets are retried by botocore with back-off (seconds): rarer, to keep the test quick.
FLAKY = {
    "flip": 0.05,
    "truncate": 0.01,
    "short": 0.01,
    "past_end": 0.01,
    "error": 0.003,
    "reset": 0.003,
}
FIRST = ("flip", "short", "flip", "past_end", "truncate", "flip")


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto server holding one built dataset (``ds``/``1``) in a fresh bucket; its URL."""
    fake_credentials(monkeypatch)
    url = moto_endpoint()
    bucket = f"faults-{uuid.uuid4().hex[:10]}"
    create_bucket(url, bucket)
    monkeypatch.setenv("YOGASTORE_TEST_BUCKET", bucket)
    store = y.Store(f"s3://{bucket}/c", endpoint_url=url, chunk_bytes=CHUNK, lock_settle=0.0)
    store.cache("ds", "1", lambda: records(N), spec=SPEC, progress=y.NullProgress())
    yield url


def _store(proxy: FaultProxy, cache_dir: Path | None, **options: Any) -> y.Store:
    import os

    options.update({"cache_dir": cache_dir} if cache_dir else {"cache_bytes": 0})
    return y.Store(
        f"s3://{os.environ['YOGASTORE_TEST_BUCKET']}/c",
        endpoint_url=proxy.url,
        lock_settle=0.0,
        **options,
    )


def _read_epoch(store: y.Store, shuffle: y.Shuffle, epoch: int, ranks: int = RANKS) -> list[int]:
    """Read the shares of ``ranks`` of ``RANKS`` ranks; check each record's content; return ids."""
    ref = store.open("ds", "1")
    ids: list[int] = []
    for rank in range(ranks):
        stream = ref.stream(rank, RANKS, shuffle=shuffle, seed=7, epoch=epoch)
        for batch in stream.batches(32):
            ids += check_batch(batch)  # exact values of every record
    return ids


@pytest.mark.parametrize("cached", [False, True], ids=["no-disk-cache", "disk-cache"])
@pytest.mark.parametrize("shuffle", [y.Shuffle.BLOCK, y.Shuffle.GLOBAL], ids=["block", "global"])
def test_faulty_network_never_yields_a_wrong_record(
    endpoint: str, tmp_path: Path, shuffle: y.Shuffle, cached: bool
) -> None:
    """Flips, cut bodies, short 206s, 400s past the end and 503s: all records exact."""
    cache_dir = tmp_path / "read-cache" if cached else None
    seed = zlib.crc32(f"{shuffle.value}-{cached}".encode())
    # Each kind of fault happens at least once whatever the number of requests; then at random.
    with FaultProxy(endpoint, FLAKY, seed=seed, first=FIRST) as proxy:
        ids = _read_epoch(_store(proxy, cache_dir), shuffle, epoch=0)
        assert sorted(ids) == list(range(N))
        assert proxy.counts["flip"] >= FIRST.count("flip")  # the faults really reached the reader
        assert sum(proxy.counts.values()) >= len(FIRST)
    if cached:
        # A later, fault-free epoch served from the shared disk cache is exact too:
        # nothing that failed its checksum was kept.
        with FaultProxy(endpoint) as clean:
            assert sorted(_read_epoch(_store(clean, cache_dir), shuffle, epoch=1)) == list(range(N))


@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "ranged"])
def test_persistent_corruption_raises(endpoint: str, tmp_path: Path, ranged: bool) -> None:
    """A path that flips every chunk response: refetched a bounded number of times, then raised."""
    with FaultProxy(endpoint, {"flip": 1.0}) as proxy:
        store = _store(proxy, None, max_attempts=2)
        ref = store.open("ds", "1")
        options = ReadOptions(cache_bytes=0, whole_fraction=1.0 if ranged else 0.01)
        source = RemoteChunkSource(ref.store.backend, ref.manifest, options)
        with pytest.raises(CorruptCacheError, match="checksum") as info:
            source.gather(np.array([5, 6], dtype=np.int64))
        assert "times" in str(info.value) or "fetches" in str(info.value)
        assert 2 <= proxy.requests["GET"] <= 8  # bounded: a few attempts, not forever
        source.close()


def test_short_responses_are_reported_as_short(endpoint: str, tmp_path: Path) -> None:
    with FaultProxy(endpoint, {"short": 1.0}) as proxy:
        ref = _store(proxy, None).open("ds", "1")
        source = RemoteChunkSource(ref.store.backend, ref.manifest, ReadOptions(cache_bytes=0))
        with pytest.raises(CorruptCacheError, match="short"):
            source.gather(np.array([5], dtype=np.int64))
        source.close()


def test_disk_cache_is_checked_against_build_checksums(endpoint: str, tmp_path: Path) -> None:
    """A cache entry with wrong bytes but a matching own digest is caught and refetched."""
    cache_dir = tmp_path / "read-cache"
    with FaultProxy(endpoint) as proxy:
        store = _store(proxy, cache_dir)
        expected = sorted(_read_epoch(store, y.Shuffle.GLOBAL, epoch=0, ranks=1))
        assert len(expected) == N // RANKS
        cache = DiskCache(cache_dir, 1 << 30)
        poisoned = 0
        with cache.env.begin(write=True) as txn:
            for key, value in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=cache.data_db)]:
                meta = _META.unpack(bytes(txn.get(key, db=cache.meta_db)))
                bad = bytearray(value)
                bad[len(bad) // 2] ^= 0x10
                txn.put(key, bytes(bad), db=cache.data_db)
                txn.put(key, _META.pack(meta[0], meta[1], _digest(key, bad)), db=cache.meta_db)
                poisoned += 1
        assert poisoned > 0
        before = proxy.requests["GET"]
        assert sorted(_read_epoch(store, y.Shuffle.GLOBAL, epoch=0, ranks=1)) == expected
        assert proxy.requests["GET"] > before  # the poisoned bytes were fetched again


# A process ends while a to_tf_dataset iterator over S3 waits for an endpoint that has
# stopped answering: the read-ahead is inside a ranged read that would give up only after
# read_timeout x max_attempts. The proxy runs in the child, in front of the test's moto.
# "work_queue": the stream claims slices of a work queue, and only the queue's requests
# (listings, claims, done markers, leases) stall: the generator runs on until it needs
# one, on the thread tf.data runs it on.
STALLED_EXIT = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.backends.fault_proxy import FaultProxy
import yogastore as y
bucket, kind = sys.argv[3], sys.argv[4]
if kind == "stream":
    proxy = FaultProxy(sys.argv[2]).__enter__()
else:
    proxy = FaultProxy(sys.argv[2], target=rf"^/{bucket}/?$|/\.queues/",
                       stall_methods=("GET", "PUT", "DELETE")).__enter__()
store = y.Store(f"s3://{bucket}/c", endpoint_url=proxy.url, cache_bytes=0,
                lock_settle=0.0, read_timeout=90, max_attempts=2)
ref = store.open("ds", "1")
if kind == "stream":
    stream = ref.stream(0, 1, shuffle=y.Shuffle.GLOBAL, seed=1)
else:
    queue = ref.work_queue(f"exit-{bucket}", num_slices=40, seed=1, lease_seconds=3)
    stream = queue.stream("w0")
it = iter(stream.to_tf_dataset(8))
batch = next(it)
proxy.stall.set()
time.sleep(1.0)  # the read-ahead goes on, into stalled requests
print("stalled", proxy.counts["stall"], flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["stream", "work_queue"])
def test_exit_does_not_wait_for_a_stalled_endpoint(endpoint: str, kind: str) -> None:
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    bucket = os.environ["YOGASTORE_TEST_BUCKET"]
    cmd = [sys.executable, "-c", STALLED_EXIT, root, endpoint, bucket, kind]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    # Without the exit handling it took at least read_timeout (90 s) after "stalled"
    # (a work queue's requests on tf.data's thread: it never ended, killed after 10 min).
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=75, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[0] == "stalled" and int(words[1]) >= 1, proc.stdout  # a request was stalled
