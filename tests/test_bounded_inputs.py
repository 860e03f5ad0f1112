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


def _reference_loads(raw: bytes) -> Any:
    """Every document measured exactly and every integer checked (the bounds' definition)."""
    if boundedjson.depth(raw) > boundedjson.MAX_DEPTH:
        return "nested"
    try:
        return json.loads(
            raw,
            parse_int=boundedjson._int,
            parse_float=boundedjson._float,
            parse_constant=boundedjson._constant,
        )
    except ValueError:
        return "invalid"


def _random_document(rng: np.random.Generator) -> bytes:
    """Nesting near the bound, brackets, quotes and long digit runs inside strings and out."""
    pieces = ["[", "]", "{", "}", '"', "\\", "9" * 21, "1" * 20, "x", ","]

    def text() -> str:
        return "".join(rng.choice(pieces) for _ in range(int(rng.integers(0, 6))))

    def value(depth: int) -> Any:
        kind = int(rng.integers(0, 5))
        if depth <= 0 or kind == 0:
            return int(rng.choice([0, 10**19, 10**20, -(10**20), 10**21, 2**64]))
        if kind == 1:
            return text()
        if kind == 2:
            return [value(depth - 1) for _ in range(int(rng.integers(1, 3)))]
        return {text(): value(depth - 1) for _ in range(int(rng.integers(1, 3)))}

    doc = value(int(rng.integers(1, 8)))
    for _ in range(int(rng.integers(0, 3))):
        doc = [doc] * int(rng.integers(1, 4))
    nest = int(rng.integers(0, 70))
    return ("[" * nest + json.dumps(doc) + "]" * nest).encode()


def test_quick_bounds_agree_with_exact_ones() -> None:
    """Counting brackets and digit runs first decides every document as the exact check does."""
    rng = np.random.default_rng(7)
    seen = set()
    for _ in range(3000):
        raw = _random_document(rng)
        want = _reference_loads(raw)
        try:
            got = boundedjson.loads(raw, "doc", CorruptCacheError)
        except CorruptCacheError as err:
            got = "nested" if "nested" in str(err) else "invalid"
        assert got == want, raw[:200]
        seen.add(want if isinstance(want, str) else "parsed")
    assert seen == {"nested", "invalid", "parsed"}


def _big_manifest(tmp_path: Path) -> dict[str, Any]:
    store = yogastore.Store(tmp_path, chunk_bytes=256)
    ref = store.cache(
        "d", "1", lambda: yogastore.Batches([{"x": np.arange(2000).reshape(1000, 2)}]), spec=SPEC
    )
    doc = json.loads(ref.manifest.to_json())
    assert len(doc["chunks"]) > 40
    return doc


BAD_ROWS = [
    (lambda r: r.update(first=r["first"] + 1), "starts at record"),
    (lambda r: r.update(count=0), r"'count' must be an integer in \[1, "),
    (lambda r: r.update(count=2**60), r"'count' must be an integer in \[1, 2\*\*48"),
    (lambda r: r.update(count=True), "'count' must be an integer"),
    (lambda r: r.update(nbytes=float(r["nbytes"])), "'nbytes' must be an integer"),
    (lambda r: r.update(index_bytes=r["nbytes"] + 1), "exceeds chunk"),
    (lambda r: r.update(key="e/1/chunk"), "outside"),
    (lambda r: r.update(key=r["key"] + "/x"), "outside"),
    (lambda r: r.update(checksum=r["checksum"].upper()), "malformed checksum"),
    (lambda r: r.update(checksum=r["checksum"] + "\n"), "malformed checksum"),
    (lambda r: r.update(index_checksum=r["index_checksum"][:-1] + "g"), "malformed index_checksum"),
    (lambda r: r.update(index_checksum=5), "must be a string"),
    (lambda r: r.update(key=r["key"] + "\x00"), "not a storage key"),
    (lambda r: r.update(key=r["key"] + "\ud800"), "not a storage key"),
    (lambda r: r.update(key="d/1/"), "not a storage key"),
    (lambda r: r.update(key="d/1/.."), "not a storage key"),
    (lambda r: r.update(key="d/1/c-back\\slash"), "not a storage key"),
    (lambda r: r.pop("index_bytes"), "'index_bytes' must be an integer"),
]


@pytest.mark.parametrize(("change", "match"), BAD_ROWS)
def test_a_bad_row_in_a_long_chunk_table_is_named(tmp_path: Path, change: Any, match: str) -> None:
    doc = _big_manifest(tmp_path)
    change(doc["chunks"][37])
    with pytest.raises(CorruptCacheError, match=f"chunk 37: .*{match}"):
        Manifest.from_json(json.dumps(doc).encode(), "m", "d/1/")


def test_a_long_chunk_table_parses_to_its_rows(tmp_path: Path) -> None:
    doc = _big_manifest(tmp_path)
    manifest = Manifest.from_json(json.dumps(doc).encode(), "m", "d/1/")
    assert [c.to_json() for c in manifest.chunks] == doc["chunks"]
    doc["chunks"][5] = ["not", "a", "row"]
    with pytest.raises(CorruptCacheError, match="chunk 5: chunk table row is not an object"):
        Manifest.from_json(json.dumps(doc).encode(), "m", "d/1/")


def test_a_chunk_count_its_bytes_cannot_hold_is_corrupt(tmp_path: Path) -> None:
    doc = _big_manifest(tmp_path)  # 16 bytes per record
    last = doc["chunks"][-1]
    last["count"] += 10**6
    doc["num_records"] += 10**6
    with pytest.raises(CorruptCacheError, match=r"records of at least 16 bytes each cannot fit"):
        Manifest.from_json(json.dumps(doc).encode(), "m", "d/1/")


def test_a_structure_too_deep_for_its_manifest_is_refused_before_reading(tmp_path: Path) -> None:
    def nest(depth: int, leaf: Any) -> Any:
        for _ in range(depth):
            leaf = {"k": leaf}
        return leaf

    store = yogastore.Store(tmp_path)
    ok = store.cache("ok", "1", lambda: [nest(25, np.int64(1))], spec=nest(25, SPEC["x"].__class__(
        shape=(), dtype="int64")))  # fmt: skip
    assert yogastore.Store(tmp_path).open("ok", "1").num_records == 1
    assert ok.num_records == 1
    read = []

    def deep() -> Any:
        read.append(1)
        yield nest(40, np.int64(1))

    spec = nest(40, yogastore.ComponentSpec(shape=(), dtype="int64"))
    with pytest.raises(yogastore.UnsupportedElementError, match=r"nests \d+ levels deep"):
        store.cache("deep", "1", deep, spec=spec)
    assert read == [] and [i.dataset_id for i in store.list()] == ["ok"]
