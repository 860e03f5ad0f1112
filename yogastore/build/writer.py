"""First pass: source records -> chunks -> backend, manifest last.

The source is iterated in batches where the schema allows (every component a
fixed-shape tensor) and record by record otherwise. The chunks are encoded one
after another on an encoding thread (their copy and block digests run without
the GIL) and put on a small pool, so reading the source, encoding and I/O
overlap. The
manifest is written with an exclusive put after every chunk landed: it is the
commit point, so a build that dies at any moment leaves nothing readable.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from storage_backends import Backend
from storage_backends.errors import UnsupportedElementError
from yogastore.build.casts import check_value
from yogastore.build.progress import LineProgress, Progress
from yogastore.format import ChunkBuilder, ColumnSpec, columns_for, parse_header
from yogastore.format.manifest import ChunkInfo, Manifest, checksum
from yogastore.spec import ComponentSpec, Kind, RaggedValue, Schema, SparseValue

__all__ = [
    "ChunkTable",
    "chunk_key_prefix",
    "commit_manifest",
    "component_columns",
    "creation_info",
    "new_build_id",
    "write_chunks",
    "write_dataset",
]

logger = logging.getLogger(__name__)

#: An item of a source: ("batch", one array per column), ("slab", (Slab,)) (records of any
#: layout, column by column) or ("record", one value per column).
SourceItem = tuple[str, Sequence[Any]]


def component_columns(comp: ComponentSpec, value: Any, path: str) -> list[Any]:
    """Split one record's component into its column values."""
    if comp.kind is Kind.TENSOR:
        return [value]
    if comp.kind is Kind.RAGGED:
        if comp.ragged_rank == 0:
            return [value.flat_values if isinstance(value, RaggedValue) else value]
        if not isinstance(value, RaggedValue) or len(value.nested_row_splits) != comp.ragged_rank:
            raise UnsupportedElementError(
                f"component {path!r}: expected RaggedValue with {comp.ragged_rank} row splits, "
                f"got {type(value).__name__}"
            )
        return [value.flat_values, *value.nested_row_splits]
    if not isinstance(value, SparseValue):
        raise UnsupportedElementError(
            f"component {path!r}: expected SparseValue, got {type(value).__name__}"
        )
    return [value.indices, value.values, value.dense_shape]


def records_from_iterable(schema: Schema, items: Iterable[Any]) -> Iterator[SourceItem]:
    """Turn an iterable of numpy structures into per-record column values.

    Raises:
        UnsupportedElementError: a value would be cast lossily to the spec's dtype.
    """
    for element in items:
        leaves = schema.flatten(element)
        values: list[Any] = []
        for comp, leaf, path in zip(schema.components, leaves, schema.paths, strict=True):
            check_value(comp, leaf, path)
            values.extend(component_columns(comp, leaf, path))
        yield "record", values


#: Builders handed to the encoding thread and not yet encoded, at most.
_ENCODING = 2


class _Uploader:
    """Encodes chunks on a thread and puts them on a pool, keeping a bounded number in flight.

    For a backend that is done with a value when its put returns
    (``Backend.put_copies``), the buffers of chunks put are handed out again
    (``buffer``): a chunk's worth of new memory costs a page fault per page on
    its first use, and TensorFlow's tf.data sets the allocator to give such
    blocks back to the system as soon as they are freed (``M_TRIM_THRESHOLD``),
    so a new buffer per chunk paid that on every chunk.
    """

    def __init__(self, backend: Backend, workers: int, keep_bytes: int = 0) -> None:
        self.backend = backend
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="yoga-put")
        self.encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="yoga-encode")
        self.pending: list[concurrent.futures.Future[ChunkInfo]] = []  # puts, in order
        self._encoding: list[concurrent.futures.Future[Any]] = []  # encodes, in order
        self.done: list[ChunkInfo] = []  # the tables of the chunks put, in order
        self.limit = 2 * workers
        self.reuse = bool(getattr(backend, "put_copies", False))
        # Buffers of chunks larger than this (a record larger than a chunk) are not kept.
        self.keep_bytes = keep_bytes
        self._free: list[bytearray] = []  # buffers whose put returned
        self._lock = threading.Lock()

    def buffer(self, length: int) -> bytearray:
        """Return a buffer of at least ``length`` bytes for the next chunk: the smallest kept."""
        with self._lock:
            fits = [i for i, buf in enumerate(self._free) if len(buf) >= length]
            if fits:
                return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
        # Room for chunks a little larger than this one (a chunk ends after the record
        # that reaches its size), so that buffers fit again.
        return bytearray(length + length // 8)

    def put_chunk(self, builder: ChunkBuilder, key: str, first: int, where: str) -> None:
        """Encode ``builder``'s records as chunk ``key`` and put it, both off this thread.

        Chunks are encoded one after another on the encoding thread (their copy and
        block digests run without the GIL) while this thread reads the next records and
        the pool puts the chunks before. At most ``_ENCODING`` builders wait for that
        thread (a builder of small records holds many times its chunk's bytes) and
        ``limit`` chunks for the pool: past either, this waits. The chunks' tables
        collect in ``done``, in the order they were given.
        """
        while len(self._encoding) >= _ENCODING:
            self._encoding.pop(0).result()
        encoded = self.encoder.submit(self._encode, builder, key, first, where)
        self._encoding.append(encoded)
        self.pending.append(self.pool.submit(self._put_encoded, encoded))
        while len(self.pending) > self.limit or (self.pending and self.pending[0].done()):
            self.done.append(self.pending.pop(0).result())

    def _encode(
        self, builder: ChunkBuilder, key: str, first: int, where: str
    ) -> tuple[ChunkInfo, memoryview]:
        data = memoryview(builder.encode(self.buffer if self.reuse else None))
        index_bytes = int(parse_header(data, len(data), where)["index_end"])
        info = ChunkInfo(
            key=key,
            first=first,
            count=builder.count,
            nbytes=len(data),
            index_bytes=index_bytes,
            checksum=checksum(data),
            index_checksum=checksum(data[:index_bytes]),
        )
        return info, data

    def _put_encoded(
        self, encoded: concurrent.futures.Future[tuple[ChunkInfo, memoryview]]
    ) -> ChunkInfo:
        info, data = encoded.result()
        self.backend.put(info.key, data)
        buffer = data.obj
        if self.reuse and isinstance(buffer, bytearray) and len(buffer) <= self.keep_bytes:
            self._keep(buffer)
        return info

    def _keep(self, buffer: bytearray) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.limit + 1:  # drop the smallest (by position, not ==)
                self._free.pop(min(range(len(self._free)), key=lambda i: len(self._free[i])))

    def wait(self) -> list[ChunkInfo]:
        """Wait for every chunk given; return their tables in order (raise the first failure)."""
        while self.pending:
            self.done.append(self.pending.pop(0).result())
        self._encoding.clear()
        return self.done

    def finish(self) -> None:
        """Wait for every put; then drop the futures and the kept buffers."""
        try:
            for fut in self.pending:
                fut.result()
        finally:
            self.encoder.shutdown(wait=True, cancel_futures=True)
            self.pool.shutdown(wait=True, cancel_futures=True)
            # The futures hold the chunks' tables and views of the buffers: without this,
            # they would live as long as the uploader.
            self.pending.clear()
            self._encoding.clear()
            with self._lock:
                self._free.clear()


def new_build_id() -> str:
    """Return a fresh build id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def chunk_key_prefix(dataset_id: str, version: str, build_id: str, rank: int | None = None) -> str:
    """Return the prefix of every chunk key of one build (or of rank ``rank``'s part of it)."""
    part = "" if rank is None else f"r{rank}-"
    return f"{dataset_id}/{version}/c-{build_id}-{part}"


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkTable:
    """What ``write_chunks`` wrote: its chunks (numbered from record 0) and their records."""

    chunks: tuple[ChunkInfo, ...]
    num_records: int


def write_chunks(
    backend: Backend,
    key_prefix: str,
    schema: Schema,
    items: Iterable[SourceItem],
    *,
    chunk_bytes: int,
    progress: Progress,
    upload_workers: int = 1,
) -> ChunkTable:
    """Write every record of ``items`` as chunks ``<key_prefix><n>`` and return their table.

    ``key_prefix`` ends with ``-`` and lies inside one dataset version
    (``<dataset>/<version>/c-...``). Returns after every chunk landed.
    """
    where = key_prefix.rsplit("/", 1)[0] + "/"
    columns: list[ColumnSpec] = [c for comp in schema.components for c in columns_for(comp)]
    names = [
        p
        for comp, p in zip(schema.components, schema.paths, strict=True)
        for _ in columns_for(comp)
    ]
    # Chunk buffers are kept for reuse up to twice the chunk size (most chunks end within
    # a record of it); a larger chunk's buffer is freed once put.
    uploader = _Uploader(backend, upload_workers, keep_bytes=2 * chunk_bytes + (64 << 10))
    builder = ChunkBuilder(columns, names)
    first = 0
    count = 0  # chunks given to the uploader
    written = 0
    lines = progress if isinstance(progress, LineProgress) else None

    def flush() -> None:
        # The chunk is encoded and put on the uploader's pool, while the next records are read.
        nonlocal builder, first, count, written
        if builder.count == 0:
            return
        key = f"{key_prefix}{count:06d}"
        uploader.put_chunk(builder, key, first, where)
        count += 1
        first += builder.count
        written += builder.nbytes
        builder = ChunkBuilder(columns, names)

    def report(n: int) -> None:
        # Bytes so far: the chunks written plus the records of the chunk being filled.
        if lines is not None:
            lines.set_bytes(written + builder.nbytes)
        progress.update(n)

    try:
        for kind, values in items:
            if kind == "batch":
                n = len(values[0]) if values else 0
                row_bytes = max(1, sum(int(np.asarray(v[:1]).nbytes) for v in values))
                start = 0
                while start < n:
                    room = max(1, (chunk_bytes - builder.nbytes) // row_bytes)
                    stop = min(n, start + room)
                    builder.add_batch([v[start:stop] for v in values])
                    report(stop - start)
                    start = stop
                    if builder.nbytes >= chunk_bytes:
                        flush()
            elif kind == "slab":
                (slab,) = values
                ends = np.cumsum(slab.record_bytes(columns))
                start = 0
                while start < slab.n:
                    # As many records as fit the chunk being filled (at least one).
                    base = int(ends[start - 1]) if start else 0
                    room = chunk_bytes - builder.nbytes
                    stop = int(np.searchsorted(ends, base + room, side="right"))
                    stop = min(slab.n, max(start + 1, stop))
                    builder.add_slab(slab.take(columns, start, stop))
                    report(stop - start)
                    start = stop
                    if builder.nbytes >= chunk_bytes:
                        flush()
            else:
                try:
                    builder.add_record(values)
                except UnsupportedElementError as err:  # which record: the source's count
                    raise UnsupportedElementError(f"record {first + builder.count}: {err}") from err
                report(1)
                if builder.nbytes >= chunk_bytes:
                    flush()
        flush()
        table = tuple(uploader.wait())
        if lines is not None:
            lines.set_bytes(sum(c.nbytes for c in table))
    finally:
        uploader.finish()
        progress.close()
    return ChunkTable(table, first)


def creation_info(chunk_bytes: int, **extra: Any) -> dict[str, Any]:
    """Return the ``created`` field of a manifest written by this process now."""
    return {
        "time": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "chunk_bytes": chunk_bytes,
        **extra,
    }


def commit_manifest(backend: Backend, manifest: Manifest, *, replace: bool = False) -> None:
    """Write ``manifest``: the commit, an exclusive put unless ``replace`` (a rebuild).

    Raises:
        KeyExistsError: another manifest was committed first.
    """
    if replace:
        backend.put(manifest.key, manifest.to_json())
    else:
        backend.put_exclusive(manifest.key, manifest.to_json())


def write_dataset(
    backend: Backend,
    dataset_id: str,
    version: str,
    schema: Schema,
    items: Iterable[SourceItem],
    *,
    chunk_bytes: int,
    progress: Progress,
    upload_workers: int = 1,
    build_id: str | None = None,
    source_fingerprint: str | None = None,
    replace: bool = False,
) -> Manifest:
    """Write every record of ``items`` as chunks, then commit the manifest.

    The manifest is created only if absent, or with ``replace`` (a rebuild by
    the holder of the version's build lock) written over the committed one.

    Chunk keys are ``<dataset>/<version>/c-<build_id>-<n>`` (``build_id``:
    random unless given), so a caller can delete one build's chunks.
    """
    build_id = build_id or new_build_id()
    started = time.perf_counter()
    table = write_chunks(
        backend,
        chunk_key_prefix(dataset_id, version, build_id),
        schema,
        items,
        chunk_bytes=chunk_bytes,
        progress=progress,
        upload_workers=upload_workers,
    )
    manifest = Manifest(
        dataset_id=dataset_id,
        version=version,
        num_records=table.num_records,
        schema=schema,
        chunks=table.chunks,
        build_id=build_id,
        created=creation_info(chunk_bytes),
        source_fingerprint=source_fingerprint,
    )
    commit_manifest(backend, manifest, replace=replace)
    elapsed = time.perf_counter() - started
    logger.info(
        "cached %s/%s: %d records, %d chunks, %.1f MB in %.2fs (%.0f records/s)",
        dataset_id,
        version,
        table.num_records,
        len(table.chunks),
        manifest.nbytes / 1e6,
        elapsed,
        table.num_records / elapsed if elapsed > 0 else 0.0,
    )
    return manifest
