"""Error hierarchy shared by yogastore and its storage backends.

Every error raised on purpose by this project derives from ``YogaStoreError``
and also from the built-in exception a caller would naturally catch, so
``except FileNotFoundError`` keeps working for code that knows nothing of
yogastore.
"""

from __future__ import annotations

import errno

__all__ = [
    "AccessDeniedError",
    "BackendUnavailableError",
    "BuildLimitError",
    "BuildTimeoutError",
    "CoordinationError",
    "CorruptCacheError",
    "DatasetNotFoundError",
    "InvalidArgumentError",
    "KeyExistsError",
    "KeyNotFoundError",
    "LockLostError",
    "LockTimeoutError",
    "RankMismatchError",
    "StaleCacheError",
    "DatasetChangedError",
    "StorageError",
    "UnsupportedElementError",
    "YogaStoreError",
    "coordination_refused",
]


class YogaStoreError(Exception):
    """Root of every error raised by yogastore."""


class InvalidArgumentError(YogaStoreError, ValueError):
    """An argument is out of range or malformed."""


class DatasetNotFoundError(YogaStoreError, FileNotFoundError):
    """No committed dataset exists under the requested id and version."""


class CorruptCacheError(YogaStoreError, ValueError):
    """A manifest or chunk failed validation (checksum, bounds, counts)."""


class UnsupportedElementError(YogaStoreError, TypeError):
    """A dataset element has a component that cannot be stored."""


class StorageError(YogaStoreError, OSError):
    """A storage backend failed to read or write."""


class KeyNotFoundError(StorageError, FileNotFoundError):
    """A backend key does not exist."""


class KeyExistsError(StorageError, FileExistsError):
    """An exclusive write found the key already present."""


class BackendUnavailableError(StorageError):
    """A backend cannot be reached or is not usable (missing bucket, credentials)."""


class AccessDeniedError(BackendUnavailableError, PermissionError):
    """The backend refused access (denied by policy, bad or missing credentials)."""


class LockLostError(StorageError):
    """A write under a lock was refused: this process no longer holds that lock.

    Its lease ran out (renewals failed or the process was paused) or another
    process took the lock over; the work done under the lock must be dropped.
    """


class LockTimeoutError(YogaStoreError, TimeoutError):
    """Waiting for another builder took longer than allowed."""


class BuildTimeoutError(YogaStoreError, TimeoutError):
    """A rank of a parallel first pass waited too long for the parts of the other ranks."""


class StaleCacheError(YogaStoreError, ValueError):
    """A cached version was built from another source (element_spec or fingerprint differ)."""


class DatasetChangedError(YogaStoreError, RuntimeError):
    """A version was deleted or rebuilt by another process after this reference was opened."""


class BuildLimitError(YogaStoreError, ValueError):
    """A build was refused or stopped: infinite source, or a ``max_records``/``max_bytes`` guard."""


class RankMismatchError(YogaStoreError, RuntimeError):
    """Distributed ranks disagree on a setting that must be equal on every rank."""


class CoordinationError(StorageError):
    """The object store does not enforce the conditional writes that coordinate writers.

    Raised before a change that its locks keep safe (a build, ``delete``,
    ``gc``, a copy into it) on such a store, unless the store was opened with
    ``coordination="single-writer"`` (safe only with one writer at a time).
    Reading never raises it.
    """


def coordination_refused(operation: str, where: str, problem: str) -> CoordinationError:
    """Return the error refusing ``operation`` in ``where``, whose conditional writes fail.

    Args:
        operation: what was asked, as a verb phrase (``"build"``, ``"run gc"``).
        where: the store, for the message.
        problem: what the probe of the store's conditional writes found.
    """
    return CoordinationError(
        errno.ENOTSUP,
        f"refusing to {operation} in {where}: the store does not enforce conditional "
        f"writes ({problem}), so its locks cannot keep concurrent writers apart; if no "
        "other process builds, deletes or runs gc there meanwhile, open the store with "
        "coordination='single-writer' (command line: --coordination single-writer)",
    )
