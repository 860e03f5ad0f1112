"""Under horovodrun: ranks refuse to train on mismatched settings; Keras 3 fit recipe resumes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_examples_distributed import BIN, EXAMPLES, example_flags, horovod_missing, run

HERE = Path(__file__).resolve().parent
HOROVODRUN = [
    str(BIN / "horovodrun"), "-np", "2", "--gloo", "-H", "localhost:2",
    "--network-interface", "lo",
]  # fmt: skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
    pytest.mark.horovod,
    pytest.mark.skipif(horovod_missing() is not None, reason=str(horovod_missing())),
]


def test_ranks_check_they_agree(tmp_path: Path) -> None:
    cmd = [
        *HOROVODRUN,
        sys.executable, str(HERE / "hvd_agreement_worker.py"),
        str(tmp_path / "store"), str(tmp_path / "out"),
    ]  # fmt: skip
    run(cmd, tmp_path / "agreement.log", timeout=240)
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Agreeing ranks read disjoint halves of the epoch.
    agree = [set(np.concatenate(r["agree"]["ids"]).tolist()) for r in ranks]
    assert len(agree[0]) == len(agree[1]) == 32 and not agree[0] & agree[1]
    for r in ranks:
        assert "seed" in r["seed"]["error"] and "batch_size" not in r["seed"]["error"]
        assert "ranks disagree on seed" in r["seed"]["error"]
        assert "ranks disagree on batch_size" in r["batch"]["error"]
        assert "horovod_stream: ranks disagree on seed" in r["stream"]["error"]


def test_horovod_keras_fit_recipe_trains_and_resumes(tmp_path: Path) -> None:
    records, batch = 256, 16  # 8 steps per epoch per rank
    flags = [
        "--batch-size", str(batch), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--save-every", "3",
    ]  # fmt: skip
    script = [sys.executable, str(EXAMPLES / "horovod_keras.py")]
    run(
        [*HOROVODRUN, *script, *example_flags(tmp_path, records, 2), *flags],
        tmp_path / "first.log",
        timeout=240,
    )
    first = [json.loads((tmp_path / "out" / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["global_step"] for r in first] == [16, 16]
    assert (tmp_path / "ckpt" / "ckpt-16.index").exists(), "rank 0 saves, named by step"
    # A second run restores step 16 and trains to 4 epochs in one fit call.
    run(
        [*HOROVODRUN, *script, *example_flags(tmp_path, records, 4), *flags],
        tmp_path / "second.log",
        timeout=240,
    )
    assert "resumed at global step 16" in (tmp_path / "second.log").read_text()
    results = [json.loads((tmp_path / "out" / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        assert res["global_step"] == 32 and res["steps_per_epoch"] == 8
        assert res["accuracy"] > 0.9, res
    # Gradients averaged in apply + the one-shot broadcast: both ranks hold one model.
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert results[0]["state"] == results[1]["state"]
