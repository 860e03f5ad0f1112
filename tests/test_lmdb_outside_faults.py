"""Outside faults on a live local store: a data file truncated under a process, a FIFO or a
device where LMDB's file should be, and versions deleted while another process reads them."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import yogastore
from storage_backends.lmdb_backend import LmdbBackend

SPEC = {"x": yogastore.ComponentSpec(shape=(256,), dtype="int32")}
N = 400


def records(n: int = N, offset: int = 0) -> list[dict[str, Any]]:
    return [{"x": np.full(256, i + offset, np.int32)} for i in range(n)]


def build(root: Path) -> None:
    store = yogastore.Store(root, chunk_bytes=16 << 10)
    store.cache("d", "1", records, spec=SPEC)
    store.backend.close()


def run(code: str, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``code`` in a new process; a signal (SIGBUS) or a hang fails the test."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


# Reads a version, truncates its data file (an outside fault), then tries
# every way this process could touch the file again.
TRUNCATED = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np, yogastore
    root, how = sys.argv[1], sys.argv[2]
    store = yogastore.Store(root)
    ref = store.open("d", "1")
    source = ref.make_source()
    everything = np.arange(ref.num_records, dtype=np.int64)
    source.gather(everything)  # every chunk mapped, verified and viewed
    data = os.path.join(root, "d", "1", "data.mdb")
    os.truncate(data, os.path.getsize(data) // 2 if how == "half" else 0)
    out = {}
    def attempt(name, call):
        try:
            call()
            out[name] = "no error"
        except yogastore.YogaStoreError as err:
            out[name] = [type(err).__name__, str(err)]
    attempt("gather_with_held_views", lambda: source.gather(everything[:5]))
    attempt("read_ref", lambda: list(ref.stream(shuffle=False)))
    attempt("open", lambda: yogastore.Store(root).open("d", "1"))
    spec = {"x": yogastore.ComponentSpec(shape=(256,), dtype="int32")}
    attempt("cache", lambda: store.cache("d", "1", list, spec=spec))
    out["list"] = [e.version for e in yogastore.Store(root).list()]
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("how", ["half", "zero"])
def test_data_file_truncated_under_a_reader_is_an_error_not_sigbus(
    tmp_path: Path, how: str
) -> None:
    build(tmp_path)
    out = run(TRUNCATED, str(tmp_path), how)
    data = str(tmp_path / "d" / "1" / "data.mdb")
    for case in ("gather_with_held_views", "read_ref", "open", "cache"):
        kind, message = out[case]
        assert kind == "CorruptCacheError", (case, out[case])
        assert data in message and "shrank" in message, (case, message)
    assert out["list"] == []  # skipped with a warning


# The compiled copies and hashes read a file map; the file is cut short under
# them. Each call must raise MappedFault; a read of the lost bytes outside them
# must still end the process with SIGBUS (other faults are not swallowed).
MAPPED_FAULT = textwrap.dedent(
    """
    import json, mmap, os, sys
    import numpy as np
    from yogastore import _gather
    path = sys.argv[1]
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
    m = mmap.mmap(os.open(path, os.O_RDONLY), 1 << 20, prot=mmap.PROT_READ)
    src = np.frombuffer(m, np.uint8)
    os.truncate(path, 4096)
    starts = np.array([0, 8192, 500000], np.int64)
    calls = {
        "gather_rows": lambda: _gather.gather_rows(np.empty(192, np.uint8), src, starts, 64),
        "gather_ranges": lambda: _gather.gather_ranges(
            np.empty(300, np.uint8), src, starts, np.full(3, 100, np.int64)),
        "hash_blocks": lambda: _gather.hash_blocks(
            np.empty(3, np.uint64), [src], np.zeros(3, np.int64), starts, starts + 100),
    }
    from yogastore.format.manifest import checksum  # hashes views with hash_blocks
    calls["checksum"] = lambda: checksum(memoryview(m))
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except _gather.MappedFault as err:
            out[name] = str(err)
    kept = np.empty(64, np.uint8)
    _gather.gather_rows(kept, src, np.array([0], np.int64), 64)  # the bytes still there
    out["kept"] = bool((kept == src[:64]).all())
    print(json.dumps(out), flush=True)
    print(int(src[8192]))  # unguarded: SIGBUS
    """
)


def test_mapped_bytes_cut_short_under_a_copy_raise_and_other_faults_still_kill(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", MAPPED_FAULT, str(tmp_path / "f")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-2000:])
    out = json.loads(proc.stdout.splitlines()[0])
    for name in ("gather_rows", "gather_ranges", "hash_blocks"):
        assert out[name].startswith(f"{name}: ") and "SIGBUS" in out[name], out
    assert out["checksum"].startswith("hash_blocks: ") and "SIGBUS" in out["checksum"], out
    assert out["kept"] is True


# A SIGBUS another thread or process sends (kill, si_code <= 0) is no fault of a
# guarded copy: it must end the process as without the guard, even when it lands
# while a copy runs, and never turn into a MappedFault of intact bytes.
SENT_BUS = textwrap.dedent(
    """
    import signal, threading, time
    import numpy as np
    from yogastore import _gather
    src = np.ones(64 << 20, np.uint8)
    starts = np.arange(0, len(src), 4096, dtype=np.int64)
    out = np.empty(len(starts), np.uint64)
    which = np.zeros(len(starts), np.int64)
    main = threading.get_ident()
    threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGBUS)).start()
    calls, deadline = 0, time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            _gather.hash_blocks(out, [src], which, starts, starts + 4096)
            calls += 1
        print("survived", calls)
    except _gather.MappedFault as err:
        print("taken for a fault after", calls, "calls:", err)
    """
)


def test_a_sigbus_sent_by_kill_still_ends_the_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SENT_BUS], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr[-2000:])


# The truncation lands after a gather's size check, while its bytes are copied
# (the race the check cannot close): the first check is skipped to stand for it.
RACED = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np, yogastore
    root = sys.argv[1]
    ref = yogastore.Store(root).open("d", "1")
    source = ref.make_source()
    everything = np.arange(ref.num_records, dtype=np.int64)
    source.gather(everything[:1])  # maps the file
    data = os.path.join(root, "d", "1", "data.mdb")
    os.truncate(data, 8192)
    backend, check = source.backend, source.backend.check_mapped
    calls = []
    def late_check(key):
        calls.append(key)
        if len(calls) > 1:
            check(key)
    backend.check_mapped = late_check
    out = {}
    try:
        source.gather(everything)
        out["gather"] = "no error"
    except yogastore.YogaStoreError as err:
        out["gather"] = [type(err).__name__, str(err)]
    backend.check_mapped = check
    print(json.dumps(out))
    """
)


def test_file_cut_short_while_a_batch_is_copied_is_an_error(tmp_path: Path) -> None:
    build(tmp_path)
    out = run(RACED, str(tmp_path))
    kind, message = out["gather"]
    assert kind == "CorruptCacheError", message
    assert str(tmp_path / "d" / "1" / "data.mdb") in message and "shrank" in message, message


# A copy to another store reads each chunk's mapped bytes; the truncation lands
# after the checks of opening and getting the chunk (the views taken before it
# stand for that race).
COPY_RACED = textwrap.dedent(
    """
    import json, os, sys
    import yogastore
    root, dst = sys.argv[1], sys.argv[2]
    store = yogastore.Store(root)
    ref = store.open("d", "1")
    views = {c.key: store.backend.get(c.key) for c in ref.manifest.chunks}
    os.truncate(os.path.join(root, "d", "1", "data.mdb"), 8192)
    store.open = lambda *args, **kwargs: ref
    store.backend.get = views.__getitem__
    out = {}
    try:
        store.copy("d", "1", to=yogastore.Store(dst))
        out["copy"] = "no error"
    except yogastore.YogaStoreError as err:
        out["copy"] = [type(err).__name__, str(err)]
    out["copied"] = [e.version for e in yogastore.Store(dst).list()]
    print(json.dumps(out))
    """
)


def test_file_cut_short_while_a_copy_reads_it_is_an_error(tmp_path: Path) -> None:
    build(tmp_path / "src")
    out = run(COPY_RACED, str(tmp_path / "src"), str(tmp_path / "dst"))
    kind, message = out["copy"]
    assert kind == "CorruptCacheError", message
    assert str(tmp_path / "src" / "d" / "1" / "data.mdb") in message, message
    assert "shrank" in message, message
    assert out["copied"] == []  # nothing half-copied is left as a version


# `yogastore verify` meets a data file cut short after its first chunk: one
# error naming the file, not a "damaged" line for every chunk after it.
VERIFY_RACED = textwrap.dedent(
    """
    import contextlib, io, json, os, sys
    from yogastore import cli
    root = sys.argv[1]
    data = os.path.join(root, "d", "1", "data.mdb")
    made = []
    def cut_after_first(*args, **kwargs):
        view = real(*args, **kwargs)
        if not made:
            os.truncate(data, 8192)
        made.append(view)
        return view
    real, cli.ChunkView = cli.ChunkView, cut_after_first
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["--store", root, "verify", "d", "1"])
    print(json.dumps({"rc": rc, "stderr": err.getvalue().splitlines(), "chunks": len(made)}))
    """
)


def test_file_cut_short_during_verify_is_one_error(tmp_path: Path) -> None:
    build(tmp_path)
    out = run(VERIFY_RACED, str(tmp_path))
    assert out["rc"] == 1 and out["chunks"] == 1, out
    [line] = out["stderr"]
    assert line.startswith("error: ") and "shrank" in line, line
    assert str(tmp_path / "d" / "1" / "data.mdb") in line, line


# A StringRanges batch is a view of the mapped file: copied after the file was
# cut short, it is an error, not a SIGBUS.
RANGES_KEPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np, yogastore
    root = sys.argv[1]
    spec = {"s": yogastore.ComponentSpec(shape=(), dtype="string")}
    records = [{"s": bytes([i % 251]) * (i % 3000)} for i in range(300)]
    ref = yogastore.Store(root, chunk_bytes=64 << 10).cache("t", "1", lambda: records, spec=spec)
    batches = list(ref.stream(shuffle=False).batches(100, strings=yogastore.StringFormat.RANGES))
    ok = batches[0]["s"].to_buffer().to_numpy().tolist() == [r["s"] for r in records[:100]]
    os.truncate(os.path.join(root, "t", "1", "data.mdb"), 8192)
    try:
        batches[-1]["s"].to_buffer()
        out = "no error"
    except yogastore.YogaStoreError as err:
        out = [type(err).__name__, str(err)]
    print(json.dumps({"ok": ok, "after": out}))
    """
)


def test_string_ranges_copied_after_their_file_was_cut_short(tmp_path: Path) -> None:
    out = run(RANGES_KEPT, str(tmp_path))
    assert out["ok"] is True
    kind, message = out["after"]
    assert kind == "CorruptCacheError" and "StringRanges.to_buffer" in message, message


# Opens a store whose version directory holds something LMDB must not open.
SPECIAL = textwrap.dedent(
    """
    import json, sys
    import yogastore
    root = sys.argv[1]
    store = yogastore.Store(root)
    out = {}
    try:
        store.open("d", "1")
        out["open"] = "opened"
    except yogastore.YogaStoreError as err:
        out["open"] = [type(err).__name__, str(err)]
    out["list"] = [e.version for e in store.list()]
    store.delete("d", "1")
    out["left"] = sorted(__import__("os").listdir(root))
    print(json.dumps(out))
    """
)


def make_fifo(root: Path) -> str:
    data = root / "d" / "1" / "data.mdb"
    data.unlink()
    os.mkfifo(data)
    return f"{data} should be a regular file but is a FIFO"


def make_device(root: Path) -> str:
    data = root / "d" / "1" / "data.mdb"
    data.unlink()
    data.symlink_to("/dev/zero")
    return f"{data} should be a regular file but is a character device"


def make_version_a_file(root: Path) -> str:
    version = root / "d" / "1"
    for child in version.iterdir():
        child.unlink()
    version.rmdir()
    version.write_text("not a directory")
    return f"{version} should be an LMDB environment directory but is a regular file"


@pytest.mark.parametrize(
    "damage", [make_fifo, make_device, make_version_a_file], ids=["fifo", "device", "file"]
)
def test_special_files_are_corrupt_at_open_never_a_hang(tmp_path: Path, damage: Any) -> None:
    build(tmp_path)
    expected = damage(tmp_path)
    out = run(SPECIAL, str(tmp_path), timeout=60)
    kind, message = out["open"]
    assert kind == "CorruptCacheError" and expected in message, message
    assert out["list"] == []
    assert out["left"] == []  # delete removed it (and the empty dataset folder)


def test_environment_whose_file_vanishes_reads_as_missing(tmp_path: Path) -> None:
    """The race a reader loses against another process's delete: missing, not damaged."""
    build(tmp_path)
    backend = LmdbBackend(str(tmp_path))
    version = tmp_path / "d" / "1"
    env = backend._env(version, create=False)
    assert env is not None and env.read(b"manifest.json") is not None
    # Another process deletes the version (and may leave a new file in its place).
    subprocess.run(
        [sys.executable, "-c", "import shutil, sys; shutil.rmtree(sys.argv[1])", str(version)],
        check=True,
    )
    assert env.read(b"manifest.json") is None
    assert env.names() == []
    with pytest.raises(yogastore.StorageError, match="deleted by another process"):
        env.write(b"k", b"v", overwrite=True)


# Reads d/1 in a loop while another process deletes and rebuilds it, until
# the stop file appears; then reads once more.
READER = textwrap.dedent(
    """
    import json, os, sys
    import yogastore
    root, stop = sys.argv[1], sys.argv[2]
    store = yogastore.Store(root)
    def read():
        ref = store.open("d", "1")
        values = [int(e["x"][0]) for e in ref.stream(shuffle=False)]
        first = values[0] if values else 0
        return first if values == list(range(first, first + ref.num_records)) else "WRONG"
    read()
    print("ready", flush=True)
    seen, odd = {}, []
    while not os.path.exists(stop):
        try:
            outcome = "read" if read() != "WRONG" else "WRONG"
        except yogastore.YogaStoreError as err:
            outcome = type(err).__name__
            if outcome not in ("DatasetNotFoundError", "DatasetChangedError"):
                odd.append(f"{outcome}: {err}"[:400])
        seen[outcome] = seen.get(outcome, 0) + 1
    print(json.dumps({"seen": seen, "odd": odd[:5], "last": read()}))
    """
)


@pytest.mark.multiprocess
def test_delete_while_another_process_reads(tmp_path: Path) -> None:
    root, stop = tmp_path / "s", tmp_path / "stop"
    build(root)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(root), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None
    try:
        assert reader.stdout.readline().strip() == "ready"
        store = yogastore.Store(root, chunk_bytes=16 << 10)
        for offset in range(1000, 26_000, 1000):
            store.delete("d", "1")  # never half-done: it raises if a file is left
            assert not (root / "d" / "1").exists()
            store.cache("d", "1", functools.partial(records, 50, offset), spec=SPEC)
    finally:
        stop.touch()
    out, err = reader.communicate(timeout=300)
    assert reader.returncode == 0, err[-2000:]
    result = json.loads(out.splitlines()[-1])
    # Never "damaged", never wrong records: missing, changed, or read whole.
    assert set(result["seen"]) <= {"read", "DatasetNotFoundError", "DatasetChangedError"}, result
    assert result["last"] == 25_000  # the long-lived reader sees the last build


# LMDB's lock file (its reader table, mapped by every reader) cut short under a
# reader: the next read is an error naming it, not a SIGBUS inside LMDB, and the
# process goes on (and ends) without one.
LOCK_CUT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np, yogastore
    root = sys.argv[1]
    ref = yogastore.Store(root).open("d", "1")
    first = [int(e["x"][0]) for e in ref.stream(shuffle=False)]
    os.truncate(os.path.join(root, "d", "1", "lock.mdb"), 0)
    out = {"first": first == list(range(len(first)))}
    try:
        list(ref.stream(shuffle=True, seed=1))
        out["after"] = "no error"
    except yogastore.YogaStoreError as err:
        out["after"] = [type(err).__name__, str(err)]
    again = sorted(int(e["x"][0]) for e in ref.stream(shuffle=True, seed=2))
    out["again"] = again == list(range(len(first)))
    print(json.dumps(out))
    """
)


def test_lock_file_cut_short_under_a_reader_is_an_error_not_sigbus(tmp_path: Path) -> None:
    build(tmp_path)
    out = run(LOCK_CUT, str(tmp_path))  # exit 0: no SIGBUS then or at exit
    assert out["first"] is True
    kind, message = out["after"]
    assert kind == "CorruptCacheError", message
    assert str(tmp_path / "d" / "1" / "lock.mdb") in message and "shrank" in message, message
    assert out["again"] is True  # the data is not affected
