"""The work queue examples, run for real: independent workers, and horovodrun with lockstep."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_examples_distributed import BIN, EXAMPLES, ROOT, example_env, horovod_missing, run


@pytest.mark.multiprocess
def test_async_workers_example(tmp_path: Path) -> None:
    records = 1200
    cmd = [
        sys.executable, str(EXAMPLES / "async_workers.py"), "--store", str(tmp_path / "store"),
        "--records", str(records), "--slices", "24", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ROOT, env=example_env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^w(\d)\s+\S+\s+(\d+)\s+(\d+)$", done.stdout, re.MULTILINE)
    assert [int(w) for w, _, _ in rows] == [0, 1, 2, 3]
    assert sum(int(n) for _, n, _ in rows) == records
    assert sum(int(s) for _, _, s in rows) == 24
    assert "each consumed exactly once" in done.stdout
    # The launcher's check, redone from the workers' own files.
    ids = [i for w in range(4) for i in json.loads((tmp_path / "out" / f"w{w}.json").read_text())]
    assert sorted(ids) == list(range(records))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.skipif(horovod_missing() is not None, reason=str(horovod_missing()))
def test_horovod_queue_example_two_ranks(tmp_path: Path) -> None:
    records, epochs = 256, 2
    cmd = [
        str(BIN / "horovodrun"), "-np", "2", "--gloo", "-H", "localhost:2",
        "--network-interface", "lo",
        sys.executable, str(EXAMPLES / "horovod_queue.py"), "--store", str(tmp_path / "store"),
        "--out", str(tmp_path / "out"), "--records", str(records), "--epochs", str(epochs),
        "--slices", "10",
    ]  # fmt: skip
    run(cmd, tmp_path / "horovod.log", timeout=240)
    results = [json.loads((tmp_path / "out" / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    # lockstep: both ranks ran every step together, idle ones included.
    assert results[0]["steps"] == results[1]["steps"]
    assert sum(r["records"] for r in results) == records * epochs
    assert results[0]["accuracy"] == results[1]["accuracy"]  # one synchronous model
    steps = {}
    counts: collections.Counter[int] = collections.Counter()
    for r in (0, 1):
        lines = (tmp_path / "out" / f"ids-rank{r}.jsonl").read_text().splitlines()
        logged = [json.loads(line) for line in lines]
        steps[r] = len(logged)
        counts.update(i for step in logged for i in step["ids"])
        assert sum(step["idle"] for step in logged) == results[r]["idle_steps"]
    assert steps[0] == steps[1] == results[0]["steps"]
    assert set(counts) == set(range(records)) and set(counts.values()) == {epochs}
