"""Chunk buffers handed out again once their put returned (``Backend.put_copies``)."""

from __future__ import annotations

import errno
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

import storage_backends
import yogastore
from storage_backends import register_backend
from storage_backends.errors import StorageError
from tests.backends.memory_backend import MemoryBackend
from yogastore.build import writer
from yogastore.format.encode import ChunkBuilder, Slab
from yogastore.format.layout import ColumnSpec

COLUMNS = [
    ColumnSpec("bytes", "string", ()),
    ColumnSpec("var", "int32", (None,)),
    ColumnSpec("fixed", "uint8", (5000,)),
    ColumnSpec("fixed", "int64", ()),
]


def _builder(seed: int, n: int) -> ChunkBuilder:
    rng = np.random.default_rng(seed)
    strings = [rng.bytes(int(k)) for k in rng.integers(0, 30_000, size=n)]
    strings[0] = b""
    lengths = rng.integers(0, 9, size=n)
    lengths[-1] = 0
    builder = ChunkBuilder(COLUMNS)
    builder.add_slab(
        Slab(
            n,
            (
                (np.zeros((n, 0), np.int64), strings),
                (lengths.reshape(-1, 1), rng.integers(0, 1 << 30, int(lengths.sum()), np.int32)),
                rng.integers(0, 256, (n, 5000), np.uint8),
                np.arange(n, dtype=np.int64),
            ),
        )
    )
    return builder


@pytest.mark.parametrize("n", [1, 40, 300])
def test_a_chunk_written_into_a_used_buffer_equals_a_new_one(n: int) -> None:
    """Every byte is written, padding and checksum table too: no old byte shows through."""
    builder = _builder(n, n)
    fresh = builder.encode()
    handed: list[int] = []

    def used(length: int) -> bytearray:
        handed.append(length)
        return bytearray(b"\xa5") * (length + 12_345)

    reused = builder.encode(used)
    assert handed == [len(fresh)]
    assert isinstance(reused, memoryview) and reused.nbytes == len(fresh)
    assert bytes(reused) == bytes(fresh)


def test_a_buffer_smaller_than_the_chunk_is_refused() -> None:
    builder = _builder(1, 3)
    with pytest.raises(ValueError, match="smaller than the chunk"):
        builder.encode(lambda length: bytearray(length - 1))


class _Keeping(MemoryBackend):
    """Keeps the very object ``put`` was given (no copy) until it is read."""

    schemes = ("keep",)
    put_copies = False

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.kept: dict[str, object] = {}

    def _put(self, key: str, data: bytes | memoryview) -> None:
        self.kept[key] = data
        super()._put(key, b"")

    def _get(self, key: str) -> bytes:
        return bytes(self.kept[key]) if key in self.kept else super()._get(key)  # type: ignore[arg-type]

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        return self._get(key)[start : start + length]

    def _size(self, key: str) -> int:
        return len(self._get(key))


class _Counting(MemoryBackend):
    """Copies on put (as ``put_copies`` says) and notes which buffer each put was given."""

    schemes = ("count",)
    buffers: ClassVar[list[int]] = []

    def _put(self, key: str, data: bytes | memoryview) -> None:
        if isinstance(data, memoryview) and "/c-" in key:
            _Counting.buffers.append(id(data.obj))
        super()._put(key, data)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(storage_backends, "REGISTRY", dict(storage_backends.REGISTRY))
    register_backend("keep", _Keeping)
    register_backend("count", _Counting)
    _Counting.buffers = []
    yield


def _records(n: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(11)
    return [{"s": rng.bytes(int(rng.integers(0, 9000))), "y": np.int64(i)} for i in range(n)]


SPEC = {
    "s": yogastore.ComponentSpec(shape=(), dtype="string"),
    "y": yogastore.ComponentSpec(shape=(), dtype="int64"),
}


def _check(ref: yogastore.DatasetRef, records: list[dict[str, object]]) -> None:
    got = [(bytes(e["s"]), int(e["y"])) for e in ref.stream(shuffle=False)]
    assert got == [(r["s"], int(r["y"])) for r in records]  # type: ignore[call-overload]


def test_a_build_reuses_its_chunk_buffers_and_stores_every_chunk_exactly(registry: None) -> None:
    records = _records(600)
    store = yogastore.Store(f"count://{uuid.uuid4().hex}", chunk_bytes=64 << 10)
    ref = store.cache("d", "1", lambda: records, spec=SPEC, progress=yogastore.NullProgress())
    chunks = len(ref.manifest.chunks)
    assert chunks > 20 and len(_Counting.buffers) == chunks
    # A few buffers in turn (those in flight, a couple more when a chunk outgrew them).
    assert len(set(_Counting.buffers)) <= 8
    _check(ref, records)
    for info in ref.manifest.chunks:  # every chunk as its manifest describes it
        data = store.backend.get(info.key)
        assert len(data) == info.nbytes
        assert writer.checksum(memoryview(data)) == info.checksum


def test_a_backend_that_keeps_what_it_was_given_gets_a_buffer_per_chunk(registry: None) -> None:
    """Without ``put_copies``, reusing a buffer would change chunks already stored."""
    records = _records(600)
    store = yogastore.Store(f"keep://{uuid.uuid4().hex}", chunk_bytes=64 << 10)
    ref = store.cache("d", "1", lambda: records, spec=SPEC, progress=yogastore.NullProgress())
    assert len(ref.manifest.chunks) > 20
    backend = store.backend
    assert isinstance(backend, _Keeping)
    buffers = {id(v.obj) for k, v in backend.kept.items() if isinstance(v, memoryview)}
    assert len(buffers) == len(ref.manifest.chunks)
    _check(ref, records)


def test_the_buffer_of_a_failed_put_is_not_handed_out_again() -> None:
    """A failed put (an upload's parts may still be running) keeps its buffer for itself."""

    class Failing(MemoryBackend):
        put_copies = True

        def _put(self, key: str, data: bytes | memoryview) -> None:
            if key.endswith("bad"):
                raise StorageError(errno.EIO, "put failed")
            super()._put(key, data)

    backend = Failing(f"mem://{uuid.uuid4().hex}")
    uploader = writer._Uploader(backend, 1, keep_bytes=1 << 20)
    handed: list[bytearray] = []
    buffer = uploader.buffer

    def noted(length: int) -> bytearray:
        handed.append(buffer(length))
        return handed[-1]

    uploader.buffer = noted  # type: ignore[method-assign]
    try:
        with pytest.raises(StorageError, match="put failed"):  # from either: it may be done
            uploader.put_chunk(_builder(1, 3), "d/1/c-x-bad", 0, "d/1/")
            uploader.wait()
        uploader.put_chunk(_builder(2, 3), "d/1/c-x-good", 3, "d/1/")
        (info,) = uploader.wait()
        assert (info.key, info.first, info.count) == ("d/1/c-x-good", 3, 3)
        assert backend.get("d/1/c-x-good") == bytes(_builder(2, 3).encode())
        bad, good = handed
        again = [buffer(len(good)) for _ in range(3)]
    finally:
        uploader.finish()
    assert good is not bad
    assert any(b is good for b in again)
    assert not any(b is bad for b in again)


def test_a_local_build_of_chunks_of_every_size_reads_back(tmp_path: Path) -> None:
    """LMDB copies on put: chunks smaller and larger than the buffers before them."""
    rng = np.random.default_rng(3)
    sizes = np.concatenate([rng.integers(0, 200, 300), rng.integers(50_000, 400_000, 12)])
    rng.shuffle(sizes)
    records = [{"s": rng.bytes(int(k)), "y": np.int64(i)} for i, k in enumerate(sizes)]
    store = yogastore.Store(tmp_path, chunk_bytes=96 << 10)
    ref = store.cache("d", "1", lambda: records, spec=SPEC, progress=yogastore.NullProgress())
    assert len(ref.manifest.chunks) > 8
    _check(ref, records)


def test_the_smallest_fitting_buffer_is_handed_out_and_oversized_ones_are_not_kept() -> None:
    uploader = writer._Uploader(MemoryBackend(f"mem://{uuid.uuid4().hex}"), 2, keep_bytes=40960)
    try:
        given = [bytearray(n) for n in (30000, 90000, 10000, 20000)]  # chunks of about 6 KB
        handed = iter(given)
        uploader.buffer = lambda length: next(handed)  # type: ignore[method-assign]
        for i in range(len(given)):
            uploader.put_chunk(_builder(i, 1), f"d/1/c-x-{i}", i, "d/1/")
        uploader.wait()
        del uploader.buffer
        assert sorted(map(len, uploader._free)) == [10000, 20000, 30000]  # not the 90000
        assert uploader.buffer(15000) is given[3]
        assert uploader.buffer(15000) is given[0]
        assert len(uploader.buffer(15000)) == 15000 + 15000 // 8  # new: 10000 is too small
    finally:
        uploader.finish()
    assert uploader.pending == [] and uploader._free == []


def test_a_finished_build_leaves_no_uploader_or_buffer_behind(tmp_path: Path) -> None:
    """The put callbacks refer to the uploader: nothing waits for the cycle collector."""
    import gc

    records = _records(300)
    store = yogastore.Store(tmp_path, chunk_bytes=64 << 10)
    gc.collect()
    gc.disable()
    try:
        ref = store.cache("d", "1", lambda: records, spec=SPEC, progress=yogastore.NullProgress())
        left = [o for o in gc.get_objects() if isinstance(o, writer._Uploader)]
    finally:
        gc.enable()
    assert len(ref.manifest.chunks) > 10
    assert left == []


@pytest.mark.parametrize("n", [1, 300])
def test_a_chunk_copied_by_the_compiled_join_equals_the_python_one(
    monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    from yogastore.format import encode

    builder = _builder(n, n + 7)
    compiled_new, compiled_used = builder.encode(), builder.encode(lambda k: bytearray(k + 9))
    monkeypatch.setattr(encode, "_gather", None)
    python_new, python_used = builder.encode(), builder.encode(lambda k: bytearray(k + 9))
    assert bytes(compiled_new) == bytes(compiled_used) == bytes(python_new) == bytes(python_used)


def test_the_compiled_join_checks_its_destination() -> None:
    from yogastore import _gather

    dst = bytearray(b"\xa5" * 12)
    pieces = [b"ab", memoryview(b"cde"), np.arange(3, dtype=np.uint8), b""]
    assert _gather.join_into(dst, pieces) == 8
    assert bytes(dst) == b"abcde\x00\x01\x02" + b"\xa5" * 4
    with pytest.raises(ValueError, match="more than the 12 bytes of dst"):
        _gather.join_into(dst, [b"x" * 8, b"y" * 5])
    assert bytes(dst[:8]) == b"abcde\x00\x01\x02"  # nothing copied by a refused join
    with pytest.raises(TypeError):
        _gather.join_into(b"read-only", [b"x"])
    with pytest.raises(ValueError, match="not C-contiguous"):  # not one run of bytes
        _gather.join_into(dst, [np.arange(6, dtype=np.uint8)[::2]])


def test_a_chunk_that_fails_to_encode_fails_the_build_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks are encoded off the reading thread: a failure there is still the build's."""
    records = _records(600)
    calls = []
    original = ChunkBuilder.encode

    def failing(self: ChunkBuilder, into: object = None) -> object:
        calls.append(self.count)
        if len(calls) == 4:
            raise RuntimeError("encoding chunk 4 failed")
        return original(self, into)  # type: ignore[arg-type]

    store = yogastore.Store(tmp_path, chunk_bytes=16 << 10)
    monkeypatch.setattr(ChunkBuilder, "encode", failing)
    with pytest.raises(RuntimeError, match="encoding chunk 4 failed"):
        store.cache("d", "1", lambda: records, spec=SPEC, progress=yogastore.NullProgress())
    assert store.versions() == []
    monkeypatch.setattr(ChunkBuilder, "encode", original)
    ref = store.cache("d", "1", lambda: records, spec=SPEC, progress=yogastore.NullProgress())
    assert len(ref.manifest.chunks) > 10
    _check(ref, records)


def test_builders_waiting_for_the_encoder_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow encoder holds the reading thread back, however many put threads there are: a
    builder of small records holds many times its chunk's bytes."""
    import threading
    import time

    waiting = [0, 0]  # builders handed over and not yet encoded; the most at once
    lock = threading.Lock()
    original = ChunkBuilder.encode

    def slow(self: ChunkBuilder, into: object = None) -> object:
        time.sleep(0.01)
        try:
            return original(self, into)  # type: ignore[arg-type]
        finally:
            with lock:
                waiting[0] -= 1

    monkeypatch.setattr(ChunkBuilder, "encode", slow)
    backend = MemoryBackend(f"mem://{uuid.uuid4().hex}")
    uploader = writer._Uploader(backend, 8, keep_bytes=1 << 20)
    try:
        for i in range(30):
            with lock:
                waiting[0] += 1
                waiting[1] = max(waiting)
            uploader.put_chunk(_builder(i, 2), f"d/1/c-x-{i:06d}", 2 * i, "d/1/")
        infos = uploader.wait()
    finally:
        uploader.finish()
    assert waiting[1] <= writer._ENCODING + 1  # those queued, and the one just handed over
    assert [(c.key, c.first) for c in infos] == [(f"d/1/c-x-{i:06d}", 2 * i) for i in range(30)]
    for i, info in enumerate(infos):
        assert backend.get(info.key) == bytes(original(_builder(i, 2)))
