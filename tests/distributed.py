"""A small harness for tests that run N torch.distributed ranks on this machine.

    results = run_ranks(fn, 2, arg1, arg2, timeout=60)

spawns `world` processes (``torch.multiprocessing`` spawn context), each joins a gloo process
group on 127.0.0.1 through a FileStore in a fresh temp directory (no ports to collide), calls
``fn(rank, world, *args)`` and sends back what it returned, or the exception it raised. The
call returns the list of results in rank order (exceptions as values, with the rank's traceback
as a note; see `raise_any`), and fails the test if a rank is not done within `timeout` seconds
of the moment every rank had started (imported torch and joined the group; that may take up
to START_TIMEOUT on a busy machine); every rank is killed then. With ``stop_on_kill=True`` a
rank that dies of a signal tears the job down, as a launcher does: the other ranks are killed
at once.
`fn` and its arguments must be picklable (module-level functions). Spawning costs about 2 s per
process (importing torch), so a test should run several cases per spawn.

`forked_rounds` runs many short rounds in children forked from each rank process, each round
with a process group of its own: cheap repetition, and a child may be SIGKILLed.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

GROUP_TIMEOUT = 60.0  # seconds; gloo's own timeout for the process group
START_TIMEOUT = 600.0  # seconds for every rank to import torch and join: only a hang is slower


class RankError(Exception):
    """A rank's exception that could not be pickled back, as text; or a rank that exited
    without a result (`exitcode` set: negative, the signal that killed it)."""

    exitcode: int | None = None


def _exited(rank: int, exitcode: int | None) -> RankError:
    error = RankError(f"rank {rank} exited with code {exitcode}")
    error.exitcode = exitcode
    return error


def init_group(rank: int, world: int, store_file: str, timeout: float = GROUP_TIMEOUT) -> None:
    """Join the gloo process group of `world` ranks rendezvousing at `store_file`."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))


def _worker(rank: int, world: int, store_file: str | None, results: Any,
            fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if store_file is not None:
            init_group(rank, world, store_file)
        results.put((rank, None))  # ready: `timeout` counts from here
        value: Any = fn(rank, world, *args)
    except BaseException as e:
        e.add_note(f"in rank {rank} of {world}:\n" + "".join(traceback.format_exception(e)))
        value = e
    try:
        payload = pickle.dumps(value)
    except Exception:
        payload = pickle.dumps(RankError("".join(traceback.format_exception(value)))
                               if isinstance(value, BaseException)
                               else RankError(f"unpicklable result {value!r}"))
    results.put((rank, payload))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0,
              init: bool = True, stop_on_kill: bool = False) -> list[Any]:
    """``fn(rank, world, *args)`` on `world` spawned ranks; results (or exceptions) by rank.
    With ``init=False`` no process group is created (for `forked_rounds`). With
    ``stop_on_kill=True``, once a rank has died of a signal the others are killed, each rank
    without a result reported as a `RankError` with its exit code."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="shardkit-ranks-") as tmp:
        store = os.path.join(tmp, "store") if init else None
        procs = [ctx.Process(target=_worker, args=(r, world, store, results, fn, args),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        ready: set[int] = set()
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while len(got) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    if len(ready) < world:
                        raise TimeoutError(
                            f"ranks {sorted(set(range(world)) - ready)} of {world} not started "
                            f"(torch imported, group joined) within {START_TIMEOUT} s")
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} of "
                                       f"{world} not done within {timeout} s")
                try:
                    rank, payload = results.get(timeout=min(left, 0.25))
                    if payload is None:
                        ready.add(rank)
                        if len(ready) == world:  # every rank has started: now the work
                            deadline = time.monotonic() + timeout
                        continue
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in got and p.exitcode is not None]
                    if dead:
                        time.sleep(0.5)  # a result may still be in the pipe
                        while not results.empty():
                            rank, payload = results.get()
                            if payload is not None:
                                got[rank] = pickle.loads(payload)
                        if stop_on_kill and any(r not in got and (procs[r].exitcode or 0) < 0
                                                for r in dead):
                            for p in procs:
                                if p.is_alive():
                                    p.kill()
                            for p in procs:
                                p.join(timeout=5)
                            dead = [r for r in range(world) if r not in got]
                        for r in dead:
                            got.setdefault(r, _exited(r, procs[r].exitcode))
                    continue
                got[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [got[r] for r in range(world)]


def raise_any(results: list[Any]) -> list[Any]:
    """`results`, after raising the first exception among them (the other ranks' ones, often
    the cause, as notes on it)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    for other in errors[1:]:
        errors[0].add_note("and " + "".join(traceback.format_exception_only(other)))
    if errors:
        raise errors[0]
    return results


def forked_rounds(rank: int, world: int, rounds: int, workdir: str,
                  body: Callable[[int, int, int], Any], timeout: float) -> list[Any]:
    """In rank process `rank`: for each round, fork a child that joins a fresh gloo group
    (its own FileStore under `workdir`), runs ``body(rank, world, round)`` and reports through
    a pipe. Returns per round the child's result, its exception, or ``("killed", signal)``
    when it died of a signal (a body may SIGKILL its own process). A child still running
    after `timeout` seconds is killed and reported as ``("hung", elapsed)``."""
    out = []
    for i in range(rounds):
        read, write = os.pipe()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.close(read)
                init_group(rank, world, os.path.join(workdir, f"store-{i}"), timeout)
                try:
                    value: Any = body(rank, world, i)
                except BaseException as e:
                    value = e
                try:
                    data = pickle.dumps(value)
                except Exception:
                    data = pickle.dumps(RankError(repr(value)))
                with os.fdopen(write, "wb") as f:
                    f.write(data)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(write)
        data = b""
        hung = None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            with_chunk = _read_some(read)
            data += with_chunk
            if done:
                data += _read_all(read)
                break
            if time.monotonic() - started > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                hung = ("hung", time.monotonic() - started)
                break
            if not with_chunk:
                time.sleep(0.02)
        os.close(read)
        if hung is not None:
            out.append(hung)
        elif os.WIFSIGNALED(status):
            out.append(("killed", os.WTERMSIG(status)))
        else:
            out.append(pickle.loads(data) if data else RankError(
                f"round {i}: child exited with {os.waitstatus_to_exitcode(status)}"))
    return out


def _read_some(fd: int) -> bytes:
    import select

    if select.select([fd], [], [], 0)[0]:
        try:
            return os.read(fd, 1 << 16)
        except OSError:
            return b""
    return b""


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
