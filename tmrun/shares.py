"""Batch-invariant steps: a fixed global batch of ``count`` shares, split over whatever ranks exist.

An elastic job changes its number of ranks mid-run. If each rank drew its own batch per step
(``batch(step, rank)``), a step would see other samples at another size. With shares, the samples
of step ``s`` are the same ``count`` shares whatever the size: rank ``r`` of ``W`` takes the
contiguous range ``[r·count // W, (r+1)·count // W)``, runs each of its shares (gradient
accumulation when it has more than one) and weights each share's loss by ``W / count``. The
run's data parallelism averages gradients over the ``W`` ranks, so the step's gradient is the
mean over all ``count`` shares' gradients at any ``W``::

    for step in run.steps(total=1000):
        for share in run.shares(count=12, ddp=ddp):
            x, y = batch(step, share.index)              # the data of one share, by its index
            run.backward(loss_fn(ddp(x), y) * share.weight)
        if run.commit():
            opt.step()
        opt.zero_grad()

With ``ddp`` given, every share but a rank's last runs under ``ddp.no_sync()``, so each rank
all-reduces once per step, as without accumulation. The result equals the fixed-size run's up to
the order of floating-point additions (see "Batch-invariant steps" in docs/design.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator


@dataclasses.dataclass(frozen=True)
class Share:
    """One share of a step's global batch: which one (``index`` of ``count``) and its loss weight."""

    index: int
    count: int
    weight: float  # world_size / count: multiply the share's mean loss by it


def share_range(rank: int, world_size: int, count: int) -> range:
    """The shares rank ``rank`` of ``world_size`` takes: contiguous, sizes differing by at most one."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if count < world_size:
        raise ValueError(f"{count} shares cannot be split over {world_size} ranks: each rank needs at least one "
                         "(choose count >= the job's largest world size, --nnodes MAX x --nproc-per-node)")
    return range(rank * count // world_size, (rank + 1) * count // world_size)


def iterate(rank: int, world_size: int, count: int, ddp: Any = None) -> Iterator[Share]:
    """This rank's shares of one step; with ``ddp``, all but the last under ``ddp.no_sync()``."""
    mine = share_range(rank, world_size, count)
    weight = world_size / count
    for position, index in enumerate(mine):
        last = position == len(mine) - 1
        with (ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext()):
            yield Share(index, count, weight)
