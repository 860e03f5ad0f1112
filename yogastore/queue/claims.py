"""A worker's claims from a work queue: claim, lease, finish, take over.

``QueueAssignment`` is the ``Assignment`` a ``QueueStream`` reads from. It
claims the next free slice with an exclusive put, renews the claims it holds
from a background thread (a lease), marks a slice done once its consumer took
every record of it, and takes over a slice whose lease expired. The key layout
is described in ``work_queue``.

On an object store, the requests a stream's reading thread makes (claims, done
markers, listings) run on a ``yogastore.read.waits.DaemonPool`` worker, and the
reading thread waits for them with ``waits.result``: at exit (``end_waits``) that
wait ends, where a request to an endpoint that stopped answering would hold the
thread, and with it the process's exit, for ``read_timeout`` x ``max_attempts``.
The claims note ``waits.current()`` when made and when an iteration starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from storage_backends.errors import KeyExistsError
from yogastore.queue.files import close_if_sole_user
from yogastore.queue.state import prefix
from yogastore.read import waits
from yogastore.read.assignment import Assignment, Span
from yogastore.read.order import Interval, intervals_length

if TYPE_CHECKING:
    from yogastore.queue.work_queue import WorkQueue

__all__ = ["QueueAssignment"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclasses.dataclass(slots=True)
class _Slice:
    epoch: int  # absolute epoch
    index: int
    intervals: tuple[Interval, ...]
    gen: int = 0
    lease_key: str | None = None
    left: int = 0  # records the consumer has still to take
    lost: bool = False  # another worker took it over while this one stalled


class QueueAssignment(Assignment):
    """A worker's claims from a ``WorkQueue``: slice after slice until all are done."""

    def __init__(self, queue: WorkQueue, worker: str, *, poll_seconds: float | None = None) -> None:
        self.queue = queue
        self.worker = worker
        # A waiting worker learns that the job ended at its next poll (one listing).
        self.poll = poll_seconds if poll_seconds is not None else min(0.25, queue.lease_seconds / 4)
        self._mutex = threading.Lock()
        self._held: deque[_Slice] = deque()  # claimed, not all consumed, in reading order
        self._taken: list[_Slice] = []  # every slice handed out, in reading order
        self._complete: set[int] = set()  # epochs with every slice done
        self._verified: set[tuple[int, int]] = set()  # done markers read and found valid
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._stash: _Slice | None = None  # claimed by wait_for_work, read next
        self._progress = time.monotonic()  # when the consumer last took a record
        self._paused = False  # leases not renewed: no progress for lease_seconds
        self.claims = 0  # successful claims (statistics)
        self.takeovers = 0
        self.lost = 0  # held slices taken over by another worker during a stall
        self._born = waits.current()  # waits end if the process exits (yogastore.read.waits)
        self._pool: waits.DaemonPool | None = None
        self._pool_pid = 0

    def _waited(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Return ``fn(*args)``; on an object store run on a worker, waited for until exit.

        Raises:
            ProcessExiting: the process began to exit (``yogastore.read.waits``).
        """
        if not self.queue.backend.remote:
            return fn(*args)  # local files: nothing waits on a network
        if waits.current() != self._born:  # no new claim left to expire unread
            raise waits.ProcessExiting("the process is exiting: a work queue request was ended")
        pool = self._pool
        if pool is None or self._pool_pid != os.getpid():  # a fork child has no workers
            pool = self._pool = waits.DaemonPool(1, "yogastore-queue", self._born)
            self._pool_pid = os.getpid()
        return waits.result(pool.submit(fn, *args), self._born)

    # Claims ------------------------------------------------------------------------

    def _expiry_ms(self) -> int:
        return int((time.time() + self.queue.lease_seconds) * 1000)

    def _try_claim(self, epoch: int, index: int, gen: int) -> _Slice | None:
        q = self.queue
        key = f"{q.prefix}e{epoch}/s{index:06d}.c{gen}"
        doc = {"worker": self.worker, "expires_ms": self._expiry_ms()}
        try:
            q.backend.put_exclusive(key, json.dumps(doc).encode())
        except KeyExistsError:
            return None
        piece = _Slice(epoch, index, q.slice_intervals(epoch, index), gen)
        piece.left = intervals_length(piece.intervals)
        return piece

    def _scan(self) -> tuple[_Slice | None, bool]:
        """Claim the next free (or expired) slice.

        Returns:
            The claimed slice (or ``None``), and whether other workers still
            hold live claims on unfinished slices.
        """
        q = self.queue
        waiting = False
        now = int(time.time() * 1000)
        with self._mutex:
            mine = {(p.epoch, p.index, p.gen) for p in self._held}
        for e in q.epochs:
            if e in self._complete:
                continue
            states = q.read_epoch(e)
            pending = False
            for index in range(q.num_slices):
                st = states.get(index)
                if not q.slice_intervals(e, index):
                    continue
                if st is not None and st.done:
                    if (e, index) not in self._verified:  # once per slice: a valid marker?
                        q.done_record(e, index)
                        self._verified.add((e, index))
                    continue
                if st is None or st.gen < 0:
                    got = self._try_claim(e, index, 0)
                elif (e, index, st.gen) in mine:
                    pending = True  # ours, still being consumed
                    continue
                else:
                    expiry = q.check_expiry(
                        st.expires_ms or q.claim_expiry(e, index, st.gen),
                        f"{q.prefix}e{e}/s{index:06d}.c{st.gen}",
                    )
                    if expiry > now:
                        pending = True
                        continue
                    got = self._try_claim(e, index, st.gen + 1)
                    if got is not None:
                        self.takeovers += 1
                        logger.warning(
                            "worker %s took over slice %d of epoch %d of job %s "
                            "(its lease expired); it is read again whole",
                            self.worker,
                            index,
                            e,
                            q.job,
                        )
                if got is not None:
                    self.claims += 1
                    return got, True
                pending = True  # someone else won it just now
            if not pending:
                self._complete.add(e)
                close_if_sole_user(q.backend, q.prefix, f"e{e}")
            waiting = waiting or pending
        return None, waiting

    def wait_for_work(self) -> bool:
        """Wait while other workers hold the last slices; claim one if its lease expires.

        Called once everything this worker claimed has been consumed.

        Returns:
            Whether a slice was claimed (the stream reads on), or every slice is done.
        """
        while True:
            if waits.current() != self._born:  # a local store's wait ends at exit too
                raise waits.ProcessExiting(
                    "the process is exiting: a work queue worker waiting for a slice was ended"
                )
            piece, waiting = self._waited(self._scan)
            if piece is not None:
                self._stash = piece
                return True
            if not waiting or self._stop.wait(self.poll):
                return False

    def finish_all(self) -> None:
        """Mark every held slice done: the stream handed out (or dropped) all of it."""
        with self._mutex:
            held = list(self._held)
            self._held.clear()
        for piece in held:
            self._waited(self._finish, piece)

    # Leases ------------------------------------------------------------------------

    def _renew(self, piece: _Slice) -> None:
        q = self.queue
        key = f"{q.prefix}e{piece.epoch}/s{piece.index:06d}.c{piece.gen}.l{self._expiry_ms()}"
        q.backend.put(key, b"")
        old, piece.lease_key = piece.lease_key, key
        if old is not None and old != key:
            q.backend.delete(old)

    def _check_lost(self, held: list[_Slice]) -> None:
        """After a stall: find the held slices another worker took over meanwhile."""
        q = self.queue
        for e in sorted({p.epoch for p in held}):
            states = q.read_epoch(e)
            for piece in held:
                st = states.get(piece.index)
                if piece.epoch == e and st is not None and st.gen > piece.gen:
                    piece.lost = True
                    self.lost += 1
                    logger.warning(
                        "worker %s stalled past its lease: slice %d of epoch %d of job %s "
                        "was taken over by another worker and is read twice",
                        self.worker,
                        piece.index,
                        e,
                        q.job,
                    )

    def _resume(self) -> None:
        """On progress after a stall: find what was lost; renewing goes on."""
        with self._mutex:
            was, self._paused = self._paused, False
            held = [p for p in self._held if not p.lost]
        if was and held:
            try:
                self._check_lost(held)
            except Exception as err:  # a failed listing must not stop the reading
                logger.warning("checking the leases of worker %s failed: %s", self.worker, err)

    def _renew_loop(self) -> None:
        lease = self.queue.lease_seconds
        while not self._stop.wait(lease / 3):
            with self._mutex:
                held = [p for p in self._held if not p.lost]
            if time.monotonic() - self._progress > lease:
                # The consumer took nothing for a whole lease (a hung step): let
                # the leases lapse so other workers can take the slices over.
                self._paused = True
                continue
            self._resume()
            for piece in held:
                if piece.lost:
                    continue
                try:
                    self._renew(piece)
                except Exception as err:  # retried next round
                    logger.warning("renewing the lease of a slice failed (retrying): %s", err)

    def _finish(self, piece: _Slice) -> None:
        q = self.queue
        key = f"{q.prefix}e{piece.epoch}/s{piece.index:06d}.done"
        doc = {
            "worker": self.worker,
            "gen": piece.gen,
            "records": intervals_length(piece.intervals),
        }
        # A plain put: only the marker's presence decides anything, so a second
        # finisher (a takeover of a slice whose holder was slow, not dead) may
        # overwrite it, and the put skips the syncs of an exclusive put (on a
        # local store two fsyncs, most of a claim's cost).
        q.backend.put(key, json.dumps(doc).encode())
        self._verified.add((piece.epoch, piece.index))
        if piece.lease_key is not None:
            q.backend.delete(piece.lease_key)
            piece.lease_key = None

    # Assignment --------------------------------------------------------------------

    def spans(self) -> Iterator[Span]:
        if self._renewer is None or not self._renewer.is_alive():
            self._born = waits.current()  # an iteration starts (maybe in an exit handler)
            self._stop.clear()
            self._progress = time.monotonic()
            self._renewer = threading.Thread(
                target=self._renew_loop, name="yogastore-lease", daemon=True
            )
            self._renewer.start()
        while True:
            piece, self._stash = self._stash, None
            if piece is None:
                piece, _waiting = self._waited(self._scan)
            if piece is None:
                return  # nothing claimable now; see wait_for_work
            with self._mutex:
                self._held.append(piece)
                self._taken.append(piece)
            self._progress = time.monotonic()
            yield piece.epoch - self.queue.epoch, piece.intervals

    def consume(self, count: int) -> None:
        if count > 0:
            self._progress = time.monotonic()
            if self._paused:
                self._waited(self._resume)
        while count > 0:
            with self._mutex:
                if not self._held:
                    return
                piece = self._held[0]
                take = min(count, piece.left)
                piece.left -= take
                count -= take
                finished = piece.left == 0
                if finished:
                    self._held.popleft()
            if finished:
                self._waited(self._finish, piece)

    def close(self) -> None:
        """Stop renewing leases (and wait for the renewing thread to stop writing).

        Once the process exits (``yogastore.read.waits``), without waiting: the renewing
        thread may be inside a request to an endpoint that stopped answering.
        """
        self._stop.set()
        renewer = self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            waits.join(renewer, self._born, self.queue.lease_seconds)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # its calls were all waited for, or the process exits

    def consumed(self, count: int) -> dict[int, list[Interval]]:
        """Return the positions per epoch of the first ``count`` records handed out."""
        out: dict[int, list[Interval]] = {}
        with self._mutex:
            taken = list(self._taken)
        for piece in taken:
            if count <= 0:
                break
            n = intervals_length(piece.intervals)
            part = piece.intervals if count >= n else tuple(prefix(piece.intervals, count))
            out.setdefault(piece.epoch, []).extend(part)
            count -= n
        return out
