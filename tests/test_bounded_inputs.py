"""Hostile JSON and numbers in manifests, chunk headers and resume states: library errors only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore
from storage_backends.errors import CorruptCacheError, InvalidArgumentError
from yogastore import boundedjson
from yogastore.format import MAGIC, parse_header
from yogastore.format.layout import PREFIX as _PREFIX
from yogastore.format.manifest import Manifest
from yogastore.read.stream import StreamState
from yogastore.spec import MAX_DIM, ComponentSpec

SPEC = {"x": yogastore.ComponentSpec(shape=(2,), dtype="int64")}

DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE_INT = b"9" * 5000

HOSTILE = [
    (DEEP, "nested"),
    (b'{"a": ' + DEEP + b"}", "nested"),
    (b'{"a": ' + HUGE_INT + b"}", "digits"),
    (b'{"a": -' + HUGE_INT + b"}", "digits"),
    (b'{"a": 1e99999}', "out of range"),
    (b'{"a": NaN}', "not a JSON number"),
    (b"\xff\xfe", "not valid JSON"),
]
IDS = ["deep-array", "deep-in-object", "huge-int", "huge-negative-int", "inf", "nan", "not-utf8"]


@pytest.mark.parametrize(("text", "match"), HOSTILE, ids=IDS)
def test_bounded_loads(text: bytes, match: str) -> None:
    with pytest.raises(CorruptCacheError, match=match):
        boundedjson.loads(text, "test document", CorruptCacheError)


def test_strings_do_not_count_as_nesting() -> None:
    doc = {"s": "[" * 1000 + "{" * 1000, "t": '"\\"[[[', "n": [[[1]]]}
    assert boundedjson.loads(json.dumps(doc), "doc", CorruptCacheError) == doc
    assert boundedjson.depth(json.dumps(doc).encode()) == 4
    with pytest.raises(InvalidArgumentError, match="expected JSON text"):
        boundedjson.loads(10**12, "doc", InvalidArgumentError)  # type: ignore[arg-type]


def _manifest_doc(tmp_path: Path) -> tuple[yogastore.Store, dict[str, Any]]:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    ref = store.cache("d", "1", lambda: [{"x": np.array([i, i])} for i in range(20)], spec=SPEC)
    return store, json.loads(ref.manifest.to_json())


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(
            created={"deep": json.loads("[" * 60 + "]" * 60)} | {"x": DEEP.decode()}
        ),
        lambda d: d["schema"].update(structure=json.loads("[" * 63 + "]" * 63)),
        lambda d: d["chunks"][0].update(count=int("9" * 30)),
        lambda d: d["schema"]["components"][0].update(shape=[10**30]),
        lambda d: d["schema"]["components"][0].update(shape=[MAX_DIM + 1]),
        lambda d: d["schema"]["components"][0].update(shape=[2**30, 2**30]),
    ],
    ids=["deep-string-ok", "deep-structure", "huge-count", "dim-1e30", "dim-2-31", "elements"],
)
def test_hostile_manifest_fields(tmp_path: Path, change: Any) -> None:
    _, doc = _manifest_doc(tmp_path)
    change(doc)
    text = json.dumps(doc).encode()
    if b"]]]]" in text and b'"deep"' in text:  # deep but only 61 levels, inside bounds
        Manifest.from_json(text, "m", "d/1/")
        return
    with pytest.raises(CorruptCacheError):
        Manifest.from_json(text, "m", "d/1/")


def test_deeply_nested_manifest_in_a_store(tmp_path: Path) -> None:
    store, _ = _manifest_doc(tmp_path)
    store.backend.delete("d/1/manifest.json")
    store.backend.put("d/1/manifest.json", b'{"format": "yogastore", "x": ' + DEEP + b"}")
    with pytest.raises(CorruptCacheError, match="nested"):
        store.open("d", "1")
    assert store.list() == []  # skipped with a warning, not a crash


def test_chunk_header_hostile_json() -> None:
    for body in (DEEP, b'{"cols": [], "index_end": ' + HUGE_INT + b"}"):
        chunk = _PREFIX.pack(MAGIC, len(body)) + body
        with pytest.raises(CorruptCacheError, match="chunk header"):
            parse_header(chunk, len(chunk), "chunk 0")


@pytest.mark.parametrize(
    "dim", [10**30, -1, MAX_DIM + 1, True, 1.5], ids=["1e30", "negative", "2-31", "bool", "float"]
)
def test_component_spec_dimension_bounds(dim: Any) -> None:
    with pytest.raises(yogastore.UnsupportedElementError, match="dimension"):
        ComponentSpec(shape=(dim,), dtype="float32")
    with pytest.raises(yogastore.UnsupportedElementError, match="elements per record"):
        ComponentSpec(shape=(2**21, 2**21), dtype="uint8")


def test_resume_state_hostile_inputs(tmp_path: Path) -> None:
    store, _ = _manifest_doc(tmp_path)
    ref = store.open("d", "1")
    good = ref.stream(shuffle=True, seed=3).state(consumed=5)
    # bytes work like str
    assert (
        next(iter(ref.resume(good.to_json().encode()).record_indices(100))).tolist()
        == next(iter(ref.resume(good).record_indices(100))).tolist()
    )
    doc = json.loads(good.to_json())
    bad = [
        b"...",
        DEEP,
        json.dumps(doc).replace('"seed":', '"seed":' + "7" * 4400 + ', "x":').encode(),
        json.dumps(doc | {"remaining": json.loads("[" * 70 + "]" * 70)}),
        b"[1, 2]",
        b"null",
    ]
    for text in bad:
        with pytest.raises(InvalidArgumentError):
            ref.resume(text)
        with pytest.raises(InvalidArgumentError):
            StreamState.from_json(text)
    with pytest.raises(InvalidArgumentError, match="StreamState"):
        ref.resume(12)  # type: ignore[arg-type]
