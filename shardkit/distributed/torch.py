"""`Coordinator` over a torch.distributed process group (gloo on CPU; NCCL with the same code).

Payloads are pickled into uint8 tensors. A collective is one torch.distributed collective of
a fixed size per rank (`inline` bytes: the payload's length, then the payload if it fits), so
that a small payload costs one round trip; a larger one takes a second collective of the largest
length, which every rank knows from the first (a gather's first round is an all-gather, so that
its senders know too). Each is started with ``async_op=True`` and waited for with the
coordinator's timeout, so a stuck rank raises DistributedTimeoutError instead of hanging. A
rank that dies closes its connections and the others fail at once. For NCCL the tensors live
on the current CUDA device, as NCCL requires. Which ranks did not answer is read from the
group's store, where every rank records the number of the collective it has reached.

After a timeout, the process group is in an undefined state (torch's own rule): create a new
one before the next collective.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import numpy as np

from ..errors import DistributedTimeoutError
from .base import DEFAULT_TIMEOUT, Coordinator

_SEQUENCE: dict[str, int] = {}  # process group name -> collectives made through shardkit
INLINE = 64 * 1024  # most bytes per rank of a collective's first round (1 MiB over all ranks)
_LEN = 8  # a first round starts with the payload's length, a little-endian int64


class TorchCoordinator(Coordinator):
    """This process's rank in torch.distributed process `group` (None: the default group)."""

    def __init__(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError(
                "a collective save needs torch.distributed initialised "
                "(torch.distributed.init_process_group) in every rank")
        self._torch = torch
        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self.group)
        self._world = dist.get_world_size(self.group)
        if self._rank < 0:
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError("this process is not a member of the process group given")
        backend = str(dist.get_backend(self.group)).lower()
        self._device = (torch.device("cuda", torch.cuda.current_device())
                        if "nccl" in backend else torch.device("cpu"))
        self.timeout = float(timeout)
        self._store = _group_store(dist, self.group)
        self._name = getattr(self.group, "group_name", "") or "default"

    @property
    def _seq(self) -> int:
        """The number of this group's collectives made so far, in this process (shared by
        every coordinator of the group, so that the ranks' numbers stay comparable)."""
        return _SEQUENCE.get(self._name, 0)

    @_seq.setter
    def _seq(self, value: int) -> None:
        _SEQUENCE[self._name] = value

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _global(self, group_rank: int) -> int:
        if self.group is self._dist.group.WORLD:
            return group_rank
        return int(self._dist.get_global_rank(self.group, group_rank))  # type: ignore[arg-type]

    def background(self) -> TorchCoordinator:
        """A coordinator over a process group of its own with the same ranks (created on
        first use, with ``use_local_synchronization``: only these ranks take part)."""
        got = getattr(self, "_background", None)
        if got is None:
            dist = self._dist
            ranks = [self._global(r) for r in range(self._world)]
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout),
                                   backend=dist.get_backend(self.group),
                                   use_local_synchronization=True)
            got = self._background = TorchCoordinator(group, self.timeout)
        return got

    # -- the collectives

    def all_gather(self, payload: Any, op: str) -> list[Any]:
        return self._collect(payload, op, None)  # type: ignore[return-value]

    def gather(self, payload: Any, op: str, dst: int = 0) -> list[Any] | None:
        return self._collect(payload, op, dst)

    def _collect(self, payload: Any, op: str, dst: int | None) -> list[Any] | None:
        """Every rank's payload on rank `dst` (None on the others), on every rank for None."""
        self._enter(op)
        if self._world == 1:
            return [payload]
        data = _to_bytes(payload)
        first, sizes = self._first(data, op)
        keep = dst is None or self._rank == dst
        if max(sizes) <= self._inline() - _LEN:
            return [_from_bytes(t, n, _LEN) for t, n in zip(first, sizes)] if keep else None
        buf = self._padded(data, max(sizes))
        nccl = self._device.type != "cpu"  # NCCL has no gather: all_gather and keep ours
        out = [self._torch.empty_like(buf) for _ in range(self._world)] if keep or nccl else None
        if dst is None or nccl:
            self._wait(self._dist.all_gather(out, buf, group=self.group, async_op=True), op)
        else:
            self._wait(self._dist.gather(buf, out, dst=self._global(dst), group=self.group,
                                         async_op=True), op)
        return [_from_bytes(t, n) for t, n in zip(out, sizes)] if out is not None and keep else None

    def broadcast(self, payload: Any, op: str, src: int = 0) -> Any:
        self._enter(op)
        if self._world == 1:
            return payload
        data = _to_bytes(payload) if self._rank == src else b""
        inline = self._inline()
        buf = self._head(data, inline)
        self._wait(self._dist.broadcast(buf, self._global(src), group=self.group,
                                        async_op=True), op)
        n = _length(buf)
        start = _LEN
        if n > inline - _LEN:  # a second round, of the whole payload
            buf = self._padded(data, n) if self._rank == src else self._torch.empty(
                n, dtype=self._torch.uint8, device=self._device)
            self._wait(self._dist.broadcast(buf, self._global(src), group=self.group,
                                            async_op=True), op)
            start = 0
        return payload if self._rank == src else _from_bytes(buf, n, start)

    def barrier(self, op: str) -> None:
        self._sizes(0, op)

    # -- plumbing

    def _sizes(self, n: int, op: str) -> list[int]:
        """Every rank's `n` (an all_gather of one int64): the barrier."""
        torch = self._torch
        self._enter(op)
        mine = torch.tensor([n], dtype=torch.int64, device=self._device)
        if self._world == 1:
            return [n]
        out = [torch.empty_like(mine) for _ in range(self._world)]
        self._wait(self._dist.all_gather(out, mine, group=self.group, async_op=True), op)
        return [int(t.item()) for t in out]

    def _inline(self) -> int:
        """Bytes per rank of a first round: INLINE, less for many ranks (at least 4 KiB)."""
        return max(4096, min(INLINE, (1 << 20) // self._world))

    def _head(self, data: bytes, inline: int) -> Any:
        """A first round's buffer: the length of `data`, then `data` if it fits."""
        fits = len(data) <= inline - _LEN
        return self._padded(len(data).to_bytes(_LEN, "little") + (data if fits else b""),
                            inline)

    def _first(self, data: bytes, op: str) -> tuple[list[Any], list[int]]:
        """A first round, an all-gather: every rank's buffer and payload length."""
        buf = self._head(data, self._inline())
        out = [self._torch.empty_like(buf) for _ in range(self._world)]
        self._wait(self._dist.all_gather(out, buf, group=self.group, async_op=True), op)
        return out, [_length(t) for t in out]

    def _padded(self, data: bytes, size: int) -> Any:
        torch = self._torch
        buf = torch.zeros(size, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return buf.to(self._device) if self._device.type != "cpu" else buf

    def _enter(self, op: str) -> None:
        """Record in the store that this rank reached collective number `_seq`."""
        self._seq += 1
        if self._store is not None:
            try:
                self._store.set(f"shardkit/{self._name}/{self._rank}", str(self._seq))
            except Exception:  # the store is a diagnostic aid only
                self._store = None

    def _wait(self, work: Any, op: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # gloo: "Operation timed out!", or a peer's closed connection
            missing = self._missing()
            who = (f"rank{'s' if len(missing) != 1 else ''} "
                   f"{', '.join(map(str, missing))} did not answer" if missing
                   else "a rank did not answer or left the group")
            raise DistributedTimeoutError(
                f"collective {op!r} (number {self._seq}) failed on rank {self._rank} of "
                f"{self._world} within {self.timeout:g} s: {who} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})") from e

    def _missing(self) -> list[int]:
        """The ranks whose last recorded collective is before ours (best effort)."""
        store = self._store
        if store is None:
            return []
        missing = []
        try:
            for r in range(self._world):
                key = f"shardkit/{self._name}/{r}"
                if not store.check([key]) or int(store.get(key)) < self._seq:
                    missing.append(r)
        except Exception:
            return []
        return missing


def _group_store(dist: Any, group: Any) -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_process_group_store

        return _get_process_group_store(group)
    except Exception:  # a private helper: without it, errors do not name the ranks
        return None


def _to_bytes(payload: Any) -> bytes:
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def _from_bytes(t: Any, n: int, start: int = 0) -> Any:
    if t.device.type != "cpu":
        t = t.cpu()
    return pickle.loads(np.asarray(t.numpy()[start : start + n]).tobytes())


def _length(t: Any) -> int:
    """The payload length at the start of a first round's buffer."""
    if t.device.type != "cpu":
        t = t[:_LEN].cpu()
    return int.from_bytes(np.asarray(t.numpy()[:_LEN]).tobytes(), "little")
