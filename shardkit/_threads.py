"""Threads for shardkit's parallel work that keep working while the interpreter exits.

``concurrent.futures.ThreadPoolExecutor`` refuses new work once interpreter shutdown has begun
("cannot schedule new futures after interpreter shutdown"), but an asynchronous save still
pending at exit runs exactly then and must complete. `WorkerPool` is an Executor of plain
daemon threads without that rule; `run_parallel` runs one function over items on a few threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any


class WorkerPool(Executor):
    """An Executor of up to `threads` daemon threads, started as work arrives."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._threads = threads
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} pool is shut down")
            self._queue.put((future, fn, args, kwargs))
            if len(self._workers) < self._threads:
                worker = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._name}-{len(self._workers)}")
                self._workers.append(worker)
                worker.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[0].cancel():
                    item[0].set_running_or_notify_cancel()  # wakes wait() on it
        for _ in workers:
            self._queue.put(None)
        if wait:
            me = threading.current_thread()
            for worker in workers:
                if worker is not me:
                    worker.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # handed to the caller, like any executor
                    future.set_exception(e)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs  # drop the references while idle


def run_parallel(work: Callable[[Any], None], items: Sequence[Any], threads: int,
                 stop: threading.Event | None = None) -> None:
    """``work(item)`` for every item, on up to `threads` threads of our own. The first error
    sets `stop` (work should check it), the other threads finish the item in hand, and the
    error is raised here."""
    stop = stop or threading.Event()
    count = min(threads, len(items))
    if count <= 1:
        for item in items:
            work(item)
        return
    errors: list[BaseException] = []
    todo = iter(items)
    lock = threading.Lock()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                item = next(todo, _DONE)
            if item is _DONE:
                return
            try:
                work(item)
            except BaseException as e:
                with lock:
                    errors.append(e)
                stop.set()
                return

    pool = [threading.Thread(target=worker, name=f"shardkit-writer-{i}", daemon=True)
            for i in range(count)]
    for t in pool:
        t.start()
    try:
        for t in pool:
            t.join()
    except BaseException:  # e.g. KeyboardInterrupt: stop the workers before leaving
        stop.set()
        for t in pool:
            t.join()
        raise
    if errors:
        raise errors[0]


_DONE = object()
