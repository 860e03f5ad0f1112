"""A damaged read-cache file is dropped before LMDB maps it: never a signal, never bad bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# In a child process, so a crash by signal fails the test instead of killing pytest.
CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from yogastore.read.diskcache import DiskCache
    directory, mode = Path(sys.argv[1]), sys.argv[2]
    cache = DiskCache(directory, 1 << 24)
    cid = b"c" * 16
    if mode == "fill":
        for i in range(200):
            cache.update([], [(cid, i * 1000, bytes([i % 251]) * 1000)])
    got, missing = cache.read(cid, [(0, 1000), (5000, 6000)])
    pieces = [[(p.start, p.end, p.data[:1].hex()) for p in ps] for ps in got]
    print(json.dumps({"total": cache.total(), "pieces": pieces}))
    """
)


def run(directory: Path, mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return {"out": json.loads(proc.stdout.splitlines()[-1]), "err": proc.stderr}


@pytest.mark.parametrize("damage", ["leaf-pages", "tail-garbage"])
def test_damaged_cache_file_is_replaced(tmp_path: Path, damage: str) -> None:
    filled = run(tmp_path, "fill")["out"]
    assert filled["total"] > 0
    assert filled["pieces"] == [[[0, 1000, "00"]], [[5000, 6000, "05"]]]
    path = tmp_path / "remote-cache.mdb"
    data = bytearray(path.read_bytes())
    page = 4096
    if damage == "leaf-pages":
        for at in range(2 * page, len(data), page):  # every page past the two meta pages
            data[at + 10 : at + 40] = b"\xff" * 30
    else:
        data[3 * page :] = b"\xa5" * (len(data) - 3 * page)
    path.write_bytes(bytes(data))
    again = run(tmp_path, "read")
    assert again["out"]["total"] == 0 and again["out"]["pieces"] == [[], []], again
    assert "damaged" in again["err"] and "starting an empty one" in again["err"]
