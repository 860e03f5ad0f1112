"""One integer check for every module: its range, its message, what counts as an integer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from storage_backends.errors import CorruptCacheError, InvalidArgumentError
from yogastore.checks import check_int, explain_keyword_only, is_int

REFUSED: list[tuple[Any, int, int | None, str]] = [
    (True, 0, None, "n must be an integer >= 0, got True"),
    (1.0, 0, None, "n must be an integer >= 0, got 1.0"),
    ("3", 0, None, "n must be an integer >= 0, got '3'"),
    (None, 0, None, "n must be an integer >= 0, got None"),
    (0, 1, None, "n must be an integer >= 1, got 0"),
    (11, 1, 10, "n must be an integer in [1, 10], got 11"),
    (0, 1, 10, "n must be an integer in [1, 10], got 0"),
    (2**64, 0, 2**64 - 1, "n must be an integer in [0, 2**64), got 18446744073709551616"),
]


@pytest.mark.parametrize(
    ("value", "low", "high", "message"),
    REFUSED,
    ids=["bool", "float", "str", "none", "below", "above", "below-range", "past-2**64"],
)
def test_refused_values_name_the_range(
    value: Any, low: int, high: int | None, message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        check_int("n", value, low, high)
    assert str(info.value) == message


def test_accepted_values_come_back_as_int() -> None:
    assert check_int("n", 0) == 0
    assert check_int("n", 10, 1, 10) == 10
    assert check_int("n", 2**64 - 1, 0, 2**64 - 1) == 2**64 - 1
    value = check_int("n", np.int32(7), 1)
    assert value == 7 and type(value) is int


def test_numpy_integers_can_be_refused_and_errors_chosen() -> None:
    assert is_int(np.int64(3)) and not is_int(np.int64(3), allow_numpy=False)
    assert not is_int(np.bool_(True)) and not is_int(False)
    with pytest.raises(InvalidArgumentError, match=r"got np\.int64"):
        check_int("n", np.int64(3), allow_numpy=False)
    with pytest.raises(CorruptCacheError, match="field 'count' must be an integer >= 1"):
        check_int("chunk 3: field 'count'", 0, 1, error=CorruptCacheError)


class _Thing:
    @explain_keyword_only
    def call(self, a: int, b: int = 0, *, c: int = 0, d: str = "") -> tuple[int, int, int, str]:
        return a, b, c, d


def test_keyword_only_calls_work_and_positional_ones_name_the_keywords() -> None:
    assert _Thing().call(1, 2, c=3, d="x") == (1, 2, 3, "x")
    with pytest.raises(TypeError) as info:
        _Thing().call(1, 2, 3, "x")  # type: ignore[misc]
    assert str(info.value) == (
        "_Thing.call() takes only a and b by position; pass the others by keyword: c=3, d='x'"
    )
