"""Planning a joiner's transfer: which source sends which bytes of which tensor, by link rate.

The leader plans each joiner's state transfer from the measured links between the sources (the
ranks that hold the state) and the joiner, so that the transfer ends as early as possible. Pure
logic: no clock, no store, no torch; the same input always gives the same plan.

The problem (Chaos's formulation; docs/design.md, "Planning a joiner's transfer")::

    shards p (bytes b_p), sources s (rate r_s bytes/s, latency l_s s)
    x[p, s] = 1 when s sends p;  every p sent by exactly one s
    finish_s = l_s + sum_p b_p x[p, s] / r_s   (0 for a source that sends nothing)
    minimise  finish = max_s finish_s

Solved in two steps:

1. :func:`cut` — each tensor is cut into 1, 2, 4, ... equal, element-aligned shards (a
   divisibility chain of shard counts), the fewest that bring a shard under ``total /
   (SHARDS_PER_SOURCE * sources)``; never below ``min_shard`` bytes (1 MiB), so a small tensor
   stays whole, and never when there is one source.
2. :func:`assign` — greedy: the largest shard first (ties: tensor order, then offset), each to
   the source that would finish it earliest (ties: the lower rank).

Sources: a rate of ``None`` (not measured) counts as the median of the measured positive rates
(:data:`DEFAULT_RATE` when none is); a rate of 0 (link down) is never used. No usable source, a
negative, NaN or infinite number, or a tensor whose size is not a multiple of its itemsize is a
``ValueError``.

A plan is plain JSON with ``"v": 1`` (:meth:`TransferPlan.to_dict`); :func:`parse_plan` checks a
plan read back (from etcd) and raises ``ValueError`` with a one-line message when it is not one.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Mapping, NamedTuple, Sequence

SCHEMA = 1
MIN_SHARD = 1 << 20
"""Bytes: no tensor is cut into shards smaller than this."""
SHARDS_PER_SOURCE = 8
"""Cut tensors until a shard is at most total / (SHARDS_PER_SOURCE * usable sources) bytes."""
DEFAULT_RATE = 1e9
"""Bytes/s assumed for every unmeasured link when no link has been measured."""


class Tensor(NamedTuple):
    """One tracked tensor of the joiner's state, as the planner sees it."""

    name: str
    nbytes: int
    itemsize: int = 1


class Link(NamedTuple):
    """A source's link to the joiner: rate in bytes/s (``None``: not measured), latency in s."""

    rate: float | None
    latency: float = 0.0


class Piece(NamedTuple):
    """Bytes ``[start, stop)`` of tensor number ``tensor``: one shard before it is assigned."""

    tensor: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Shard:
    """Bytes ``[start, stop)`` of a tensor, sent by ``source`` (elements: divide by itemsize)."""

    source: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    name: str
    nbytes: int
    itemsize: int
    shards: tuple[Shard, ...]


@dataclasses.dataclass(frozen=True)
class SourceLoad:
    """What one usable source sends and when it is predicted to be done."""

    rank: int
    rate: float
    latency: float
    nbytes: int
    finish: float


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    tensors: tuple[TensorPlan, ...]
    sources: tuple[SourceLoad, ...]
    finish: float
    """Predicted seconds until the last byte arrived: the largest source finish."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (lists, not tuples), with the schema version."""
        return {"v": SCHEMA, "finish": self.finish,
                "sources": [dataclasses.asdict(s) for s in self.sources],
                "tensors": [{"name": t.name, "nbytes": t.nbytes, "itemsize": t.itemsize,
                             "shards": [dataclasses.asdict(s) for s in t.shards]} for t in self.tensors]}


# -- planning -----------------------------------------------------------------------------------


def plan_transfer(tensors: Sequence[Tensor | tuple], sources: Mapping[int, Link | float | None], *,
                  min_shard: int = MIN_SHARD) -> TransferPlan:
    """The joiner's transfer: ``tensors`` as (name, nbytes[, itemsize]), ``sources`` by rank."""
    specs = _tensors(tensors)
    links = usable_links(sources)
    pieces = cut(specs, len(links), min_shard=min_shard)
    owners = assign(pieces, links)
    by_tensor: list[list[Shard]] = [[] for _ in specs]
    loads = {rank: 0 for rank in links}
    for piece, owner in zip(pieces, owners):
        by_tensor[piece.tensor].append(Shard(owner, piece.start, piece.stop))
        loads[owner] += piece.nbytes
    sources_out = tuple(SourceLoad(rank, link.rate, link.latency, loads[rank],
                                   _finish(loads[rank], link)) for rank, link in links.items())
    return TransferPlan(
        tensors=tuple(TensorPlan(t.name, t.nbytes, t.itemsize, tuple(s)) for t, s in zip(specs, by_tensor)),
        sources=sources_out,
        finish=max(s.finish for s in sources_out),
    )


def usable_links(sources: Mapping[int, Link | float | None]) -> dict[int, Link]:
    """The sources that may send, by rank, each with a known rate: unmeasured get the median."""
    links: dict[int, Link] = {}
    for rank, value in sources.items():
        link = value if isinstance(value, Link) else Link(value)
        if type(rank) is not int:
            raise ValueError(f"source rank {rank!r} is not an int")
        if link.rate is not None and not _number(link.rate):
            raise ValueError(f"source {rank}: rate {link.rate!r} is not a finite number >= 0")
        if not _number(link.latency):
            raise ValueError(f"source {rank}: latency {link.latency!r} is not a finite number >= 0")
        links[rank] = Link(None if link.rate is None else float(link.rate), float(link.latency))
    measured = [link.rate for link in links.values() if link.rate]
    default = statistics.median(measured) if measured else DEFAULT_RATE
    usable = {rank: Link(default if link.rate is None else link.rate, link.latency)
              for rank, link in sorted(links.items()) if link.rate != 0}
    if not usable:
        raise ValueError(f"no source with a usable link among {sorted(links)}")
    return usable


def cut(tensors: Sequence[Tensor], sources: int, *, min_shard: int = MIN_SHARD) -> list[Piece]:
    """Each tensor in 2**k equal, element-aligned pieces (see the module docstring for k)."""
    total = sum(t.nbytes for t in tensors)
    target = math.inf if sources <= 1 else total / (SHARDS_PER_SOURCE * sources)
    pieces = []
    for index, tensor in enumerate(tensors):
        elements = tensor.nbytes // tensor.itemsize
        count = 1
        while (tensor.nbytes / count > target and tensor.nbytes / (2 * count) >= min_shard
               and 2 * count <= elements):
            count *= 2
        bounds = [tensor.itemsize * (elements * i // count) for i in range(count + 1)]
        pieces += [Piece(index, start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]
    return pieces


def assign(pieces: Sequence[Piece], links: Mapping[int, Link]) -> list[int]:
    """The source of each piece: largest first, to the source that would finish it earliest."""
    loads = {rank: 0 for rank in links}
    owners = [0] * len(pieces)
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i].nbytes, pieces[i].tensor, pieces[i].start)):
        best = min(links, key=lambda rank: (_finish(loads[rank] + pieces[i].nbytes, links[rank]), rank))
        loads[best] += pieces[i].nbytes
        owners[i] = best
    return owners


def _finish(nbytes: int, link: Link) -> float:
    """Seconds until a source sending ``nbytes`` over ``link`` is done (0 when it sends nothing)."""
    assert link.rate  # usable links only
    return link.latency + nbytes / link.rate if nbytes else 0.0


def _tensors(tensors: Sequence[Tensor | tuple]) -> list[Tensor]:
    try:
        specs = [Tensor(*t) for t in tensors]
    except TypeError as exc:
        raise ValueError(f"a tensor is not (name, nbytes[, itemsize]): {exc}") from None
    names = set()
    for t in specs:
        if not isinstance(t.name, str) or t.name in names:
            raise ValueError(f"tensor name {t.name!r} is not a string or not unique")
        if type(t.nbytes) is not int or type(t.itemsize) is not int or t.nbytes < 0 or t.itemsize < 1:
            raise ValueError(f"tensor {t.name}: nbytes {t.nbytes!r}, itemsize {t.itemsize!r} are not "
                             "an int >= 0 and an int >= 1")
        if t.nbytes % t.itemsize:
            raise ValueError(f"tensor {t.name}: {t.nbytes} bytes is not a multiple of its itemsize {t.itemsize}")
        names.add(t.name)
    return specs


def _number(value: Any) -> bool:
    """A finite number >= 0 (numpy's floats included, booleans not)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


# -- reading a plan back ------------------------------------------------------------------------


def parse_plan(data: Any) -> TransferPlan:
    """The plan in ``data`` (a plan's ``to_dict`` read back), every field and invariant checked.

    Raises ``ValueError`` with one line saying what is wrong: another version, a missing or
    mistyped field, a tensor not covered exactly once by its shards, a shard not element-aligned
    or from a source the plan does not list, a source's bytes or finish time that do not add up.
    """
    body = _object(data, "plan")
    if type(body.get("v")) is not int or body["v"] != SCHEMA:
        raise ValueError(f"transfer plan: schema version {body.get('v')!r}, expected {SCHEMA}")
    sources = tuple(_source(s) for s in _list(body, "sources", "plan"))
    rates = {s.rank: s for s in sources}
    if len(rates) != len(sources) or not sources:
        raise ValueError("transfer plan: sources are empty or name a rank twice")
    tensors = tuple(_tensor_plan(t, rates) for t in _list(body, "tensors", "plan"))
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError("transfer plan: a tensor name appears twice")
    sent = {rank: 0 for rank in rates}
    for tensor in tensors:
        for shard in tensor.shards:
            sent[shard.source] += shard.stop - shard.start
    for s in sources:
        if sent[s.rank] != s.nbytes:
            raise ValueError(f"transfer plan: source {s.rank} says {s.nbytes} bytes, its shards hold {sent[s.rank]}")
        if not math.isclose(s.finish, _finish(s.nbytes, Link(s.rate, s.latency)), rel_tol=1e-9, abs_tol=1e-12):
            raise ValueError(f"transfer plan: source {s.rank} finish {s.finish} does not match its bytes, "
                             "rate and latency")
    finish = _field(body, "finish", float, "plan")
    if not math.isclose(finish, max(s.finish for s in sources), rel_tol=1e-9, abs_tol=1e-12):
        raise ValueError(f"transfer plan: finish {finish} is not the latest source's finish")
    return TransferPlan(tensors, sources, finish)


def _source(data: Any) -> SourceLoad:
    body = _object(data, "source")
    load = SourceLoad(rank=_field(body, "rank", int, "source"), rate=_field(body, "rate", float, "source"),
                      latency=_field(body, "latency", float, "source"), nbytes=_field(body, "nbytes", int, "source"),
                      finish=_field(body, "finish", float, "source"))
    if load.rate <= 0 or load.nbytes < 0:
        raise ValueError(f"transfer plan: source {load.rank} has rate {load.rate} or bytes {load.nbytes} out of range")
    return load


def _tensor_plan(data: Any, sources: Mapping[int, SourceLoad]) -> TensorPlan:
    body = _object(data, "tensor")
    name = _field(body, "name", str, "tensor")
    nbytes, itemsize = _field(body, "nbytes", int, name), _field(body, "itemsize", int, name)
    if itemsize < 1 or nbytes % itemsize:
        raise ValueError(f"transfer plan: tensor {name}: {nbytes} bytes is not a multiple of itemsize {itemsize}")
    shards = []
    for item in _list(body, "shards", name):
        shard_body = _object(item, f"shard of {name}")
        shards.append(Shard(*(_field(shard_body, key, int, f"shard of {name}") for key in ("source", "start", "stop"))))
    at = 0
    for shard in shards:
        if shard.start != at or shard.stop <= shard.start:
            raise ValueError(f"transfer plan: tensor {name}: shard [{shard.start}, {shard.stop}) is empty "
                             f"or does not follow byte {at}")
        if shard.stop % itemsize:
            raise ValueError(f"transfer plan: tensor {name}: shard [{shard.start}, {shard.stop}) is not "
                             f"element-aligned (itemsize {itemsize})")
        if shard.source not in sources:
            raise ValueError(f"transfer plan: tensor {name}: source {shard.source} is not among the plan's sources")
        at = shard.stop
    if at != nbytes:
        raise ValueError(f"transfer plan: tensor {name}: shards cover {at} of {nbytes} bytes")
    return TensorPlan(name, nbytes, itemsize, tuple(shards))


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"transfer plan: {what} is not a JSON object")
    return data


def _list(body: dict[str, Any], key: str, where: str) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise ValueError(f"transfer plan: {where}: {key!r} is missing or not a list")
    return value


def _field(body: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = body.get(key)
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind or (kind is float and not (math.isfinite(value) and value >= 0)):
        raise ValueError(f"transfer plan: {where}: {key!r} is {value!r}, expected {kind.__name__}"
                         f"{' (finite, >= 0)' if kind is float else ''}")
    return value
