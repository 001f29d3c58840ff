"""A real ``torch.distributed.ProcessGroup`` whose transport the runtime replaces at a switch.

torch's own parallelism (``DistributedDataParallel(model, process_group=...)``, ``fully_shard``,
DTensor on a ``DeviceMesh``) holds on to the process group it was given. :class:`SwappableGroup`
is that group: a Python subclass of c10d's ``ProcessGroup``, registered as the ``tmrun`` backend
(so torch's tables know it and ``DeviceMesh.from_group`` takes it), that forwards every
collective to its current *transport*: a gloo group of the current generation, or nothing on a
standby, where each collective is answered inside the process as a world of one would answer it
(the sandbox). At a switch the runtime attaches the next generation's gloo group; the script's
DDP, FSDP2 or DTensor objects never notice.

A collective that fails (a peer died) is latched on the run through its ``guard`` and answered
locally, so no exception reaches the script's backward or optimizer step; the rest of the step's
collectives are answered locally too, and ``run.commit()`` votes the step down (as for
``run.data_parallel``). Which collectives are forwarded: ``allreduce``, ``allreduce_coalesced``,
``allgather``, ``_allgather_base``/``all_gather_single``, ``allgather_into_tensor_coalesced``,
``reduce_scatter``, ``_reduce_scatter_base``/``reduce_scatter_single``,
``reduce_scatter_tensor_coalesced``, ``broadcast`` and ``barrier``: what DDP, FSDP2 and HSDP use.
Point-to-point and all-to-all (pipeline and tensor parallelism) are not (torch's base class
raises for them).

A standby promoted to another rank than the one its shadow ran as is *rebound*
(:meth:`SwappableGroup.rebind`): its group's members, rank and torch's rank tables follow.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions, BarrierOptions,
                                        BroadcastOptions, ProcessGroup, ReduceScatterOptions, Work,
                                        _create_work_from_future)

from tmrun.groups import completed

BACKEND = "tmrun"


class Guard(Protocol):
    """What a group asks of its run: whether this step's collectives already failed, and to latch one."""

    @property
    def group_failed(self) -> bool: ...

    def latch(self, error: BaseException, *, group_failed: bool = False) -> None: ...


class Transport(Protocol):
    """Where a group's collectives go: ``native`` is a c10d ProcessGroup, None once closed."""

    @property
    def native(self) -> ProcessGroup | None: ...


class Strict:
    """The guard without a run: errors are raised, as torch's own groups raise them."""

    group_failed = False

    def latch(self, error: BaseException, *, group_failed: bool = False) -> None:
        raise error


class SwappableGroup(ProcessGroup):
    """The ranks ``members`` (global ranks, in group-rank order) as one torch process group."""

    def __init__(self, members: Sequence[int], rank: int, guard: Guard | None = None) -> None:
        members = tuple(members)
        super().__init__(members.index(rank), len(members))
        self.members = members
        self.global_rank = rank
        self.guard: Guard = guard or Strict()
        self._transport: Transport | None = None  # None: the sandbox
        self._name = ""
        self.answered = 0  # collectives answered inside the process (the sandbox, or after a failure)
        self._pending: list[_Latched] = []  # forwarded works that may still hold the transport

    # ---------------------------------------------------------------- identity, as torch asks for it
    def getRank(self) -> int:  # noqa: N802 (c10d's names: the C++ callers reach these)
        return self.members.index(self.global_rank)

    def getSize(self) -> int:  # noqa: N802
        return len(self.members)

    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _get_backend(self, device: torch.device) -> "SwappableGroup":
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    # ---------------------------------------------------------------- the transport
    @property
    def sandboxed(self) -> bool:
        return self._transport is None

    def attach(self, transport: Transport | None) -> None:
        """Forward to ``transport`` from now on (None: answer everything inside the process)."""
        self.release()
        self._transport = transport

    def release(self) -> None:
        """Let go of every forwarded work (the transport was closed, or a new one attached), so that
        nothing in this process keeps the old connections open."""
        for work in self._pending:
            work.release()
        self._pending = []

    def rebind(self, members: Sequence[int], rank: int) -> None:
        """This process is now global rank ``rank``, in the group of ``members`` (a standby
        promoted to another rank than its shadow's); torch's rank table of the group follows."""
        self.members, self.global_rank = tuple(members), rank
        from torch.distributed import distributed_c10d

        if self in distributed_c10d._world.pg_group_ranks:
            distributed_c10d._world.pg_group_ranks[self] = {g: i for i, g in enumerate(self.members)}

    # ---------------------------------------------------------------- collectives
    def allreduce(self, tensors, opts=None):
        return self._forward(lambda t: t.allreduce(tensors, _opts(opts, AllreduceOptions)), tensors, lambda: None)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._forward(lambda t: t.allreduce_coalesced(tensors, _opts(opts, AllreduceCoalescedOptions)),
                             tensors, lambda: None)

    def broadcast(self, tensors, opts=None):
        return self._forward(lambda t: t.broadcast(tensors, _opts(opts, BroadcastOptions)), tensors, lambda: None)

    def barrier(self, opts=None):
        return self._forward(lambda t: t.barrier(_opts(opts, BarrierOptions)), [], lambda: None)

    def allgather(self, outputs, inputs, opts=None):
        def local() -> None:
            for outs, inp in zip(outputs, inputs):
                for out in outs:
                    out.copy_(inp)

        return self._forward(lambda t: t.allgather(outputs, inputs, _opts(opts, AllgatherOptions)),
                             [o for outs in outputs for o in outs], local)

    def _allgather_base(self, output, input, opts=None):
        return self._forward(lambda t: t._allgather_base(output, input, _opts(opts, AllgatherOptions)),
                             [output], lambda: _tile(output, input, self.getSize()))

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        def local() -> None:
            for out, inp in zip(outputs, inputs):
                _tile(out, inp, self.getSize())

        return self._forward(lambda t: t.allgather_into_tensor_coalesced(outputs, inputs,
                                                                          _opts(opts, AllgatherOptions)),
                             list(outputs), local)

    def reduce_scatter(self, outputs, inputs, opts=None):
        def local() -> None:
            for out, ins in zip(outputs, inputs):
                out.copy_(ins[self.getRank()])

        return self._forward(lambda t: t.reduce_scatter(outputs, inputs, _opts(opts, ReduceScatterOptions)),
                             list(outputs), local)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._forward(lambda t: t._reduce_scatter_base(output, input, _opts(opts, ReduceScatterOptions)),
                             [output], lambda: _own_chunk(output, input, self.getRank(), self.getSize()))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        def local() -> None:
            for out, inp in zip(outputs, inputs):
                _own_chunk(out, inp, self.getRank(), self.getSize())

        return self._forward(lambda t: t.reduce_scatter_tensor_coalesced(outputs, inputs,
                                                                          _opts(opts, ReduceScatterOptions)),
                             list(outputs), local)

    def _forward(self, call: Callable[[dist.ProcessGroup], dist.Work], results: list[torch.Tensor],
                 local: Callable[[], None]) -> dist.Work:
        """``call`` on the transport; answered locally (``local`` fills ``results``) in the sandbox,
        once this step's group failed, or when the call fails, which is latched, never raised."""
        transport = self._transport
        if transport is None or self.guard.group_failed:
            return self._answer(results, local)
        native = transport.native
        try:
            if native is None:
                raise RuntimeError(f"rank {self.global_rank}'s group of this generation was closed")
            work = call(native)
        except RuntimeError as exc:
            self.guard.latch(_bare(exc), group_failed=True)
            return self._answer(results, local)
        latched = _Latched(work, results, self.guard)
        self._pending = [w for w in self._pending if w.holding]
        self._pending.append(latched)
        return latched

    def _answer(self, results: list[torch.Tensor], local: Callable[[], None]) -> dist.Work:
        local()
        self.answered += 1
        return _create_work_from_future(completed(results))


class _Latched(Work):
    """A transport's work whose failure is latched on the run instead of raised: ``wait`` returns,
    and the future (DDP chains on it) completes with the results buffers either way.

    It lets go of the transport's work once that is over, or when the group is released: a gloo
    work holds its group's connections, and a peer blocked in a collective with this rank fails
    at once only when nothing here holds them any more (FSDP2 keeps its works between calls).
    """

    def __init__(self, work: Work, results: list[torch.Tensor], guard: Guard) -> None:
        super().__init__()
        self._work: Work | None = work
        self._results, self._guard = results, guard

    @property
    def holding(self) -> bool:
        return self._work is not None

    def release(self) -> None:
        self._work = None

    def wait(self, timeout=None) -> bool:
        work = self._work
        if work is None:
            return True
        self._work = None
        try:
            work.wait()
        except RuntimeError as exc:  # a peer is gone: this step cannot commit
            del work
            self._guard.latch(_bare(exc), group_failed=True)
        return True

    def is_completed(self) -> bool:
        work = self._work
        return work is None or work.is_completed()

    def get_future(self) -> torch.futures.Future:
        work = self._work
        if work is None:
            return completed(self._results)
        try:
            inner = work.get_future()
        except RuntimeError:  # some of gloo's works have no future: wait, then a completed one
            self.wait()
            return completed(self._results)

        def settle(future: torch.futures.Future) -> list[torch.Tensor]:
            self._work = None
            try:
                future.wait()
            except RuntimeError as exc:
                self._guard.latch(_bare(exc), group_failed=True)
            return self._results

        return inner.then(settle)


def _bare(error: RuntimeError) -> RuntimeError:
    """``error`` without its traceback: the run keeps the error until the step is voted, and the
    traceback's frames would keep the failed work (and with it the group's connections) alive."""
    return error.with_traceback(None)


def _opts(opts, kind):
    return opts if opts is not None else kind()


def _tile(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    """A world of one's all-gather into one tensor: every rank's block is this rank's input."""
    for block in output.chunk(size):
        block.copy_(input.view_as(block))


def _own_chunk(output: torch.Tensor, input: torch.Tensor, rank: int, size: int) -> None:
    """A world of one's reduce-scatter: this rank's block of its own input."""
    output.copy_(input.chunk(size)[rank].view_as(output))
