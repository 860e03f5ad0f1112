"""Does this S3-compatible store enforce conditional writes? Asked once per endpoint and bucket.

Build coordination (the lock object, the exclusive manifest commit) rests on
two conditions on PUT: ``If-None-Match: *`` (create only if absent) and
``If-Match: <etag>`` (replace only that version). AWS S3 enforces both; some
stores accept the headers and ignore them, and then concurrent builders all
build, and one may commit a manifest naming chunks another swept away.

The probe writes a fresh key under the store's prefix with ``If-None-Match:
*`` twice (the second must fail with 412) and once with a made-up ``If-Match``
(must fail with 412), then deletes it. The verdict is kept for the process's
life per (endpoint, bucket). Reading never needs it: a read-only look at a
lock (``Backend.lock_held``) does not probe. The probe sees the
store only through ``ConditionalStore``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from typing import Protocol

from storage_backends.conditional import ConditionalStore
from storage_backends.errors import KeyExistsError, StorageError, coordination_refused

__all__ = ["check_conditional_writes", "conditional_writes_verdict", "probe_conditional_writes"]

logger = logging.getLogger(__name__)

PROBE_PREFIX = ".yogastore-probe/"
_VERDICTS: dict[tuple[str, str], str | None] = {}
_LOCK = threading.Lock()


class ProbedStore(ConditionalStore, Protocol):
    """A ``ConditionalStore`` that says which endpoint and bucket it is."""

    @property
    def endpoint_url(self) -> str | None:
        """The S3 API endpoint; ``None`` for AWS."""
        ...

    @property
    def bucket(self) -> str:
        """The bucket."""
        ...


def probe_conditional_writes(backend: ConditionalStore) -> str | None:
    """Run the probe now; return ``None`` if both conditions are enforced, else what failed."""
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    failures = []
    try:
        backend.create_if_absent(key, b"first")
        try:
            backend.create_if_absent(key, b"second")
            failures.append("a second PUT with If-None-Match: * replaced the object")
        except KeyExistsError:
            pass
        try:
            backend.replace_if_match(key, b"third", '"0123456789abcdef0123456789abcdef"')
            failures.append("a PUT with a made-up If-Match replaced the object")
        except KeyExistsError:
            pass
    finally:
        with contextlib.suppress(StorageError):
            backend.delete_if_match(key, None)
    return "; ".join(failures) or None


def conditional_writes_verdict(backend: ProbedStore) -> str | None:
    """Probe once per endpoint and bucket; return ``None`` if enforced, else what failed.

    Raises:
        StorageError: the probe itself failed (it is tried again next time).
    """
    where = (backend.endpoint_url or "aws", backend.bucket)
    with _LOCK:
        known = where in _VERDICTS
        verdict = _VERDICTS.get(where)
    if not known:
        verdict = probe_conditional_writes(backend)
        with _LOCK:
            _VERDICTS[where] = verdict
        if verdict is None:
            logger.debug("%s enforces conditional writes", backend.where)
    return verdict


def check_conditional_writes(backend: ProbedStore, operation: str = "build") -> None:
    """Probe once per endpoint and bucket; raise if conditional writes are not enforced.

    Args:
        backend: the store.
        operation: what is refused, for the message (a verb phrase).

    Raises:
        CoordinationError: the store ignores ``If-None-Match`` or ``If-Match``;
            the message names the endpoint and the single-writer way out.
        StorageError: the probe itself failed (it is tried again next time).
    """
    verdict = conditional_writes_verdict(backend)
    if verdict is not None:
        raise coordination_refused(operation, backend.where, verdict)
