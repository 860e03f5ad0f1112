"""Horovod + a work queue: synchronous training where ranks claim slices of each epoch.

    horovodrun -np 2 --gloo -H localhost:2 --network-interface lo \\
        python examples/horovod_queue.py --store /tmp/ys --out /tmp/hvdq

Every rank reads the slices it claims from one ``WorkQueue`` job, so ranks end
the job after different numbers of steps. ``lockstep`` keeps them stepping
together: one max all-reduce of "I still have a batch" per step, and a rank
that has run out runs the step with an empty (zero-weight) batch until every
rank is done, so the gradient all-reduce never waits for a rank that left.
(The other way out is ``hvd.join()``: a rank that runs out calls it once and
stops; Horovod then answers the others' all-reduces for it.) Gradients are
summed and the loss divided by the global count of real records, so an empty
batch changes nothing.

Each rank writes ``ids-rank<r>.jsonl`` (the sample ids of every step, empty
for an idle step) and ``result-rank<r>.json`` to ``--out``; every record is
read exactly once per epoch.
"""

from __future__ import annotations

import argparse
import os
import sys

import _common
import numpy as np


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="records per rank per step")
    parser.add_argument("--slices", type=int, default=10, help="queue slices per epoch")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    import horovod.tensorflow as hvd

    hvd.init()
    import keras
    import tensorflow as tf

    from yogastore import lockstep

    rank, size = hvd.rank(), hvd.size()
    ref = _common.synthetic_dataset(args.store, args.records)
    # One new job per run: rank 0 picks its name, every rank uses it.
    nonce = np.random.default_rng().integers(1 << 40) if rank == 0 else 0
    nonce = int(hvd.broadcast(tf.constant(nonce, tf.int64), root_rank=0, name="job").numpy())
    queue = ref.work_queue(
        f"hvd-{nonce:x}", num_slices=args.slices, seed=args.seed, num_epochs=args.epochs
    )
    model = _common.make_model()
    optimizer = keras.optimizers.SGD(args.lr * size)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
        count = hvd.allreduce(tf.reduce_sum(weight), op=hvd.Sum)
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            loss = tf.reduce_sum(per_example * weight) / tf.maximum(count, 1.0)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Sum)
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return hvd.allreduce(loss, op=hvd.Sum)

    def any_rank_has_data(mine: bool) -> bool:
        flag = hvd.allreduce(tf.constant(int(mine)), op=hvd.Max, name="has_data")
        return int(flag.numpy()) > 0

    empty = {
        "id": np.zeros(0, np.int64),
        "x": np.zeros((0, _common.DIM), np.float32),
        "y": np.zeros(0, np.int64),
    }
    log = _common.IdLog(args.out, rank)
    steps = idle = records = 0
    losses = []
    # wait=False: a rank out of slices must not wait for the slice another
    # rank holds; that rank is waiting for this one in the next all-reduce.
    stream = queue.stream(f"rank{rank}", wait=False)
    for batch in lockstep(stream.batches(args.batch_size), any_rank_has_data):
        if batch is None:
            idle += 1
            batch = empty
        weight = np.ones(len(batch["id"]), np.float32)
        losses.append(float(train_step(batch["x"], batch["y"], weight)))
        steps += 1
        records += len(batch["id"])
        log.write(steps, -1, [batch["id"]], idle=len(batch["id"]) == 0)
    log.close()
    acc = _common.accuracy(model, ref)
    print(
        f"rank {rank}: {steps} steps ({idle} idle), {records} records, "
        f"{queue.status().workers.get(f'rank{rank}', 0)} slices, accuracy {acc:.3f}"
    )
    hvd.allreduce(tf.constant(0), name="done")  # every rank has read the status
    if rank == 0:
        queue.delete()
    _common.write_json(
        os.path.join(args.out, f"result-rank{rank}.json"),
        {"steps": steps, "idle_steps": idle, "records": records, "accuracy": acc,
         "first_loss": losses[0], "last_loss": losses[-1], "workers": size},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
