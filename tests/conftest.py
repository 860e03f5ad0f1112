"""Shared fixtures: every test gets its own store root and default home."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YOGASTORE_HOME", str(tmp_path / "yogastore-home"))


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"
