"""Damaged files and full disks: always a library error naming the file, never a signal."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore
from storage_backends import lmdb_env

SPEC = {
    "x": yogastore.ComponentSpec(shape=(64,), dtype="int32"),
    "s": yogastore.ComponentSpec(shape=(None,), dtype="string"),
}
N = 200
PAGE = 4096


def items() -> list[dict[str, Any]]:
    return [
        {"x": np.full(64, i, np.int32), "s": np.array([b"r%d" % i] * (i % 3), dtype=object)}
        for i in range(N)
    ]


def build(root: Path) -> yogastore.DatasetRef:
    # Chunks of ~12 kB live on LMDB overflow pages, whose sizes a flip can damage.
    return yogastore.Store(root, chunk_bytes=12000).cache("d", "1", items, spec=SPEC)


# Reads each store named on stdin (one per line) and prints one JSON line per store.
READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np, yogastore
    n = int(sys.argv[1])
    for line in sys.stdin:
        root = line.strip()
        try:
            got = list(yogastore.Store(root).open("d", "1").stream(shuffle=False))
            ok = len(got) == n and all(
                np.array_equal(e["x"], np.full(64, i, np.int32))
                and list(e["s"]) == [b"r%d" % i] * (i % 3)
                for i, e in enumerate(got)
            )
            out = "ok" if ok else "wrong"
        except yogastore.YogaStoreError as err:
            out = type(err).__name__ + ": " + str(err)[:300]
        except BaseException as err:
            out = "FOREIGN " + type(err).__name__ + ": " + str(err)[:300]
        print(json.dumps([root, out]), flush=True)
    """
)


def read_in_subprocess(roots: list[Path]) -> tuple[dict[str, str], int]:
    """Return each store's outcome and the reader's exit code (negative: a signal)."""
    proc = subprocess.run(
        [sys.executable, "-c", READER, str(N)],
        input="".join(f"{r}\n" for r in roots),
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes = dict(json.loads(line) for line in proc.stdout.splitlines())
    return outcomes, proc.returncode


def flipped_copy(src: Path, dst: Path, offset: int, bit: int) -> Path:
    shutil.copytree(src, dst)
    data_file = dst / "d" / "1" / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    raw[offset] ^= 1 << bit
    data_file.write_bytes(bytes(raw))
    return dst


def leaf_pages(data: bytes) -> list[int]:
    """Return the numbers of B-tree leaf pages (LMDB 0.9 page header: flags at byte 10)."""
    return [
        p for p in range(len(data) // PAGE) if struct.unpack_from("<H", data, p * PAGE + 10)[0] == 2
    ]


def test_damaged_value_size_is_an_error_not_sigbus(tmp_path: Path) -> None:
    """The node size field of a leaf (a chunk's length) changed: once a SIGBUS in txn.get."""
    src = tmp_path / "src"
    build(src)
    data = (src / "d" / "1" / "data.mdb").read_bytes()
    leaves = leaf_pages(data)
    assert leaves
    roots = [
        flipped_copy(src, tmp_path / f"leaf{page}-{off}", page * PAGE + off, 6)
        for page in leaves
        for off in (17, 12, 13)
    ]
    outcomes, code = read_in_subprocess(roots)
    assert code == 0, f"reader died with signal {-code}"
    assert len(outcomes) == len(roots)
    for root, out in outcomes.items():
        assert out == "ok" or out.startswith("CorruptCacheError"), (root, out)
        if out != "ok":
            assert "data.mdb" in out or "chunk" in out
    damaged = [root for root, out in outcomes.items() if "is damaged" in out]
    assert damaged
    # The command line too: no signal, no traceback, exit 1, the file named.
    cli = subprocess.run(
        [sys.executable, "-m", "yogastore", "--store", damaged[0], "verify", "d", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 1, cli
    assert "Traceback" not in cli.stderr
    assert "data.mdb" in cli.stderr and "damaged" in cli.stderr


def test_verify_names_every_damaged_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = build(tmp_path)
    store = ref.store
    assert len(ref.manifest.chunks) >= 3
    data_file = tmp_path / "d" / "1" / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    for i in (0, 2):
        chunk = bytes(store.backend.get(ref.manifest.chunks[i].key))
        for start in range(len(chunk) - 96, 0, -32):  # a stretch found once in the file
            at = raw.find(chunk[start : start + 96])
            if at >= 0 and raw.find(chunk[start : start + 96], at + 1) == -1:
                break
        else:
            pytest.fail(f"no unique stretch of chunk {i} in data.mdb")
        raw[at + 5] ^= 0x10
    store.backend.close()
    data_file.write_bytes(bytes(raw))
    from yogastore.cli import main

    assert main(["verify", "d", "1", "--store", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "chunk 0 " in err and "chunk 2 " in err and "chunk 1 " not in err
    assert "2 of" in err


def _unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            'mount -t tmpfs -o size=64k tmpfs "$0"',
            str(Path.cwd()),
        ],
        capture_output=True,
    )
    return probe.returncode == 0


FULL_DISK = textwrap.dedent(
    """
    import errno, json, os, sys
    import numpy as np, yogastore
    root = sys.argv[1]
    spec = {"x": yogastore.ComponentSpec(shape=(1024,), dtype="uint8")}
    make = lambda: [{"x": np.full(1024, i % 256, np.uint8)} for i in range(2000)]
    out = {}
    store = yogastore.Store(os.path.join(root, "store"), chunk_bytes=64 << 10)
    try:
        store.cache("big", "1", make, spec=spec)  # 2 MB into a 1 MB filesystem
        out["too_big"] = "built"
    except yogastore.StorageError as err:
        out["too_big"] = [err.errno, str(err)]
    # The failed build freed its space: nothing of it is left on disk.
    big = os.path.join(root, "store", "big")
    out["left"] = sorted(os.listdir(big)) if os.path.isdir(big) else None
    out["versions"] = store.versions()
    # Fill what is left, then start a new version: its environment cannot be created.
    fd = os.open(os.path.join(root, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\\0" * 4096)
    except OSError:
        os.close(fd)
    try:
        store.cache("other", "1", lambda: make()[:10], spec=spec)
        out["full"] = "built"
    except yogastore.StorageError as err:
        out["full"] = [err.errno, str(err)]
    os.remove(os.path.join(root, "filler"))
    out["gc"] = [(e.dataset_id, e.version, e.committed) for e in store.gc()]
    ref = store.cache("small", "1", lambda: make()[:100], spec=spec)
    out["small"] = ref.num_records
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_full_disk_on_a_small_tmpfs(tmp_path: Path) -> None:
    """A real 1 MB tmpfs (mounted in a user and mount namespace)."""
    if not _unshare_available():
        pytest.skip("cannot mount a tmpfs here; test_full_disk_injected covers ENOSPC")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    proc = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$0" "$2" "$1"',
            sys.executable,
            str(mnt),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.splitlines()[-1])
    for case in ("too_big", "full"):
        code, message = out[case]
        assert code == errno.ENOSPC, out
        assert "disk full" in message and "bytes free" in message, message
    assert out["versions"] == [] and out["gc"] == [], out
    assert out["left"] in ([], None), out  # no version directory, no lock file
    assert out["small"] == 100
    # The failed builds' files went whole: no chunk-by-chunk delete that the full disk refused.
    assert "could not" not in proc.stderr, proc.stderr[-2000:]


def test_full_disk_injected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC injected where space is reserved before LMDB maps a new environment's lock file.

    (The tmpfs test above is the real thing; this one runs where no tmpfs can be mounted.)
    """

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    store = yogastore.Store(tmp_path)
    with pytest.raises(yogastore.StorageError, match="disk full") as info:
        store.cache("d", "1", items, spec=SPEC)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(lmdb_env, "free_bytes", lambda path: 100)
    err = lmdb_env.disk_full_error(str(tmp_path), 5000, "test")
    assert "100 bytes free" in str(err) and "5,000" in str(err)


@pytest.mark.slow
def test_flip_sweep_no_signal_no_wrong_record(tmp_path: Path) -> None:
    """300 single-bit flips spread over every page of a store's data file."""
    src = tmp_path / "src"
    build(src)
    size = (src / "d" / "1" / "data.mdb").stat().st_size
    pages = size // PAGE
    rng = random.Random(1234)
    flips = []
    for k in range(300):
        page = k % pages
        # Half in the page header and first nodes, where sizes and page numbers live.
        off = rng.randrange(64) if k % 2 else rng.randrange(PAGE)
        flips.append((page * PAGE + off, rng.randrange(8)))
    results: dict[str, str] = {}
    for start in range(0, len(flips), 60):
        roots = [
            flipped_copy(src, tmp_path / f"f{k}", off, bit)
            for k, (off, bit) in enumerate(flips[start : start + 60], start)
        ]
        outcomes, code = read_in_subprocess(roots)
        assert code == 0, f"a reader died with signal {-code} after {len(outcomes)} stores"
        results.update(outcomes)
        for root in roots:
            shutil.rmtree(root)
    assert len(results) == len(flips)
    wrong = {r: o for r, o in results.items() if o == "wrong" or o.startswith("FOREIGN")}
    assert not wrong, wrong
    errors = [o for o in results.values() if o != "ok"]
    assert errors and all(o.startswith(("CorruptCacheError", "StorageError")) for o in errors)
