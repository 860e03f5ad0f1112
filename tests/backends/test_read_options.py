"""Reader settings belong to the store (``ReadOptions``), capabilities to the backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore as y
from storage_backends.base import Backend
from storage_backends.errors import InvalidArgumentError
from storage_backends.lmdb_backend import LmdbBackend

SPEC = {"x": y.ComponentSpec(shape=(3,), dtype="int32")}


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"bogus": 1, "whole_fraction": 0.5}, r"unknown read options \['bogus'\]"),
        ({"max_parallel": 0}, "max_parallel"),
        ({"max_parallel": True}, "max_parallel"),
        ({"cache_bytes": -1}, "cache_bytes"),
        ({"horizon_chunks": 0}, "horizon_chunks"),
        ({"cache_dir": 3}, "cache_dir"),
        ({"whole_fraction": 0.0}, "whole_fraction"),
        ([("cache_bytes", 0)], "mapping"),
    ],
    ids=["unknown", "parallel-0", "parallel-bool", "cache-neg", "horizon", "dir", "whole", "list"],
)
def test_bad_read_options_are_named(value: Any, match: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        y.ReadOptions.of(value)
    with pytest.raises(InvalidArgumentError, match=match):
        y.Store(tmp_path, read_options=value)


def test_store_owns_its_read_options(tmp_path: Path) -> None:
    assert y.Store(tmp_path).read_options == y.ReadOptions()
    store = y.Store(tmp_path, read_options={"whole_fraction": 0.5}, cache_bytes=0)
    assert store.read_options == y.ReadOptions(whole_fraction=0.5, cache_bytes=0)
    with pytest.raises(InvalidArgumentError, match=r"\['cache_bytes'\] given both"):
        y.Store(tmp_path, read_options={"cache_bytes": 5}, cache_bytes=0)
    with pytest.raises(InvalidArgumentError, match="cache_dir must be a non-empty path"):
        y.Store(tmp_path, cache_dir="")
    given = y.ReadOptions(horizon_chunks=2)
    assert y.Store(tmp_path, read_options=given).read_options is given
    assert y.ReadOptions().cache_path() == Path(tmp_path / "yogastore-home")  # conftest's home
    assert y.ReadOptions(cache_dir="~/c").cache_path() == Path.home() / "c"


def test_capability_defaults_are_declared() -> None:
    assert (Backend.remote, Backend.coordinated) == (False, True)
    assert (Backend.upload_workers, Backend.max_parallel) == (1, 16)
    assert LmdbBackend.schemes == ("", "file") and not LmdbBackend.remote


@pytest.mark.s3
@pytest.mark.parametrize(
    ("read", "expected"), [({}, 5), ({"max_parallel": 3}, 3)], ids=["backend", "read-options"]
)
def test_remote_reader_gets_the_stores_options(
    mock_bucket: str, tmp_path: Path, read: dict[str, Any], expected: int
) -> None:
    store = y.Store(
        f"s3://{mock_bucket}/p",
        max_parallel=5,
        upload_workers=2,
        cache_dir=tmp_path / "rc",
        read_options=read,
        lock_settle=0.0,
    )
    assert (store.backend.remote, store.backend.upload_workers) == (True, 2)
    assert store.backend.coordinated
    ref = store.cache(
        "d",
        "1",
        lambda: ({"x": np.full(3, i, dtype=np.int32)} for i in range(20)),
        spec=SPEC,
        progress=y.NullProgress(),
    )
    source = ref.make_source()
    assert source.options is store.read_options  # type: ignore[attr-defined]
    assert source._max_parallel == expected  # type: ignore[attr-defined]
    ids = [int(v) for b in ref.stream(shuffle=False).batches(7) for v in b["x"][:, 0]]
    assert ids == list(range(20))
    assert (tmp_path / "rc").is_dir()  # the disk cache lives where the options say
