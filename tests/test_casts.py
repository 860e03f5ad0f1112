"""Values from an iterable against spec=: exact conversions stored, lossy ones refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore
from storage_backends.errors import UnsupportedElementError
from yogastore import ComponentSpec

REFUSED: list[tuple[str, str, tuple[int | None, ...], Any, str]] = [
    # (id, dtype, shape, value, what the message must say)
    ("int->string", "string", (), 5, "int 5, not bytes or str"),
    ("npint->string", "string", (), np.int64(7), "int64"),
    ("float->string", "string", (), 2.5, "float"),
    ("None->string", "string", (), None, "None is not a value"),
    ("list-int->strings", "string", (2,), [b"a", 3], "int 3"),
    ("list-float->int", "int32", (2,), [1.0, 2.5], "float64 would lose information"),
    ("list-float->int-neg", "int32", (2,), [0.9, -3.7], "float64 would lose information"),
    ("nested-list-float->int", "int32", (2, 2), [[1, 2], [3, 4.5]], "float64"),
    ("varlen-list-float->int", "int64", (None,), [1.0, 2.5, 3.0], "float64"),
    ("list-int->bool", "bool", (2,), [0, 2], "int64 would lose information as bool"),
    ("list-float->bool", "bool", (2,), [0.5, 1.0], "float64 would lose information as bool"),
    ("f64->f32-inf", "float32", (), np.float64(1e300), "1e+300 is outside the float32 range"),
    ("f64->f16-inf", "float16", (), np.float64(70000.0), "outside the float16 range"),
    ("pyfloat->bf16-inf", "bfloat16", (), 1e300, "outside the bfloat16 range"),
    ("c128->c64-inf", "complex64", (), np.complex128(1e300), "outside the complex64 range"),
    ("i64->f64-inexact", "float64", (), np.int64(2**53 + 1), "9007199254740993 has no exact"),
    ("i64->f32-inexact", "float32", (1,), [2**25 + 1], "33554433 has no exact float32"),
    ("i64->f16-inf", "float16", (), np.int64(70000), "outside the float16 range"),
    ("pyint->i8", "int8", (), 300, "integer 300 is outside the int8 range"),
    ("pyint->u8", "uint8", (), -1, "integer -1 is outside the uint8 range"),
    ("pyint->u64", "uint64", (), 2**64, "18446744073709551616 is outside the uint64 range"),
    ("list->i8", "int8", (2,), [1, 300], "integer 300 is outside the int8 range"),
    ("huge-int->f64", "float64", (), 10**400, "has no exact float64 value"),
    ("None->int", "int32", (), None, "None is not a value"),
    ("object-array", "int32", (2,), np.array([1, "a"], dtype=object), "holds str 'a'"),
    ("ragged-nested-list", "int32", (2, None), [[1, 2], [3]], "nested lists of different"),
    ("text->int", "int32", (), "12", "holds str '12', not a number"),
    ("complex->float", "float64", (), np.complex128(1 + 0j), "complex to real"),
]

EXACT: list[tuple[str, str, tuple[int | None, ...], Any, Any]] = [
    # (id, dtype, shape, value, what is read back)
    ("pyint->i32", "int32", (), 3, np.int32(3)),
    ("pyfloat->f32", "float32", (), 0.5, np.float32(0.5)),
    ("list->i64", "int64", (2,), [1, 2], np.array([1, 2], np.int64)),
    ("list-bool->bool", "bool", (2,), [True, False], np.array([True, False])),
    ("bool->int", "int32", (), True, np.int32(1)),
    ("list-mixed->f64", "float64", (2,), [1, 2.5], np.array([1.0, 2.5])),
    ("f64->f32-rounds", "float32", (), np.float64(0.1), np.float32(0.1)),
    ("i16->f16-exact", "float16", (), np.int16(2048), np.float16(2048)),
    ("u64-top", "uint64", (1,), [2**64 - 1], np.array([2**64 - 1], np.uint64)),
    ("int-list->u64", "uint64", (2,), [1, 2**63], np.array([1, 2**63], np.uint64)),
    ("big-int->f64-exact", "float64", (), 2**70, np.float64(2.0**70)),
    ("varlen", "int64", (None,), [1, 2, 3], np.array([1, 2, 3], np.int64)),
    ("nested", "int8", (2, 2), [[1, -2], [3, 127]], np.array([[1, -2], [3, 127]], np.int8)),
    ("object-ints", "int32", (2,), np.array([1, 2], dtype=object), np.array([1, 2], np.int32)),
    ("str->string", "string", (), "é", "é".encode()),
    ("strings", "string", (2,), ["a", b"b"], np.array([b"a", b"b"], dtype=object)),
    ("nan->f32", "float32", (), float("nan"), np.float32("nan")),
]


def _cache(tmp_path: Path, dtype: str, shape: tuple[int | None, ...], value: Any) -> Any:
    spec = {"v": ComponentSpec(shape=shape, dtype=dtype)}
    store = yogastore.Store(tmp_path)
    ref = store.cache(
        "c", "1", lambda: [{"v": value}], spec=spec, progress=yogastore.NullProgress()
    )
    return next(iter(ref.stream(shuffle=False)))["v"]


@pytest.mark.parametrize(
    ("dtype", "shape", "value", "message"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_lossy_value_refused(
    tmp_path: Path, dtype: str, shape: tuple[int | None, ...], value: Any, message: str
) -> None:
    with pytest.raises(yogastore.UnsupportedElementError) as info:
        _cache(tmp_path, dtype, shape, value)
    text = str(info.value)
    assert "component 'v'" in text, "the message names the component"
    assert f"{type(value).__name__} value" in text, "the message names the value's type"
    assert f"spec= says {dtype}" in text, "the message names the spec"
    assert message in text
    assert yogastore.Store(tmp_path).backend.list("") == [], "a refused build leaves nothing"


@pytest.mark.parametrize(
    ("dtype", "shape", "value", "expected"), [r[1:] for r in EXACT], ids=[r[0] for r in EXACT]
)
def test_exact_value_stored(
    tmp_path: Path, dtype: str, shape: tuple[int | None, ...], value: Any, expected: Any
) -> None:
    got = _cache(tmp_path, dtype, shape, value)
    if isinstance(expected, bytes):
        assert got == expected
        return
    got = np.asarray(got)
    assert got.dtype == np.asarray(expected).dtype or dtype == "string"
    assert np.array_equal(got, np.asarray(expected), equal_nan=got.dtype.kind == "f")


def test_ragged_and_sparse_values_checked(tmp_path: Path) -> None:
    from yogastore.spec import Kind, RaggedValue, SparseValue

    store = yogastore.Store(tmp_path)
    ragged = ComponentSpec(shape=(None, None), dtype="int8", kind=Kind.RAGGED, ragged_rank=1)
    value = RaggedValue(np.array([1, 300], np.int64), (np.array([0, 1, 2], np.int64),))
    with pytest.raises(yogastore.UnsupportedElementError, match="300 is outside the int8"):
        store.cache("r", "1", lambda: [value], spec=ragged)
    sparse = ComponentSpec(shape=(4,), dtype="int32", kind=Kind.SPARSE)
    bad = SparseValue(np.array([[0]], np.int64), np.array([0.5]), np.array([4], np.int64))
    with pytest.raises(yogastore.UnsupportedElementError, match="float64 would lose"):
        store.cache("s", "1", lambda: [bad], spec=sparse)


@pytest.mark.parametrize(
    ("dtype", "bad"),
    [("int64", 2**64 - 1), ("uint64", -1), ("int8", 2**64 - 1), ("float64", 2**64 - 1)],
)
def test_integers_no_single_integer_type_holds_are_refused_by_value(
    tmp_path: Path, dtype: str, bad: int
) -> None:
    """-1 and 2**64 - 1 together fit neither int64 nor uint64: the misfit is named."""
    spec = {"v": yogastore.ComponentSpec(shape=(2,), dtype=dtype)}
    with pytest.raises(yogastore.UnsupportedElementError, match=f"integer {bad} "):
        yogastore.Store(tmp_path).cache("d", "1", lambda: [{"v": [-1, 2**64 - 1]}], spec=spec)
    ref = yogastore.Store(tmp_path).cache(
        "f", "1", lambda: [{"v": [-1, 2**63]}],
        spec={"v": yogastore.ComponentSpec(shape=(2,), dtype="float64")},
    )  # fmt: skip
    assert [np.asarray(e["v"]).tolist() for e in ref.stream(shuffle=False)] == [[-1.0, 2.0**63]]


def test_a_record_of_the_wrong_shape_is_refused_naming_record_and_component(
    tmp_path: Path,
) -> None:
    spec = {
        "a": yogastore.ComponentSpec(shape=(4,), dtype="int32"),
        "x": yogastore.ComponentSpec(shape=(None, 2), dtype="int32"),
        "s": yogastore.ComponentSpec(shape=(2,), dtype="string"),
    }

    def records(bad: str) -> list[dict[str, object]]:
        out: list[dict[str, object]] = [
            {"a": np.zeros(4, np.int32), "x": np.zeros((i, 2), np.int32), "s": [b"ab", b""]}
            for i in range(10)
        ]
        out[7][bad] = {"a": np.zeros(5, np.int32), "x": np.zeros((3, 3), np.int32), "s": [b"a"]}[
            bad
        ]
        return out

    store = yogastore.Store(tmp_path)
    for bad, shape in (("a", r"\(5,\)"), ("x", r"\(3, 3\)"), ("s", r"\(1,\)")):
        with pytest.raises(
            UnsupportedElementError, match=rf"record 7: component '{bad}' has shape {shape}"
        ):
            store.cache("m", "1", lambda bad=bad: records(bad), spec=spec)
    assert store.versions() == []
    ref = store.cache("m", "1", lambda: records("a")[:7], spec=spec)
    assert ref.num_records == 7


def test_a_string_without_utf8_encoding_is_refused_naming_its_component(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path)
    spec = {"s": yogastore.ComponentSpec(shape=(), dtype="string")}
    bad = "lone \udc80 surrogate"
    with pytest.raises(
        UnsupportedElementError, match=r"record 1: component 's': .* cannot be encoded as UTF-8"
    ):
        store.cache("r", "1", lambda: [{"s": "fine"}, {"s": bad}], spec=spec)
    with pytest.raises(
        UnsupportedElementError, match=r"batch 0: component 's': .* cannot be encoded as UTF-8"
    ):
        store.cache(
            "b", "1", lambda: yogastore.Batches([{"s": np.array(["a", bad], object)}]), spec=spec
        )
    assert store.versions() == []
    ref = store.cache("r", "1", lambda: [{"s": "fine"}, {"s": "\u00e9\U0001f600"}], spec=spec)
    assert [bytes(e["s"]) for e in ref.stream(shuffle=False)] == [
        b"fine",
        "\u00e9\U0001f600".encode(),
    ]


@pytest.mark.parametrize("value", [[[1, 2], [], [3]], [[1], [2]], [], np.zeros((2, 2), np.int32)])
def test_a_ragged_component_given_as_lists_is_told_to_take_a_ragged_value(
    tmp_path: Path, value: Any
) -> None:
    from yogastore.spec import Kind

    spec = {"r": ComponentSpec(shape=(None, None), dtype="int32", kind=Kind.RAGGED, ragged_rank=1)}
    with pytest.raises(
        UnsupportedElementError,
        match=r"component 'r': .* ragged_rank 1 takes a yogastore.RaggedValue",
    ):
        yogastore.Store(tmp_path).cache("d", "1", lambda: [{"r": value}], spec=spec)
