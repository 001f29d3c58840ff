"""``--redundancy 1``: every rank keeps, in host memory, a copy of its neighbour's shards.

FSDP2 shards have no replica: a SIGKILLed rank takes its shard with it. With redundancy, every
``every`` committed steps each rank takes a *snapshot* at the step boundary: a copy of its own
tracked state (tensors and leaves), and it sends its non-replicated tensors (the ones
:mod:`tmrun.replicas` gives a key) to its left neighbour, rank ``r - 1``, while receiving its
right neighbour's. The sends and receives run in gloo's threads on a group of their own, while
training goes on; the commit vote carries "my snapshot is complete", and once every rank says so
in the same vote, that snapshot is the *agreed* one (every rank agrees which, since they agree on
the vote).

After a failure whose shard has no replica, the exchange rolls back (:func:`restore`, and
``exchange_state``): the survivors restore their own agreed snapshot, everyone continues from its
step, and the joiner pulls the lost rank's shards from the lost rank's left neighbour, which
sends them from its copy. Two neighbours lost together lose a shard: the job restarts.

Host memory per rank: two copies of the rank's own state at most (its snapshot, the neighbour's
shards), plus a third while a new snapshot is under way.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from tmrun.groups import RealGroup, abort

TAG = 1 << 29
"""The snapshot's tags, far from the exchange's."""


@dataclasses.dataclass
class Snapshot:
    """One snapshot: ``own`` (every tracked tensor of this rank, as copies), ``leaves``, and
    ``neighbour`` (the right neighbour's keyed tensors, in its order). A thread waits for the
    sends and receives (gloo's point-to-point works say they are done only to ``wait``)."""

    step: int
    own: list[torch.Tensor]
    leaves: dict[str, Any]
    neighbour: list[torch.Tensor]
    works: list[Any] = dataclasses.field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        self._done = threading.Event()
        threading.Thread(target=self._wait, daemon=True, name=f"tmrun-snapshot-{self.step}").start()

    def _wait(self) -> None:
        try:
            for work in self.works:
                work.wait()  # gloo releases the GIL while it waits
        except RuntimeError as exc:  # a neighbour is gone: this snapshot never completes
            self.error = str(exc)[:300] or type(exc).__name__
        finally:
            self.works = []
            self._done.set()

    @property
    def complete(self) -> bool:
        if not self._done.is_set():
            return False
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class Redundancy:
    """A rank's snapshots in one generation (``group`` is that generation's :class:`RealGroup`)."""

    def __init__(self, every: int, timeout: float) -> None:
        self.every = every
        self.timeout = datetime.timedelta(seconds=timeout)
        self.agreed: Snapshot | None = None
        self.pending: Snapshot | None = None
        self._gloo: dist.ProcessGroupGloo | None = None
        self._gen = -1
        self.failed: str | None = None  # why the last snapshot failed (its group is dropped)

    def due(self, step: int) -> bool:
        return step % self.every == 0 and self.pending is None

    def start(self, group: RealGroup, gen: int, step: int, tensors: list[torch.Tensor], keyed: list[bool],
              leaves: dict[str, Any]) -> None:
        """Copy this rank's state and send its keyed tensors to the left neighbour, in the background."""
        if group.size < 2:
            return
        if self._gen != gen:  # one group for the snapshots per generation, built by every rank at the same step
            self.drop_group()
            store = dist.PrefixStore("redundancy", group.store)
            self._gloo = dist.ProcessGroupGloo(store, group.rank, group.size, self.timeout)
            self._gen = gen
        assert self._gloo is not None
        with torch.no_grad():
            own = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        mine = [t for t, k in zip(own, keyed) if k]
        neighbour = [torch.empty_like(t) for t in mine]
        left, right = (group.rank - 1) % group.size, (group.rank + 1) % group.size
        works = [self._gloo.send([t], left, TAG + i) for i, t in enumerate(mine)]
        works += [self._gloo.recv([t], right, TAG + i) for i, t in enumerate(neighbour)]
        self.pending = Snapshot(step, own, dict(leaves), neighbour, works)

    def vote(self) -> bool:
        """This rank's say in the commit vote: its pending snapshot is complete."""
        pending = self.pending
        if pending is None:
            return True
        try:
            return pending.complete
        except RuntimeError as exc:  # a neighbour is gone: this snapshot never completes
            self.failed = str(exc)[:300]
            self.pending = None
            return False

    def agree(self) -> None:
        """Every rank voted its snapshot complete: it is the one to roll back to."""
        if self.pending is not None and self.pending.complete:
            self.agreed, self.pending = self.pending, None

    def holds(self) -> int:
        """The step of the agreed snapshot, -1 when none."""
        return self.agreed.step if self.agreed is not None else -1

    def broken(self) -> None:
        """The generation broke: keep the agreed snapshot (the one to roll back to), drop the one
        under way and let go of the snapshots' connections."""
        self.pending = None
        self.drop_group()

    def new_generation(self) -> None:
        """After a switch: ranks may have changed hands; the next snapshot starts over."""
        self.pending = None
        self.agreed = None
        self.drop_group()

    def drop_group(self) -> None:
        gloo, self._gloo, self._gen = self._gloo, None, -1
        abort(gloo)


def restore(snapshot: Snapshot, tensors: list[torch.Tensor]) -> None:
    """Put this rank's own snapshot back into its live tensors."""
    with torch.no_grad():
        for live, saved in zip(tensors, snapshot.own):
            live.copy_(saved)
