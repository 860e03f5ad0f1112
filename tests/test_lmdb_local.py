"""Local LMDB specifics: map growth while writing, threads, one environment per version."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest

import yogastore
from storage_backends import lmdb_backend

SPEC = yogastore.ComponentSpec(shape=(1024,), dtype="uint8")


def test_map_grows_while_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_backend, "_INITIAL_MAP_SIZE", 1 << 20)
    store = yogastore.Store(tmp_path, chunk_bytes=256 << 10)
    ref = store.cache(
        "big", "1", lambda: (np.full(1024, i % 256, np.uint8) for i in range(8000)), spec=SPEC
    )
    assert (tmp_path / "big" / "1" / "data.mdb").stat().st_size > 4 * (1 << 20), (
        "the data outgrew the initial 1 MiB map"
    )
    got = [int(e[0]) for e in ref.stream(shuffle=False)]
    assert got == [i % 256 for i in range(8000)]


def test_one_environment_per_version(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path)
    for version in ("1", "2"):
        store.cache("d", version, lambda: (np.zeros(1024, np.uint8) for _ in range(3)), spec=SPEC)
    envs = sorted(p.parent.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("data.mdb"))
    assert envs == ["d/1", "d/2"]


def test_concurrent_reader_threads(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path, chunk_bytes=64 << 10)
    ref = store.cache(
        "t", "1", lambda: (np.full(1024, i % 256, np.uint8) for i in range(4000)), spec=SPEC
    )

    def read(rank: int) -> list[int]:
        stream = ref.stream(rank, 8, seed=3)
        return [int(b[j, 0]) for b in stream.batches(64) for j in range(len(b))]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        parts = list(pool.map(read, range(8)))
    expected = [
        [int(i) % 256 for b in ref.stream(r, 8, seed=3).record_indices(64) for i in b]
        for r in range(8)
    ]
    assert parts == expected


def test_chunks_over_lmdb_value_limit_are_refused_before_a_build(tmp_path: Path) -> None:
    """LMDB stores at most 4 GiB - 1 bytes per value: chunk_bytes over it is refused at once."""
    from storage_backends.errors import InvalidArgumentError, UnsupportedElementError
    from storage_backends.lmdb_backend import LmdbBackend

    with pytest.raises(InvalidArgumentError, match="chunk_bytes=8,589,934,592 is over"):
        yogastore.Store(tmp_path, chunk_bytes=8 << 30)
    store = yogastore.Store(tmp_path)
    called = []
    with pytest.raises(InvalidArgumentError, match="over the 4,294,967,295 bytes LmdbBackend"):
        store.cache("d", "1", lambda: called.append(1) or [1], chunk_bytes=1 << 32)
    assert called == [] and store.versions() == []

    class Tiny(LmdbBackend):  # the put's own check, without 4 GiB of memory
        max_value_bytes = 100

    backend = Tiny(str(tmp_path / "tiny"))
    backend.put("small", b"x" * 100)
    with pytest.raises(UnsupportedElementError, match="value of 101 bytes is over LMDB's limit"):
        backend.put("big", b"x" * 101)
    assert backend.get("small") == b"x" * 100 and not backend.exists("big")
