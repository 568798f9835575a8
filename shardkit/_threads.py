"""Threads for shardkit's parallel work that keep working while the interpreter exits.

``concurrent.futures.ThreadPoolExecutor`` refuses new work once interpreter shutdown has begun
("cannot schedule new futures after interpreter shutdown"), but an asynchronous save still
pending at exit runs exactly then and must complete. `WorkerPool` is an Executor of plain
daemon threads without that rule; `ParallelRun` runs one function over items on a few threads
of its own, in the background.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any


def usable_cores() -> frozenset[int]:
    """The cores this process may run on: its CPU affinity, or every core of the machine where
    the platform has none."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return frozenset(range(os.cpu_count() or 1))


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


class ParallelRun:
    """``work(item)`` for every item on up to `threads` new daemon threads, started at once;
    `wait` joins them and raises the first error. The caller's thread is free meanwhile."""

    def __init__(self, work: Callable[[Any], None], items: Sequence[Any], threads: int,
                 stop: threading.Event | None = None) -> None:
        self.stop = stop or threading.Event()
        self._errors: list[BaseException] = []
        self._todo = iter(items)
        self._lock = threading.Lock()
        self._work = work
        self._pool = [threading.Thread(target=self._worker, name=f"shardkit-writer-{i}",
                                       daemon=True)
                      for i in range(max(1, min(threads, len(items))))]
        for t in self._pool:
            t.start()

    def _worker(self) -> None:
        while not self.stop.is_set():
            with self._lock:
                item = next(self._todo, _DONE)
            if item is _DONE:
                return
            try:
                self._work(item)
            except BaseException as e:
                with self._lock:
                    self._errors.append(e)
                self.stop.set()
                return

    def wait(self) -> None:
        """Join the threads; raise the first error any of them met."""
        try:
            for t in self._pool:
                t.join()
        except BaseException:  # e.g. KeyboardInterrupt: stop the workers before leaving
            self.stop.set()
            for t in self._pool:
                t.join()
            raise
        if self._errors:
            raise self._errors[0]


_DONE = object()
