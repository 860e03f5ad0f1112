"""A corrupted or hostile cache gives CorruptCacheError, never a crash or wrong data."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore
from yogastore.format.manifest import checksum

SPEC = {
    "x": yogastore.ComponentSpec(shape=(4,), dtype="int32"),
    "s": yogastore.ComponentSpec(shape=(None,), dtype="string"),
    "v": yogastore.ComponentSpec(shape=(None,), dtype="float64"),
}


def items(n: int = 200) -> list[dict[str, Any]]:
    return [
        {
            "x": np.full(4, i, np.int32),
            "s": np.array([b"r%d" % i] * (i % 3), dtype=object),
            "v": np.arange(i % 5, dtype=np.float64),
        }
        for i in range(n)
    ]


def build(root: Path) -> yogastore.DatasetRef:
    return yogastore.Store(root, chunk_bytes=2048).cache("d", "1", items, spec=SPEC)


def read_all(root: Path) -> list[Any]:
    ref = yogastore.Store(root).open("d", "1")
    return list(ref.stream(shuffle=False))


def test_flipped_byte_on_disk_is_detected(tmp_path: Path) -> None:
    ref = build(tmp_path)
    info = ref.manifest.chunks[1]
    chunk = bytes(ref.store.backend.get(info.key))
    data_file = tmp_path / "d" / "1" / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    # Find a stretch of this chunk that occurs exactly once in the file.
    for start in range(len(chunk) - 96, 0, -32):
        needle = chunk[start : start + 96]
        at = raw.find(needle)
        if at >= 0 and raw.find(needle, at + 1) == -1:
            break
    else:
        pytest.fail("no unique stretch of the chunk found in data.mdb")
    raw[at + 10] ^= 0x01
    data_file.write_bytes(bytes(raw))
    with pytest.raises(yogastore.CorruptCacheError, match=r"chunk 1 .*checksum"):
        read_all(tmp_path)


def _rewrite_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    store = yogastore.Store(root)
    key = "d/1/manifest.json"
    doc = json.loads(bytes(store.backend.get(key)))
    edit(doc)
    store.backend.put(key, json.dumps(doc).encode())


def _rewrite_chunk(root: Path, index: int, edit: Callable[[bytearray], bytearray]) -> None:
    """Replace chunk ``index`` and fix its checksums: a hostile, self-consistent cache."""
    store = yogastore.Store(root)
    key = "d/1/manifest.json"
    doc = json.loads(bytes(store.backend.get(key)))
    row = doc["chunks"][index]
    data = edit(bytearray(store.backend.get(row["key"])))
    store.backend.put(row["key"], bytes(data))
    row.update(
        nbytes=len(data),
        checksum=checksum(bytes(data)),
        index_checksum=checksum(bytes(data[: row["index_bytes"]])),
    )
    store.backend.put(key, json.dumps(doc).encode())


def _edit_header(edit: Callable[[dict[str, Any]], None]) -> Callable[[bytearray], bytearray]:
    def apply(data: bytearray) -> bytearray:
        (length,) = struct.unpack_from("<I", data, 4)
        header = json.loads(bytes(data[8 : 8 + length]))
        edit(header)
        new = json.dumps(header, separators=(",", ":")).encode()
        data[8 : 8 + len(new)] = new
        struct.pack_into("<I", data, 4, len(new))
        return data

    return apply


def _poke_offsets(data: bytearray) -> bytearray:
    (length,) = struct.unpack_from("<I", data, 4)
    header = json.loads(bytes(data[8 : 8 + length]))
    start, _size = header["cols"][1]["offsets"]  # column "v": record offsets
    np.frombuffer(data, dtype="<i8", count=3, offset=start)  # bounds check of the test itself
    struct.pack_into("<q", data, start + 8, 1 << 40)
    return data


MANIFEST_EDITS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "chunk-past-end",
        lambda d: d["chunks"][0].update(nbytes=d["chunks"][0]["nbytes"] + 4096),
        "bytes",
    ),
    ("index-past-chunk", lambda d: d["chunks"][0].update(index_bytes=10**9), "index"),
    ("count-mismatch", lambda d: d.update(num_records=d["num_records"] + 1), "covers"),
    (
        "chunk-count-lies",
        lambda d: (
            d["chunks"][0].update(count=d["chunks"][0]["count"] + 1),
            d["chunks"][1].update(
                first=d["chunks"][1]["first"] + 1, count=d["chunks"][1]["count"] - 1
            ),
        ),
        "records",
    ),
    ("key-outside-dataset", lambda d: d["chunks"][0].update(key="other/1/c-x"), "outside"),
    ("object-dtype", lambda d: d["schema"]["components"][0].update(dtype="object"), "object"),
    ("negative-dim", lambda d: d["schema"]["components"][0].update(shape=[-4]), "component"),
    (
        "namedtuple-code",
        lambda d: d["schema"].update(
            structure={
                "type": "namedtuple",
                "name": "__import__('os').system",
                "fields": ["a", "b", "c"],
                "items": d["schema"]["structure"]["items"],
            }
        ),
        "identifier",
    ),
    ("missing-chunk", lambda d: d["chunks"][1].update(key="d/1/c-missing"), "missing"),
    ("bad-checksum-format", lambda d: d["chunks"][0].update(checksum="md5:abc"), "checksum"),
    ("format-version", lambda d: d.update(format_version=99), "format version"),
]


@pytest.mark.parametrize("name,edit,message", MANIFEST_EDITS, ids=[m[0] for m in MANIFEST_EDITS])
def test_hostile_manifest(
    tmp_path: Path, name: str, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    build(tmp_path)
    _rewrite_manifest(tmp_path, edit)
    with pytest.raises(yogastore.CorruptCacheError, match=message) as info:
        read_all(tmp_path)
    assert "'d'" in str(info.value), "the error names the dataset"
    assert isinstance(info.value, ValueError)


CHUNK_EDITS: list[tuple[str, Callable[[bytearray], bytearray], str]] = [
    (
        "region-past-end",
        _edit_header(lambda h: h["cols"][0].update(data=[h["cols"][0]["data"][0], 10**8])),
        "outside the chunk",
    ),
    (
        "unaligned-region",
        _edit_header(lambda h: h["cols"][0].update(data=[h["cols"][0]["data"][0] + 3, 16])),
        "outside the chunk",
    ),
    ("record-count", _edit_header(lambda h: h.update(k=h["k"] + 1)), "records"),
    ("missing-column", _edit_header(lambda h: h["cols"].pop()), "columns"),
    ("offsets-jump", _poke_offsets, "offsets"),
    ("bad-magic", lambda d: bytearray(b"NOPE") + d[4:], "magic"),
    ("truncated", lambda d: d[: len(d) // 2], "outside the chunk|offsets|past|exceeds"),
]


@pytest.mark.parametrize("name,edit,message", CHUNK_EDITS, ids=[m[0] for m in CHUNK_EDITS])
def test_hostile_chunk_with_matching_checksum(
    tmp_path: Path, name: str, edit: Callable[[bytearray], bytearray], message: str
) -> None:
    build(tmp_path)
    _rewrite_chunk(tmp_path, 0, edit)
    with pytest.raises(yogastore.CorruptCacheError, match=message) as info:
        read_all(tmp_path)
    assert "chunk 0" in str(info.value)


def test_intact_cache_reads_back_exactly(tmp_path: Path) -> None:
    build(tmp_path)
    got = read_all(tmp_path)
    for i, e in enumerate(got):
        assert e["x"].tolist() == [i] * 4
        assert e["s"].tolist() == [b"r%d" % i] * (i % 3)
        assert e["v"].tolist() == list(map(float, range(i % 5)))


def test_a_manifest_key_changed_into_its_neighbours_name_is_refused(tmp_path: Path) -> None:
    """One byte turns key "y" into "x": two components would answer to one name."""
    spec = {
        "x": yogastore.ComponentSpec(shape=(2,), dtype="float32"),
        "y": yogastore.ComponentSpec(shape=(), dtype="int64"),
    }
    records = [{"x": np.array([i, -i], np.float32), "y": np.int64(i)} for i in range(20)]
    root = tmp_path / "s"
    yogastore.Store(root).cache(
        "d", "1", lambda: iter(records), spec=spec, progress=yogastore.NullProgress()
    )
    data_file = root / "d" / "1" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    at = data.find(b'"y"', data.find(b'"keys": ['))
    assert at > 0
    data[at + 1] = ord("x")
    data_file.write_bytes(bytes(data))
    with pytest.raises(yogastore.CorruptCacheError, match="not sorted and unique"):
        yogastore.Store(root).open("d", "1")
