"""The store on S3 (moto in-process): reads per rank, the disk cache, copy, corruption."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import yogastore as y
from storage_backends.errors import CorruptCacheError, InvalidArgumentError, KeyNotFoundError
from tests.backends.s3_support import (
    REGION,
    SPEC,
    check_batch,
    moto_bucket,
    records,
)
from yogastore.read.diskcache import _ENTRY, _META, DiskCache, _digest
from yogastore.read.read_options import ReadOptions
from yogastore.read.remote import RemoteChunkSource, coalesce

pytestmark = pytest.mark.s3

BUCKET = "yoga-test"
N = 800
CHUNK = 64 << 10


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_bucket(monkeypatch, BUCKET) as name:
        yield name


def s3_store(tmp_path: Path, **options: Any) -> y.Store:
    options.setdefault("cache_dir", tmp_path / "read-cache")
    options.setdefault("lock_settle", 0.0)
    return y.Store(f"s3://{BUCKET}/cache", chunk_bytes=CHUNK, **options)


def build(store: y.Store, n: int = N, dataset_id: str = "ds") -> y.DatasetRef:
    return store.cache(dataset_id, "1", lambda: records(n), spec=SPEC, progress=y.NullProgress())


def read_all(stream: y.Stream, batch_size: int = 32) -> list[int]:
    ids: list[int] = []
    for batch in stream.batches(batch_size):
        ids += check_batch(batch)
    return ids


@pytest.mark.parametrize(
    ("shuffle", "n"), [(y.Shuffle.BLOCK, 1600), (y.Shuffle.GLOBAL, 800)], ids=["block", "global"]
)
def test_each_rank_fetches_its_share(
    bucket: str, tmp_path: Path, shuffle: y.Shuffle, n: int
) -> None:
    """Rank r of n fetches at most 1.1 x (1/n of the data bytes) in one epoch."""
    ref = build(s3_store(tmp_path), n=n)
    assert len(ref.manifest.chunks) >= n // 20
    num_shards = 4
    share = ref.nbytes / num_shards
    seen: list[int] = []
    ratios = []
    for rank in range(num_shards):
        # No disk cache: every byte a rank uses comes over the network.
        reader = s3_store(tmp_path, cache_bytes=0).open("ds", "1")
        stream = reader.stream(rank, num_shards, shuffle=shuffle, seed=5)
        ids = read_all(stream)
        stats = stream.stats()
        assert stats["records"] == len(ids) == n // num_shards
        assert stats["cache_hits"] == 0
        ratios.append(stats["bytes_fetched"] / share)
        if shuffle is y.Shuffle.BLOCK:
            # Chunks the rank needs entirely are fetched whole (one request each),
            # the rest by coalesced ranges: far fewer requests than records.
            chunk_of = np.searchsorted(ref.manifest.chunk_starts(), ids, side="right") - 1
            used = np.bincount(chunk_of, minlength=len(ref.manifest.chunks))
            full = sum(int(u == c.count) for u, c in zip(used, ref.manifest.chunks, strict=True))
            assert full >= 6
            assert stats["chunks_verified"] >= full - 2
            assert stats["requests"] < len(ids) / 2
        seen += ids
    print(f"{shuffle.name} bytes fetched / share per rank: {[round(r, 4) for r in ratios]}")
    # Ranged reads fetch whole checksum blocks (256 B in these 64 KiB chunks):
    # scattered small records (global shuffle) cost up to a block each.
    assert max(ratios) <= (1.1 if shuffle is y.Shuffle.BLOCK else 1.45)
    assert min(ratios) >= 0.9  # each rank really fetched its own share
    assert sorted(seen) == list(range(n))


def test_read_through_cache(bucket: str, tmp_path: Path) -> None:
    ref = build(s3_store(tmp_path))
    first = ref.stream(1, 2, shuffle=y.Shuffle.GLOBAL, seed=1)
    ids = read_all(first)
    assert first.stats()["bytes_fetched"] > 0
    assert first.stats()["cache_misses"] > 0
    # A new source (as in a new process): everything comes from disk.
    again = s3_store(tmp_path).open("ds", "1").stream(1, 2, shuffle=y.Shuffle.GLOBAL, seed=1)
    assert read_all(again) == ids
    stats = again.stats()
    assert stats["bytes_fetched"] == 0
    assert stats["requests"] == 0
    assert stats["cache_hits"] > 0
    assert stats["cache_misses"] == 0
    # The other rank's records were never fetched: they miss.
    other = s3_store(tmp_path).open("ds", "1").stream(0, 2, shuffle=y.Shuffle.GLOBAL, seed=1)
    read_all(other)
    assert other.stats()["bytes_fetched"] > 0


def test_cache_size_limit_evicts_least_recently_used(bucket: str, tmp_path: Path) -> None:
    limit = 500_000
    ref = build(s3_store(tmp_path, cache_bytes=limit))
    assert ref.nbytes > 4 * limit
    for epoch in range(2):
        stream = ref.stream(0, 1, shuffle=y.Shuffle.BLOCK, seed=2, epoch=epoch)
        assert sorted(read_all(stream)) == list(range(N))
    cache = DiskCache(tmp_path / "read-cache", limit)
    assert 0 < cache.total() <= limit
    # The most recently read chunk is still cached; the first ones are gone.
    order = stream.order(1).records(np.arange(N))
    last_chunk = int(np.searchsorted(ref.manifest.chunk_starts(), order[-1], side="right") - 1)
    first_chunk = int(np.searchsorted(ref.manifest.chunk_starts(), order[0], side="right") - 1)
    cid_last = DiskCache.chunk_id(ref.store.backend.url, ref.manifest.chunks[last_chunk])
    cid_first = DiskCache.chunk_id(ref.store.backend.url, ref.manifest.chunks[first_chunk])
    info = ref.manifest.chunks[last_chunk]
    pieces, _ = cache.read(cid_last, [(0, info.nbytes)])
    assert pieces[0]
    pieces, _ = cache.read(cid_first, [(0, ref.manifest.chunks[first_chunk].nbytes)])
    assert not pieces[0]


def _damage(cache: DiskCache, how: str) -> int:
    """Damage every entry of the read cache in one way; return how many."""
    with cache.env.begin(write=True) as txn:
        entries = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=cache.data_db)]
        for key, value in entries:
            meta = bytes(txn.get(key, db=cache.meta_db))
            if how == "zeros":  # same length, digest no longer matches
                txn.put(key, bytes(len(value)), db=cache.data_db)
            elif how == "short":  # fewer bytes than [start, end), with a matching digest
                short = value[: len(value) // 2]
                charged, tick, _ = _META.unpack(meta)
                txn.put(key, short, db=cache.data_db)
                txn.put(key, _META.pack(charged, tick, _digest(key, short)), db=cache.meta_db)
            elif how == "bad-meta":  # metadata of the wrong size
                txn.put(key, meta[:5], db=cache.meta_db)
            else:  # "moved": value and metadata intact, under offsets one byte later
                cid, start, end = _ENTRY.unpack(key)
                if start == 0:
                    continue  # keep chunk indexes: a bad index drops the whole chunk
                txn.delete(key, db=cache.data_db)
                txn.delete(key, db=cache.meta_db)
                moved = _ENTRY.pack(cid, start + 1, end + 1)
                txn.put(moved, value, db=cache.data_db)
                txn.put(moved, meta, db=cache.meta_db)
    return len(entries)


@pytest.mark.parametrize(
    ("how", "shuffle"),
    [
        ("zeros", y.Shuffle.NONE),
        ("short", y.Shuffle.NONE),
        ("short", y.Shuffle.GLOBAL),
        ("bad-meta", y.Shuffle.GLOBAL),
        ("moved", y.Shuffle.GLOBAL),
    ],
    ids=["zeros-whole", "short-whole", "short-ranged", "bad-meta-ranged", "moved-ranged"],
)
def test_damaged_cache_entry_is_refetched(
    bucket: str, tmp_path: Path, how: str, shuffle: y.Shuffle
) -> None:
    """Damaged entries are dropped and fetched again, on whole-chunk and ranged reads."""
    ref = build(s3_store(tmp_path), n=300)
    # NONE reads whole chunks (checksummed); GLOBAL over two ranks reads byte
    # ranges, whose record bytes only the cache's own checks protect.
    first = ref.stream(0, 2, shuffle=shuffle, seed=3)
    expected = read_all(first)
    fetched = first.stats()["bytes_fetched"]
    cache = DiskCache(tmp_path / "read-cache", 1 << 30)  # this process's open environment
    assert _damage(cache, how) > 0
    stream = s3_store(tmp_path).open("ds", "1").stream(0, 2, shuffle=shuffle, seed=3)
    assert read_all(stream) == expected  # values checked record by record
    stats = stream.stats()
    assert stats["bytes_fetched"] >= fetched * 0.9  # nothing damaged was trusted
    if shuffle is y.Shuffle.NONE:  # ranged reads may hit bytes overfetched in this pass
        assert stats["cache_hits"] == 0


def test_missing_chunk_is_corrupt_cache(bucket: str, tmp_path: Path) -> None:
    ref = build(s3_store(tmp_path))
    ref.store.backend.delete(ref.manifest.chunks[3].key)
    stream = s3_store(tmp_path, cache_bytes=0).open("ds", "1").stream(shuffle=y.Shuffle.NONE)
    with pytest.raises(CorruptCacheError, match="missing") as info:
        read_all(stream)
    assert isinstance(info.value.__cause__, KeyNotFoundError)


@pytest.mark.parametrize("where", ["index", "data"], ids=["index", "data"])
def test_damaged_chunk_is_detected(bucket: str, tmp_path: Path, where: str) -> None:
    ref = build(s3_store(tmp_path))
    info = ref.manifest.chunks[2]
    data = bytearray(ref.store.backend.get(info.key))
    at = info.index_bytes - 8 if where == "index" else info.nbytes - 100
    data[at] ^= 0xFF
    ref.store.backend.put(info.key, bytes(data))
    # Block shuffle reads chunks whole: the chunk checksum catches either damage.
    whole = s3_store(tmp_path, cache_bytes=0).open("ds", "1").stream(shuffle=y.Shuffle.BLOCK)
    with pytest.raises(CorruptCacheError, match="checksum"):
        read_all(whole)
    if where == "index":  # ranged reads verify the index checksum
        source = RemoteChunkSource(ref.store.backend, ref.manifest, ref.store.read_options)
        with pytest.raises(CorruptCacheError, match="index checksum"):
            source.gather(np.array([info.first], dtype=np.int64))


def test_all_layouts_through_ranged_reads(bucket: str, tmp_path: Path) -> None:
    """Ragged, sparse, variable-shape and string columns gather right from sparse buffers."""
    spec = {
        "var": y.ComponentSpec(shape=(None, 2), dtype="float64"),
        "words": y.ComponentSpec(shape=(None,), dtype="string"),
        "ragged": y.ComponentSpec(
            shape=(None, None), dtype="int32", kind=y.Kind.RAGGED, ragged_rank=1
        ),
        "sparse": y.ComponentSpec(shape=(5, 4), dtype="int16", kind=y.Kind.SPARSE),
        "fixed": y.ComponentSpec(shape=(3,), dtype="uint8"),
    }

    def element(i: int) -> dict[str, Any]:
        k = i % 4
        return {
            "var": np.arange(2 * k, dtype=np.float64).reshape(k, 2) + i,
            "words": np.array([b"w%d" % (i * 10 + j) for j in range(i % 3)], dtype=object),
            "ragged": y.RaggedValue(
                np.arange(i % 5, dtype=np.int32) + i, (np.array([0, i % 5 // 2, i % 5]),)
            ),
            "sparse": y.SparseValue(
                np.array([[i % 5, i % 4]], dtype=np.int64),
                np.array([i], dtype=np.int16),
                np.array([5, 4], dtype=np.int64),
            ),
            "fixed": np.array([i % 256, 1, 2], dtype=np.uint8),
        }

    local = y.Store(tmp_path / "local", chunk_bytes=2048)
    ref = local.cache("kinds", "1", lambda: (element(i) for i in range(300)), spec=spec)
    remote_ref = local.copy("kinds", "1", to=s3_store(tmp_path, cache_bytes=0))
    for rank in range(3):
        a = list(ref.stream(rank, 3, shuffle=y.Shuffle.GLOBAL, seed=9))
        b = list(remote_ref.stream(rank, 3, shuffle=y.Shuffle.GLOBAL, seed=9))
        assert len(a) == len(b) == 100
        for x, z in zip(a, b, strict=True):
            assert np.array_equal(x["var"], z["var"]) and x["var"].shape == z["var"].shape
            assert list(x["words"]) == list(z["words"])
            assert x["ragged"].to_list() == z["ragged"].to_list()
            assert np.array_equal(x["sparse"].indices, z["sparse"].indices)
            assert np.array_equal(x["sparse"].values, z["sparse"].values)
            assert np.array_equal(x["fixed"], z["fixed"])


def test_copy_both_ways(bucket: str, tmp_path: Path) -> None:
    local = y.Store(tmp_path / "local", chunk_bytes=CHUNK)
    ref = build(local, n=400)
    remote = s3_store(tmp_path)
    up = local.copy("ds", "1", to=remote)
    assert up.manifest.to_json() == ref.manifest.to_json()
    assert sorted(read_all(remote.open("ds", "1").stream(shuffle=True))) == list(range(400))
    back_store = y.Store(tmp_path / "back")
    down = remote.copy("ds", "1", to=back_store)
    assert down.manifest == ref.manifest
    for info in ref.manifest.chunks:
        assert bytes(back_store.backend.get(info.key)) == bytes(local.backend.get(info.key))
    assert read_all(back_store.open("ds", "1").stream(shuffle=False)) == list(range(400))
    # Copying again finds the committed copy and changes nothing.
    assert remote.copy("ds", "1", to=back_store).manifest.build_id == ref.manifest.build_id
    assert [d.dataset_id for d in remote.list()] == ["ds"]


def test_copy_verifies_checksums(bucket: str, tmp_path: Path) -> None:
    remote = s3_store(tmp_path)
    ref = build(remote, n=400)
    info = ref.manifest.chunks[1]
    data = bytearray(remote.backend.get(info.key))
    data[-50] ^= 1
    remote.backend.put(info.key, bytes(data))
    target = y.Store(tmp_path / "target")
    with pytest.raises(CorruptCacheError, match="checksum"):
        remote.copy("ds", "1", to=target)
    with pytest.raises(y.DatasetNotFoundError):
        target.open("ds", "1")


def test_layout_and_delete(bucket: str, tmp_path: Path) -> None:
    store = s3_store(tmp_path)
    ref = build(store, n=300)
    keys = [
        o["Key"]
        for o in boto3.client("s3", region_name=REGION).list_objects_v2(Bucket=BUCKET)["Contents"]
    ]
    assert "cache/ds/1/manifest.json" in keys
    assert all(k.startswith(f"cache/ds/1/c-{ref.manifest.build_id}-") for k in keys if "/c-" in k)
    assert not any(k.endswith(".lock") for k in keys)  # released after the build
    manifest = json.loads(store.backend.get("ds/1/manifest.json"))
    assert manifest["num_records"] == 300
    store.delete("ds", "1")
    assert store.list() == []
    assert store.backend.list("") == []


def test_resume_on_s3(bucket: str, tmp_path: Path) -> None:
    ref = build(s3_store(tmp_path), n=600)
    streams = [ref.stream(r, 2, shuffle=True, seed=4) for r in range(2)]
    consumed = []
    for s in streams:
        batches = s.batches(50)
        consumed += check_batch(next(batches)) + check_batch(next(batches))
    state = streams[0].state(consumed=100)
    rest = []
    for r in range(3):
        rest += read_all(ref.resume(state, r, 3))
    assert sorted(consumed + rest) == list(range(600))


@pytest.mark.parametrize(
    ("gap", "overfetch", "expected"),
    [
        (0, 0.0, [(0, 20), (30, 40), (41, 50)]),  # touching and overlapping ranges merge
        (1, 0.0, [(0, 20), (30, 50)]),
        (0, 0.1, [(0, 20), (30, 50)]),
        (0, 0.5, [(0, 50)]),
    ],
    ids=["adjacent", "gap", "budget", "big-budget"],
)
def test_coalesce(gap: int, overfetch: float, expected: list[tuple[int, int]]) -> None:
    starts = np.array([30, 0, 10, 41, 35, 12], dtype=np.int64)
    ends = np.array([40, 10, 20, 50, 38, 12], dtype=np.int64)
    assert coalesce(starts, ends, gap, overfetch) == expected


@pytest.mark.parametrize(
    "options",
    [
        {"overfetch": "0.1"},
        {"overfetch": None},
        {"overfetch": 2.0},
        {"whole_fraction": True},
        {"whole_fraction": "0.5"},
        {"whole_fraction": 0.0},
    ],
    ids=[
        "overfetch-str",
        "overfetch-none",
        "overfetch-range",
        "whole-bool",
        "whole-str",
        "whole-0",
    ],
)
def test_remote_options_are_checked(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        ReadOptions(**options)


def test_copy_waiting_for_another_copier_keeps_its_result(bucket: str, tmp_path: Path) -> None:
    local = y.Store(tmp_path / "local", chunk_bytes=CHUNK)
    ref = build(local, n=100)
    remote = s3_store(tmp_path)
    other = dataclasses.replace(ref.manifest, created={"by": "the other copier"})
    holding = threading.Event()

    def other_copier() -> None:
        with remote.backend.lock("ds/1", timeout=10):
            holding.set()
            time.sleep(0.5)  # our copy is waiting for the lock now
            for info in ref.manifest.chunks:
                remote.backend.put(info.key, bytes(local.backend.get(info.key)))
            remote.backend.put_exclusive("ds/1/manifest.json", other.to_json())

    thread = threading.Thread(target=other_copier)
    thread.start()
    try:
        assert holding.wait(10)
        copied = local.copy("ds", "1", to=remote)
    finally:
        thread.join()
    assert copied.manifest.created == {"by": "the other copier"}
    assert remote.open("ds", "1").manifest.created == {"by": "the other copier"}
    assert sorted(read_all(copied.stream(shuffle=True))) == list(range(100))


def test_disk_cache_ranges_lru_and_damage(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "dc", limit=10_000)
    a, b = b"A" * 16, b"B" * 16
    letters = b"abcdefghij" * 150
    cache.update([], [(a, 0, b"0123456789"), (a, 20, letters)])
    pieces, used = cache.read(a, [(5, 25), (2000, 2010), (0, 3)])
    assert [(p.start, p.end) for p in pieces[0]] == [(0, 10), (20, 1520)]
    assert pieces[0][1].data == letters
    assert pieces[1] == []
    assert [p.data for p in pieces[2]] == [b"0123456789"]
    assert cache.read(b, [(0, 10)])[0] == [[]]  # other chunks' entries never leak in
    # Least recently used goes first: touch the small entry, then overflow.
    cache.update([used[0]], [])
    cache.update([], [(b, i * 3000, bytes(2000)) for i in range(4)])
    assert cache.total() <= 10_000
    assert cache.read(a, [(0, 10)])[0][0]  # recently used: kept
    assert not cache.read(a, [(20, 30)])[0][0]  # least recently used: evicted
    assert len(cache.read(b, [(0, 12_000)])[0][0]) == 4
    # A damaged value fails its digest, is dropped and reads as missing.
    with cache.env.begin(write=True, db=cache.data_db) as txn:
        key = next(k for k, _ in txn.cursor() if k.startswith(a))
        txn.put(key, b"X" * 10)
    assert cache.read(a, [(0, 10)])[0] == [[]]
    cache.drop_chunk(b)
    assert cache.read(b, [(0, 12_000)])[0] == [[]]
    assert cache.total() == 0


_OPEN_WHILE_WRITING = """
import sys, threading, time
from pathlib import Path
from yogastore.read.diskcache import DiskCache

directory = Path(sys.argv[1])
cache = DiskCache(directory, 1 << 20)
inside = threading.Event()

def writer():
    with cache.env.begin(write=True) as txn:
        inside.set()
        time.sleep(0.2)  # needs the interpreter back to go on
        txn.put(b"k", b"v", db=cache.data_db)

thread = threading.Thread(target=writer)
thread.start()
assert inside.wait(10)
DiskCache(directory, 1 << 20)  # a new reader of the same file, as each new source makes
thread.join(10)
assert not thread.is_alive()
"""


def test_disk_cache_opened_while_another_thread_writes(tmp_path: Path) -> None:
    """Opening the cache again never waits for LMDB's writer lock (it would deadlock)."""
    # In a child process: a regression hangs with the interpreter lock held.
    subprocess.run(
        [sys.executable, "-c", _OPEN_WHILE_WRITING, str(tmp_path / "dc")],
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )


@settings(max_examples=300, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 200)), max_size=60),
    gap=st.integers(0, 64),
    overfetch=st.floats(0.0, 0.5),
)
def test_coalesce_properties(pairs: list[tuple[int, int]], gap: int, overfetch: float) -> None:
    starts = np.array([s for s, _ in pairs], dtype=np.int64)
    ends = starts + np.array([n for _, n in pairs], dtype=np.int64)
    out = coalesce(starts, ends, gap, overfetch)
    assert all(b < c for (_, b), (c, _) in itertools.pairwise(out))  # sorted, apart
    wanted = np.zeros(5300, dtype=bool)
    fetched = np.zeros(5300, dtype=bool)
    for s, e in zip(starts, ends, strict=True):
        wanted[s:e] = True
    for a, b in out:
        assert a < b
        fetched[a:b] = True
    assert not np.any(wanted & ~fetched)  # every wanted byte is fetched
    # Extra bytes: at most ``gap`` per merge, then ``overfetch`` of what is kept.
    limit = (wanted.sum() + gap * len(pairs)) * (1 + overfetch)
    assert fetched.sum() <= limit


def test_a_chunk_row_claiming_more_bytes_than_can_be_held_is_corrupt(
    bucket: str, tmp_path: Path
) -> None:
    """A manifest row's size is the buffer a remote reader allocates: a huge one is named."""
    store = s3_store(tmp_path)
    build(store)
    key = "ds/1/manifest.json"
    doc = json.loads(bytes(store.backend.get(key)))
    doc["chunks"][1]["nbytes"] = 2**62
    store.backend.delete(key)
    store.backend.put(key, json.dumps(doc).encode())
    for shuffle in (y.Shuffle.BLOCK, y.Shuffle.GLOBAL):
        stream = s3_store(tmp_path).open("ds", "1").stream(0, 1, shuffle=shuffle, seed=1)
        with pytest.raises(y.CorruptCacheError, match=r"c-.*000001: its manifest row gives"):
            read_all(stream)


def test_an_inflated_count_of_zero_byte_records_is_refuted_promptly(
    bucket: str, tmp_path: Path
) -> None:
    """No byte bound holds such a count: the look-ahead is capped, the chunk header refutes it."""
    store = s3_store(tmp_path)
    spec = {"v": y.ComponentSpec(shape=(0,), dtype="int64")}
    store.cache("z", "1", lambda: [{"v": np.zeros(0, np.int64)}] * 100, spec=spec)
    key = "z/1/manifest.json"
    doc = json.loads(bytes(store.backend.get(key)))
    doc["chunks"][-1]["count"] += 2**40
    doc["num_records"] += 2**40
    store.backend.delete(key)
    store.backend.put(key, json.dumps(doc).encode())
    stream = s3_store(tmp_path).open("z", "1").stream(0, 1, shuffle=False)
    with pytest.raises(y.CorruptCacheError, match="chunk holds 100 records, manifest says"):
        for _ in stream.batches(256):
            pass
