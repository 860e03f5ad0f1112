"""The manifest: the JSON document whose presence commits a dataset version.

It is O(number of chunks): per-record offsets live in each chunk's header.
Parsing validates every field (types, ranges, contiguity of the chunk table)
and raises ``CorruptCacheError`` naming the dataset and what failed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from typing import Any

import numpy as np
import xxhash

from storage_backends import check_key
from storage_backends.errors import CorruptCacheError, InvalidArgumentError
from yogastore import boundedjson
from yogastore.checks import check_int
from yogastore.format import ColumnSpec, columns_for
from yogastore.spec import Schema

try:  # the compiled, SIGBUS-guarded hash; without it xxhash does the same
    from yogastore import _gather
except ImportError:  # pragma: no cover - the package builds it on install
    _gather = None  # type: ignore[assignment]

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "MAX_NAME_BYTES",
    "ChunkInfo",
    "Manifest",
    "checksum",
    "manifest_key",
    "validate_name",
]

#: 2: chunk indexes carry block checksums of the data (``yogastore.format.blocks``).
#: Older versions are refused with a message saying to build again.
FORMAT_VERSION = 2
#: Name of a version's manifest, under ``<dataset id>/<version>/``: its key commits the version.
MANIFEST = "manifest.json"
#: Longest dataset id or version, in UTF-8 bytes.
MAX_NAME_BYTES = 200
_CHECKSUM = re.compile(r"xxh3_64:[0-9a-f]{16}")
#: Most records a dataset may hold: far beyond any real one (2 PB of 8-byte records), and
#: small enough that every index, permutation and count fits an int64 with room to spare.
MAX_RECORDS = (1 << 48) - 1
_HEX = re.compile(r"[0-9a-f]*")
_ZERO = np.zeros(1, np.int64)


def checksum(data: bytes | memoryview) -> str:
    """Return the checksum string recorded for ``data``.

    A view (perhaps of a memory-mapped file) is hashed by the compiled, guarded
    hash: a file cut short under it raises ``MappedFault`` (an ``OSError``) for
    the caller to name, instead of ending the process with SIGBUS.
    """
    if _gather is None or isinstance(data, bytes):
        return f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"
    view = memoryview(data).cast("B")
    digest = np.empty(1, np.uint64)
    _gather.hash_blocks(digest, [view], _ZERO, _ZERO, np.array([view.nbytes], np.int64))
    return f"xxh3_64:{int(digest[0]):016x}"


def manifest_key(dataset_id: str, version: str) -> str:
    """Return the key of a version's manifest."""
    return f"{dataset_id}/{version}/{MANIFEST}"


def validate_name(value: Any, what: str) -> str:
    """Check a dataset id or version and return it.

    Raises:
        InvalidArgumentError: empty, not a string, containing ``/`` or ``..``,
            starting with ``.``, not printable, or longer than ``MAX_NAME_BYTES``
            in UTF-8.
    """
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty string, got {value!r}")
    if "/" in value or "\\" in value or ".." in value or not value.isprintable():
        raise InvalidArgumentError(
            f"{what} {value!r} must be printable and contain no '/', '\\\\' or '..'"
        )
    if value.startswith("."):
        raise InvalidArgumentError(f"{what} {value!r} must not start with '.'")
    # Counted in UTF-8 bytes: a name is a path component (plus ".lock"),
    # and file systems allow 255 bytes, not characters.
    if len(value.encode("utf-8")) > MAX_NAME_BYTES:
        raise InvalidArgumentError(
            f"{what} {value[:40]!r}... is {len(value.encode('utf-8'))} bytes in UTF-8; "
            f"at most {MAX_NAME_BYTES} are allowed"
        )
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkInfo:
    """One row of the chunk table."""

    key: str
    first: int
    count: int
    nbytes: int
    index_bytes: int
    checksum: str
    index_checksum: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _int(obj: dict[str, Any], name: str, where: str, low: int = 0, high: int | None = None) -> int:
    return check_int(f"{where}: field {name!r}", obj.get(name), low, high, error=CorruptCacheError)


def _str(obj: dict[str, Any], name: str, where: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise CorruptCacheError(f"{where}: field {name!r} must be a string, got {value!r}")
    return value


def _check_counts_fit(chunks: list[ChunkInfo], schema: Schema, where: str) -> None:
    """Refuse a chunk whose record count cannot fit its bytes.

    Every record takes its fixed columns' bytes and 8 bytes of offsets per
    variable-length column, so a readable chunk holds at most ``nbytes`` over
    that many records; readers size work by counts before a chunk is read.
    """
    least = 0
    for comp in schema.components:
        for col in columns_for(comp):
            if col.layout == "fixed":
                least += col.np_dtype.itemsize * math.prod(d or 0 for d in col.shape)
            else:
                least += 8
    if least == 0:
        return
    for i, c in enumerate(chunks):
        if c.count * least > c.nbytes:
            raise CorruptCacheError(
                f"{where} chunk {i}: {c.count} records of at least {least} bytes each cannot "
                f"fit its {c.nbytes} bytes"
            )


def _storage_name(name: str) -> bool:
    """Whether ``name`` is one part of a storage key (``storage_backends.check_key``)."""
    try:
        check_key(name)
    except InvalidArgumentError:
        return False
    return "/" not in name


def _well_formed_rows(rows: list[Any], prefix: str) -> tuple[list[ChunkInfo], int] | None:
    """The chunk table and its record count when every row passes ``from_json``'s checks.

    The same checks as the row-by-row loop, a column at a time (a table of 15,625
    chunks: 0.15 s row by row). ``None`` when any row fails: the loop then finds and
    names it.
    """
    try:
        table = [
            (
                r["key"], r["first"], r["count"], r["nbytes"], r["index_bytes"],
                r["checksum"], r["index_checksum"],
            )
            for r in rows
        ]  # fmt: skip
    except (TypeError, KeyError, IndexError):
        return None
    if not table:
        return [], 0
    keys, firsts, counts, sizes, index_sizes, sums, index_sums = map(list, zip(*table, strict=True))
    if not all(type(v) is int for col in (firsts, counts, sizes, index_sizes) for v in col):
        return None  # bools and floats too are refused by the loop
    starts = list(itertools.accumulate(counts, initial=0))
    if (
        starts[:-1] != firsts
        or min(counts) < 1
        or max(counts) > MAX_RECORDS
        or min(sizes) < 8
        or min(index_sizes) < 8
        or any(i > n for i, n in zip(index_sizes, sizes, strict=True))
    ):
        return None
    cut = len(prefix)
    if not all(type(k) is str and k.startswith(prefix) and _storage_name(k[cut:]) for k in keys):
        return None
    digests = sums + index_sums
    if not all(type(d) is str and len(d) == 24 and d.startswith("xxh3_64:") for d in digests):
        return None
    if not _HEX.fullmatch("".join(d[8:] for d in digests)):
        return None
    chunks = list(map(ChunkInfo, keys, firsts, counts, sizes, index_sizes, sums, index_sums))
    return chunks, starts[-1]


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """A committed dataset version."""

    dataset_id: str
    version: str
    num_records: int
    schema: Schema
    chunks: tuple[ChunkInfo, ...]
    build_id: str
    created: dict[str, Any]
    source_fingerprint: str | None = None
    """The ``fingerprint=`` the dataset was built with (canonical JSON text), if any."""

    @property
    def nbytes(self) -> int:
        """Total bytes of all chunks."""
        return sum(c.nbytes for c in self.chunks)

    @property
    def where(self) -> str:
        return f"dataset {self.dataset_id!r} version {self.version!r}"

    @property
    def key(self) -> str:
        """The key of this manifest."""
        return manifest_key(self.dataset_id, self.version)

    def keys(self) -> frozenset[str]:
        """Return the keys this manifest commits: its own and its chunks'."""
        return frozenset((self.key, *(c.key for c in self.chunks)))

    def columns(self) -> list[ColumnSpec]:
        """Return the flat column list of the schema."""
        return [col for comp in self.schema.components for col in columns_for(comp)]

    def chunk_starts(self) -> np.ndarray:
        """Return the first record index of every chunk (int64)."""
        return np.fromiter((c.first for c in self.chunks), dtype=np.int64, count=len(self.chunks))

    def to_json(self) -> bytes:
        """Return the manifest as UTF-8 JSON bytes."""
        doc = {
            "format": "yogastore",
            "format_version": FORMAT_VERSION,
            "dataset_id": self.dataset_id,
            "version": self.version,
            "num_records": self.num_records,
            "schema": self.schema.to_json(),
            "chunks": [c.to_json() for c in self.chunks],
            "build_id": self.build_id,
            "created": self.created,
            "source_fingerprint": self.source_fingerprint,
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | memoryview, where: str, prefix: str) -> Manifest:
        """Parse and validate manifest bytes.

        Args:
            data: the manifest bytes.
            where: text naming the dataset for error messages.
            prefix: the key prefix every chunk key must start with.
        """
        doc = boundedjson.loads(data, f"{where}: manifest", CorruptCacheError)
        if not isinstance(doc, dict) or doc.get("format") != "yogastore":
            raise CorruptCacheError(f"{where}: manifest is not a yogastore manifest")
        if doc.get("format_version") != FORMAT_VERSION:
            raise CorruptCacheError(
                f"{where}: manifest format version {doc.get('format_version')!r} is not "
                f"{FORMAT_VERSION} (version 1 chunks lack the block checksums every read now "
                "checks); delete this version and build it again with this yogastore version"
            )
        num_records = _int(doc, "num_records", where, high=MAX_RECORDS)
        schema = Schema.from_json(doc.get("schema"), where)
        rows = doc.get("chunks")
        if not isinstance(rows, list):
            raise CorruptCacheError(f"{where}: manifest has no chunk table")
        fast = _well_formed_rows(rows, prefix)
        chunks: list[ChunkInfo] = [] if fast is None else fast[0]
        expected_first = 0 if fast is None else fast[1]
        for i, row in enumerate(rows if fast is None else ()):
            at = f"{where} chunk {i}"
            if not isinstance(row, dict):
                raise CorruptCacheError(f"{at}: chunk table row is not an object")
            info = ChunkInfo(
                key=_str(row, "key", at),
                first=_int(row, "first", at),
                count=_int(row, "count", at, low=1, high=MAX_RECORDS),
                nbytes=_int(row, "nbytes", at, low=8),
                index_bytes=_int(row, "index_bytes", at, low=8),
                checksum=_str(row, "checksum", at),
                index_checksum=_str(row, "index_checksum", at),
            )
            name = info.key[len(prefix) :]
            if not info.key.startswith(prefix) or "/" in name:
                raise CorruptCacheError(f"{at}: chunk key {info.key!r} is outside {prefix!r}")
            if not _storage_name(name):
                raise CorruptCacheError(
                    f"{at}: chunk key {info.key!r} is not a storage key (printable, no "
                    "backslash, not '.' or '..')"
                )
            if info.first != expected_first:
                raise CorruptCacheError(
                    f"{at}: starts at record {info.first}, expected {expected_first}"
                )
            if info.index_bytes > info.nbytes:
                raise CorruptCacheError(f"{at}: index of {info.index_bytes} bytes exceeds chunk")
            for field, digest in (
                ("checksum", info.checksum),
                ("index_checksum", info.index_checksum),
            ):
                if not _CHECKSUM.fullmatch(digest):
                    raise CorruptCacheError(f"{at}: malformed {field} {digest!r}")
            expected_first += info.count
            chunks.append(info)
        if expected_first != num_records:
            raise CorruptCacheError(
                f"{where}: chunk table covers {expected_first} records, manifest says {num_records}"
            )
        _check_counts_fit(chunks, schema, where)
        created = doc.get("created", {})
        fingerprint = doc.get("source_fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise CorruptCacheError(
                f"{where}: field 'source_fingerprint' must be a string or null, got {fingerprint!r}"
            )
        return cls(
            dataset_id=_str(doc, "dataset_id", where),
            version=_str(doc, "version", where),
            num_records=num_records,
            schema=schema,
            chunks=tuple(chunks),
            build_id=_str(doc, "build_id", where),
            created=created if isinstance(created, dict) else {},
            source_fingerprint=fingerprint,
        )
