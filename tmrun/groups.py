"""Communication groups the runtime trains over, behind one small interface.

- :class:`RealGroup`: a gloo process group over a store prefix (one per generation). On GPUs an
  NCCL group derived by split/shrink from one communicator built at start is the planned second
  implementation (docs/design.md); the runtime does not care which it gets.
- :class:`SandboxGroup`: the standby's shadow world. Every collective is answered inside the
  process as a world of one would answer it (all-reduce returns its input, all-gather tiles the
  local tensor, broadcast and barrier return at once) with tensors of the right shape; nothing
  leaves the process. Its counters prove it: ``bytes_sent`` stays 0 while ``answered`` grows.

Every collective returns a ``torch.futures.Future`` whose value is the result tensor, so DDP's
communication hook can chain on it without blocking.
"""

from __future__ import annotations

import abc
import datetime

import torch
import torch.distributed as dist


def completed(value) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


class Group(abc.ABC):
    rank: int
    size: int
    bytes_sent: int = 0  # payload bytes handed to a transport by this process
    answered: int = 0  # collectives answered without any transport

    @property
    def contributors(self) -> int:
        """How many ranks' inputs a sum over this group adds up (a sandbox answers as one)."""
        return self.size

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.futures.Future:
        """Reduce ``tensor`` in place across the group (``sum``, or ``mean``: each input scaled by
        ``1/size`` before the sum, the order torch DDP uses, so that gradients match it bit for bit)."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.futures.Future: ...

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def close(self) -> None:
        """Release the transport; further collectives fail."""


class SandboxGroup(Group):
    """Answers every collective locally (shadow iterations on a standby)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.bytes_sent = 0
        self.answered = 0

    @property
    def contributors(self) -> int:
        return 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.futures.Future:
        _check_op(op)
        self.answered += 1
        return completed(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.futures.Future:
        self.answered += 1
        return completed(tensor)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.answered += 1
        return [tensor.clone() for _ in range(self.size)]

    def barrier(self) -> None:
        self.answered += 1


class RealGroup(Group):
    """A gloo group among ``size`` ranks that rendezvous through ``store``.

    ``timeout`` bounds a collective (a peer that does not answer fails it); connecting waits at
    least ``CONNECT_TIMEOUT``, since members of a new generation may start seconds apart.
    """

    CONNECT_TIMEOUT = datetime.timedelta(seconds=300)

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        self.rank, self.size = rank, size
        self.bytes_sent = 0
        self.answered = 0
        self.store = store  # the generation's store: torch-native mesh groups are built on it too
        self._pg = dist.ProcessGroupGloo(store, rank, size, max(timeout, self.CONNECT_TIMEOUT))
        self._pg.set_timeout(timeout)
        self._native: "dist.ProcessGroup | None" = None
        self.connect_s: dict[str, float] = {}  # where its build went, seconds (set by tmrun.swap's builder)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.futures.Future:
        _check_op(op)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        if op == "mean":  # as torch DDP does: each input times 1/size, then the sum (bit for bit)
            tensor.mul_(1.0 / self.size)
        self.bytes_sent += tensor.numel() * tensor.element_size()
        future = self._live.allreduce([tensor], options).get_future()
        return future.then(lambda f: f.value()[0])

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.futures.Future:
        options = dist.BroadcastOptions()
        options.rootRank = src
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        return self._live.broadcast([tensor], options).get_future().then(lambda f: f.value()[0])

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self._live.allgather([out], [tensor]).wait()
        return out

    def barrier(self) -> None:
        self._live.barrier().wait()

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return self._live.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        return self._live.recv([tensor], src, tag)

    @property
    def native(self) -> "dist.ProcessGroup | None":
        """This gloo group as a c10d ``ProcessGroup`` (None once closed): what the run's torch-native
        group forwards to (:mod:`tmrun.process_group`). Only this object holds it, so ``close``
        still drops the last reference to the connections."""
        if self._pg is not None and self._native is None:
            self._native = wrap(self._pg, self.store, self.rank, self.size)
        return self._native if self._pg is not None else None

    @property
    def _live(self) -> "dist.ProcessGroupGloo":
        if self._pg is None:
            raise RuntimeError(f"rank {self.rank}'s group of {self.size} was closed")
        return self._pg

    def close(self) -> None:
        """Abort and drop the gloo group. gloo's ``abort`` leaves its connections open; dropping the
        last reference closes them, so a peer waiting in a collective with this rank fails at once
        instead of at its collective timeout (a peer that is not a direct neighbour of a dead rank
        would otherwise wait that long)."""
        pg, self._pg, self._native = self._pg, None, None
        abort(pg)


def abort(gloo: "dist.ProcessGroupGloo | None") -> None:
    """Abort a gloo group, whatever state it is in (the caller then drops its last reference)."""
    if gloo is None:
        return
    try:
        gloo.abort()
    except (RuntimeError, AttributeError):
        pass


def _check_op(op: str) -> None:
    if op not in ("sum", "mean"):
        raise ValueError(f"unsupported reduce op {op!r}: use 'sum' or 'mean'")


def local_process_group() -> "dist.ProcessGroup":
    """A c10d ProcessGroup of one rank that never communicates: DDP's own group.

    DDP needs a ProcessGroup; every byte of gradient traffic goes through the runtime's
    communication hook instead, over whatever :class:`Group` is current.
    """
    store = dist.HashStore()
    return wrap(dist.ProcessGroupGloo(store, 0, 1), store, 0, 1)


def wrap(gloo: "dist.ProcessGroupGloo", store: dist.Store, rank: int, size: int) -> "dist.ProcessGroup":
    """A gloo backend as a c10d ``ProcessGroup``: the object with every collective's method
    (a backend alone lacks the coalesced ones FSDP2 calls)."""
    from torch._C._distributed_c10d import ProcessGroup

    group = ProcessGroup(store, rank, size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    return group
