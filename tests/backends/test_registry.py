"""Registering a backend for a URL scheme, by call or by entry point."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import storage_backends
import yogastore as y
from storage_backends import ENTRY_POINT_GROUP, Backend, open_backend, register_backend
from storage_backends.contract import BackendContract
from storage_backends.errors import InvalidArgumentError
from storage_backends.lmdb_backend import LmdbBackend
from tests.backends.memory_backend import MemoryBackend

TARGET = "tests.backends.memory_backend:MemoryBackend"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The registry, restored after the test."""
    table = dict(storage_backends.REGISTRY)
    monkeypatch.setattr(storage_backends, "REGISTRY", table)
    return table  # type: ignore[return-value]


class TestMemoryBackend(BackendContract):
    """A backend written against the public contract alone passes the suite."""

    @pytest.fixture
    def backend(self, registry: dict[str, object]) -> Iterator[MemoryBackend]:
        register_backend("mem", MemoryBackend)
        backend = open_backend(f"mem://{uuid.uuid4().hex}")
        assert isinstance(backend, MemoryBackend)
        yield backend
        backend.close()


@pytest.mark.parametrize("target", [MemoryBackend, TARGET], ids=["class", "string"])
def test_register_and_open(registry: dict[str, object], target: object) -> None:
    register_backend("mem", target)  # type: ignore[arg-type]
    backend = open_backend("mem://one")
    backend.put("k", b"v")
    assert isinstance(backend, MemoryBackend)
    assert bytes(open_backend("mem://one").get("k")) == b"v"


def test_register_checks_the_schemes_a_class_declares(registry: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError, match="does not serve scheme 'gs'"):
        register_backend("gs", MemoryBackend)
    assert "gs" not in storage_backends.REGISTRY
    register_backend("gs", TARGET)  # a string is checked when first used
    with pytest.raises(InvalidArgumentError, match="does not serve scheme 'gs'"):
        open_backend("gs://bucket/x")


class Abstract(Backend):
    """Primitives missing."""

    schemes = ("mem",)


class StrSchemes(MemoryBackend):
    schemes = "mem"  # type: ignore[assignment]


class BadRemote(MemoryBackend):
    remote = "no"  # type: ignore[assignment]


class BadCopies(MemoryBackend):
    put_copies = 1  # type: ignore[assignment]


class BadWorkers(MemoryBackend):
    upload_workers = 0


class ParallelSetLate(MemoryBackend):
    """A capability set per instance (as S3 sets its own from options) is checked on open."""

    def __init__(self, url: str, **options: object) -> None:
        super().__init__(url)
        self.max_parallel = -1


class Uncoordinated(MemoryBackend):
    coordinated = False


def test_capabilities_set_by_the_constructor_are_checked(registry: dict[str, object]) -> None:
    register_backend("mem", ParallelSetLate)
    with pytest.raises(InvalidArgumentError, match="ParallelSetLate: max_parallel must be"):
        open_backend("mem://late")


def test_an_uncoordinated_backend_runs_no_work_queue(registry: dict[str, object]) -> None:
    register_backend("mem", Uncoordinated)
    backend = open_backend(f"mem://{uuid.uuid4().hex}")
    assert backend.exclusive_puts_problem() == "Uncoordinated declares coordinated = False"
    store = y.Store(backend.url)
    spec = {"x": y.ComponentSpec(shape=(), dtype="int64")}
    records = lambda: ({"x": np.int64(i)} for i in range(20))  # noqa: E731
    ref = store.cache("d", "1", records, spec=spec, progress=y.NullProgress())
    queue = ref.work_queue("j", num_slices=4)
    with pytest.raises(y.CoordinationError, match="coordinated = False"):
        queue.stream("w")
    assert backend.list(".queues/") == []


@pytest.mark.parametrize(
    ("scheme", "target", "match"),
    [
        ("MEM", MemoryBackend, "lower-case"),
        ("mem://", MemoryBackend, "lower-case"),
        ("mem", "no_colon", "module:Class"),
        ("mem", "tests.backends.no_such_module:X", "cannot load"),
        ("mem", "tests.backends.memory_backend:Nothing", "cannot load"),
        ("mem", "pathlib:Path", "not a storage_backends.Backend"),
        ("mem", "tests.backends.raising_module:X", "cannot load .*boom at import"),
        ("mem", "tests.backends.test_registry:Abstract", r"does not implement \['_delete'"),
        ("mem", "tests.backends.test_registry:StrSchemes", "schemes must be a tuple"),
        ("mem", "tests.backends.test_registry:BadRemote", "remote must be True or False"),
        ("mem", "tests.backends.test_registry:BadWorkers", "upload_workers must be an integer"),
        ("mem", "tests.backends.test_registry:BadCopies", "put_copies must be True or False"),
    ],
    ids=[
        "upper",
        "with-slashes",
        "no-colon",
        "no-module",
        "no-class",
        "not-a-backend",
        "import-raises",
        "abstract",
        "str-schemes",
        "remote-not-bool",
        "workers-zero",
        "copies-not-bool",
    ],
)
def test_bad_registrations(
    registry: dict[str, object], scheme: str, target: object, match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        register_backend(scheme, target)  # type: ignore[arg-type]
        open_backend(f"{scheme}://x")


def test_a_taken_scheme_needs_replace(registry: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError, match="already served"):
        register_backend("s3", "tests.backends.memory_backend:MemoryBackend")
    register_backend("file", LmdbBackend)  # the same backend again: fine
    register_backend("mem", MemoryBackend)
    register_backend("mem", MemoryBackend)


def test_entry_point_found_when_scheme_unknown(
    registry: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        asked.append(group)
        return [importlib.metadata.EntryPoint(name="memx", value=TARGET, group=group)]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    open_backend("/some/path")  # a known scheme never looks at entry points
    assert asked == []
    assert isinstance(open_backend("memx://two"), MemoryBackend)
    assert asked == [ENTRY_POINT_GROUP]
    open_backend("memx://two")  # remembered
    assert asked == [ENTRY_POINT_GROUP]
    with pytest.raises(InvalidArgumentError, match=ENTRY_POINT_GROUP):
        open_backend("nope://x")


def test_store_on_a_registered_backend(registry: dict[str, object]) -> None:
    register_backend("mem", MemoryBackend)
    spec = {"x": y.ComponentSpec(shape=(2,), dtype="int64")}
    store = y.Store(f"mem://{uuid.uuid4().hex}")
    ref = store.cache(
        "d",
        "1",
        lambda: ({"x": np.array([i, -i], dtype=np.int64)} for i in range(50)),
        spec=spec,
        progress=y.NullProgress(),
    )
    got = [int(v) for b in ref.stream(shuffle=False).batches(8) for v in b["x"][:, 0]]
    assert got == list(range(50))
    assert [i.dataset_id for i in store.list()] == ["d"]


def test_importing_does_not_import_pytest_or_backends(tmp_path: Path) -> None:
    code = (
        "import sys, yogastore, storage_backends;"
        "bad = [m for m in ('pytest', 'lmdb', 'boto3', 'tensorflow') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path)
