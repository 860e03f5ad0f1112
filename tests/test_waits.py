"""Worker threads and waits of the object-store read paths (yogastore.read.waits)."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time

import pytest

from yogastore.read import waits


def test_pool_runs_calls_and_hands_back_results_and_errors() -> None:
    born = waits.current()
    pool = waits.DaemonPool(3, "t", born)
    futures = [pool.submit(lambda i=i: i * i) for i in range(50)]
    assert [waits.result(f, born) for f in futures] == [i * i for i in range(50)]
    failing = pool.submit(lambda: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        waits.result(failing, born)
    workers = [t for t in threading.enumerate() if t.name.startswith("t_")]
    assert 1 <= len(workers) <= 3 and all(t.daemon for t in workers)
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in workers)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 0)


def test_shutdown_cancels_queued_calls_and_waits_for_running_ones() -> None:
    born = waits.current()
    pool = waits.DaemonPool(1, "q", born)
    gate, started = threading.Event(), threading.Event()

    def run() -> bool:
        started.set()
        return gate.wait(5)

    running = pool.submit(run)
    queued = [pool.submit(lambda: "ran") for _ in range(3)]
    assert started.wait(5)
    threading.Timer(0.2, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result(0) is True  # waited for, not cut short
    assert all(f.cancelled() for f in queued)


def test_a_wait_of_a_reader_made_before_exit_began_ends() -> None:
    # A reader notes current() when made; once end_waits has run, current() differs and
    # its waits raise instead of waiting for a request that may not come back for minutes.
    # (end_waits itself is not called here: it would end the waits of this test process.)
    never: concurrent.futures.Future[int] = concurrent.futures.Future()
    started = time.monotonic()
    with pytest.raises(waits.ProcessExiting, match="exiting"):
        waits.result(never, waits.current() - 1)
    assert time.monotonic() - started < 5
    assert never.cancelled()
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    done.set_result(7)
    assert waits.result(done, waits.current() - 1) == 7  # a result already there is taken
    # A stuck worker does not hold up shutdown once the process is exiting.
    pool = waits.DaemonPool(1, "s", waits.current() - 1)
    gate, started = threading.Event(), threading.Event()
    pool.submit(lambda: started.set() or gate.wait(30))
    assert started.wait(5)
    started = time.monotonic()
    pool.shutdown(wait=True)
    assert time.monotonic() - started < 5
    gate.set()


def test_a_call_that_raises_timeout_error_hands_it_back() -> None:
    # TimeoutError is also what concurrent.futures raises for a wait that timed out.
    born = waits.current()
    pool = waits.DaemonPool(1, "e", born)

    def slow_then_timeout() -> None:
        time.sleep(0.2)  # longer than a poll
        raise TimeoutError("the call's own")

    with pytest.raises(TimeoutError, match="the call's own"):
        waits.result(pool.submit(slow_then_timeout), born)
    pool.shutdown()


def test_a_pool_freed_without_shutdown_stops_its_workers() -> None:
    pool = waits.DaemonPool(4, "freed", waits.current())
    big = [pool.submit(lambda: bytearray(1 << 20)) for _ in range(8)]
    assert all(len(waits.result(f, waits.current())) == 1 << 20 for f in big)
    workers = [t for t in threading.enumerate() if t.name.startswith("freed_")]
    assert workers
    del pool, big
    gc.collect()
    for thread in workers:
        thread.join(5)
    assert not any(t.is_alive() for t in workers)


def test_process_exiting_is_the_one_tf_read_exports() -> None:
    pytest.importorskip("tensorflow")
    from yogastore.train import tf_read

    assert tf_read.ProcessExiting is waits.ProcessExiting
    assert issubclass(waits.ProcessExiting, RuntimeError)
