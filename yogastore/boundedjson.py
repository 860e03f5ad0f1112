"""JSON parsing with bounds checked before any work grows with the input.

Manifests, chunk headers and resume states come from files and users; a
hostile or damaged document must fail as a library error, not as a
``RecursionError`` (deep nesting), a ``ValueError`` from ``int`` (Python
refuses integers over 4,300 digits) or a later overflow. Nesting depth is
measured with one vectorised pass before parsing; integers are checked for
length before conversion; non-finite numbers are refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from storage_backends.errors import YogaStoreError

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "depth", "loads"]

#: Deepest nesting of arrays and objects accepted (yogastore writes under 20).
MAX_DEPTH = 64
#: Longest integer accepted, in digits: enough for any 64-bit value.
MAX_INT_DIGITS = 20

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))
_OPEN = np.array([ord("["), ord("{")], dtype=np.uint8)
_CLOSE = np.array([ord("]"), ord("}")], dtype=np.uint8)


class _Refused(ValueError):
    pass


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"integer of {len(text)} digits (at most {MAX_INT_DIGITS} accepted)")
    return int(text)


def _float(text: str) -> float:
    if len(text) > 64:
        raise _Refused(f"number of {len(text)} characters")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"number {text[:30]} is out of range")
    return value


def _constant(text: str) -> Any:
    raise _Refused(f"{text} is not a JSON number")


def depth(data: bytes) -> int:
    """Return the deepest nesting of arrays and objects outside strings."""
    return _depth(_STRING.sub(b'""', data))


def _measure(raw: bytes) -> tuple[int, int]:
    """Depth outside strings and an upper bound of the longest integer's digits.

    Vectorised when the document has no escapes (strings then lie between
    consecutive quotes); with escapes, strings are emptied by a regex first.
    """
    if b"\\" in raw:
        bare = _STRING.sub(b'""', raw)
        longest = 0 if _LONG_DIGITS.search(bare) is None else MAX_INT_DIGITS + 1
        return _depth(bare), longest
    chars = np.frombuffer(raw, dtype=np.uint8)
    quotes = chars == ord('"')
    outside = (np.cumsum(quotes) & 1) == 0  # closing quotes count as outside
    steps = ((chars == _OPEN[0]) | (chars == _OPEN[1])).astype(np.int32)
    steps -= (chars == _CLOSE[0]) | (chars == _CLOSE[1])
    steps *= outside
    levels = int(np.cumsum(steps).max()) if chars.size else 0
    # Digits inside strings count too: an upper bound, enough to skip the check.
    breaks = np.flatnonzero((chars < ord("0")) | (chars > ord("9")))
    edges = np.concatenate(([-1], breaks, [chars.size]))
    return levels, int(np.diff(edges).max()) - 1


def _depth(bare: bytes) -> int:
    """``depth`` of a document whose strings are emptied."""
    chars = np.frombuffer(bare, dtype=np.uint8)
    if chars.size == 0:
        return 0
    steps = ((chars == _OPEN[0]) | (chars == _OPEN[1])).astype(np.int32)
    steps -= (chars == _CLOSE[0]) | (chars == _CLOSE[1])
    return int(np.cumsum(steps).max())


def loads(
    data: bytes | bytearray | memoryview | str, where: str, error: type[YogaStoreError]
) -> Any:
    """Parse ``data`` as JSON within the bounds above.

    Args:
        data: the document.
        where: what is being parsed, for the error message.
        error: the error class to raise (``CorruptCacheError`` for stored
            data, ``InvalidArgumentError`` for caller input).

    Raises:
        YogaStoreError: ``error``, naming ``where`` and what failed.
    """
    if not isinstance(data, bytes | bytearray | memoryview | str):
        raise error(f"{where}: expected JSON text, got {type(data).__name__}")
    raw = data.encode() if isinstance(data, str) else bytes(data)
    # Nesting cannot exceed the number of opening brackets (those in strings
    # included): most documents (chunk headers) need no exact measure.
    opening = raw.count(b"[") + raw.count(b"{")
    if opening <= MAX_DEPTH:
        levels, long_digits = opening, _LONG_DIGITS.search(raw) is not None
    else:
        levels, longest = _measure(raw)
        long_digits = longest > MAX_INT_DIGITS
    if levels > MAX_DEPTH:
        raise error(f"{where}: JSON nested {levels} levels deep (at most {MAX_DEPTH} accepted)")
    try:
        if long_digits:
            return json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
        return json.loads(raw, parse_float=_float, parse_constant=_constant)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError
        raise error(f"{where}: not valid JSON: {err}") from err
