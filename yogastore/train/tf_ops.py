"""The read bridge's TensorFlow kernel: strings made from one buffer plus offsets.

``yogastore/_tfops.cc`` defines ``YogastoreGatherBytes``: string ``i`` of a
batch is ``values[starts[i]:starts[i] + lengths[i]]``, each bounds-checked and
copied once, in a ``tf.data`` thread. With it a batch of strings crosses from
Python to ``tf.data`` as three arrays (no Python object per string): from a
local store ``values`` is a read-only view of the mapped chunks, wrapped by
TensorFlow without a copy, so each string is copied once, from the page cache
into its tensor, beside the reading thread instead of on it. Without the
kernel ``to_tf_dataset`` hands strings over as numpy object arrays, with the
same results.

``YogastoreJoinBytes`` goes the other way for a cache build: a batch of
strings becomes their bytes one after another plus their lengths, copied once
in a ``tf.data`` thread, so the first pass takes the batch as two arrays.

The kernel is compiled against the installed TensorFlow's headers (a C++
compiler is needed; ``make demo`` and ``make test`` build it)::

    python -m yogastore.train.tf_ops

It is written next to this package as ``_tfops-<TensorFlow version>-<source
hash>.so``, so a library built for another TensorFlow or another source is
never loaded. ``YOGASTORE_TF_OPS=0`` (or ``false``, ``off``, ``no``) switches the kernel off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import tensorflow as tf

__all__ = ["build", "gather_bytes", "join_bytes", "library_path", "load"]

_SOURCE = Path(__file__).resolve().parent.parent / "_tfops.cc"
_lock = threading.Lock()
_loaded: dict[str, Any] = {}
_warned: list[str] = []
logger = logging.getLogger(__name__)


def library_path() -> Path:
    """Return where the kernel for this TensorFlow and this source lives (built or not)."""
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    return _SOURCE.with_name(f"_tfops-{tf.__version__}-{digest}.so")


def build(verbose: bool = False) -> Path:
    """Compile the kernel for the installed TensorFlow; return the library's path.

    The library is written to a temporary file and renamed into place, so
    processes building at once never load a partial file.

    Raises:
        RuntimeError: no compiler, or compiling failed (its output is in the message).
    """
    target = library_path()
    if target.exists():
        return target
    compiler = os.environ.get("CXX", "g++")
    flags = [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    fd, tmp = tempfile.mkstemp(prefix=".tfops-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-w", str(_SOURCE), "-o", tmp, *flags]
    if verbose:
        print(shlex.join(cmd), file=sys.stderr)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as err:
        os.unlink(tmp)
        raise RuntimeError(f"cannot run the C++ compiler {compiler!r}: {err}") from err
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(
            f"compiling {_SOURCE.name} failed ({shlex.join(cmd)}):\n{done.stderr[-4000:]}"
        )
    os.replace(tmp, target)
    for old in target.parent.glob("_tfops-*.so"):  # builds of other sources or TensorFlows
        if old != target:
            old.unlink(missing_ok=True)
    return target


def load(warn_missing: bool = False) -> Any | None:
    """Return the loaded kernel module, or ``None`` when it is not built or switched off.

    With ``warn_missing``, a kernel that is not built is logged once per process.
    """
    if os.environ.get("YOGASTORE_TF_OPS", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    path = library_path()
    key = str(path)
    with _lock:
        if key not in _loaded:
            try:
                _loaded[key] = tf.load_op_library(key) if path.exists() else None
            except (tf.errors.OpError, OSError) as err:  # a damaged file: build it again
                logger.warning("yogastore: cannot load %s (%s); rebuild it", path, err)
                _loaded[key] = None
        if _loaded[key] is None and warn_missing and not _warned:
            _warned.append(key)
            logger.warning(
                "yogastore: strings cross to tf.data as Python objects (slower): the TensorFlow "
                "kernel is not built; run python -m yogastore.train.tf_ops "
                "(YOGASTORE_TF_OPS=0 silences this)"
            )
        return _loaded[key]


def gather_bytes(
    values: Any, starts: Any, lengths: Any, file: Any = b"", file_guard: Any = (0, 0, 0)
) -> tf.Tensor:
    """Return ``values[starts[i]:starts[i] + lengths[i]]`` as a string tensor.

    When ``values`` maps a file, ``file`` names it and ``file_guard`` holds its
    device, inode and the size it must still have (``Backend.mapped_file``): a
    file truncated since fails the kernel instead of killing the process.

    Raises:
        RuntimeError: the kernel is not built or switched off.
        tf.errors.InvalidArgumentError: a range reaches outside ``values``.
        tf.errors.DataLossError: ``file`` shrank below its guarded size.
    """
    guard = tf.cast(file_guard, tf.int64)
    return _ops().yogastore_gather_bytes(values, starts, lengths, file, guard)


def join_bytes(strings: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """Return the bytes of ``strings`` (row-major) one after another, and their lengths.

    Raises:
        RuntimeError: the kernel is not built or switched off.
    """
    values, lengths = _ops().yogastore_join_bytes(strings)
    return values, lengths


def _ops() -> Any:
    """The loaded kernel module; ``RuntimeError`` when it is not built or switched off."""
    ops = load()
    if ops is None:
        raise RuntimeError(
            "the yogastore TensorFlow kernel is not built: run python -m yogastore.train.tf_ops"
        )
    return ops


if __name__ == "__main__":
    print(build(verbose="-v" in sys.argv[1:]))
