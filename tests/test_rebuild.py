"""Rebuilds replace a version only when they succeed; readers of a replaced build are told so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore as y
from tests.backends.s3_support import create_bucket, fake_credentials

SPEC = {"x": y.ComponentSpec(shape=(64,), dtype="uint8")}


def records(n: int, value: int = 0) -> list[dict[str, Any]]:
    return [{"x": np.full(64, (i + value) % 256, np.uint8)} for i in range(n)]


def failing(n: int) -> Iterator[dict[str, Any]]:
    yield from records(n, 100)
    raise OSError("the source broke")


def firsts(ref: y.DatasetRef) -> list[int]:
    return [int(e["x"][0]) for e in ref.stream(shuffle=False)]


def cache(store: y.Store, make: Any, **kw: Any) -> y.DatasetRef:
    return store.cache("d", "1", make, spec=SPEC, progress=y.NullProgress(), **kw)


def check_rebuilds(store: y.Store) -> None:
    old = cache(store, lambda: records(30))
    # A rebuild whose source fails leaves the committed version as it was.
    with pytest.raises(OSError, match="source broke"):
        cache(store, lambda: failing(500), rebuild=True)
    assert firsts(store.open("d", "1")) == list(range(30))
    with pytest.raises(y.BuildLimitError):
        cache(store, lambda: records(500, 7), rebuild=True, max_records=100)
    assert store.open("d", "1").manifest.build_id == old.manifest.build_id
    # A successful rebuild replaces it; only the new build's chunks remain.
    new = cache(store, lambda: records(20, 1), rebuild=True)
    assert firsts(store.open("d", "1")) == [(i + 1) % 256 for i in range(20)]
    assert new.manifest.build_id != old.manifest.build_id
    chunks = [k for k in store.backend.list("d/1/") if not k.endswith("manifest.json")]
    assert sorted(chunks) == sorted(c.key for c in new.manifest.chunks)
    # The reference opened before the rebuild is stale, not corrupt.
    with pytest.raises(y.DatasetChangedError, match="rebuilt"):
        firsts(old)
    store.delete("d", "1")
    with pytest.raises(y.DatasetChangedError, match="deleted"):
        firsts(new)


def test_rebuild_local(tmp_path: Path) -> None:
    check_rebuilds(y.Store(tmp_path, chunk_bytes=1024))


@pytest.mark.s3
def test_rebuild_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moto import mock_aws

    fake_credentials(monkeypatch)
    with mock_aws():
        create_bucket(None, "rebuild")
        # No disk cache: a reference to a replaced build may otherwise go on
        # reading that build, whole and verified, from the cache.
        store = y.Store(
            "s3://rebuild/c",
            chunk_bytes=1024,
            cache_dir=tmp_path / "rc",
            cache_bytes=0,
            lock_settle=0.0,
        )
        check_rebuilds(store)


def test_failed_build_leaves_no_files(tmp_path: Path) -> None:
    store = y.Store(tmp_path, chunk_bytes=1024)
    with pytest.raises(OSError, match="source broke"):
        cache(store, lambda: failing(300))
    # Nothing of the version is left on disk: no LMDB file, no lock file, no
    # dataset folder.
    assert not (tmp_path / "d").exists()
    assert store.versions() == [] and store.gc() == []
    assert firsts(cache(store, lambda: records(5))) == list(range(5))


KILLED_REBUILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import yogastore
    def records():
        for i in range(10_000):
            if i == 300:
                os.kill(os.getpid(), signal.SIGKILL)
            yield {"x": np.full(64, 200, np.uint8)}
    spec = {"x": yogastore.ComponentSpec(shape=(64,), dtype="uint8")}
    store = yogastore.Store(sys.argv[1], chunk_bytes=1024)
    store.cache("d", "1", records, spec=spec, rebuild=True, progress=yogastore.NullProgress())
    """
)


def test_killed_rebuild_keeps_the_committed_version(tmp_path: Path) -> None:
    store = y.Store(tmp_path, chunk_bytes=1024)
    old = cache(store, lambda: records(40))
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_REBUILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    ref = store.open("d", "1")
    assert ref.manifest.build_id == old.manifest.build_id
    assert firsts(ref) == list(range(40))
    # The killed build's chunks are leftovers for gc.
    assert [(e.version, e.committed) for e in store.gc()] == [("1", True)]
    assert firsts(store.open("d", "1")) == list(range(40))


def test_a_reference_that_read_before_is_told_of_a_rebuild_or_delete(tmp_path: Path) -> None:
    # Streams of a reference made while another lives share its chunk views, but not past a
    # rebuild or delete.
    store = y.Store(tmp_path, chunk_bytes=1024)
    old = cache(store, lambda: records(30))
    assert firsts(old) == list(range(30))
    first = old.stream(shuffle=False)
    assert [int(e["x"][0]) for e in first] == list(range(30))
    again = old.stream(shuffle=False)  # while ``first`` lives
    assert [int(e["x"][0]) for e in again] == list(range(30))
    assert first.stats()["requests"] > 0 and again.stats()["requests"] == 0  # views shared
    other = y.Store(tmp_path, chunk_bytes=1024)  # another writer of the same store
    new = cache(other, lambda: records(20, 1), rebuild=True)
    with pytest.raises(y.DatasetChangedError, match="rebuilt"):
        firsts(old)
    assert firsts(new) == [(i + 1) % 256 for i in range(20)]
    other.delete("d", "1")
    with pytest.raises(y.DatasetChangedError, match="deleted"):
        firsts(new)


def test_a_reference_kept_after_its_streams_pins_nothing(tmp_path: Path) -> None:
    # A long-lived reference (a notebook, a training driver) must not keep the build's
    # pages: rebuilds by others reuse them, and a delete frees the file.
    store = y.Store(tmp_path, chunk_bytes=1024)
    ref = cache(store, lambda: records(3000))
    assert len(firsts(ref)) == 3000  # a stream, made and dropped
    data = tmp_path / "d" / "1" / "data.mdb"
    other = y.Store(tmp_path, chunk_bytes=1024)
    sizes = []
    for i in range(6):
        cache(other, lambda i=i: records(3000, i), rebuild=True)
        sizes.append(data.stat().st_size)
    # Each build is about as large as the file after the first two; pinned pages would add a
    # build's size per rebuild.
    assert sizes[-1] <= sizes[1] * 1.2, sizes
    other.delete("d", "1")
    held = [os.readlink(f) for f in Path("/proc/self/fd").iterdir() if _link(f)]
    assert not [p for p in held if p.startswith(str(tmp_path))], held
    assert ref.manifest.num_records == 3000  # the reference itself is still alive here


def _link(f: Path) -> bool:
    try:
        os.readlink(f)
    except OSError:
        return False
    return True
