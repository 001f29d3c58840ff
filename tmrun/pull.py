"""Pulling a receiver's state from several sources, in shares set by measured link rates.

A switch's state exchange (:func:`tmrun.swap.exchange_state`) sends every tracked tensor from the
*sources* (the ranks at the highest committed step) to each *receiver*. This module decides who
sends which bytes, and does the sending:

- :func:`probe_links`, phase 1's light probe: on a group just built in the background, each
  joiner that will pull from the replicas times a small message and ``PROBE_BYTES`` from every
  other rank, one source at a time; the difference is the link's rate (bytes/s).
- :func:`pull_plans`: every rank of the new group knows every receiver's measured rates (they
  travel in the exchange's header, one row per rank), so every rank computes the same plan per
  receiver, a pure function of the tensors and the rates (:mod:`tmrun.transfer_plan`): no plan
  needs to be written to etcd and read back during the stall.
- :func:`transfer`: all sends and receives of every plan in flight at once, each shard straight
  from the source's tensor into the receiver's (a contiguous slice: nothing is copied; a tensor
  that is not contiguous travels whole, through one contiguous copy on each side).

Three ways to pull (``pull=``): ``planned`` (the default: shards by rate), ``striped`` (tensor
``i`` whole from source ``i mod n``, what tmrun did before; kept for the benchmarks) and
``single`` (everything from the receiver's fastest source).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from tmrun.groups import RealGroup
from tmrun.transfer_plan import Link, Tensor, plan_transfer

PROBE_BYTES = 1 << 20
"""Bytes a joiner receives from each source in phase 1's probe."""
PINGS = 3
"""8-byte round trips a probe times before its ``PROBE_BYTES``: the quickest is the round trip."""
LOADS = 2
"""Times a probe receives ``PROBE_BYTES`` from each source: the quickest counts (a process that
was not on a CPU at once only ever makes a transfer slower, never faster)."""
PROBE_TAG = 1 << 30
"""The probe's tags: far above any tensor tag of an exchange."""
PULLS = ("planned", "striped", "single")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of tensor number ``tensor``, sent by ``source``."""

    tensor: int
    start: int
    stop: int
    source: int


@dataclasses.dataclass(frozen=True)
class Pull:
    """What one receiver gets from whom, and when the last byte is predicted in (seconds)."""

    receiver: int
    pieces: tuple[Piece, ...]
    predicted: float | None  # None: a rate the plan used was not measured


def probe_links(group: RealGroup, receivers: Sequence[int], nbytes: int = PROBE_BYTES) -> dict[int, float]:
    """Phase 1's probe: on a receiver, ``{source rank: bytes/s}`` for every rank not in
    ``receivers``; on every other rank, ``{}`` once it answered each receiver.

    A receiver asks one source at a time (the others do not share its link meanwhile): for 8
    bytes, ``PINGS`` times, then for ``nbytes``, ``LOADS`` times; the rate is ``nbytes`` over the
    quickest of those less the quickest ping, so the round trip cancels out (a single ping is too
    noisy: on a fresh connection one took 5 ms where the quickest took 0.3; a single load on a
    loaded machine came out 18% slow once). Every rank must call this with the same ``receivers``.
    """
    me = group.rank
    sources = [rank for rank in range(group.size) if rank not in receivers]
    ask = torch.zeros(1, dtype=torch.int64)
    small, big = torch.zeros(1, dtype=torch.int64), torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    rates: dict[int, float] = {}
    if me in receivers:
        for src in sources:
            took = []
            for payload in (small,) * PINGS + (big,) * LOADS:
                started = time.perf_counter()
                group.send(ask, src, PROBE_TAG).wait()
                group.recv(payload, src, PROBE_TAG + 1).wait()
                took.append(time.perf_counter() - started)
            rates[src] = big.numel() / max(min(took[PINGS:]) - min(took[:PINGS]), 1e-6)
    else:
        for dst in receivers:
            for payload in (small,) * PINGS + (big,) * LOADS:
                group.recv(ask, dst, PROBE_TAG).wait()
                group.send(payload, dst, PROBE_TAG + 1).wait()
    return rates


def pull_plans(tensors: Sequence[torch.Tensor], sources: Sequence[int], receivers: Sequence[int],
               rates: Sequence[Sequence[int]], pull: str = "planned") -> list[Pull]:
    """Each receiver's pieces. ``rates[dst][src]``: bytes/s from ``src`` to ``dst``, 0 when not
    measured. The same input gives the same plans on every rank."""
    if pull not in PULLS:
        raise ValueError(f"unknown pull {pull!r}: use one of {', '.join(PULLS)}")
    specs = [_spec(index, tensor) for index, tensor in enumerate(tensors)]
    plans = []
    for dst in receivers:
        measured = {src: float(rates[dst][src]) or None for src in sources}
        if pull == "planned":
            plan = plan_transfer(specs, {src: Link(rate) for src, rate in measured.items()})
            pieces = tuple(Piece(index, shard.start, shard.stop, shard.source)
                           for index, tensor in enumerate(plan.tensors) for shard in tensor.shards)
        elif pull == "striped":
            pieces = tuple(Piece(index, 0, spec.nbytes, sources[index % len(sources)])
                           for index, spec in enumerate(specs) if spec.nbytes)
        else:
            fastest = min(sources, key=lambda src: (-(measured[src] or 0.0), src))
            pieces = tuple(Piece(index, 0, spec.nbytes, fastest) for index, spec in enumerate(specs) if spec.nbytes)
        plans.append(Pull(dst, pieces, _predicted(pieces, measured)))
    return plans


def transfer(group: RealGroup, tensors: Sequence[torch.Tensor], plans: Sequence[Pull],
             sending: Callable[[int, int], torch.Tensor] | None = None) -> tuple[int, dict[int, tuple[int, float]]]:
    """Post every send and receive of ``plans`` that involves this rank, then wait for them.

    Returns the bytes this rank received and, per source, ``(bytes, seconds until its last
    piece was in)``; the seconds are an upper bound (receives are waited for in the order they
    were posted). Tags count a receiver's pieces from 0, so every pair agrees on them.
    """
    me = group.rank
    works = []
    started = time.monotonic()
    for plan in plans:
        for tag, piece in enumerate(plan.pieces):
            tensor = tensors[piece.tensor]
            if me == piece.source:
                out = sending(plan.receiver, piece.tensor) if sending is not None else tensor
                works.append((None, 0, group.send(_view(out, piece), plan.receiver, tag), None))
            elif me == plan.receiver:
                size = piece.stop - piece.start
                into = _view(tensor, piece) if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=
                                                                                             torch.contiguous_format)
                works.append((piece.source, size, group.recv(into, piece.source, tag), (tensor, into)))
    received = 0
    links: dict[int, tuple[int, float]] = {}
    for src, size, work, landed in works:
        work.wait()
        if landed is not None and landed[0] is not landed[1] and not landed[0].is_contiguous():
            landed[0].copy_(landed[1])
        if src is not None:
            received += size
            got, _ = links.get(src, (0, 0.0))
            links[src] = (got + size, time.monotonic() - started)
    return received, links


def tags_used(plans: Sequence[Pull]) -> int:
    """The first tag no plan uses (where the exchange's other messages may start)."""
    return max((len(plan.pieces) for plan in plans), default=0)


def _spec(index: int, tensor: torch.Tensor) -> Tensor:
    """A tensor as the planner sees it; one that is not contiguous travels whole (one element)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() or nbytes == 0:
        return Tensor(str(index), nbytes, tensor.element_size())
    return Tensor(str(index), nbytes, nbytes)


def _view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The bytes of ``piece`` as a view into ``tensor`` (the tensor itself when it travels whole;
    a contiguous copy of one that is not, which gloo cannot send in place)."""
    nbytes = tensor.numel() * tensor.element_size()
    if piece.start == 0 and piece.stop == nbytes:
        return tensor.contiguous()
    size = tensor.element_size()
    return tensor.view(-1)[piece.start // size:piece.stop // size]


def _predicted(pieces: Sequence[Piece], measured: dict[int, float | None]) -> float | None:
    """The last source's finish: its bytes over its rate (None when a source's rate is unknown)."""
    loads: dict[int, int] = {}
    for piece in pieces:
        loads[piece.source] = loads.get(piece.source, 0) + piece.stop - piece.start
    if any(not measured[src] for src in loads):
        return None
    return max((load / measured[src] for src, load in loads.items()), default=0.0)
