"""The distributed examples, run for real: horovodrun, MultiWorkerMirroredStrategy,
MirroredStrategy, and a SIGKILL mid-epoch followed by restarts with 2 and 1 workers.

Every example logs the sample ids each rank trained on per step; the checks
are per epoch: shards disjoint, epoch complete (minus what drop_remainder
leaves out), and the order exactly the one the order module prescribes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from yogastore import DatasetRef, Store

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
SEED = 7  # the examples' default --seed


def example_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group, output to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env or example_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group ``proc`` leads (the launcher and its workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def run(cmd: list[str], log: Path, timeout: float) -> None:
    proc = start(cmd, log)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail(f"timed out after {timeout}s: {cmd}\n{tail(log)}")
    assert code == 0, f"exit code {code}: {cmd}\n{tail(log)}"


def tail(log: Path, lines: int = 60) -> str:
    text = log.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def read_ids(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Return rank -> step records ({"step", "epoch", "ids", ...}) from an id-log directory."""
    logs: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("ids-rank*.jsonl")):
        rank = int(path.stem.removeprefix("ids-rank"))
        lines = path.read_text().splitlines()
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                # Only a line being written when the process was killed may be cut.
                assert i == len(lines) - 1, f"{path}: bad line {i}"
        logs[rank] = records
    return logs


def epoch_ids(records: list[dict[str, Any]], epoch: int) -> list[int]:
    return [i for r in records if r["epoch"] == epoch for i in r["ids"]]


def open_dataset(store: Path) -> DatasetRef:
    (info,) = Store(store).list()
    return Store(store).open(info.dataset_id, info.version)


def shard_order(ref: DatasetRef, rank: int, shards: int, epoch: int, count: int) -> list[int]:
    """What rank ``rank`` of ``shards`` reads first in ``epoch``, per the order module."""
    stream = ref.stream(rank, shards, seed=SEED, epoch=epoch, drop_remainder=True)
    return np.concatenate(list(stream.record_indices(count)))[:count].tolist()


def check_epochs(
    logs: dict[int, list[dict[str, Any]]],
    ref: DatasetRef,
    epochs: int,
    batch: int,
    expected: Callable[[int, int, int], list[int]],
) -> None:
    """Per epoch: same step count on every rank, disjoint, complete, in the prescribed order."""
    ranks = sorted(logs)
    n = ref.num_records
    steps = (n // len(ranks)) // batch
    for epoch in range(epochs):
        per_rank = {r: epoch_ids(logs[r], epoch) for r in ranks}
        assert {len(v) for v in per_rank.values()} == {steps * batch}, f"epoch {epoch}: steps"
        everything = [i for v in per_rank.values() for i in v]
        assert len(set(everything)) == len(everything), f"epoch {epoch}: a record read twice"
        assert set(everything) <= set(range(n))
        assert n - len(everything) < len(ranks) * (batch + 1), f"epoch {epoch}: incomplete"
        for r in ranks:
            assert per_rank[r] == expected(r, epoch, steps * batch), f"epoch {epoch} rank {r}"


def check_results(out: Path, ranks: int) -> None:
    results = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(ranks)]
    for res in results:
        assert res["accuracy"] > 0.9, res  # a separable problem: far above chance (0.5)
        assert res["epoch_losses"][-1] < res["epoch_losses"][0], res
    # Synchronous training: every rank ends with the same model.
    assert len({r["accuracy"] for r in results}) == 1, results


def example_flags(tmp_path: Path, records: int, epochs: int) -> list[str]:
    return [
        "--store", str(tmp_path / "store"),
        "--out", str(tmp_path / "out"),
        "--records", str(records),
        "--epochs", str(epochs),
    ]  # fmt: skip


# The launcher ------------------------------------------------------------------------


def load_common() -> Any:
    spec = importlib.util.spec_from_file_location("_common", EXAMPLES / "_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = load_common().free_ports(8)
    assert len(set(ports)) == 8
    with contextlib.ExitStack() as stack:
        for port in ports:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", port))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        ("import time; time.sleep(120)", 124),  # nobody finishes: stopped at the deadline
        (  # worker 1 fails: worker 0, stuck waiting for it, is stopped at once
            "import json, os, sys, time\n"
            "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1: sys.exit(3)\n"
            "time.sleep(120)",
            3,
        ),
    ],
    ids=["timeout", "one-fails"],
)
def test_launcher_stops_every_worker(tmp_path: Path, worker: str, expected: int) -> None:
    script = tmp_path / "worker.py"
    script.write_text(worker)
    handler = signal.getsignal(signal.SIGTERM)  # launch_workers installs its own
    started = time.monotonic()
    try:
        code = load_common().launch_workers(str(script), [], 2, timeout=3)
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert code == expected
    assert time.monotonic() - started < 60


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_whose_peer_never_comes_gives_up_at_its_timeout(tmp_path: Path) -> None:
    env = example_env()
    hosts = [f"127.0.0.1:{port}" for port in load_common().free_ports(2)]
    env["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": 0}}
    )
    cmd = [
        sys.executable, str(EXAMPLES / "multi_worker.py"),
        *example_flags(tmp_path, 64, 1), "--timeout", "10",
    ]  # fmt: skip
    log = tmp_path / "alone.log"
    proc = start(cmd, log, env)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail(f"the worker did not give up\n{tail(log)}")
    assert code == 1, tail(log)
    text = log.read_text()
    assert "Timeout (0:00:10)!" in text  # faulthandler's watchdog ended it ...
    assert "collective_all_reduce_strategy.py" in text  # ... while it waited for its peer


# Horovod ----------------------------------------------------------------------------


def horovod_missing() -> str | None:
    if importlib.util.find_spec("horovod") is None:
        return "horovod is not installed in this venv (make horovod builds it)"
    if shutil.which("horovodrun", path=str(BIN)) is None:
        return f"horovodrun is not in {BIN}"
    return None


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.skipif(horovod_missing() is not None, reason=str(horovod_missing()))
def test_horovod_example_two_ranks(tmp_path: Path) -> None:
    records, epochs, batch = 256, 2, 16
    cmd = [
        str(BIN / "horovodrun"), "-np", "2", "--gloo", "-H", "localhost:2",
        "--network-interface", "lo",
        sys.executable, str(EXAMPLES / "horovod_train.py"),
        *example_flags(tmp_path, records, epochs), "--batch-size", str(batch),
    ]  # fmt: skip
    run(cmd, tmp_path / "horovod.log", timeout=240)
    ref = open_dataset(tmp_path / "store")
    logs = read_ids(tmp_path / "out")
    assert sorted(logs) == [0, 1]
    check_epochs(logs, ref, epochs, batch, lambda r, e, count: shard_order(ref, r, 2, e, count))
    check_results(tmp_path / "out", 2)
    for rank in (0, 1):  # evaluated with horovod_stream shards: every record once
        result = json.loads((tmp_path / "out" / f"result-rank{rank}.json").read_text())
        assert result["evaluated"] == records


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.skipif(horovod_missing() is not None, reason=str(horovod_missing()))
def test_horovod_parallel_build_example_two_ranks(tmp_path: Path) -> None:
    records = 256
    cmd = [
        str(BIN / "horovodrun"), "-np", "2", "--gloo", "-H", "localhost:2",
        "--network-interface", "lo",
        sys.executable, str(EXAMPLES / "horovod_parallel_build.py"),
        *example_flags(tmp_path, records, 1),
    ]  # fmt: skip
    run(cmd, tmp_path / "horovod.log", timeout=240)
    ref = open_dataset(tmp_path / "store")
    results = [json.loads((tmp_path / "out" / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["build_id"] for r in results} == {ref.manifest.build_id}
    assert {r["num_records"] for r in results} == {records}
    # Each rank wrote its part: rank 0's records (even ids) first, then rank 1's.
    stored = [int(i) for b in ref.stream(shuffle=False).batches(64) for i in b["id"]]
    assert stored == [*range(0, records, 2), *range(1, records, 2)]
    assert {key.split("-")[-2] for key in (c.key for c in ref.manifest.chunks)} == {"r0", "r1"}
    # Then each read its shard of epoch 0 (record indices -> the ids stored there).
    for r, result in enumerate(results):
        assert result["ids"] == [stored[i] for i in shard_order(ref, r, 2, 0, records // 2)]
    assert sorted(results[0]["ids"] + results[1]["ids"]) == list(range(records))


# tf.distribute ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multi_worker_example_two_processes(tmp_path: Path) -> None:
    records, epochs, batch = 256, 2, 16
    cmd = [
        sys.executable, str(EXAMPLES / "multi_worker.py"), "--workers", "2",
        *example_flags(tmp_path, records, epochs), "--batch-size", str(batch),
        "--timeout", "200",
    ]  # fmt: skip
    run(cmd, tmp_path / "multi_worker.log", timeout=240)
    ref = open_dataset(tmp_path / "store")
    logs = read_ids(tmp_path / "out")
    assert sorted(logs) == [0, 1]
    check_epochs(logs, ref, epochs, batch, lambda r, e, count: shard_order(ref, r, 2, e, count))
    check_results(tmp_path / "out", 2)


@pytest.mark.slow
def test_mirrored_strategy_example_two_replicas(tmp_path: Path) -> None:
    records, epochs, batch = 256, 2, 16
    cmd = [
        sys.executable, str(EXAMPLES / "mirrored_strategy.py"), "--replicas", "2",
        *example_flags(tmp_path, records, epochs), "--batch-size", str(batch),
        "--checkpoint-dir", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    run(cmd, tmp_path / "mirrored.log", timeout=180)
    ref = open_dataset(tmp_path / "store")
    (records_log,) = read_ids(tmp_path / "out").values()
    # One input pipeline; its per-replica batches go to replica 0, 1, 0, 1, ...
    logs = {r: [x for x in records_log if x["replica"] == r] for r in (0, 1)}

    def pipeline_order(replica: int, epoch: int, count: int) -> list[int]:
        steps = count // batch
        whole = np.array(shard_order(ref, 0, 1, epoch, steps * 2 * batch))
        return whole.reshape(steps, 2, batch)[:, replica].reshape(-1).tolist()

    for replica in (0, 1):
        logs[replica].sort(key=lambda x: x["step"])
    check_epochs(logs, ref, epochs, batch, pipeline_order)
    check_results(tmp_path / "out", 1)
    assert (tmp_path / "ckpt" / "checkpoint").exists()


# Kill and restart -------------------------------------------------------------------


def wait_for_step(proc: subprocess.Popen[bytes], log: Path, ids_log: Path, step: int) -> None:
    """Wait (at most 180 s) until ``ids_log`` has ``step``; on any failure kill the job."""
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"training ended before step {step}\n{tail(log)}"
            if ids_log.exists():
                lines = ids_log.read_text().splitlines()
                done = [json.loads(x) for x in lines if x.endswith("}")]
                if done and done[-1]["step"] >= step:
                    return
            time.sleep(0.05)
        pytest.fail(f"step {step} not reached in time\n{tail(log)}")
    except BaseException:
        kill_group(proc)
        raise


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_after_sigkill_with_two_then_one_worker(tmp_path: Path) -> None:
    records, epochs, batch = 240, 2, 8
    steps_per_epoch = records // 2 // batch  # 15 with two workers
    ckpt = tmp_path / "ckpt"

    def cmd(workers: int, out: str, delay: float) -> list[str]:
        return [
            sys.executable, str(EXAMPLES / "resume_training.py"), "--workers", str(workers),
            "--store", str(tmp_path / "store"), "--out", str(tmp_path / out),
            "--records", str(records), "--epochs", str(epochs), "--batch-size", str(batch),
            "--checkpoint-dir", str(ckpt), "--save-every", "2", "--step-delay", str(delay),
            "--timeout", "200",
        ]  # fmt: skip

    # A: two workers, SIGKILLed (launcher and workers) in the middle of epoch 0.
    proc = start(cmd(2, "a", 0.15), tmp_path / "a.log")
    wait_for_step(proc, tmp_path / "a.log", tmp_path / "a" / "ids-rank0.jsonl", 5)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    # B: two workers again, SIGKILLed in the middle of epoch 1.
    proc = start(cmd(2, "b", 0.15), tmp_path / "b.log")
    wait_for_step(proc, tmp_path / "b.log", tmp_path / "b" / "ids-rank0.jsonl", 20)
    kill_group(proc)
    # C: one worker finishes the job.
    run(cmd(1, "c", 0.0), tmp_path / "c.log", timeout=200)

    resumed_b = json.loads((tmp_path / "b" / "resumed-rank0.json").read_text())
    resumed_c = json.loads((tmp_path / "c" / "resumed-rank0.json").read_text())
    step_b, step_c = resumed_b["step"], resumed_c["step"]
    assert 0 < step_b < steps_per_epoch, "the first kill must land mid-epoch 0"
    assert steps_per_epoch < step_c < 2 * steps_per_epoch, "the second kill mid-epoch 1"
    assert resumed_b["workers"] == 2 and resumed_c["workers"] == 1

    # What counts as trained: each run's steps up to the checkpoint the next run
    # resumed from (later steps died with the process and were redone).
    a, b, c = (read_ids(tmp_path / x) for x in "abc")
    for rank in (0, 1):
        a[rank] = [r for r in a[rank] if r["step"] <= step_b]
        b[rank] = [r for r in b[rank] if r["step"] <= step_c]
        assert [r["step"] for r in a[rank] + b[rank]] == list(range(1, step_c + 1))
    ref = open_dataset(tmp_path / "store")

    # Epoch 0, two workers throughout: each rank saw exactly an uninterrupted run's ids.
    for rank in (0, 1):
        got = epoch_ids(a[rank], 0) + epoch_ids(b[rank], 0)
        assert got == shard_order(ref, rank, 2, 0, steps_per_epoch * batch), f"rank {rank}"
    # Epoch 1 up to the second kill: still the uninterrupted order.
    done = (step_c - steps_per_epoch) * batch
    for rank in (0, 1):
        assert epoch_ids(b[rank], 1) == shard_order(ref, rank, 2, 1, done)
    # Then one worker reads exactly the records of epoch 1 nobody trained on.
    seen = [i for rank in (0, 1) for i in epoch_ids(b[rank], 1)]
    rest = epoch_ids(c[0], 1)
    assert not set(seen) & set(rest)
    assert len(set(rest)) == len(rest)
    assert sorted(seen + rest) == list(range(records))  # all sizes divide: nothing dropped
    expected_state = ref.stream(0, 2, seed=SEED, epoch=1, drop_remainder=True).state(done)
    assert json.loads(resumed_c["state"]) == json.loads(expected_state.to_json())
    assert rest == np.concatenate(list(ref.resume(expected_state).record_indices(64))).tolist()
    for epoch in (0, 1):
        everything = [i for log in (a, b, c) for rank in log for i in epoch_ids(log[rank], epoch)]
        assert sorted(everything) == list(range(records)), f"epoch {epoch}"
