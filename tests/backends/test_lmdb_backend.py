from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from storage_backends.contract import BackendContract
from storage_backends.lmdb_backend import LmdbBackend


class TestLmdbBackend(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[LmdbBackend]:
        backend = LmdbBackend(str(tmp_path / "lmdb-store"))
        yield backend
        backend.close()


def test_writes_start_the_disk_on_every_threshold_of_committed_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from storage_backends import lmdb_backend, lmdb_pages

    started: list[int] = []

    def counting(fd: int) -> None:
        started.append(os.fstat(fd).st_size)
        real(fd)  # the real call, on the open data file

    real = lmdb_pages.start_writeback
    monkeypatch.setattr(lmdb_backend, "_WRITEBACK_BYTES", 100_000)
    monkeypatch.setattr(lmdb_pages, "start_writeback", counting)
    backend = LmdbBackend(str(tmp_path / "lmdb-store"))
    try:
        values = {f"d/1/k{i}": os.urandom(30_000 + i) for i in range(20)}
        for key, value in values.items():
            backend.put(key, value)
        # 20 values of about 30 KB: every fourth put crosses 100,000 bytes.
        assert len(started) == 5 and all(size > 0 for size in started)
        assert all(bytes(backend.get(k)) == v for k, v in values.items())
    finally:
        backend.close()
    # Without the system call it does nothing, and says nothing.
    lmdb_pages._writeback.cache_clear()
    monkeypatch.setattr(lmdb_pages, "_c", object)  # a C library without the call
    real(0)
    lmdb_pages._writeback.cache_clear()
