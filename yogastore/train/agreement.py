"""Rank agreement: every rank must read the same dataset with the same settings.

Ranks with different seeds, dataset versions, shard counts or batch sizes
read overlapping shards (some records twice, others never) and nothing
fails. So before the first read each rank hashes each setting, the ranks
exchange the hashes in one small all-gather (32 64-bit integers per rank),
and every rank raises ``RankMismatchError`` naming the settings that
differ, with the ranks holding each value.

The all-gather is passed in, so the check works with any communicator:
``horovod_allgather``, ``strategy_allgather`` (``tf.distribute``), or a test's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from storage_backends.errors import RankMismatchError

__all__ = [
    "AllGather",
    "check_agreement",
    "horovod_allgather",
    "setting_hashes",
    "strategy_allgather",
]

MAX_SETTINGS = 31  # columns of hashes per rank (plus one for the names)

#: Gathers a ``[k]`` int64 array from every rank into a ``[num_ranks, k]`` array.
AllGather = Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]]


def _text(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        return repr(value)


def setting_hashes(settings: Mapping[str, Any]) -> tuple[list[str], npt.NDArray[np.int64]]:
    """Return the sorted setting names and one signed 64-bit hash per setting."""
    names = sorted(settings)
    hashes = np.array(
        [xxhash.xxh3_64_intdigest(_text(settings[n]).encode()) for n in names], dtype=np.uint64
    ).view(np.int64)
    return names, hashes


def check_agreement(settings: Mapping[str, Any], allgather: AllGather, what: str) -> None:
    """Raise on every rank unless all ranks passed equal ``settings``.

    Every rank must call this with the same setting names (a different set
    of names is itself reported as a mismatch).

    Args:
        settings: name -> JSON-able value (e.g. ``{"seed": 1, "batch_size": 32}``).
        allgather: the communicator's all-gather (see module docstring).
        what: the call being checked, for the message (e.g. ``horovod_dataset``).

    Raises:
        RankMismatchError: naming each differing setting, this rank's value and
            which ranks agree with it.
    """
    names, local = setting_hashes(settings)
    if len(names) > MAX_SETTINGS:
        raise ValueError(f"at most {MAX_SETTINGS} settings, got {len(names)}")
    # A first column hashing the names catches ranks passing different sets;
    # rows have one fixed length, as an all-gather needs.
    names_hash = np.array([xxhash.xxh3_64_intdigest(_text(names).encode())], np.uint64)
    row = np.zeros(1 + MAX_SETTINGS, np.int64)
    row[0] = names_hash.view(np.int64)[0]
    row[1 : 1 + len(local)] = local
    table = np.asarray(allgather(row), dtype=np.int64).reshape(-1, len(row))
    me = _my_row(table, row)
    if not (table[:, 0] == row[0]).all():
        raise RankMismatchError(
            f"{what}: ranks pass different sets of settings (this rank: {names}); "
            "every rank must run the same code and version of yogastore"
        )
    differing = [j for j in range(1, 1 + len(names)) if not (table[:, j] == table[0, j]).all()]
    if not differing:
        return
    parts = []
    for j in differing:
        name = names[j - 1]
        same = [int(r) for r in np.flatnonzero(table[:, j] == row[j])]
        parts.append(
            f"{name}={_text(settings[name])[:200]} on ranks {same}, another value on "
            f"ranks {[r for r in range(len(table)) if r not in same]}"
        )
    who = f"this rank ({me})" if isinstance(me, int) else "this rank"
    raise RankMismatchError(
        f"{what}: ranks disagree on {', '.join(names[j - 1] for j in differing)} "
        f"({who}: {'; '.join(parts)}); every rank must use the same dataset version, seed, "
        "shard count and batch size, or ranks read overlapping records"
    )


def _my_row(table: npt.NDArray[np.int64], row: npt.NDArray[np.int64]) -> int | str:
    matches = np.flatnonzero((table == row).all(axis=1))
    return int(matches[0]) if len(matches) == 1 else "?"


def horovod_allgather(row: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """All-gather ``row`` over Horovod ranks (``hvd.init()`` first)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    out = hvd.allgather(tf.constant(row[None, :]), name="yogastore_agreement")
    return np.asarray(out.numpy(), dtype=np.int64)


def strategy_allgather(strategy: Any) -> AllGather:
    """Return an all-gather over every replica of a ``tf.distribute`` strategy."""
    import tensorflow as tf

    def gather(row: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        value = strategy.run(lambda: tf.constant(row[None, :]))
        out = strategy.gather(value, axis=0)
        return np.asarray(out.numpy(), dtype=np.int64)

    return gather
