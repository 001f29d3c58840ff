"""Which ranks hold a copy of each piece of tracked state, and a receiver's pull from those only.

Under data parallelism every rank holds the same state, so a joiner may take any tensor from any
source. Under FSDP2 every rank holds its own shard and nobody else has it; under HSDP the ranks of
one replicate group hold the same shard. tmrun reads this off the state itself: a tensor of a
``state_dict`` that is a DTensor is replicated exactly over the mesh dimensions whose placement
is ``Replicate()``, so two ranks hold the same local tensor when their coordinates agree on every
other dimension. A plain tensor is replicated on every rank (DDP, and the scalars of an optimizer).

:func:`replica_pulls` plans each receiver's pull of each tensor from the sources that hold *its*
copy (the ranks whose key equals the receiver's), and raises :class:`NoReplica` when one has none
(every holder of a shard was lost): the job must not train on shadow state.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from tmrun.pull import Pull, pull_plans

Key = Callable[[int], tuple[int, ...] | None]
"""A tensor's replica key of a rank: ranks with equal keys hold the same bytes (None: none)."""


class NoReplica(LookupError):
    """No source holds a receiver's copy of some tensor."""


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds of ``tensor``: a DTensor's local shard, else the tensor."""
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def key_of(tensor: torch.Tensor) -> Key | None:
    """``tensor``'s replica key function; None when every rank holds the same (a plain tensor)."""
    mesh, placements = getattr(tensor, "device_mesh", None), getattr(tensor, "placements", None)
    if mesh is None or placements is None:
        return None
    layout = mesh.mesh
    kept = tuple(dim for dim, placement in enumerate(placements) if not placement.is_replicate())
    if not kept:
        return None

    def key(rank: int) -> tuple[int, ...] | None:
        where = (layout == rank).nonzero()
        if where.numel() == 0:
            return None
        coordinate = where[0].tolist()
        return tuple(coordinate[dim] for dim in kept)

    return key


def replica_pulls(tensors: Sequence[torch.Tensor], keys: Sequence[Key | None], paths: Sequence[str],
                  sources: Sequence[int], receivers: Sequence[int], rates: Sequence[Sequence[int]],
                  pull: str = "planned", copies: Callable[[int], int | None] | None = None,
                  from_copies: set[tuple[int, int]] | None = None) -> list[Pull]:
    """Each receiver's pieces, every tensor from the sources that hold the receiver's copy of it.

    ``copies``: where no source holds a receiver's copy of a tensor, the rank that keeps a
    redundant copy of that receiver's shards (:mod:`tmrun.redundancy`), if it is a source; such
    pieces are added to ``from_copies`` as ``(receiver, tensor index)``: their source sends them
    from its copy, not from its own tensor.
    """
    if all(key is None for key in keys):
        return pull_plans(tensors, sources, receivers, rates, pull)
    plans = []
    for dst in receivers:
        classes: dict[tuple[int, ...], list[int]] = {}
        for index, key in enumerate(keys):
            mine = key(dst) if key is not None else None
            holders = tuple(src for src in sources if key is None or (mine is not None and key(src) == mine))
            keeper = copies(dst) if copies is not None and not holders else None
            if keeper is not None and keeper in sources:
                holders = (keeper,)
                if from_copies is not None:
                    from_copies.add((dst, index))
            if not holders:
                raise NoReplica(f"no surviving rank holds rank {dst}'s copy of {paths[index]} "
                                f"(its holders hold key {mine}; sources {list(sources)})")
            classes.setdefault(holders, []).append(index)
        pieces = []
        predicted: float | None = 0.0
        for holders, indices in classes.items():
            (part,) = pull_plans([tensors[i] for i in indices], holders, (dst,), rates, pull)
            pieces += [dataclasses.replace(piece, tensor=indices[piece.tensor]) for piece in part.pieces]
            predicted = None if predicted is None or part.predicted is None else max(predicted, part.predicted)
        plans.append(Pull(dst, tuple(pieces), predicted))
    return plans
