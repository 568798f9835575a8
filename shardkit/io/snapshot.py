"""Asynchronous saves: host snapshots in a reused buffer pool, then a write in the background.

An async save copies every tensor into a host buffer before it returns, so the training loop
may update its weights at once while a background thread writes the copy. The buffers are kept
between saves (keyed by checkpoint key): fresh memory costs more to touch than warm. CUDA
tensors are copied into pinned buffers; one device synchronisation makes the snapshot valid.

`AsyncWriter` then runs the write in a background thread, one at a time; the `SaveHandle` it
returns tells "staged" from "durable", and a write's error is handed to the next caller. Pending
writes are waited for at interpreter exit (and forgotten in a forked child, where their threads
do not exist).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from ..errors import ShardkitError
from ..frameworks import kind_of, loaded, memory_key, module, string_to_host, to_host
from ..values.sharing import shared_rows

ALIGNMENT = 64  # bytes; more than any stored item size, and a cache line


def alloc_host_buffer(nbytes: int, *, pin: bool = False) -> np.ndarray:
    """A writable, 64-byte aligned uint8 host buffer of `nbytes` bytes.

    With `pin` the memory is page-locked through torch (``pin_memory=True``) so that device to
    host copies can run without a bounce buffer; that needs torch with CUDA.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if pin:
        torch = loaded("torch")
        raw = None if torch is None else torch.pinned_buffer(nbytes + ALIGNMENT)
        if raw is None:
            raise ShardkitError(
                "pinned host buffers need torch with a CUDA device; none is available "
                "(use pin=False)"
            )
    else:
        raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes]


class HostBufferPool:
    """Host buffers for snapshots, one per checkpoint key, reused between snapshots.

    A buffer is reallocated only when a key's tensor grows beyond it or changes between pinned
    (device) and ordinary (host) memory; buffers of keys that a snapshot no longer contains are
    released. Not thread-safe: the owner must not take a snapshot while the previous one is being
    written (async saves wait for the pending write first).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[np.ndarray, bool]] = {}
        self.allocations = 0  # how many buffers were allocated so far (tests, diagnostics)

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool."""
        return sum(b.nbytes for b, _ in self._buffers.values())

    def buffer(self, key: str, nbytes: int, *, pin: bool = False) -> np.ndarray:
        """A uint8 buffer of exactly `nbytes` for `key`, reusing the one it had if large enough."""
        held = self._buffers.get(key)
        if held is not None and held[1] == pin and held[0].nbytes >= nbytes:
            return held[0][:nbytes]
        buf = alloc_host_buffer(nbytes, pin=pin)
        self.allocations += 1
        self._buffers[key] = (buf, pin)
        return buf

    def snapshot(self, items: Iterable[tuple[str, Any]]) -> dict[str, np.ndarray]:
        """Copy each ``(key, tensor)`` into its pooled buffer; returns key -> host array copy.

        Tensors may be numpy arrays, torch tensors (CPU or CUDA, any dtype shardkit stores,
        non-contiguous), JAX arrays or anything numpy converts. The copies are C-contiguous.
        Host tensors that are one memory (tied weights: `values.sharing`) are copied once and
        stay one array, so that the save stores them once.
        """
        out: dict[str, Any] = {}
        hosts: list[tuple[str, np.ndarray]] = []  # copied once the shared ones are known
        device_copies = False
        first_of: dict[tuple[Any, ...], str] = {}  # `memory_key` of a framework value -> key
        again: dict[str, str] = {}  # key -> the key of the same memory, copied for both
        for key, value in items:
            same = None if type(value) is np.ndarray else memory_key(value)
            if same is not None:  # a framework tensor or variable
                first = first_of.setdefault(same, key)
                if first != key:  # one memory on any device (a TensorFlow variable twice)
                    again[key] = first
                    out[key] = None  # its place in the order
                    continue
            if _is_cuda_tensor(value):  # into a pinned buffer, not waited for
                buf = self.buffer(key, value.numel() * value.element_size(), pin=True)
                out[key] = module("torch").copy_to_host(value, buf)
                device_copies = True
                continue
            copied = string_to_host(value)
            if copied is not None:  # string tensors: a plain copy, no pooling
                out[key] = np.array(copied[0], copy=True)
                continue
            host, _ = to_host(value, key)
            hosts.append((key, host))
            out[key] = None
        shared = shared_rows([host for _, host in hosts])
        for i, (key, host) in enumerate(hosts):
            if i in shared:
                again[key] = hosts[shared[i]][0]
                continue
            dst = self.buffer(key, host.nbytes).view(host.dtype).reshape(host.shape)
            np.copyto(dst, host, casting="no")
            out[key] = dst
        for key, first in again.items():
            while first in again:  # a device value's first, itself one memory with another
                first = again[first]
            out[key] = out[first]
        if device_copies:
            module("torch").synchronize()  # the copies must land before the write
        for key in [k for k in self._buffers if k not in out or k in again]:
            del self._buffers[key]  # gone, or no buffer of its own
        return out


def _is_cuda_tensor(value: Any) -> bool:
    return type(value) is not np.ndarray and kind_of(value) == "torch" and (
        value.device.type == "cuda")


# --- the background write -------------------------------------------------------------------------


class SaveHandle(str):
    """The path a save wrote (a str, as TensorFlow returns) that also tracks an async write.

    Two moments: *staged* (the state has been copied; the caller may change it) and *durable*
    (the checkpoint is committed on disk). A save returns once staged; `done` tells whether it
    is durable, `wait` blocks until it is (raising the write's error), `exception` returns it.
    """

    _future: Future[str]
    _reported: bool

    def __new__(cls, path: str, future: Future[str] | None = None) -> SaveHandle:
        self = super().__new__(cls, path)
        if future is None:
            future = Future()
            future.set_result(path)
        self._future = future
        self._reported = False
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (str(self),))

    def __repr__(self) -> str:
        if not self._future.done():
            state = "pending"
        else:
            state = "failed" if self._future.exception() is not None else "durable"
        return f"SaveHandle({str(self)!r}, {state})"

    @property
    def path(self) -> str:
        """The checkpoint's path, as a plain str."""
        return str(self)

    def staged(self) -> bool:
        """Whether the state has been copied, so that the caller may change it.

        Returns:
            True: the snapshot is taken before `save` returns.
        """
        return True

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the state has been copied (already so when `save` returns).

        Args:
            timeout: seconds to wait at most (None: no limit).
        Returns:
            True.
        """
        return True

    def done(self) -> bool:
        """Whether the write has finished.

        Returns:
            True once the checkpoint is committed, or the write failed.
        """
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is durable (`result` is the same).

        Args:
            timeout: seconds to wait at most (None: no limit).
        Returns:
            The checkpoint's path.
        Raises:
            TimeoutError: it is still being written after `timeout` seconds.
            ShardkitError: the write's own error (any the save raises), raised here.
        """
        try:
            self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"the save of {self!s} is still running after {timeout} s") from None
        except BaseException:
            self._reported = True
            raise
        return str(self)

    result = wait

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The write's error, once it has finished.

        Args:
            timeout: seconds to wait at most (None: no limit).
        Returns:
            The error the write raised, or None if it succeeded.
        Raises:
            TimeoutError: it is still being written after `timeout` seconds.
        """
        try:
            error = self._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"the save of {self!s} is still running after {timeout} s") from None
        if error is not None:
            self._reported = True
        return error


_HANDLES: list[SaveHandle] = []  # async saves not yet known to be durable or reported
_HANDLES_LOCK = threading.Lock()


def _unfinished(h: SaveHandle) -> bool:
    return not h._future.done() or (h._future.exception() is not None and not h._reported)


class AsyncWriter:
    """Runs one background write at a time and hands its error to the next caller."""

    def __init__(self) -> None:
        self._pending: SaveHandle | None = None
        self._pid = os.getpid()

    def wait(self) -> None:
        pending = self._pending
        if pending is None:
            return
        if os.getpid() != self._pid:  # a forked child: the write belongs to the parent
            self._pending, self._pid = None, os.getpid()
            return
        error = pending._future.exception()  # if interrupted, still pending: waited for later
        self._pending = None
        if error is not None and not pending._reported:
            pending._reported = True
            if hasattr(error, "add_note"):
                error.add_note(f"(raised by the asynchronous save of {pending!s})")
            raise error

    def submit(self, path: str, job: Callable[[], Any]) -> SaveHandle:
        self.wait()
        future: Future[str] = Future()
        handle = SaveHandle(path, future)

        def run() -> None:
            future.set_running_or_notify_cancel()
            try:
                job()
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(path)

        with _HANDLES_LOCK:
            _HANDLES[:] = [h for h in _HANDLES if _unfinished(h)]
            _HANDLES.append(handle)
        threading.Thread(target=run, name="shardkit-async-save", daemon=False).start()
        self._pending = handle
        return handle


def _forget_parent_saves() -> None:
    """In a forked child the parent's writer threads do not exist: never wait for them."""
    global _HANDLES_LOCK
    _HANDLES_LOCK = threading.Lock()
    _HANDLES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_saves)


@atexit.register
def _wait_at_exit() -> None:
    """Wait for every pending async save; report the errors nobody has seen."""
    with _HANDLES_LOCK:
        handles = list(_HANDLES)
    for h in handles:
        error = h._future.exception()
        if error is not None and not h._reported:
            h._reported = True
            print(f"shardkit: the asynchronous save of {h!s} failed:", file=sys.stderr)
            traceback.print_exception(error)
