"""Run under horovodrun by test_horovod_keras.py: ranks that agree, and ranks that do not.

Usage: hvd_agreement_worker.py STORE OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def main() -> int:
    import horovod.tensorflow as hvd

    hvd.init()
    from yogastore import ComponentSpec, RankMismatchError, Store
    from yogastore import distributed as yd

    store, out = sys.argv[1], Path(sys.argv[2])
    rank = hvd.rank()
    ref = Store(store, lock_timeout=120).cache(
        "agree",
        "1",
        lambda: ({"i": np.int64(i)} for i in range(64)),
        spec={"i": ComponentSpec(shape=(), dtype="int64")},
    )
    results: dict[str, Any] = {}
    cases = {
        "agree": (1, 8),
        "seed": (1 + rank, 8),  # a different seed per rank
        "batch": (1, 8 + 4 * rank),  # a different batch size per rank
    }
    for name, (seed, batch) in cases.items():
        position = yd.StreamPosition(ref, seed=seed)
        try:
            ds = yd.horovod_dataset(position, batch)
            results[name] = {"ids": [b["i"].numpy().tolist() for b in ds]}
        except RankMismatchError as err:
            results[name] = {"error": str(err)}
    try:
        stream = yd.horovod_stream(ref, seed=1 + rank)
        results["stream"] = {"ids": [int(e["i"]) for e in stream]}
    except RankMismatchError as err:
        results["stream"] = {"error": str(err)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
