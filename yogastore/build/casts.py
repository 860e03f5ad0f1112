"""Refusing lossy conversions of values from an iterable to the dtype ``spec=`` names.

numpy converts almost anything into almost anything: ``bytes(5)`` is five NUL
bytes, ``1.5`` becomes ``1``, ``1e300`` becomes ``inf`` in float32 and 300
wraps around in int8 (or raises a bare ``OverflowError``). A cache written that
way holds wrong data with no error, so every value is checked here first.

The rules, by the kind of the value (``b`` bool, ``i`` integer, ``f`` float,
``c`` complex) and the kind of the spec's dtype:

* Across kinds only widening is allowed: bool into anything numeric, integer
  into float or complex, float into complex. Float into integer or bool,
  integer into bool and complex into anything real are refused whatever the
  values, so a build does not fail hours in at the first ``2.5`` or ``2``.
* An integer must lie within the target integer's range, and an integer
  converted to a float must keep its exact value (``2**53 + 1`` does not in
  float64) and stay finite (70000 in float16 does not).
* A float narrowed to a smaller float may round but a finite value must stay
  finite (``1e300`` in float32 is refused).
* A string component takes ``bytes`` or ``str`` (encoded as UTF-8) only; a
  number, ``None`` or any other object is refused. Text, ``None`` and other
  objects are refused for a numeric component.

Python scalars and lists (flat, nested, of any length) are judged by the
Python types of their elements, not by what ``numpy.asarray`` guesses for them
(it turns ``[1, 2**63]`` into float64), then checked like arrays.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from storage_backends.errors import UnsupportedElementError
from yogastore.format.encode import strings_as_bytes
from yogastore.spec import STRING, ComponentSpec, Kind, RaggedValue, SparseValue, numpy_dtype

__all__ = ["as_numpy", "check_value"]

_TEXT = (bytes, bytearray, str, np.bytes_, np.str_)
# Integers of up to this magnitude are exact in float64, so they can be compared there.
_EXACT_IN_F64 = 2**53


def _spec_text(comp: ComponentSpec) -> str:
    return f"{comp.dtype} of shape {comp.shape}"


def _refuse(comp: ComponentSpec, path: str, value: Any, reason: str) -> UnsupportedElementError:
    return UnsupportedElementError(
        f"component {path!r}: {type(value).__name__} value where spec= says "
        f"{_spec_text(comp)}: {reason}; convert it yourself or fix spec="
    )


def _kind(dtype: np.dtype[Any]) -> str:
    """Return the numpy kind of ``dtype``, with bfloat16 counted as a float."""
    if dtype.kind == "V" and dtype.name == "bfloat16":
        return "f"
    return dtype.kind


def check_value(comp: ComponentSpec, value: Any, path: str) -> None:
    """Refuse ``value`` when converting it to ``comp``'s dtype would lose or invent information.

    Args:
        comp: the component's spec.
        value: one record's value of that component.
        path: the component's path, for the message.

    Raises:
        UnsupportedElementError: naming the component, the value's type, the
            spec and why the value was refused.
    """
    if comp.kind is Kind.SPARSE:
        if not isinstance(value, SparseValue):
            return  # the column split refuses it, naming the component
        value = value.values
    elif isinstance(value, RaggedValue):
        value = value.flat_values
    elif (
        comp.kind is Kind.RAGGED
        and comp.ragged_rank
        and isinstance(value, list | tuple | np.ndarray)
    ):
        raise _refuse(
            comp,
            path,
            value,
            f"a ragged component of ragged_rank {comp.ragged_rank} takes a yogastore.RaggedValue "
            f"(its flat values and {comp.ragged_rank} row-splits "
            f"array{'s' if comp.ragged_rank > 1 else ''}), not nested lists or an array",
        )
    value = as_numpy(value)
    if comp.dtype == STRING:
        _check_text(comp, value, path)
        return
    target = numpy_dtype(comp.dtype)
    if isinstance(value, np.ndarray | np.generic) and value.dtype != object:
        arr = np.asarray(value)
    else:
        arr = _from_python(comp, value, path, target)
    _check_array(comp, value, arr, path, target)


def as_numpy(value: Any) -> Any:
    """An array-like with a dtype of its own (a tf or torch tensor) as a numpy array.

    Judged by that dtype, not element by element as Python numbers (and in one call).
    """
    if isinstance(value, np.ndarray | np.generic) or not hasattr(value, "dtype"):
        return value
    if not hasattr(value, "__array__"):
        return value
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        return value
    return value if arr.dtype == object else arr


def _objects(comp: ComponentSpec, value: Any, path: str) -> np.ndarray:
    """Return ``value`` as an object array of its elements (nested lists flattened)."""
    if value is None:
        raise _refuse(comp, path, value, "None is not a value")
    try:
        obj = np.asarray(value, dtype=object)
    except (ValueError, TypeError) as err:
        raise _refuse(comp, path, value, f"it is not an array of values ({err})") from err
    for x in obj.reshape(-1):
        if isinstance(x, list | tuple | np.ndarray):
            raise _refuse(
                comp, path, value, "nested lists of different lengths are not a dense value"
            )
    return obj


def _check_text(comp: ComponentSpec, value: Any, path: str) -> None:
    if isinstance(value, _TEXT):
        return
    if isinstance(value, list | tuple):  # bytearrays in lists are strings, not int arrays
        value = strings_as_bytes(value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "SU":
        return
    for x in _objects(comp, value, path).reshape(-1):
        if not isinstance(x, _TEXT):
            raise _refuse(
                comp,
                path,
                value,
                f"holds {type(x).__name__} {x!r:.40}, not bytes or str "
                "(numbers are not converted to text)",
            )


def _from_python(comp: ComponentSpec, value: Any, path: str, target: np.dtype[Any]) -> np.ndarray:
    """Convert Python scalars, lists and object arrays by the types of their elements."""
    obj = _objects(comp, value, path)
    items = obj.reshape(-1).tolist()
    for x in items:
        if not isinstance(x, bool | int | float | complex | np.bool_ | np.number):
            raise _refuse(comp, path, value, f"holds {type(x).__name__} {x!r:.40}, not a number")
    if all(isinstance(x, bool | np.bool_) for x in items):
        return np.asarray(items, dtype=np.bool_).reshape(obj.shape)
    if all(isinstance(x, bool | int | np.bool_ | np.integer) for x in items):
        ints = [int(x) for x in items]
        low, high = min(ints), max(ints)
        for dtype in (np.int64, np.uint64):
            info = np.iinfo(dtype)
            if info.min <= low and high <= info.max:
                return np.asarray(ints, dtype=dtype).reshape(obj.shape)
        _check_big_ints(comp, value, path, target, ints)
        return np.asarray([float(x) for x in ints]).reshape(obj.shape)
    if any(isinstance(x, complex | np.complexfloating) for x in items):
        return np.asarray(items, dtype=np.complex128).reshape(obj.shape)
    return np.asarray([float(x) for x in items], dtype=np.float64).reshape(obj.shape)


def _check_big_ints(
    comp: ComponentSpec, value: Any, path: str, target: np.dtype[Any], ints: list[int]
) -> None:
    """Integers no single one of int64 and uint64 holds: only exact, finite floats can.

    (Each may fit one of them, as -1 and 2**64 - 1 do.)
    """
    if _kind(target) in "iub":
        info = np.iinfo(target) if _kind(target) != "b" else np.iinfo(np.uint8)
        big = next((x for x in ints if not info.min <= x <= info.max), max(ints))
        raise _refuse(comp, path, value, f"integer {big} is outside the {comp.dtype} range")
    for x in ints:
        try:
            exact = int(float(x)) == x
        except OverflowError:
            exact = False
        if not exact:
            raise _refuse(comp, path, value, f"integer {x} has no exact {comp.dtype} value")


def _check_array(
    comp: ComponentSpec, value: Any, arr: np.ndarray, path: str, target: np.dtype[Any]
) -> None:
    src, dst = _kind(arr.dtype), _kind(target)
    if arr.dtype == target or src == "b":
        if src == "b" and dst not in "biufc":
            raise _refuse(comp, path, value, f"bool cannot become {comp.dtype}")
        return
    if src not in "iufc":
        raise _refuse(comp, path, value, f"values of dtype {arr.dtype} are not numbers")
    allowed = {"i": "iufc", "u": "iufc", "f": "fc", "c": "c"}[src]
    if dst not in allowed:
        raise _refuse(
            comp,
            path,
            value,
            f"values of dtype {arr.dtype} would lose information as {comp.dtype} "
            "(float to integer or bool, integer to bool and complex to real are refused)",
        )
    # numpy calls int64 -> float64 safe; it is not for integers above 2**53.
    if arr.size == 0 or (src == dst and np.can_cast(arr.dtype, target, casting="safe")):
        return  # widening within a kind keeps every value exactly
    if dst in "iu":
        info = np.iinfo(target)
        low, high = int(arr.min()), int(arr.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise _refuse(comp, path, value, f"integer {bad} is outside the {comp.dtype} range")
        return
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.simplefilter("ignore")  # numpy warns on overflow; we refuse instead
        converted = arr.astype(target)
    grew = ~np.isfinite(converted)
    if src in "fc":
        grew &= np.isfinite(arr)
    if grew.any():
        bad = arr[grew].reshape(-1)[0].item()
        raise _refuse(comp, path, value, f"{bad} is outside the {comp.dtype} range")
    if src in "iu":
        _check_exact(comp, value, path, arr, converted.real.astype(np.float64))


def _check_exact(
    comp: ComponentSpec, value: Any, path: str, arr: np.ndarray, back: np.ndarray
) -> None:
    """Refuse integers whose float conversion (``back``, as float64) changed their value."""
    ints = arr.reshape(-1)
    floats = back.reshape(-1)
    small = (ints <= _EXACT_IN_F64) & (ints >= -_EXACT_IN_F64)
    changed = small & (floats != ints.astype(np.float64))
    for i in np.flatnonzero(~small).tolist():
        changed[i] = int(floats[i]) != int(ints[i])
    if changed.any():
        bad = int(ints[np.flatnonzero(changed)[0]])
        raise _refuse(comp, path, value, f"integer {bad} has no exact {comp.dtype} value")
