"""Where LMDB keeps each value in its data file, found without LMDB.

Two costs of reading through LMDB that grow with the file, not with what is
read, are avoided this way:

* py-lmdb touches every page of a value it returns (it pre-faults the value so
  that the GIL is not held across page faults): for a 4 MiB chunk of which a
  reader wants one 16 KiB record, the whole chunk is read from disk.
* LMDB trusts the file's structure, so a damaged page could crash it; the
  backend therefore checks the whole file (``lmdb.verify``, which visits every
  page: seconds per gigabyte-sized file, per process) before LMDB may walk it.

This module reads the committed B-tree of the main database itself (its
branch and leaf pages only, with ``pread``: a few pages per thousand keys,
whatever the size of the values) with bounds checks on every field it uses,
and returns for each key the byte offset and length of its value in the file.
The reader maps the file and touches only the pages it reads, and LMDB never
walks the tree, so nothing needs the whole-file check.

It reads LMDB 0.9's 64-bit on-disk layout (data version 1, 16-byte page
headers), the layout py-lmdb writes. Anything else, or anything that does not
look exactly as that layout requires (a page that does not hold its own page
number, a node outside its page, a depth or page count beyond the meta
page's, a cycle), answers ``None``: the caller then checks the file and reads
through LMDB. A value running past the end of the file is located all the
same, so that the caller reports the damage. This walk is a reader, not a
verifier: bytes of the values it locates are checked against the build's
checksums (chunk indexes and data blocks) before use, as before.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["Located", "Mapping", "locate_values", "overflow_header_ok"]

_MAGIC = 0xBEEFC0DE
_VERSION = 1  # LMDB 0.9's data version
_PAGEHDRSZ = 16
_NODESIZE = 8
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_MDB_DUPSORT = 0x04
_P_INVALID = (1 << 64) - 1
_MAX_DEPTH = 32  # LMDB's cursor stack
_MAX_TREE_PAGES = 1 << 20  # branch + leaf pages walked at most (4 GiB of tree)

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_NODE = struct.Struct("<HHHH")


@dataclass(frozen=True)
class Located:
    """Where one value lives: ``[offset, offset + size)`` of the data file."""

    offset: int
    size: int
    pgno: int  # its first overflow page, whose header is checked before use; 0: in a leaf
    psize: int


@dataclass(frozen=True)
class _Meta:
    psize: int
    txnid: int
    flags: int
    depth: int
    pages: int  # branch + leaf pages of the main database
    root: int


def _read(fd: int, offset: int, n: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise _Unexpected
    return data


class _Unexpected(Exception):
    """The file does not look the way this reader expects: read through LMDB instead."""


def _meta(fd: int, offset: int) -> _Meta:
    page = _read(fd, offset, _PAGEHDRSZ + 152)
    flags = _U16.unpack_from(page, 10)[0]
    magic, version = _U32.unpack_from(page, 16)[0], _U32.unpack_from(page, 20)[0]
    if not flags & _P_META or magic != _MAGIC or version != _VERSION:
        raise _Unexpected
    free, main = _PAGEHDRSZ + 24, _PAGEHDRSZ + 24 + 48
    return _Meta(
        psize=_U32.unpack_from(page, free)[0],  # the free DB's md_pad holds the page size
        txnid=_U64.unpack_from(page, main + 48 + 8)[0],
        flags=_U16.unpack_from(page, main + 4)[0],
        depth=_U16.unpack_from(page, main + 6)[0],
        pages=_U64.unpack_from(page, main + 8)[0] + _U64.unpack_from(page, main + 16)[0],
        root=_U64.unpack_from(page, main + 40)[0],
    )


def _committed(fd: int, txnid: int) -> _Meta:
    """The meta page of transaction ``txnid`` (either of the two), or raise."""
    first = _meta(fd, 0)
    psize = first.psize
    if psize < 512 or psize > 0x8000 or psize & (psize - 1):
        raise _Unexpected
    for meta in (first, _meta(fd, psize)):
        if meta.txnid == txnid and meta.psize == psize:
            return meta
    raise _Unexpected  # a newer commit rewrote the snapshot's meta page


def locate_values(fd: int, txnid: int) -> dict[bytes, Located] | None:
    """Map each key of the main database to where its value is in the file.

    Args:
        fd: an open descriptor of the environment's data file.
        txnid: the committed transaction whose tree to read (a read
            transaction of it is open, so its pages are not reused).

    Returns:
        The located values, or ``None`` when the file is not in the layout
        this reader knows or anything about it is unexpected.
    """
    try:
        return _walk(fd, txnid)
    except (_Unexpected, struct.error, OSError, OverflowError):
        return None


def _walk(fd: int, txnid: int) -> dict[bytes, Located]:
    meta = _committed(fd, txnid)
    if meta.flags & _MDB_DUPSORT or meta.depth > _MAX_DEPTH or meta.pages > _MAX_TREE_PAGES:
        raise _Unexpected
    found: dict[bytes, Located] = {}
    if meta.root == _P_INVALID:  # an empty database
        return found
    psize, file_size = meta.psize, os.fstat(fd).st_size  # tree pages must lie inside
    stack = [(meta.root, 1)]
    walked = 0
    while stack:
        pgno, depth = stack.pop()
        walked += 1
        if depth > meta.depth or walked > meta.pages or (pgno + 1) * psize > file_size:
            raise _Unexpected
        page = _read(fd, pgno * psize, psize)
        flags = _U16.unpack_from(page, 10)[0]
        lower = _U16.unpack_from(page, 12)[0]
        if _U64.unpack_from(page, 0)[0] != pgno or lower < _PAGEHDRSZ or lower > psize:
            raise _Unexpected
        kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META | _P_LEAF2)
        if kind not in (_P_BRANCH, _P_LEAF):
            raise _Unexpected
        for i in range((lower - _PAGEHDRSZ) // 2):
            node = _U16.unpack_from(page, _PAGEHDRSZ + 2 * i)[0]
            if node < lower or node + _NODESIZE > psize:
                raise _Unexpected
            lo, hi, nflags, ksize = _NODE.unpack_from(page, node)
            if node + _NODESIZE + ksize > psize:
                raise _Unexpected
            if kind == _P_BRANCH:
                stack.append((lo | hi << 16 | nflags << 32, depth + 1))
                continue
            if nflags & (_F_SUBDATA | _F_DUPDATA):
                continue  # a named database or duplicates: not this store's layout
            key = page[node + _NODESIZE : node + _NODESIZE + ksize]
            size = lo | hi << 16
            if not nflags & _F_BIGDATA:  # a small value, inside the leaf page
                at = node + _NODESIZE + ksize
                if at + size > psize:
                    raise _Unexpected
                found[key] = Located(pgno * psize + at, size, 0, psize)
                continue
            first = _U64.unpack_from(page, node + _NODESIZE + ksize)[0]
            offset = first * psize + _PAGEHDRSZ
            if first < 2:
                raise _Unexpected
            # A value running past the end of the file is kept: the reader names the
            # damage (LMDB would read the missing pages and die of SIGBUS).
            found[key] = Located(offset, size, first, psize)
    return found


def overflow_header_ok(fd: int, spot: Located) -> bool:
    """Whether ``spot``'s first page is an overflow page of itself, long enough for it."""
    if spot.pgno == 0:
        return True  # in a leaf page the walk read
    try:
        head = _read(fd, spot.offset - _PAGEHDRSZ, _PAGEHDRSZ)
    except (_Unexpected, OSError, OverflowError):
        return False
    pgno: int = _U64.unpack_from(head, 0)[0]
    flags: int = _U16.unpack_from(head, 10)[0]
    pages: int = _U32.unpack_from(head, 12)[0]
    return (
        pgno == spot.pgno
        and flags & _P_OVERFLOW != 0
        and pages * spot.psize >= spot.size + _PAGEHDRSZ
    )


_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writing dirty pages, do not wait


def start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk, without waiting (Linux; else nothing).

    A build writing gigabytes then overlaps the disk's work with its own
    instead of leaving it all to the final sync, and the page cache holds
    no more than a few writes' worth of dirty pages.
    """
    func = _writeback()
    if func is not None:
        func(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # an error only means no head start


@functools.cache
def _writeback() -> Any:
    func = getattr(_c(), "sync_file_range", None)
    if func is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        func.restype = ctypes.c_int
    return func


class Mapping:
    """A read-only map of a whole file, unmapped when the last reference goes.

    Unlike ``mmap.mmap``, it keeps no duplicate of the descriptor: a process
    holding many versions open does not hold two descriptors for each. Views
    keep it alive by referring to it.
    """

    def __init__(self, fd: int, size: int) -> None:
        libc = _c()
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size:,} bytes failed: {os.strerror(err or errno.EIO)}")
        self.address: int = address
        self.size = size
        # Random access: a fault reads its page, not a window around it.
        libc.madvise(address, size, mmap.MADV_RANDOM)

    def resident(self, offset: int, size: int, samples: int = 8) -> float:
        """The share of ``samples`` pages spread over ``[offset, offset + size)`` in the page cache.

        A sample, not every page: ``mincore`` over a 4 MiB range costs tens of
        microseconds when the pages are not cached.
        """
        if size <= 0 or offset + size > self.size:
            return 0.0
        page = mmap.PAGESIZE
        mincore, vec = _c().mincore, (ctypes.c_ubyte * 1)()
        found = 0
        for i in range(samples):
            at = offset + (size - 1) * i // max(1, samples - 1)
            if mincore(self.address + at - at % page, page, vec) == 0 and vec[0] & 1:
                found += 1
        return found / samples

    def __del__(self) -> None:
        if _libc is not None and getattr(self, "address", None):
            _libc.munmap(self.address, self.size)
