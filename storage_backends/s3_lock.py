"""A lock object in S3 with a lease, built on conditional writes only.

* Acquire: create ``<name>.lock`` with ``If-None-Match: *``; read it back
  after ``lock_settle`` seconds and keep it only if it still carries this
  holder's token (so a store whose conditional writes race cannot fool us).
* Hold: a daemon thread rewrites the object every ``lease / 4`` seconds with
  ``If-Match`` on its last ETag. The holder counts the lock valid until
  ``2/3 * lease`` after the moment it *sent* its last successful write, on its
  own monotonic clock: a waiter cannot take over before a full lease has passed
  since it first saw that write, which happened after it was sent. Past that
  point, or once a renewal finds another owner, the backend refuses this
  process's writes under ``<name>/`` (a fence against a holder that was only
  paused, or whose renewals hang, not dead). Commits (``put_exclusive`` under
  ``<name>/``) renew synchronously first, so a takeover this holder's clock
  cannot see still stops them.
* Wait: look at the lock's ETag (one HEAD request) with backoff. An ETag
  unchanged for longer than the holder's lease, measured on the waiter's own
  monotonic clock so machine clocks need not agree, or an object older than
  twice the lease by the server's own clock, belongs to a holder that stopped
  renewing: take it over with ``If-Match`` on that ETag, so that of several
  waiters exactly one wins.
* Release: delete with ``If-Match`` on the holder's ETag.

The lock sees the store only through ``ConditionalStore``; the backend that
made it fences its writes with the ``holders`` map the lock enters itself in.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import MutableMapping
from types import TracebackType
from typing import Any

from storage_backends.conditional import ConditionalStore, ObjectHead
from storage_backends.errors import (
    KeyExistsError,
    KeyNotFoundError,
    LockLostError,
    LockTimeoutError,
    StorageError,
)
from storage_backends.s3_errors import ConflictError, retried

__all__ = ["S3Lock", "lock_held"]

logger = logging.getLogger(__name__)

_SUFFIX = ".lock"
#: Share of the lease a holder trusts, counted from sending its last landed write.
_VALID_SHARE = 2 / 3
#: Renewals per lease.
_RENEWALS_PER_LEASE = 4


def _lease_of(head: ObjectHead, default: float) -> float:
    try:
        return float(head.metadata.get("lease", default))
    except (TypeError, ValueError):
        return default


def _lapsed(age: float | None, lease: float) -> bool:
    """Whether a lock object this old (server clock) belongs to a holder that stopped renewing."""
    return age is not None and age > 2 * lease + 2


def lock_held(store: ConditionalStore, name: str) -> bool:
    """Return whether lock ``name`` is held, from one look at its object; nothing is written.

    Held: the object is there and not so old that a waiter would take it
    over at once (``S3Lock`` with ``timeout=0`` times out on exactly these);
    an object that does not state its lease counts as held. The look needs
    neither write access nor a store that enforces conditional writes.
    """
    head = store.head(name + _SUFFIX)
    if head is None:
        return False
    return "lease" not in head.metadata or not _lapsed(head.age, _lease_of(head, 0.0))


class S3Lock:
    """Exclusive lock ``name`` in a ``ConditionalStore``; use it as a context manager.

    Args:
        store: where the lock object lives.
        name: lock name (the object is ``<name>.lock``).
        timeout: seconds to wait; ``None`` waits forever.
        lease: seconds the lock stays valid without renewal.
        poll: longest pause between two looks at a held lock.
        settle: seconds to wait before reading back a lock just written.
        holders: the locks this process holds in ``store``, by name; the
            lock is in it from entry to exit, so that the store can fence
            writes under ``<name>/`` (``valid``, ``refusal``, ``renew``).

    Raises:
        LockTimeoutError: on entry, when ``timeout`` passed first.
    """

    def __init__(
        self,
        store: ConditionalStore,
        name: str,
        timeout: float | None,
        *,
        lease: float,
        poll: float,
        settle: float,
        holders: MutableMapping[str, S3Lock],
    ) -> None:
        self.store = store
        self.name = name
        self.key = name + _SUFFIX
        self.timeout = timeout
        self.lease = float(lease)
        self.poll = float(poll)
        self.settle = float(settle)
        self.holders = holders
        self.token = uuid.uuid4().hex
        self.etag = ""
        self.renewals = 0
        self.lost = False
        #: ``time.monotonic()`` after which this holder no longer trusts its lease.
        self.valid_until = 0.0
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._renew_lock = threading.Lock()  # one conditional rewrite at a time
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

    def _write(self, etag: str | None) -> str:
        """Create the lock object (``etag`` None) or replace the version ``etag``."""
        metadata = {"lease": repr(self.lease)}
        if etag is None:
            return self.store.create_if_absent(self.key, self._body(), metadata)
        return self.store.replace_if_match(self.key, self._body(), etag, metadata)

    def _owner(self) -> tuple[str | None, str, dict[str, Any]]:
        """Return (owner token, ETag, body) of the lock object, or (None, '', {})."""
        try:
            # Retries a body cut off mid-way and translates every failure.
            raw, etag = self.store.read_tagged(self.key)
        except KeyNotFoundError:
            return None, "", {}
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            body = {}
        if not isinstance(body, dict):
            body = {}
        return body.get("owner"), etag, body

    def _confirm(self, settle: bool = True) -> bool:
        """Read the lock back; adopt its ETag if it carries our token."""
        if settle and self.settle:
            time.sleep(self.settle)
        owner, etag, _ = self._owner()
        if owner == self.token:
            self.etag = etag
            return True
        return False

    def _granted(self, sent: float) -> None:
        """Trust the lease for a while after ``sent``, when a write that landed was sent."""
        self.valid_until = max(self.valid_until, sent + self.lease * _VALID_SHARE)

    def valid(self) -> bool:
        """Return whether this holder may still write under the lock."""
        return not self.lost and time.monotonic() <= self.valid_until

    def refusal(self, key: str) -> LockLostError:
        """Return the error refusing a write of ``key`` by a holder no longer valid."""
        if self.lost:
            why = "another process took the lock over"
        else:
            late = time.monotonic() - self.valid_until
            why = (
                f"its {self.lease:g}s lease ran out {late:.1f}s ago without a successful "
                "renewal (renewals failing or hanging, or this process was paused), so "
                "another process may have taken the lock over"
            )
        return LockLostError(
            errno.ESTALE,
            f"refusing to write {key!r} in {self.store.where}: this process lost the lock "
            f"{self.name!r}: {why}; build again to get a consistent result",
        )

    def _acquired(self, sent: float, landed: bool) -> bool:
        """Finish an acquisition whose write carries our token.

        ``landed``: the write sent at ``sent`` is known to have landed. Otherwise
        an earlier try of ours may be the one that landed, sent at an unknown
        time, so the lease is renewed once to learn a send time.
        """
        if landed:
            self._granted(sent)
            return True
        with self._renew_lock:
            return self._extend() and self.valid()

    def _create(self) -> bool:
        self.store.warm_up()  # first, so that making the connection does not eat the lease
        sent = time.monotonic()
        try:
            self._write(None)
        except KeyExistsError as err:
            # A retried create may meet its own first try, which had landed.
            return retried(err) and self._confirm(settle=False) and self._acquired(sent, False)
        except ConflictError:
            return False
        return self._confirm() and self._acquired(sent, True)

    def __enter__(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        delay = 0.02
        seen: tuple[str, float] | None = None
        head: ObjectHead | None = None
        while True:
            if head is None and self._create():
                break
            if head is None:
                # Released in between, or a store whose listing lags its writes:
                # back off like any other miss, within the deadline.
                head = self.store.head(self.key)
            now = time.monotonic()
            if head is not None:
                etag = head.etag
                lease = _lease_of(head, self.lease)
                age = head.age
                if seen is None or seen[0] != etag:
                    seen = (etag, now)
                if now - seen[1] > lease or _lapsed(age, lease):
                    if self._take_over(etag, lease):
                        break
                    seen = None
            if deadline is not None and now >= deadline:
                _, _, body = self._owner()
                raise LockTimeoutError(
                    f"lock {self.key!r} in {self.store.where} still held after "
                    f"{self.timeout}s (holder: host {body.get('host')!r}, pid {body.get('pid')!r})"
                )
            pause = delay * (0.5 + random.random())
            if deadline is not None:
                pause = min(pause, max(deadline - now, 0.0))
            time.sleep(pause)
            delay = min(delay * 2, self.poll, self.lease / 4)
            head = self.store.head(self.key)
        self.holders[self.name] = self
        self._thread = threading.Thread(
            target=self._renew, name=f"yoga-lease-{self.name}", daemon=True
        )
        self._thread.start()

    def _take_over(self, etag: str, lease: float) -> bool:
        sent = time.monotonic()
        try:
            self._write(etag)
        except KeyExistsError as err:
            # A retried takeover may meet its own first try, which had landed.
            if not (retried(err) and self._confirm() and self._acquired(sent, False)):
                return False
        except (KeyNotFoundError, ConflictError):
            return False
        else:
            if not (self._confirm() and self._acquired(sent, True)):
                return False
        logger.warning(
            "took over the lock %s in %s: its holder stopped renewing its %.1fs lease",
            self.key,
            self.store.where,
            lease,
        )
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / _RENEWALS_PER_LEASE):
            if not self._renew_once():
                return

    def _renew_once(self) -> bool:
        """Extend the lease once (the renewal thread); return False if the lock was lost."""
        with self._renew_lock:
            if self.lost:
                return False
            try:
                return self._extend()
            except Exception as err:  # keep renewing through transient failures
                logger.warning("renewing lock %s failed: %s", self.key, err)
                return True

    def renew(self, key: str) -> None:
        """Extend the lease now, before committing ``key`` under the lock.

        The holder's clock cannot see every takeover (a paused process, a
        store's clock running ahead); a conditional rewrite right before a
        commit can.

        Raises:
            LockLostError: another process holds the lock, or the lease ran out.
            StorageError: the renewal failed; the lock may or may not be ours.
        """
        if not self._renew_lock.acquire(timeout=max(self.valid_until - time.monotonic(), 0.0)):
            raise self.refusal(key)  # a renewal hangs and the lease ran out meanwhile
        try:
            if not self.lost:
                self._extend()
        finally:
            self._renew_lock.release()
        if not self.valid():
            raise self.refusal(key)

    def _extend(self) -> bool:
        """Rewrite the lock on its ETag (caller holds ``_renew_lock``); False if lost."""
        for _ in range(2):
            self.renewals += 1
            sent = time.monotonic()
            try:
                self.etag = self._write(self.etag)
            except (KeyExistsError, KeyNotFoundError):
                # Still ours if a retried earlier write of ours landed: renew again
                # on its ETag, as its send time is unknown.
                if self._confirm(settle=False):
                    continue
                self.lost = True
                logger.error(
                    "lost the lock %s in %s: another process took it over",
                    self.key,
                    self.store.where,
                )
                return False
            # Do not trust the conditional write alone: read the lock back.
            if not self._confirm(settle=False):
                self.lost = True
                logger.error(
                    "lost the lock %s in %s: it names another owner after renewal",
                    self.key,
                    self.store.where,
                )
                return False
            self._granted(sent)
            return True
        return True  # ours, but not extended: the next renewal tries again

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if os.getpid() != self._pid:
            return  # a fork child leaving the block: the lock is its parent's
        if self._thread is not None:
            # A renewal stuck in a request must not hold up the release: the
            # conditional delete below is safe against its late landing.
            self._thread.join(timeout=self.lease / _RENEWALS_PER_LEASE)
        if self.holders.get(self.name) is self:
            del self.holders[self.name]
        if self.lost:
            return
        for _ in range(3):
            try:
                self.store.delete_if_match(self.key, self.etag)
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
