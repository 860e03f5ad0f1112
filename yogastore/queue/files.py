"""Close the local files a work queue run opened, once no one in this process uses them.

A local store keeps one LMDB environment (three file descriptors) per key
directory, and a queue run has one directory per epoch: without closing, a
long job or a process that runs many jobs runs out of descriptors. Each user
of a run in this process (a worker's claims, a ``status`` call) registers
while it runs; the last one to leave closes the run's environments, and a
sole user closes each epoch's as soon as every slice of it is done. A later
access simply opens them again.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["close_if_sole_user", "using"]

_LOCK = threading.Lock()
_USERS: dict[str, int] = {}  # key directory of a run -> its users in this process


def _directory(backend: Any, prefix: str) -> str | None:
    lmdb_backend = sys.modules.get("storage_backends.lmdb_backend")
    if lmdb_backend is None or not isinstance(backend, lmdb_backend.LmdbBackend):
        return None  # an object store opens no files per key
    return str(backend.root / prefix.rstrip("/"))


def _close(backend: Any, directory: str) -> None:
    # A backend rooted at the directory closes only the environments under it
    # (and none that a live buffer still needs).
    type(backend)(directory).close()


@contextlib.contextmanager
def using(backend: Any, run_prefix: str) -> Iterator[None]:
    """Register a user of a run's keys; the last one leaving closes their files."""
    directory = _directory(backend, run_prefix)
    if directory is None:
        yield
        return
    with _LOCK:
        _USERS[directory] = _USERS.get(directory, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            left = _USERS[directory] - 1
            if left:
                _USERS[directory] = left
            else:
                del _USERS[directory]
                _close(backend, directory)


def close_if_sole_user(backend: Any, run_prefix: str, sub: str) -> None:
    """Close the files of ``sub`` (a folder of the run) if one user alone holds the run."""
    directory = _directory(backend, run_prefix)
    if directory is None:
        return
    with _LOCK:
        if _USERS.get(directory) == 1:
            _close(backend, directory + "/" + sub.strip("/"))
