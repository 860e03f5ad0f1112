"""(b2)'s reader, run in a fresh process: a rank's first epochs through ``to_tf_dataset``.

``python -m benchmarks._first_epochs ROOT DATASET VERSION RANK SHARDS SEED BATCH EPOCHS``
reads epochs ``0 .. EPOCHS-1`` of rank ``RANK`` of ``SHARDS`` (global shuffle), each a new
stream and dataset as a training loop makes them, consumed by a Python loop, and prints one
JSON line per epoch: its records, label sum and the seconds of its iteration (the dataset is
made before the clock starts, as for (b)).
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> None:
    root, dataset, version, rank, shards, seed, batch, epochs = argv
    import numpy as np
    import tensorflow as tf  # noqa: F401  (imported before the clock, as in (b)'s process)

    import yogastore

    ref = yogastore.Store(root).open(dataset, version)
    for epoch in range(int(epochs)):
        stream = ref.stream(
            int(rank), int(shards), shuffle=True, seed=int(seed), epoch=epoch, num_epochs=1
        )
        ds = stream.to_tf_dataset(int(batch))
        start = time.perf_counter()
        records = total = 0
        for batch_ in ds:
            labels = np.asarray(batch_["y"])
            records += len(labels)
            total += int(labels.sum())
        seconds = time.perf_counter() - start
        line = {"epoch": epoch, "records": records, "label_sum": total, "seconds": seconds}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
