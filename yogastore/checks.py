"""Argument checks shared by every module: one rule for "an integer in a range".

``check_int`` is the one way yogastore checks an integer argument or field:
a bool is never an integer (``True`` is not a record count), a numpy integer
is one unless the value must be written back as JSON as it is, and the error
names the argument, the range allowed and the value seen.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeGuard, TypeVar

import numpy as np

from storage_backends.errors import InvalidArgumentError

__all__ = ["check_int", "explain_keyword_only", "is_int"]

P = ParamSpec("P")
R = TypeVar("R")


def is_int(value: Any, *, allow_numpy: bool = True) -> TypeGuard[int | np.integer[Any]]:
    """Return whether ``value`` is an integer: an ``int`` or a numpy integer, never a bool.

    Args:
        value: the value to test.
        allow_numpy: count numpy integers; ``False`` for values that are
            stored as they are (a dataclass field written to JSON later).
    """
    kinds = (int, np.integer) if allow_numpy else int
    return isinstance(value, kinds) and not isinstance(value, bool)


def _range_text(low: int, high: int | None) -> str:
    if high is None:
        return f">= {low}"
    top = high + 1
    if top >= 1 << 32 and top & (top - 1) == 0:
        # A limit such as 2**64 - 1 reads better as the half-open 2**64.
        return f"in [{low}, 2**{top.bit_length() - 1})"
    return f"in [{low}, {high}]"


def check_int(
    name: str,
    value: Any,
    low: int = 0,
    high: int | None = None,
    *,
    allow_numpy: bool = True,
    error: type[Exception] = InvalidArgumentError,
) -> int:
    """Return ``value`` as an ``int`` if it is an integer with ``low <= value <= high``.

    Args:
        name: what the message calls the value (``"seed"``,
            ``"resume state epoch"``, ``"<dataset> chunk 3: field 'count'"``).
        value: the value to check.
        low: smallest value allowed.
        high: largest value allowed (``None``: no upper limit).
        allow_numpy: accept numpy integers (see ``is_int``).
        error: the exception to raise (``CorruptCacheError`` for stored data).

    Raises:
        InvalidArgumentError: (or ``error``) "<name> must be an integer >= <low>"
            (or "in [<low>, <high>]"), with the value seen.
    """
    fits = is_int(value, allow_numpy=allow_numpy) and low <= value
    if not fits or (high is not None and value > high):
        raise error(f"{name} must be an integer {_range_text(low, high)}, got {value!r}")
    return int(value)


def explain_keyword_only(fn: Callable[P, R]) -> Callable[P, R]:
    """Make a call that passes keyword-only parameters by position say how to write it.

    Python's own ``TypeError`` ("takes from 1 to 3 positional arguments but 4
    were given") does not say which parameters became keyword-only; code
    written when they were positional gets a ``TypeError`` naming them, with
    the values it passed. The signature, and so what type checkers see, is
    ``fn``'s.
    """
    params = list(inspect.signature(fn).parameters.values())
    positional = [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    keyword = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    shown = [n for n in positional if n not in ("self", "cls")]

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if len(args) > len(positional):
            extra = args[len(positional) :]
            named = ", ".join(f"{n}={v!r:.40}" for n, v in zip(keyword, extra, strict=False))
            raise TypeError(
                f"{fn.__qualname__}() takes only {' and '.join(shown) or 'no arguments'} by "
                f"position; pass the others by keyword: {named or '...'}"
            )
        return fn(*args, **kwargs)

    return wrapper
