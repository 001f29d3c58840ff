"""Every value the agents, the leader and the CLI exchange through etcd: frozen, versioned JSON.

Direction of each record:

- :class:`NodeRecord` — ``nodes/<node>``: written by that node's agent (bound to its lease),
  read by the leader and ``tmrun status``.
- :class:`Plan` — ``plan``: written by the leader with compare-and-set, read by every agent.
- :class:`Outcome` — ``outcome``: written once by the leader when the job ends.
- :class:`Request` — ``requests/<id>``: written by ``tmrun drain``, answered by the leader.
- :class:`EventRecord` — ``events/<seq>``: appended by the leader, read by ``tmrun events``.
- :class:`MemberAssignment` — ``etcd/<node>``: written by the leader's agent under SLURM, read by
  that node's agent, which then starts an etcd member joining the cluster.

Each record serialises to a dict with ``"v": SCHEMA``; a record of another version, or one whose
fields are missing or of the wrong type (``nodes/x`` holding ``{"v": 1}``, a ``slots`` that is a
string), is rejected with :class:`RecordError` rather than misread. Readers use :func:`parse`,
which skips such a value with one warning per key and revision. Nothing here is pickled.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

from agent.skipped import warn_skipped
from agent.store import Entry

SCHEMA = 1

T = TypeVar("T", bound="Record")


class RecordError(ValueError):
    """A stored value is not a record this version understands."""


class Record:
    """Mixin: ``to_dict``/``from_dict`` with the schema version and every field's type checked."""

    def to_dict(self) -> dict[str, Any]:
        return {"v": SCHEMA, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T:
        if not isinstance(data, dict):
            raise RecordError(f"{cls.__name__}: not a JSON object")
        if type(data.get("v")) is not int or data["v"] != SCHEMA:
            raise RecordError(f"{cls.__name__}: schema version {data.get('v')!r}, expected {SCHEMA}")
        return cls._from_fields(data)

    @classmethod
    def _from_fields(cls: type[T], data: dict[str, Any]) -> T:
        """The record from ``data``'s fields (unknown ones ignored), each checked against its type."""
        hints = _hints(cls)
        values = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if field.name in data:
                values[field.name] = _conform(hints[field.name], data[field.name], f"{cls.__name__}.{field.name}")
            elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise RecordError(f"{cls.__name__}: field {field.name!r} is missing")
        record = cls(**values)
        record._check()
        return record

    def _check(self) -> None:
        """Invariants beyond the fields' types; raise RecordError."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# Items that pass as they are: a plan's members and slots, a node's worker pids (a plan of 1,000
# nodes is checked by every agent on every change: one pass over its items, no call per item).
_PLAIN_ITEM = {str: str, int: int}


def _conform(hint: Any, value: Any, where: str) -> Any:
    """``value`` as a ``hint`` (JSON lists become tuples), or RecordError saying what is wrong."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and isinstance(value, (list, tuple)) and args[0] in _PLAIN_ITEM:
        plain = _PLAIN_ITEM[args[0]]
        if all(type(item) is plain for item in value):
            return tuple(value)
    if origin is dict and isinstance(value, dict) and args[1] in _PLAIN_ITEM:
        plain = _PLAIN_ITEM[args[1]]
        if all(type(k) is str and type(v) is plain for k, v in value.items()):
            return dict(value)
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            try:
                return _conform(arm, value, where)
            except RecordError:
                continue
        raise RecordError(f"{where}: {_brief(value)} is not {hint}")
    if hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e300:
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(_conform(args[0], item, f"{where}[]") for item in value)
    elif origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: _conform(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    else:
        raise TypeError(f"{where}: no check for {hint}")  # a bug in a record's annotations
    raise RecordError(f"{where}: {_brief(value)} is not {getattr(hint, '__name__', hint)}")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse(cls: type[T], entry: Entry | None) -> T | None:
    """The record held by ``entry``; None when there is no entry or it does not hold a valid
    ``cls`` (then one warning per key and revision: :mod:`agent.skipped`)."""
    if entry is None:
        return None
    try:
        return cls.from_dict(entry.value)
    except RecordError as exc:
        warn_skipped(entry.key, entry.mod_revision, str(exc))
        return None


@dataclasses.dataclass(frozen=True)
class RunState(Record):
    """What a node's workers are doing in generation ``gen``.

    ``state``: ``idle`` (no workers), ``running``, ``succeeded``, ``failed``, ``stopped``.
    ``exitcode``: the first failing worker's exit code (negative: killed by that signal);
    ``error``: why a worker said it could not go on (the runtime's ``failed`` message), or "".
    ``stalled_since``/``stalled_rank``: a torchrun script's workers on this node have shown no
    progress since then (wall clock; its first worker to stop), or 0 (``agent/stall.py``).
    """

    gen: int = 0
    state: str = "idle"
    exitcode: int | None = None
    rank: int | None = None
    worker_pids: tuple[int, ...] = ()
    at: float = 0.0
    runtime: bool = False  # every worker said hello: the script runs the tmrun runtime
    step: int = 0  # the job's step, as the workers last reported it
    step_time: float = 0.0
    last_swap: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""
    stalled_since: float = 0.0
    stalled_rank: int | None = None

    def _check(self) -> None:
        for name, value in self.last_swap.items():  # read by agent/swap_report.py
            if name in SWAP_NUMBERS and value is not None:
                _conform(float, value, f"RunState.last_swap[{name!r}]")


# ``last_swap`` fields that are numbers (or None) wherever they are present.
SWAP_NUMBERS = frozenset({"gen", "step", "stall", "build", "transfer", "bytes_received", "from_leaver", "handover_s",
                          "phase1_steps", "phase1_step_time", "normal_step_time", "prepared_at", "ready_at",
                          "switched_at", "first_step_at", "predicted_s", "group_build",
                          "store_connect", "gloo_connect"})


@dataclasses.dataclass(frozen=True)
class NodeRecord(Record):
    node: str
    host: str
    pid: int
    slots: int
    standby_hint: bool = False
    joined_at: float = 0.0
    run: dict[str, Any] = dataclasses.field(default_factory=dict)
    metrics: str = ""  # host:port of the agent's Prometheus metrics (--metrics-port), or ""
    # measured link rates into this node: source node -> bytes/s of the last state it sent here
    links: dict[str, float] = dataclasses.field(default_factory=dict)
    link_port: int = 0  # where the agent accepts other agents' link checks (0: none)
    unreachable: tuple[str, ...] = ()  # members this agent's link checks cannot reach now

    @property
    def run_state(self) -> RunState:
        return RunState._from_fields(self.run) if self.run else RunState()

    def _check(self) -> None:
        if self.slots < 1:
            raise RecordError(f"NodeRecord.slots: {self.slots} is not a positive number of workers")
        if not 0 <= self.link_port < 65536:
            raise RecordError(f"NodeRecord.link_port: {self.link_port} is not a port")
        bad = [source for source, rate in self.links.items() if not rate >= 0]
        if bad:
            raise RecordError(f"NodeRecord.links: the rate from {bad[0]!r} is not a number of bytes/s >= 0")
        self.run_state  # noqa: B018  (raises RecordError when ``run`` is not a RunState)


REJOINS = ("rejoining", "link")
"""``Plan.out`` reasons after which the node waits in the pool as a standby."""


@dataclasses.dataclass(frozen=True)
class Plan(Record):
    """One generation: who trains, in which order (group rank = index), and where the store is.

    ``out`` maps nodes that left the job to why (``drained``, ``rejoining``, ``failed``, ``lost``,
    ``link``: taken out because a link between it and another member was cut).
    ``hot``: every member runs the tmrun runtime, so standbys shadow-train and a node can be
    swapped without restarting the others. ``mode`` says how members reach this generation:
    ``restart`` (new workers everywhere), ``swap-agreed`` (a planned swap: the running workers
    build the group in the background and switch at a step boundary they vote for) or
    ``swap-now`` (a failure: the survivors switch as soon as the group is built).
    ``restarts`` counts generations that restarted workers because of a failure;
    ``in_place_restarts`` the subset that restarted on the same nodes for lack of a standby
    (bounded by --max-restarts). ``hot_swaps`` counts generations reached by a hot swap (a failure
    or a drain that a standby filled without restarting anyone); they are not restarts.
    """

    gen: int
    members: tuple[str, ...]
    slots: dict[str, int]
    store_host: str
    store_port: int
    leader: str
    reason: str = "start"
    restarts: int = 0
    in_place_restarts: int = 0
    out: dict[str, str] = dataclasses.field(default_factory=dict)
    created: float = 0.0
    hot: bool = False
    mode: str = "restart"
    joiners: tuple[str, ...] = ()  # members that join this generation by a swap
    handover: dict[str, str] = dataclasses.field(default_factory=dict)  # leaver -> the joiner it hands over to
    requested: float = 0.0  # wall time of the request or failure report that led to this generation
    hot_swaps: int = 0
    link_at: dict[str, str] = dataclasses.field(default_factory=dict)  # member -> host:port of its link checks

    @property
    def world_size(self) -> int:
        return sum(self.slots[m] for m in self.members)

    def rejoined(self, node: str, run: RunState) -> bool:
        """``node`` gave up its place with ``drain --rejoin``, or was taken out for a cut link, and is
        a standby again (its workers stopped training: idle, or waiting warm as shadow workers)."""
        return self.out.get(node) in REJOINS and node not in self.members and run.state in ("idle", "shadow")

    def rank_owners(self) -> list[str]:
        """The member holding each group rank (index: the rank), in one pass over the members."""
        return [member for member in self.members for _ in range(self.slots[member])]

    def rank_offset(self, node: str) -> int:
        offset = 0
        for member in self.members:
            if member == node:
                return offset
            offset += self.slots[member]
        raise KeyError(node)

    def _check(self) -> None:
        missing = [m for m in self.members if m not in self.slots]
        if missing or len(set(self.members)) != len(self.members):
            raise RecordError(f"Plan: members {list(self.members)} do not match slots {self.slots}")
        if any(n < 1 for n in self.slots.values()):
            raise RecordError(f"Plan.slots: {self.slots} holds a number below 1")


@dataclasses.dataclass(frozen=True)
class Outcome(Record):
    state: str  # "succeeded" | "failed"
    reason: str
    gen: int
    at: float = 0.0


@dataclasses.dataclass(frozen=True)
class Request(Record):
    """A request from a person or script. ``state``: pending → accepted/rejected → done."""

    id: str
    kind: str  # "drain"
    node: str
    created: float
    state: str = "pending"
    answer: str = ""
    gen: int = 0
    rejoin: bool = False  # the drained node comes back to the pool as a standby


@dataclasses.dataclass(frozen=True)
class EventRecord(Record):
    at: float
    kind: str
    text: str
    gen: int = 0
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MemberAssignment(Record):
    """Start an etcd member on ``node`` that joins ``cluster`` (member name -> peer URL)."""

    node: str
    cluster: dict[str, str]
    at: float
