"""Store API: names, open/cache/list/delete, decorator, arguments, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import yogastore

SPEC = {
    "x": yogastore.ComponentSpec(shape=(3,), dtype="float32"),
    "y": yogastore.ComponentSpec(shape=(), dtype="int64"),
}


def items(n: int = 50) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(3, i, np.float32), "y": np.int64(i)} for i in range(n)]


def test_import_does_not_pull_heavy_modules() -> None:
    import subprocess

    code = (
        "import sys, yogastore, storage_backends; "
        "print(sorted(m for m in ('tensorflow', 'boto3', 'lmdb', 'botocore') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cache_open_list_delete(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path)
    calls = []

    def make() -> list[dict[str, np.ndarray]]:
        calls.append(1)
        return items()

    ref = store.cache("d", "1", make, spec=SPEC)
    again = store.cache("d", "1", make, spec=SPEC)
    assert len(calls) == 1, "a cached dataset is not rebuilt"
    assert again.num_records == ref.num_records == 50
    store.cache("d", "2", lambda: items(7), spec=SPEC)
    listed = sorted(store.list(), key=lambda i: i.version)
    assert [(i.dataset_id, i.version, i.num_records) for i in listed] == [
        ("d", "1", 50),
        ("d", "2", 7),
    ]
    assert all(i.bytes > 0 for i in listed)
    opened = store.open("d", "1")
    assert [int(e["y"]) for e in opened.stream(shuffle=False)] == list(range(50))
    store.delete("d", "1")
    with pytest.raises(yogastore.DatasetNotFoundError):
        store.open("d", "1")
    with pytest.raises(FileNotFoundError):
        store.delete("d", "1")
    assert [i.version for i in store.list()] == ["2"]
    rebuilt = store.cache("d", "1", lambda: items(3), spec=SPEC)
    assert rebuilt.num_records == 3


def test_default_root_and_file_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YOGASTORE_HOME", str(tmp_path / "home"))
    store = yogastore.Store()
    store.cache("d", "1", lambda: items(4), spec=SPEC)
    assert (tmp_path / "home" / "d" / "1").is_dir()
    same = yogastore.Store(f"file://{tmp_path / 'home'}")
    assert same.open("d", "1").num_records == 4


def test_cacheable_decorator(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path)

    @store.cacheable("dec", version="3", spec=SPEC)
    def make() -> list[dict[str, np.ndarray]]:
        return items(5)

    ref = make()
    assert isinstance(ref, yogastore.DatasetRef)
    assert (ref.dataset_id, ref.version, ref.num_records) == ("dec", "3", 5)


def test_open_missing_names_the_dataset(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path)
    with pytest.raises(yogastore.DatasetNotFoundError, match="'nope'") as info:
        store.open("nope", "1")
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, yogastore.YogaStoreError)


BAD_NAMES = ["", "a/b", "..", "a..b", "x\n", "tab\there", "\x00", "./x"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_invalid_ids_and_versions(tmp_path: Path, name: str) -> None:
    store = yogastore.Store(tmp_path)
    with pytest.raises(yogastore.InvalidArgumentError):
        store.cache(name, "1", lambda: items(1), spec=SPEC)
    with pytest.raises(yogastore.InvalidArgumentError):
        store.open("ok", name)
    with pytest.raises(ValueError):
        store.delete(name, "1")


@pytest.fixture
def ref(tmp_path: Path) -> yogastore.DatasetRef:
    return yogastore.Store(tmp_path).cache("d", "1", lambda: items(20), spec=SPEC)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shard_rank": 2, "num_shards": 2},
        {"shard_rank": -1, "num_shards": 2},
        {"num_shards": 0},
        {"start_offset": -1},
        {"seed": -5},
        {"epoch": -1},
        {"num_epochs": -1},
        {"shuffle": "yes"},
        {"block_window": 0},
    ],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()),
)
def test_invalid_stream_arguments(ref: yogastore.DatasetRef, kwargs: dict[str, object]) -> None:
    with pytest.raises(yogastore.InvalidArgumentError):
        ref.stream(**kwargs)  # type: ignore[arg-type]


def test_old_positional_stream_call_names_the_keywords(ref: yogastore.DatasetRef) -> None:
    with pytest.raises(TypeError, match=r"by keyword: shuffle=False, seed=3$"):
        ref.stream(0, 4, False, 3)  # type: ignore[misc]
    assert len(ref.stream(0, 4, shuffle=False, seed=3)) == 5


def test_invalid_batch_size_and_consumed(ref: yogastore.DatasetRef) -> None:
    stream = ref.stream()
    for bad in (0, -3):
        with pytest.raises(yogastore.InvalidArgumentError, match="batch_size"):
            next(iter(stream.batches(bad)))
    with pytest.raises(yogastore.InvalidArgumentError, match="consumed"):
        stream.state(consumed=-1)
    with pytest.raises(yogastore.InvalidArgumentError):
        yogastore.Store(ref.store.url, chunk_bytes=0)
    with pytest.raises(yogastore.InvalidArgumentError, match="make_dataset"):
        ref.store.cache("other", "1", None)
    with pytest.raises(yogastore.InvalidArgumentError, match="spec"):
        ref.store.cache("other", "1", lambda: items(2))


def test_stream_len_and_batches(ref: yogastore.DatasetRef) -> None:
    stream = ref.stream(1, 3, seed=4, num_epochs=2)
    assert len(stream) == 14
    batches = list(stream.batches(4))
    assert [len(b["y"]) for b in batches] == [4, 4, 4, 2]
    assert [len(b["y"]) for b in stream.batches(4, drop_remainder=True)] == [4, 4, 4]
    flat = [int(v) for b in batches for v in b["y"]]
    assert flat == [int(e["y"]) for e in stream]
    assert stream.stats()["records"] > 0
    with pytest.raises(TypeError):
        len(ref.stream(num_epochs=None))


def test_endless_stream_keeps_going(ref: yogastore.DatasetRef) -> None:
    stream = ref.stream(num_epochs=None, seed=1)
    seen = []
    for i, element in enumerate(stream):
        seen.append(int(element["y"]))
        if i == 64:
            break
    assert sorted(seen[:20]) == list(range(20)) and sorted(seen[20:40]) == list(range(20))
    assert seen[:20] != seen[20:40]


def test_shuffle_true_is_global_locally(ref: yogastore.DatasetRef) -> None:
    assert ref.stream(shuffle=True).shuffle is yogastore.Shuffle.GLOBAL
    assert ref.stream(shuffle=False).shuffle is yogastore.Shuffle.NONE


def test_copy_adopts_the_version_another_copier_committed_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = yogastore.Store(tmp_path / "a").cache("d", "1", lambda: items(20), spec=SPEC)
    theirs = yogastore.Store(tmp_path / "c").cache("d", "1", lambda: items(30), spec=SPEC)
    to = yogastore.Store(tmp_path / "b")
    put_exclusive = to.backend.put_exclusive

    def commit_theirs_first(key: str, data: bytes) -> None:
        # Another copier commits its build between our chunks and our manifest.
        for info in theirs.manifest.chunks:
            to.backend.put(info.key, bytes(theirs.store.backend.get(info.key)))
        put_exclusive(theirs.manifest.key, theirs.manifest.to_json())
        put_exclusive(key, data)  # refused: KeyExistsError

    monkeypatch.setattr(to.backend, "put_exclusive", commit_theirs_first)
    ref = source.store.copy("d", "1", to=to)
    assert (ref.manifest.build_id, ref.num_records) == (theirs.manifest.build_id, 30)
    assert set(to.backend.list("d/1/")) == theirs.manifest.keys()  # our chunks swept
    assert [int(e["y"]) for e in to.open("d", "1").stream(shuffle=False)] == list(range(30))
