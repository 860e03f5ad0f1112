"""Pieces shared by the distributed examples: a synthetic dataset, a tiny model,
per-rank sample-id logs and a launcher for multi-worker jobs on one machine.

Imports of TensorFlow and Keras happen inside functions so a launcher process
(which only starts workers) stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from yogastore import ComponentSpec, DatasetRef, Store, Stream

DIM = 8


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default=None,
        help="store directory (default: $YOGASTORE_HOME or ~/.cache/yogastore)",
    )
    parser.add_argument("--out", required=True, help="directory for per-rank id logs and results")
    parser.add_argument("--records", type=int, default=512, help="records in the synthetic dataset")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7, help="shuffle seed (same on every rank)")
    parser.add_argument("--lr", type=float, default=0.5)


def synthetic_dataset(store: str | None, num_records: int) -> DatasetRef:
    """Cache (once) a linearly separable problem: ``y = [x . w > 0]``, with an ``id`` field."""

    def make() -> Any:
        rng = np.random.default_rng(1234)
        w = rng.normal(size=DIM).astype(np.float32)
        for i in range(num_records):
            x = rng.normal(size=DIM).astype(np.float32)
            yield {"id": np.int64(i), "x": x, "y": np.int64(x @ w > 0)}

    spec = {
        "id": ComponentSpec(shape=(), dtype="int64"),
        "x": ComponentSpec(shape=(DIM,), dtype="float32"),
        "y": ComponentSpec(shape=(), dtype="int64"),
    }
    # Every rank calls this; the store's build lock lets exactly one build it
    # (the others wait for it, at most lock_timeout seconds).
    cache = Store(store, lock_timeout=300)
    return cache.cache("separable", f"n{num_records}-d{DIM}", make, spec=spec)


def make_model() -> Any:
    """Return a logistic-regression Keras model (two logits)."""
    import keras

    keras.utils.set_random_seed(0)  # identical initial weights on every rank
    return keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(2)])


def strategy_train_step(strategy: Any, model: Any, optimizer: Any, global_batch: int) -> Any:
    """Return a ``tf.function`` running one synchronous step of ``model`` under ``strategy``."""
    import tensorflow as tf

    @tf.function  # type: ignore[misc]
    def train_step(batch: dict[str, Any]) -> Any:
        def step(batch: dict[str, Any]) -> Any:
            with tf.GradientTape() as tape:
                logits = model(batch["x"], training=True)
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(batch["y"], logits)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)

    return train_step


def count_correct(model: Any, stream: Stream) -> tuple[int, int]:
    """Return (correctly classified, total) over the records of ``stream``."""
    correct = total = 0
    for batch in stream.batches(1024):
        logits = np.asarray(model(batch["x"], training=False))
        correct += int((logits.argmax(axis=1) == batch["y"]).sum())
        total += len(batch["y"])
    return correct, total


def accuracy(model: Any, ref: DatasetRef) -> float:
    """Return the model's accuracy over the whole dataset."""
    correct, total = count_correct(model, ref.stream(shuffle=False))
    return correct / max(total, 1)


class IdLog:
    """Appends one JSON line per training step: the sample ids this rank trained on."""

    def __init__(self, out: str | Path, rank: int) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(out) / f"ids-rank{rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def write(self, step: int, epoch: int, ids: Any, **extra: Any) -> None:
        flat = [int(i) for i in np.concatenate([np.asarray(a).reshape(-1) for a in ids])]
        doc = {"step": step, "epoch": epoch, "ids": flat, **extra}
        self._file.write(json.dumps(doc) + "\n")
        self._file.flush()  # a killed process must leave every finished step in the log

    def close(self) -> None:
        self._file.close()


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago.

    Every socket stays bound until all ports are picked, so the ports are
    distinct, and all are closed together just before the workers start.
    A small race remains: between the close and a worker binding its port
    (after importing TensorFlow, a few seconds) another process may bind it.
    The worker then fails to start its server and ``launch_workers`` stops
    the job with that worker's exit code; rerunning picks new ports.
    """
    with contextlib.ExitStack() as stack:
        sockets = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            for _ in range(count)
        ]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def exit_after(seconds: float) -> None:
    """End this process (exit code 1, tracebacks on stderr) if it still runs after ``seconds``.

    A MultiWorkerMirroredStrategy worker waits for its peers with no time
    limit, inside TensorFlow and holding the GIL, so a Python timer would
    never fire; faulthandler's watchdog is a C thread and does. This bounds
    the wait also for a worker started by hand with ``TF_CONFIG``.
    """
    faulthandler.dump_traceback_later(seconds, exit=True)


def launch_workers(script: str, argv: list[str], num_workers: int, timeout: float) -> int:
    """Run ``num_workers`` copies of ``script`` as one MultiWorkerMirroredStrategy job.

    Each worker gets a ``TF_CONFIG`` naming every worker on 127.0.0.1 at a
    free port (see ``free_ports``). If one worker fails, the others are
    stopped (they would wait in a collective); after ``timeout`` seconds all
    are. Returns the first non-zero exit code, 124 on timeout, or 0.
    """
    hosts = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    procs = []
    for index in range(num_workers):
        env = dict(os.environ)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}}
        )
        procs.append(subprocess.Popen([sys.executable, script, *argv], env=env))

    def stop_all(signum: int = signal.SIGTERM, frame: Any = None) -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()

    signal.signal(signal.SIGTERM, stop_all)
    deadline = time.monotonic() + timeout
    code = 0
    while True:
        codes = [p.poll() for p in procs]  # poll every worker, not just up to a live one
        if None not in codes:
            break
        failed = [c for c in codes if c not in (None, 0)]
        if failed or time.monotonic() > deadline:
            code = failed[0] if failed else 124
            print(f"launcher: stopping workers (exit codes {codes})")
            stop_all()
            break
        time.sleep(0.1)
    for p in procs:
        try:
            p.wait(timeout=30)  # killed or already gone: returns at once
        except subprocess.TimeoutExpired:
            print(f"launcher: worker {p.pid} did not exit after SIGKILL")
            code = code or 124
            continue
        if code == 0 and p.returncode:
            code = p.returncode
    return code
