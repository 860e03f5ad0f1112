"""Waits of the read paths that end when the process exits, and workers that never delay it.

An object-store read can wait minutes for an endpoint that stalls (each request up to
``read_timeout``, ``max_attempts`` times). Two things would then hold up the exit of a
process that still has a reader running:

- ``concurrent.futures`` joins its pools' worker threads before ``atexit`` handlers run, so
  a worker inside such a request delays the exit until the request gives up;
- a ``tf.data`` read-ahead thread waiting in a reader for such a worker keeps TensorFlow's
  teardown of its iterator waiting.

So the readers run their fetches on ``DaemonPool`` threads (never joined at exit), and wait
for them with ``result``, which raises ``ProcessExiting`` once ``end_waits`` has run. A
reader notes ``current()`` when it is made and passes it to its waits: the waits of readers
made before the exit began end within ``_POLL`` seconds, those of readers made later (in an
exit handler of the caller's) wait as usual.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["DaemonPool", "ProcessExiting", "current", "end_waits", "join", "result"]

_T = TypeVar("_T")
_POLL = 0.05
_generation = 0


class ProcessExiting(RuntimeError):
    """A read was ended because the process is exiting."""


def end_waits() -> None:
    """End the waits running now.

    Called by ``to_tf_dataset``'s exit handler alone, before TensorFlow tears iterators
    down; it also ends that module's generators made before it (they note ``current()``).
    """
    global _generation
    _generation += 1


def current() -> int:
    """The number of exits begun (0, or 1 in exit handlers that run after ``end_waits``)."""
    return _generation


def result(future: concurrent.futures.Future[_T], born: int) -> _T:
    """Return ``future.result()``, or raise ``ProcessExiting`` once ``current() != born``."""
    while True:
        # wait(), not result(timeout=): a call that raised TimeoutError itself is done.
        done, _ = concurrent.futures.wait((future,), timeout=_POLL)
        if done:
            return future.result()
        if current() != born:
            future.cancel()
            raise ProcessExiting(
                "the process is exiting: a read still waiting for its data was ended"
            )


def join(thread: threading.Thread, born: int, timeout: float | None = None) -> bool:
    """Wait for ``thread`` to end (at most ``timeout`` seconds), but not once ``current() != born``.

    Returns:
        Whether the thread ended.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while thread.is_alive():
        if current() != born:
            return False
        step = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
        if step <= 0:
            return False
        thread.join(step)
    return True


class _Shared:
    """What a pool's workers share with it (never the pool itself, so that it can be freed)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0
        self.threads: list[threading.Thread] = []


def _work(shared: _Shared) -> None:
    while True:
        item = shared.queue.get()
        if item is None:
            return
        future, fn, args = item
        if future.set_running_or_notify_cancel():
            try:
                value = fn(*args)
            except BaseException as err:  # handed to the waiter, as an executor does
                future.set_exception(err)
            else:
                future.set_result(value)
                del value
        del item, future, fn, args
        with shared.lock:
            shared.idle += 1


def _stop(shared: _Shared) -> None:
    """Tell every worker to stop once the queued calls ahead of it are done."""
    with shared.lock:
        count = len(shared.threads)
    for _ in range(count):
        shared.queue.put(None)


class DaemonPool:
    """A small thread pool whose workers are daemon threads.

    ``submit`` returns a ``concurrent.futures.Future``. Workers start as work arrives, up to
    ``workers``. ``shutdown`` stops them; with ``wait`` it waits for the running calls, but
    not once ``current()`` differs from ``born`` (the process is exiting, see ``end_waits``).
    A pool freed without ``shutdown`` stops its workers too, as an executor's do.
    """

    def __init__(self, workers: int, name: str, born: int) -> None:
        self._born = born
        self._max = max(int(workers), 1)
        self._name = name
        self._shared = _Shared()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._shared)

    def submit(self, fn: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        shared = self._shared
        with shared.lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: cannot submit work after shutdown")
            shared.queue.put((future, fn, args))
            if shared.idle == 0 and len(shared.threads) < self._max:
                thread = threading.Thread(
                    target=_work,
                    args=(shared,),
                    name=f"{self._name}_{len(shared.threads)}",
                    daemon=True,
                )
                thread.start()
                shared.threads.append(thread)
            elif shared.idle:
                shared.idle -= 1
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop the workers; cancel the queued calls if asked; wait for the running ones."""
        shared = self._shared
        with shared.lock:
            self._closed = True
            threads = list(shared.threads)
        if cancel_futures:
            while True:
                try:
                    item = shared.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        self._finalizer()  # puts one stop per worker, once
        if not wait:
            return
        for thread in threads:
            if not join(thread, self._born):
                return
