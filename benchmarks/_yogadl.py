"""(f) YogaDL 0.1.4, the library yogastore replaces, in a virtual environment of its own.

The environment is created on first use under the user's cache directory and
reused afterwards (a stamp file records the pins it was built with). YogaDL
then runs in a subprocess with that environment's Python on the same TFRecord
file, with the same shuffle and shard. If the environment cannot be built, the
row says why and carries no number.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PINS = ("yogadl==0.1.4", "lmdb<2", "websockets<14", "tensorflow-cpu==2.21.0")
ROOT = Path(__file__).resolve().parent.parent
_STAMP = ".yogastore-bench-pins"


def default_venv() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "yogastore" / "bench-yogadl-venv"


def _tail(text: str, lines: int = 4) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def ensure_venv(path: Path, log: Any = print) -> tuple[Path | None, str]:
    """Return (python of the YogaDL venv, how it was obtained) or (None, why not)."""
    python = path / "bin" / "python"
    stamp = path / _STAMP
    wanted = "\n".join(PINS)
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python, f"reused {path}"
    if path.exists():
        if not (path / "pyvenv.cfg").exists():
            return None, f"{path} exists and is not a virtual environment; pass --yogadl-venv"
        shutil.rmtree(path)  # a half-built environment of an earlier run
    log(f"creating the YogaDL environment in {path} (one time): pip install {' '.join(PINS)}")
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        ("python -m venv", [sys.executable, "-m", "venv", str(path)]),
        (
            "pip install " + " ".join(PINS),
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PINS],
        ),
        (
            "import yogadl",
            [str(python), "-c", "import yogadl.storage, yogadl.tensorflow, lmdb, tensorflow"],
        ),
    ]
    for what, cmd in steps:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            return None, f"{what} failed: {err}"
        if proc.returncode != 0:
            return None, f"{what} failed: {_tail(proc.stderr or proc.stdout)}"
    stamp.write_text(wanted)
    return python, f"created {path} in {time.perf_counter() - started:.0f}s"


def run_yogadl(
    python: Path, case: dict[str, Any], work: Path, tfrecord: Path, data: Path, max_records: int
) -> dict[str, Any]:
    """Build YogaDL's cache of the TFRecord source and time its shuffled, sharded reads."""
    cfg_path = work / "yogadl.json"
    out_path = work / "yogadl.out.json"
    storage = work / "yogadl-storage"
    storage.mkdir(exist_ok=True)
    cfg = {
        "case": case,
        "tfrecord": str(tfrecord),
        "data": str(data),
        "storage": str(storage),
        "max_records": max_records,
        "out": str(out_path),
    }
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [str(python), str(Path(__file__).with_name("_yogadl_worker.py")), str(cfg_path)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"YogaDL worker exited {proc.returncode}: {_tail(proc.stderr)}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result
