"""The queue makespan benchmark runs end to end on a tiny size; its counts are checked.

No timing is asserted: only that both modes read every record exactly once,
that the queue made one claim per slice and that the claim-rate runs claimed
and finished every slice, on the local store and on a moto server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
@pytest.mark.s3
def test_queue_makespan_tiny(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "benchmarks.queue_makespan", "--records=240", "--slices=8",
        "--step-ms=0.02", "--claim-slices=6", f"--json={out}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    for mode in ("static", "queue"):
        assert result[mode]["exactly_once"] and result[mode]["records_read"] == 240
        assert sum(result[mode]["records_per_worker"]) == 240
    assert result["static"]["records_per_worker"] == [60, 60, 60, 60]
    assert result["queue"]["claims"] == 8
    for store in ("local", "moto"):
        assert result["claim_rate"][store]["claims"] == 6
        assert result["claim_rate"][store]["done"] == 6
    assert "static / queue makespan" in done.stdout and "moto" in done.stdout
