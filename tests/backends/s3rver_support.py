"""s3rver (npm), a second S3 implementation: started on 127.0.0.1 on a free port.

``make test`` installs it from ``tests/s3rver/package.json``; without it (no
npm) the tests that need it are skipped, saying why. s3rver accepts
conditional-write headers but ignores them, which is what those tests show.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["S3RVER_DIR", "s3rver"]

S3RVER_DIR = Path(__file__).resolve().parent.parent / "s3rver"
ACCESS_KEY = "S3RVER"  # the credentials s3rver accepts


@contextlib.contextmanager
def s3rver(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run s3rver storing under ``directory``; yield its endpoint URL (credentials set)."""
    node = shutil.which("node")
    if node is None or not (S3RVER_DIR / "node_modules" / "s3rver").is_dir():
        pytest.skip("s3rver is not installed: run `make unit` (needs node and npm)")
    directory.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # s3rver's listings past 1,000 keys need the legacy provider on Node 17+.
    env["NODE_OPTIONS"] = "--openssl-legacy-provider"
    proc = subprocess.Popen(
        [node, str(S3RVER_DIR / "serve.js"), str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"s3rver did not start: {proc.stderr.read() if proc.stderr else ''}")
        port = int(json.loads(line)["port"])
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ACCESS_KEY)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
