"""Housekeeping of a store: which versions are yogastore's own, and garbage collection.

Only what a build writes counts as a dataset version: ``<id>/<version>/``
holding nothing but ``manifest.json``, chunks ``c-<build id>-<n>`` (or
``c-<build id>-r<rank>-<n>``) and the intents and parts of a parallel first
pass (``yogastore.build.parallel``), under names ``validate_name`` accepts.
Anything else under a store's root (another program's LMDB files, a folder
with files of its own) is never listed, collected nor deleted: pointing
``--store`` at a directory that holds other data must not lose that data.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import TYPE_CHECKING

from storage_backends import Backend
from storage_backends.errors import (
    CorruptCacheError,
    InvalidArgumentError,
    LockTimeoutError,
    StorageError,
)
from yogastore.build.parallel import held_rank_locks, intent_ranks
from yogastore.format.manifest import MANIFEST, validate_name

if TYPE_CHECKING:
    from yogastore.store import GcEntry, Store

__all__ = ["check_own", "collect_garbage", "is_own_key", "own_versions"]

logger = logging.getLogger(__name__)

# What builds write in a version besides its manifest: chunks c-<build id>-<n>
# (c-<build id>-r<rank>-<n> in a parallel first pass), and a parallel first
# pass's intent-n<ranks>-<attempt digest>.json and part-<build id>-r<rank>.json.
_OWN_NAME = re.compile(
    r"c-[0-9A-Za-z_-]+-[0-9]+|intent-n[0-9]+-[0-9a-f]{16}\.json|part-[0-9A-Za-z_-]+-r[0-9]+\.json"
)


def _is_own_name(name: str) -> bool:
    return name == MANIFEST or _OWN_NAME.fullmatch(name) is not None


def is_own_key(prefix: str, key: str) -> bool:
    """Return whether ``key`` is a manifest or chunk directly under ``prefix``."""
    rest = key[len(prefix) :]
    return key.startswith(prefix) and "/" not in rest and _is_own_name(rest)


def _valid_names(dataset_id: str, version: str) -> bool:
    try:
        validate_name(dataset_id, "dataset id")
        validate_name(version, "version")
    except InvalidArgumentError:
        return False
    return True


def own_versions(backend: Backend, url: str) -> list[tuple[str, str]]:
    """Return the sorted (id, version) pairs whose keys are all yogastore's own."""
    found: set[tuple[str, str]] = set()
    foreign: set[tuple[str, str]] = set()
    for key in backend.list(""):
        parts = key.split("/")
        if len(parts) < 3:
            continue
        pair = (parts[0], parts[1])
        if len(parts) == 3 and _is_own_name(parts[2]) and _valid_names(*pair):
            found.add(pair)
        else:
            foreign.add(pair)
    for dataset_id, version in sorted(found & foreign):
        logger.warning(
            "ignoring %s/%s in %s: it holds keys yogastore did not write", dataset_id, version, url
        )
    return sorted(found - foreign)


def check_own(keys: list[str], prefix: str, url: str) -> None:
    """Refuse to delete a place that holds keys yogastore did not write.

    Raises:
        InvalidArgumentError: one of ``keys`` is not a manifest or chunk.
    """
    foreign = [key for key in keys if not is_own_key(prefix, key)]
    if foreign:
        raise InvalidArgumentError(
            f"{prefix} in {url} holds keys yogastore did not write (such as "
            f"{foreign[0]!r}); it is not a dataset version, so nothing was deleted"
        )


def collect_garbage(store: Store) -> list[GcEntry]:
    """Remove what dead builds left in every version (``Store.gc``)."""
    removed = []
    for dataset_id, version in store.versions():
        name = f"{dataset_id}/{version}"
        if not store.backend.coordinated and store.building(dataset_id, version):
            # Locks are not exclusive on this store (single-writer): taking one would
            # succeed beside the builder's. Look before taking it.
            logger.info("gc: %s is being built; left alone", name)
            continue
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(store.backend.lock(name, timeout=0))
            except LockTimeoutError:
                logger.info("gc: %s is being built; left alone", name)
                continue
            except StorageError as err:
                if store.remote:
                    raise
                # A damaged lock file: one version must not stop the others.
                logger.warning("gc: leaving %s alone: %s", name, err)
                continue
            entry = _collect(store, dataset_id, version)
            if entry is not None:
                removed.append(entry)
    return removed


def _collect(store: Store, dataset_id: str, version: str) -> GcEntry | None:
    """Remove one version's leftovers (its lock held)."""
    from yogastore.store import GcEntry

    name = f"{dataset_id}/{version}"
    prefix = name + "/"
    backend = store.backend
    try:
        manifest = store._read_manifest(dataset_id, version)
    except CorruptCacheError as err:
        logger.warning("gc: leaving %s alone: %s", name, err)
        return None
    keys = backend.list(prefix)
    if not keys or not all(is_own_key(prefix, key) for key in keys):
        return None  # changed since listed: gone, damaged or not ours
    if manifest is None:
        try:
            # The ranks of a parallel build hold their locks while it runs.
            ranks = held_rank_locks(backend, dataset_id, version, intent_ranks(keys, prefix), 0)
            with ranks:
                freed = backend.disk_usage(prefix)
                backend.delete_prefix(prefix)
                backend.delete_lock(name)
        except LockTimeoutError:
            logger.info("gc: %s is being built in parallel; left alone", name)
            return None
        return GcEntry(dataset_id, version, len(keys), freed, False)
    keep = manifest.keys()
    stale = [key for key in keys if key not in keep]
    freed = sum(backend.size(key) for key in stale)
    for key in stale:
        backend.delete(key)
    return GcEntry(dataset_id, version, len(stale), freed, True) if stale else None
