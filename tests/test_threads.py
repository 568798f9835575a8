"""shardkit._threads: the worker pool and ParallelRun."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, wait

import pytest

from shardkit._threads import ParallelRun, WorkerPool


def test_pool_runs_work_on_at_most_its_threads_and_returns_results():
    pool = WorkerPool(2, "test")
    names: set[str] = set()
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            names.add(threading.current_thread().name)
        time.sleep(0.01)
        return i * i

    futures = [pool.submit(job, i) for i in range(8)]
    assert [f.result(timeout=5) for f in futures] == [i * i for i in range(8)]
    assert names <= {"test-0", "test-1"} and len(names) == 2
    pool.shutdown()
    with pytest.raises(RuntimeError, match="test pool is shut down"):
        pool.submit(job, 1)


def test_pool_hands_errors_to_the_caller_and_keeps_working():
    pool = WorkerPool(1, "test")

    def boom() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        pool.submit(boom).result(timeout=5)
    assert pool.submit(lambda: 7).result(timeout=5) == 7
    pool.shutdown()


def test_pool_shutdown_can_cancel_queued_work():
    pool = WorkerPool(1, "test")
    gate, started = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(60)

    first = pool.submit(hold)
    queued = [pool.submit(lambda: 1) for _ in range(3)]
    assert started.wait(60)  # the one worker is now inside gate.wait
    pool.shutdown(wait=False, cancel_futures=True)
    _, not_done = wait(queued, timeout=5)  # cancelled futures count as done at once
    assert not not_done and all(f.cancelled() for f in queued)
    with pytest.raises(CancelledError):
        queued[0].result()
    gate.set()
    assert first.result(timeout=5) is True
    pool.shutdown()
    with pytest.raises(ValueError, match="at least 1"):
        WorkerPool(0, "test")


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_parallel_run_runs_every_item_once(threads):
    done: list[int] = []
    lock = threading.Lock()
    names: set[str] = set()

    def work(i: int) -> None:
        with lock:
            done.append(i)
            names.add(threading.current_thread().name)

    ParallelRun(work, list(range(20)), threads).wait()
    assert sorted(done) == list(range(20)) and len(names) <= threads


def test_parallel_run_stops_at_the_first_error_and_raises_it():
    stop = threading.Event()
    seen: list[int] = []

    def work(i: int) -> None:
        seen.append(i)
        if i == 3:
            raise ValueError("item 3 is bad")
        time.sleep(0.005)

    with pytest.raises(ValueError, match="item 3 is bad"):
        ParallelRun(work, list(range(200)), 2, stop=stop).wait()
    assert stop.is_set() and len(seen) < 200
