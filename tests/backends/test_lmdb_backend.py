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
