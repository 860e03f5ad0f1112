"""A lock object in S3 with a lease, built on conditional writes only.

* Acquire: create ``<name>.lock`` with ``If-None-Match: *``; read it back
  after ``lock_settle`` seconds and keep it only if it still carries this
  holder's token (so a store whose conditional writes race cannot fool us).
* Hold: a daemon thread rewrites the object every ``lease / 3`` seconds with
  ``If-Match`` on its last ETag. A failed condition means another process took
  the lock over; the backend then refuses this process's writes under
  ``<name>/`` (a fence against a holder that was only paused, not dead).
* Wait: look at the lock's ETag (one HEAD request) with backoff. An ETag
  unchanged for longer than the holder's lease, measured on the waiter's own
  monotonic clock so machine clocks need not agree, or an object older than
  twice the lease by the server's own clock, belongs to a holder that stopped
  renewing: take it over with ``If-Match`` on that ETag, so that of several
  waiters exactly one wins.
* Release: delete with ``If-Match`` on the holder's ETag.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from types import TracebackType
from typing import Any

from storage_backends.errors import (
    KeyExistsError,
    KeyNotFoundError,
    LockTimeoutError,
    StorageError,
)
from storage_backends.s3_backend import ConflictError, S3Backend, retried

__all__ = ["S3Lock"]

logger = logging.getLogger(__name__)

_SUFFIX = ".lock"


def _server_age(head: dict[str, Any]) -> float | None:
    """Seconds since the object was last written, on the server's clock."""
    try:
        date = head["ResponseMetadata"]["HTTPHeaders"]["date"]
        now = email.utils.parsedate_to_datetime(date)
        return float((now - head["LastModified"]).total_seconds())
    except (KeyError, TypeError, ValueError):
        return None


def _lease_of(head: dict[str, Any], default: float) -> float:
    try:
        return float(head.get("Metadata", {}).get("lease", default))
    except (TypeError, ValueError):
        return default


class S3Lock:
    """Exclusive lock ``name`` of an ``S3Backend``; use it as a context manager.

    Args:
        backend: the backend holding the lock object.
        name: lock name (the object is ``<name>.lock``).
        timeout: seconds to wait; ``None`` waits forever.

    Raises:
        LockTimeoutError: on entry, when ``timeout`` passed first.
    """

    def __init__(self, backend: S3Backend, name: str, timeout: float | None) -> None:
        self.backend = backend
        self.name = name
        self.key = name + _SUFFIX
        self.timeout = timeout
        self.lease = float(backend.options.lock_lease)
        self.token = uuid.uuid4().hex
        self.etag = ""
        self.renewals = 0
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps(
            {
                "owner": self.token,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "lease": self.lease,
                "renewals": self.renewals,
                "time": time.time(),
            }
        ).encode()

    def _write(self, **condition: str) -> str:
        return self.backend._put_object(
            self.key, self._body(), Metadata={"lease": repr(self.lease)}, **condition
        )

    def _owner(self) -> tuple[str | None, str, dict[str, Any]]:
        """Return (owner token, ETag, body) of the lock object, or (None, '', {})."""
        try:
            resp = self.backend._call(
                "reading lock", self.key, "get_object", Key=self.backend._full(self.key)
            )
            raw = resp["Body"].read()
        except KeyNotFoundError:
            return None, "", {}
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            body = {}
        if not isinstance(body, dict):
            body = {}
        return body.get("owner"), str(resp.get("ETag", "")), body

    def _confirm(self, settle: bool = True) -> bool:
        """Read the lock back; adopt its ETag if it carries our token."""
        if settle and self.backend.options.lock_settle:
            time.sleep(self.backend.options.lock_settle)
        owner, etag, _ = self._owner()
        if owner == self.token:
            self.etag = etag
            return True
        return False

    def _create(self) -> bool:
        try:
            self._write(IfNoneMatch="*")
        except KeyExistsError as err:
            return retried(err) and self._confirm(settle=False)
        except ConflictError:
            return False
        return self._confirm()

    def __enter__(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        delay = 0.02
        seen: tuple[str, float] | None = None
        head: dict[str, Any] | None = None
        while True:
            if head is None:
                if self._create():
                    break
                head = self.backend._head(self.key)
                if head is None:
                    continue  # released in between: try again at once
            now = time.monotonic()
            etag = str(head.get("ETag", ""))
            lease = _lease_of(head, self.lease)
            age = _server_age(head)
            if seen is None or seen[0] != etag:
                seen = (etag, now)
            if now - seen[1] > lease or (age is not None and age > 2 * lease + 2):
                if self._take_over(etag, lease):
                    break
                seen = None
            if deadline is not None and now >= deadline:
                _, _, body = self._owner()
                raise LockTimeoutError(
                    f"lock {self.key!r} in {self.backend.where} still held after "
                    f"{self.timeout}s (holder: host {body.get('host')!r}, pid {body.get('pid')!r})"
                )
            pause = delay * (0.5 + random.random())
            if deadline is not None:
                pause = min(pause, max(deadline - now, 0.0))
            time.sleep(pause)
            delay = min(delay * 2, self.backend.options.lock_poll, self.lease / 4)
            head = self.backend._head(self.key)
        self.backend._held[self.name] = self
        self._thread = threading.Thread(
            target=self._renew, name=f"yoga-lease-{self.name}", daemon=True
        )
        self._thread.start()

    def _take_over(self, etag: str, lease: float) -> bool:
        try:
            self._write(IfMatch=etag)
        except (KeyExistsError, KeyNotFoundError, ConflictError):
            return False
        if not self._confirm():
            return False
        logger.warning(
            "took over the lock %s in %s: its holder stopped renewing its %.1fs lease",
            self.key,
            self.backend.where,
            lease,
        )
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 3):
            if not self._renew_once():
                return

    def _renew_once(self) -> bool:
        """Extend the lease once; return False if the lock was lost."""
        self.renewals += 1
        try:
            self.etag = self._write(IfMatch=self.etag)
            return True
        except (KeyExistsError, KeyNotFoundError):
            pass
        except Exception as err:  # keep renewing through transient failures
            logger.warning("renewing lock %s failed: %s", self.key, err)
            return True
        try:
            if self._confirm(settle=False):  # a retried renewal had landed
                return True
        except Exception as err:
            logger.warning("checking lock %s failed: %s", self.key, err)
            return True
        self.lost = True
        logger.error(
            "lost the lock %s in %s: another process took it over", self.key, self.backend.where
        )
        return False

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.backend._held.get(self.name) is self:
            del self.backend._held[self.name]
        if self.lost:
            return
        for _ in range(3):
            try:
                self.backend._call(
                    "releasing lock",
                    self.key,
                    "delete_object",
                    Key=self.backend._full(self.key),
                    IfMatch=self.etag,
                )
                return
            except KeyNotFoundError:
                return
            except KeyExistsError:  # our ETag is stale: still ours only if our token is there
                if not self._confirm(settle=False):
                    return
            except StorageError as err:
                logger.warning("releasing lock %s failed: %s", self.key, err)
                if exc is None:
                    raise
                return
