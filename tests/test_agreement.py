"""Rank agreement with a stand-in all-gather: every rank sees the same verdict."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

from yogastore import RankMismatchError
from yogastore.train.agreement import check_agreement, setting_hashes


def run_ranks(per_rank: list[dict[str, Any]]) -> list[str | None]:
    """Check each rank's settings against all ranks' rows, as one all-gather would."""
    rows: list[np.ndarray] = []

    def capture(row: np.ndarray) -> np.ndarray:
        rows.append(row)
        return row[None]

    for settings in per_rank:  # what each rank contributes
        with contextlib.suppress(RankMismatchError):
            check_agreement(settings, capture, "t")
    table = np.stack(rows)
    out: list[str | None] = []
    for settings in per_rank:
        try:
            check_agreement(settings, lambda row: table, "test_call")
            out.append(None)
        except RankMismatchError as err:
            out.append(str(err))
    return out


def test_agreeing_ranks_pass() -> None:
    settings = {"seed": 1, "batch_size": 8, "dataset": "d/1/abc", "position": [[0, 64]]}
    assert run_ranks([settings, dict(settings), dict(reversed(settings.items()))]) == [None] * 3


def test_the_differing_settings_are_named_on_every_rank() -> None:
    base = {"seed": 1, "batch_size": 8, "dataset": "d/1/abc", "num_shards": 3}
    errors = run_ranks([base, {**base, "seed": 2}, {**base, "seed": 2, "batch_size": 4}])
    assert all(e is not None for e in errors)
    for e in errors:
        assert e is not None
        assert e.startswith("test_call: ranks disagree on batch_size, seed (")
        assert "dataset" not in e.split("(")[0]
    assert "seed=1 on ranks [0], another value on ranks [1, 2]" in str(errors[0])
    assert "seed=2 on ranks [1, 2]" in str(errors[1])
    assert "batch_size=4 on ranks [2], another value on ranks [0, 1]" in str(errors[2])


def test_different_setting_names_are_a_mismatch() -> None:
    errors = run_ranks([{"seed": 1}, {"seed": 1, "extra": 2}])
    assert all(e is not None and "different sets of settings" in e for e in errors)


def test_hashes_are_stable_and_distinguish_values() -> None:
    names, a = setting_hashes({"b": [1, 2], "a": "x"})
    _, b = setting_hashes({"a": "x", "b": [1, 2]})
    _, c = setting_hashes({"a": "x", "b": [2, 1]})
    assert names == ["a", "b"] and a.dtype == np.int64
    assert (a == b).all() and a[1] != c[1]


def test_a_raising_all_gather_is_not_swallowed() -> None:
    def broken(row: np.ndarray) -> np.ndarray:
        raise OSError("peer gone")

    with pytest.raises(OSError, match="peer gone"):
        check_agreement({"seed": 1}, broken, "x")
