"""Large values located in the LMDB file without LMDB: exact, never wrong, pages read on demand."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

import lmdb
import lmdb.verify
import numpy as np
import pytest

import yogastore
from storage_backends import lmdb_pages
from storage_backends.errors import CorruptCacheError
from storage_backends.lmdb_backend import LmdbBackend

PAGE = 4096


def _exit_code(target: Any, *args: Any) -> int | None:
    """Run ``target(*args)`` in a fork child (a fresh set of LMDB environments); its exit code."""
    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(120)
    return child.exitcode


def _values(seed: int, n: int) -> dict[bytes, bytes]:
    rng = random.Random(seed)
    sizes = [0, 1, 100, 2000, 4000, 5000, 65536, 300_000, 1 << 20]
    return {
        f"k{i:04d}-{rng.random():.6f}".encode(): rng.randbytes(rng.choice(sizes)) for i in range(n)
    }


def _env(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), map_size=1 << 30, subdir=True)


def _located(path: Path) -> tuple[dict[bytes, lmdb_pages.Located] | None, int]:
    with _env(path) as env, env.begin() as txn:
        txnid = int(txn.id())
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        return lmdb_pages.locate_values(fd, txnid), txnid
    finally:
        os.close(fd)


def _file_bytes(path: Path, spot: lmdb_pages.Located) -> bytes:
    with open(path / "data.mdb", "rb") as f:
        f.seek(spot.offset)
        return f.read(spot.size)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_value_is_found_exactly_after_puts_overwrites_and_deletes(
    tmp_path: Path, seed: int
) -> None:
    values = _values(seed, 120)
    with _env(tmp_path) as env:
        keys = list(values)
        for start in range(0, len(keys), 17):  # many commits: both meta pages in use
            with env.begin(write=True) as txn:
                for key in keys[start : start + 17]:
                    txn.put(key, values[key])
        rng = random.Random(seed)
        with env.begin(write=True) as txn:
            for key in rng.sample(keys, 20):
                del values[key]
                txn.delete(key)
            for key in rng.sample(sorted(values), 20):
                values[key] = rng.randbytes(rng.choice([10, 70_000]))
                txn.put(key, values[key])
    found, _ = _located(tmp_path)
    assert found is not None
    # Every value, at the bytes LMDB stores: small ones inside leaf pages, large
    # ones on overflow pages.
    assert set(found) == set(values)
    for key, spot in found.items():
        assert spot.size == len(values[key])
        assert _file_bytes(tmp_path, spot) == values[key]
        assert (spot.pgno == 0) == (len(values[key]) <= 2000)


def test_an_empty_environment_has_nothing_to_locate(tmp_path: Path) -> None:
    with _env(tmp_path) as env, env.begin(write=True):
        pass
    found, _ = _located(tmp_path)
    assert found == {}


def test_another_transaction_or_a_foreign_file_is_not_located(tmp_path: Path) -> None:
    with _env(tmp_path) as env, env.begin(write=True) as txn:
        txn.put(b"a", b"x" * 10_000)
    found, txnid = _located(tmp_path)
    assert found is not None and set(found) == {b"a"}
    fd = os.open(tmp_path / "data.mdb", os.O_RDONLY)
    try:
        assert lmdb_pages.locate_values(fd, txnid + 7) is None  # no meta page of it
    finally:
        os.close(fd)
    other = tmp_path / "other"
    other.write_bytes(os.urandom(3 * PAGE))
    fd = os.open(other, os.O_RDONLY)
    try:
        assert lmdb_pages.locate_values(fd, txnid) is None
    finally:
        os.close(fd)


def test_flipped_tree_pages_never_locate_outside_the_data_pages(tmp_path: Path) -> None:
    """Damage anywhere in the first pages: ``None``, or spots past the meta pages.

    (A spot past the end of the file is kept: the backend reports it as damage.)
    """
    values = _values(5, 60)
    with _env(tmp_path) as env, env.begin(write=True) as txn:
        for key, value in values.items():
            txn.put(key, value)
    with _env(tmp_path) as env, env.begin() as txn:
        txnid = int(txn.id())
    data = tmp_path / "data.mdb"
    clean = data.read_bytes()
    rng = random.Random(11)
    outcomes = {"none": 0, "found": 0}
    for _ in range(300):
        damaged = bytearray(clean)
        at = rng.randrange(min(len(clean), 8 * PAGE))
        damaged[at] ^= 1 << rng.randrange(8)
        data.write_bytes(bytes(damaged))
        fd = os.open(data, os.O_RDONLY)
        try:
            found = lmdb_pages.locate_values(fd, txnid)
        finally:
            os.close(fd)
        if found is None:
            outcomes["none"] += 1
            continue
        outcomes["found"] += 1
        for spot in found.values():
            assert spot.offset >= 2 * PAGE + 16 and spot.size < 1 << 32
    assert outcomes["found"] and outcomes["none"]  # both branches were exercised


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            libc = ctypes.CDLL(None, use_errno=True)
            address = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
            assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0
            return sum(v & 1 for v in vec)
        finally:
            del address
            mapped.close()
    finally:
        os.close(fd)


def _drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _build_16k(root: str) -> None:
    spec = yogastore.ComponentSpec(shape=(16384,), dtype="uint8")
    store = yogastore.Store(root, chunk_bytes=4 << 20)
    store.cache(
        "d", "1", lambda: (np.full(16384, i % 251, np.uint8) for i in range(1024)), spec=spec
    )


def _cold_16k_store(root: Path) -> Path:
    """Build the 16 KiB store, drop its data file from the page cache; the file's path.

    Built in a child process: pages mapped by a live process stay cached.
    """
    assert _exit_code(_build_16k, str(root)) == 0
    data = root / "d" / "1" / "data.mdb"
    _drop_cached(data)
    if _resident_pages(data) > 64:
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED")
    return data


def test_reading_one_record_pages_in_that_record_not_its_chunk(tmp_path: Path) -> None:
    """A 4 MiB chunk of 16 KiB records: one record read pages in a few pages, not 1,024."""
    data = _cold_16k_store(tmp_path)
    # Record 300 alone, through a fresh store (no views of the build left).
    source = yogastore.Store(tmp_path).open("d", "1").make_source()
    try:
        (column,) = source.gather(np.array([300], dtype=np.int64))
        assert column.record(0).tolist() == [300 % 251] * 16384
    finally:
        source.close()
    resident = _resident_pages(data)
    # Its index, its 16 KiB record (5 pages when unaligned), the tree and meta pages.
    assert resident < 64, f"{resident} pages of a {data.stat().st_size // PAGE}-page file"


def test_the_read_path_serves_located_bytes_and_survives_a_damaged_tree(tmp_path: Path) -> None:
    """Store reads through located values are exact; a flipped tree page is caught, not read."""
    backend = LmdbBackend(str(tmp_path))
    values = {f"v/{i}": os.urandom(50_000 + i) for i in range(10)}
    for key, value in values.items():
        backend.put(key, value)
    for key, value in values.items():
        assert bytes(backend.get(key)) == value
    backend.close()
    data = tmp_path / "v" / "data.mdb"
    raw = bytearray(data.read_bytes())
    for page in range(2, len(raw) // PAGE):
        flags = int.from_bytes(raw[page * PAGE + 10 : page * PAGE + 12], "little")
        if flags & 0x02:  # the leaf page holding the keys
            raw[page * PAGE + PAGE - 40] ^= 0xFF
            break
    else:
        pytest.fail("no leaf page found")
    data.write_bytes(bytes(raw))
    backend = LmdbBackend(str(tmp_path))
    try:
        with pytest.raises(CorruptCacheError, match="damaged"):
            for key, value in values.items():
                assert bytes(backend.get(key)) == value
    finally:
        backend.close()


def test_announced_ranges_are_read_ahead_and_nothing_else(tmp_path: Path) -> None:
    data = _cold_16k_store(tmp_path)
    backend = LmdbBackend(str(tmp_path))
    try:
        key = next(k for k in backend.list("d/1/") if "/c-" in k)
        before = _resident_pages(data)
        backend.will_read(key, (1 << 20,), (2 << 20,))  # before any read: ignored
        backend.will_read("d/1/no-such-key", (0,), (4096,))
        backend.will_read(key, (5,), (3,))  # empty and reversed ranges: ignored
        assert _resident_pages(data) <= before + 8
        view = backend.get(key)  # maps the value; touches none of it
        backend.will_read(key, (1 << 20,), (2 << 20,))
        deadline = time.monotonic() + 10
        while _resident_pages(data) < before + 256 and time.monotonic() < deadline:
            time.sleep(0.05)
        resident = _resident_pages(data)
        assert before + 256 <= resident <= before + 256 + 16  # that MiB, read ahead
        del view
    finally:
        backend.close()


def test_announced_spans_merge_consecutive_blocks_per_chunk() -> None:
    from yogastore.read.verified import _announce

    base, size = 100, 4096
    total = base + 9 * size + 10  # the last block is short
    owners = np.array([3, 3, 3, 3, 5, 5, 5, 5, 8], dtype=np.int64)
    numbers = np.array([0, 1, 2, 5, 6, 7, 8, 9, 4])
    lo = base + numbers * size
    hi = np.minimum(lo + size, total)
    heard: dict[int, tuple[list[int], list[int]]] = {}
    data = {8: memoryview(bytes(1234))}
    runs = np.array([3, 5, 8], dtype=np.int64)
    _announce(lambda c, spans: heard.setdefault(c, spans()), owners, lo, hi, runs, {2}, data)
    assert heard[3] == ([base, base + 5 * size], [base + 3 * size, base + 6 * size])
    # Chunk 5's block 6 starts where chunk 3's block 5 ends: not merged across chunks.
    assert heard[5] == ([base + 6 * size], [total])  # its last block is short
    assert heard[8] == ([0], [1234])  # announced whole


def _open_cut_store(root: str, what: str) -> None:
    """Child: open (and list, and read) a store whose file lost its last page."""
    try:
        if what == "list":
            assert [d.dataset_id for d in yogastore.Store(root).list()] == []
            os._exit(0)
        ref = yogastore.Store(root).open("d", "1")
        for _ in ref.stream(shuffle=False).batches(64):
            pass
    except CorruptCacheError as err:
        os._exit(3 if "past the end" in str(err) and "data.mdb" in str(err) else 4)
    except BaseException:
        os._exit(5)
    os._exit(0)


@pytest.mark.parametrize("what", ["open", "list"])
def test_a_file_missing_its_last_pages_is_damage_not_a_crash(tmp_path: Path, what: str) -> None:
    """The manifest on the last overflow pages, the file cut short: an error naming it."""
    spec = yogastore.ComponentSpec(shape=(4096,), dtype="uint8")
    store = yogastore.Store(tmp_path, chunk_bytes=16 << 10)
    ref = store.cache(
        "d", "1", lambda: (np.full(4096, i % 7, np.uint8) for i in range(1200)), spec=spec
    )
    assert ref.num_records == 1200
    data = tmp_path / "d" / "1" / "data.mdb"
    os.truncate(data, data.stat().st_size - PAGE)
    exitcode = _exit_code(_open_cut_store, str(tmp_path), what)
    # 3: CorruptCacheError naming the file; -7 would be SIGBUS.
    assert exitcode == (0 if what == "list" else 3)


def _read_counting_checks(root: str) -> None:
    """Child: read every record, exit 10 + the number of whole-file checks (20+, 30+: errors)."""
    calls: list[str] = []
    real = lmdb.verify.verify

    def counting(path: str, subdir: bool | None = None) -> list[str]:
        calls.append(path)
        result: list[str] = real(path, subdir=subdir)
        return result

    lmdb.verify.verify = counting
    try:
        ref = yogastore.Store(root).open("d", "1")
        got = [int(b[j, 0]) for b in ref.stream(shuffle=False).batches(64) for j in range(len(b))]
    except CorruptCacheError as err:  # 20+: the file is damaged; 30+: bytes fail checksums
        os._exit((20 if "damaged" in str(err) else 30) + len(calls))
    except BaseException:
        os._exit(6)
    os._exit(10 + len(calls) if got == [i % 13 for i in range(300)] else 7)


def _in_child(root: Path) -> int | None:
    return _exit_code(_read_counting_checks, str(root))


def _damage_leaf_pages(data: Path) -> None:
    """Change the page number every leaf page holds (in its header) in a file."""
    raw = bytearray(data.read_bytes())
    leaves = [
        page
        for page in range(2, len(raw) // PAGE)
        if int.from_bytes(raw[page * PAGE : page * PAGE + 8], "little") == page  # a header
        and int.from_bytes(raw[page * PAGE + 10 : page * PAGE + 12], "little") & 0x02
    ]
    assert leaves
    for page in leaves:
        raw[page * PAGE] ^= 0x01
    data.write_bytes(bytes(raw))


def _build_small(root: Path) -> None:
    spec = yogastore.ComponentSpec(shape=(1000,), dtype="uint8")
    records = (np.full(1000, i % 13, np.uint8) for i in range(300))
    yogastore.Store(root, chunk_bytes=64 << 10).cache("d", "1", lambda: records, spec=spec)


def test_reading_a_sound_file_never_walks_it_whole(tmp_path: Path) -> None:
    """``lmdb.verify`` visits every page; reads of a file the tree reader knows skip it."""
    _build_small(tmp_path)
    assert _in_child(tmp_path) == 10  # every record exact, no whole-file check
    # A file whose tree the reader declines (the leaf pages' page numbers changed)
    # is checked whole before LMDB may walk it, and the damage is reported.
    _damage_leaf_pages(tmp_path / "d" / "1" / "data.mdb")
    assert _in_child(tmp_path) == 21  # one whole-file check, then CorruptCacheError


@pytest.mark.parametrize(
    ("where", "expected"), [("2**63", 20), ("2**64-1", 20), ("inside", 20), ("other", 30)]
)
def test_an_overflow_page_number_out_of_range_is_damage(
    tmp_path: Path, where: str, expected: int
) -> None:
    """A leaf pointing a chunk past the end, inside its own pages, or at another chunk."""
    assert _exit_code(_build_small, tmp_path) == 0
    found, _ = _located(tmp_path / "d" / "1")
    assert found is not None
    chunks = [(k, s) for k, s in sorted(found.items()) if k.startswith(b"c-")]
    key, spot = chunks[0]
    pgno = {
        "2**63": 1 << 63,
        "2**64-1": (1 << 64) - 1,
        "inside": spot.pgno + 1,  # no page header there
        "other": chunks[1][1].pgno,  # a sound overflow page, of another chunk
    }[where]
    data = tmp_path / "d" / "1" / "data.mdb"
    raw = bytearray(data.read_bytes())
    node = key + spot.pgno.to_bytes(8, "little")
    assert node in raw  # in the live leaf page (and in older copies of it)
    data.write_bytes(bytes(raw).replace(node, key + pgno.to_bytes(8, "little")))
    # CorruptCacheError naming the file (or the chunk's index checksum), no LMDB walk.
    assert _in_child(tmp_path) == expected


def _list_in_child(root: str) -> None:
    try:
        versions = yogastore.Store(root).list()
        yogastore.Store(root).delete("d", "1")
    except BaseException:
        os._exit(5)
    os._exit(3 if versions == [] else 4)


def test_a_key_that_is_not_utf8_is_damage_listing_skips_and_delete_removes(
    tmp_path: Path,
) -> None:
    assert _exit_code(_build_small, tmp_path) == 0
    found, _ = _located(tmp_path / "d" / "1")
    assert found is not None
    key = sorted(k for k in found if k.startswith(b"c-"))[1]
    data = tmp_path / "d" / "1" / "data.mdb"
    data.write_bytes(data.read_bytes().replace(key, key[:-1] + b"\xff"))
    exitcode = _exit_code(_list_in_child, str(tmp_path))
    assert exitcode == 3  # skipped by list (a warning names the file), then deleted
    assert not (tmp_path / "d" / "1").exists()


def _write_in_child(root: str) -> None:
    try:
        LmdbBackend(root).put("d/1/extra", b"x" * 100)
    except CorruptCacheError as err:
        os._exit(3 if "damaged" in str(err) else 4)
    except BaseException:
        os._exit(5)
    os._exit(0)


def test_the_first_write_into_a_damaged_file_checks_it_first(tmp_path: Path) -> None:
    """Writes let LMDB walk the tree (reads do not): a damaged tree is refused, not walked."""
    _build_small(tmp_path)
    _damage_leaf_pages(tmp_path / "d" / "1" / "data.mdb")
    exitcode = _exit_code(_write_in_child, str(tmp_path))
    assert exitcode == 3
