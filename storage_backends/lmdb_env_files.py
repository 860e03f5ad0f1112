"""File-level rules for an LMDB environment directory, kept apart from LMDB itself.

* A version directory must be a directory and its ``data.mdb`` a regular file:
  handing a FIFO or a device to LMDB (or to the verifier, which reads the
  file) would block forever or map something else entirely, so such a file is
  ``CorruptCacheError`` before anything opens it.
* Removing a directory is retried while a reader in another process, which
  opened the environment just before its deletion, creates a lock (or empty
  data) file in it: a delete never stops half-way for that.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time
from pathlib import Path

from storage_backends.errors import CorruptCacheError, StorageError

__all__ = ["DATA_FILE", "check_files", "not_regular_error", "open_data_file", "remove_tree"]

logger = logging.getLogger(__name__)

DATA_FILE = "data.mdb"
_REMOVE_ATTEMPTS = 40

_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def not_regular_error(path: Path, mode: int, want: str) -> CorruptCacheError:
    """Return the error for a file of the wrong kind (``mode`` from ``stat``)."""
    kind = _KINDS.get(stat.S_IFMT(mode), "a special file")
    return CorruptCacheError(
        f"{path} should be {want} but is {kind}; delete this dataset version "
        "(`yogastore delete ID VERSION`) and build it again"
    )


def check_files(path: Path) -> int:
    """Return the data file's size (0 if absent) after checking both are what LMDB needs.

    Opening a FIFO or a device as LMDB's file would block or map something
    else entirely: refuse it before LMDB (or the verifier) touches it.

    Raises:
        CorruptCacheError: ``path`` is not a directory or its data file is
            not a regular file.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    if not stat.S_ISDIR(st.st_mode):
        raise not_regular_error(path, st.st_mode, "an LMDB environment directory")
    data = path / DATA_FILE
    try:
        st = os.stat(data)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(st.st_mode):
        raise not_regular_error(data, st.st_mode, "a regular file")
    return st.st_size


def open_data_file(path: Path) -> int:
    """Open the data file LMDB just mapped, for ``fstat``; never blocks."""
    data = path / DATA_FILE
    fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_regular_error(data, mode, "a regular file")
    return fd


def remove_tree(base: Path) -> None:
    """Remove ``base`` (a directory or a stray file) whole.

    A reader in another process that opened the environment just before it
    was deleted may create a lock (or empty data) file in it while the tree
    is being removed; the removal is then simply done again.
    """
    delay = 0.005
    for attempt in range(_REMOVE_ATTEMPTS):
        try:
            if base.is_dir() and not base.is_symlink():
                shutil.rmtree(base)
            else:
                base.unlink()
            return
        except FileNotFoundError:
            if not os.path.lexists(base):
                return
            err: OSError | None = None
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == _REMOVE_ATTEMPTS - 1:
                raise StorageError(exc.errno, f"cannot delete {base}: {exc}") from exc
            err = exc
        logger.debug("retrying the removal of %s: %s", base, err)
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
