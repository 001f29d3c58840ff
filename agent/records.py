"""Every value the agents, the leader and the CLI exchange through etcd: frozen, versioned JSON.

Direction of each record:

- :class:`NodeRecord` — ``nodes/<node>``: written by that node's agent (bound to its lease),
  read by the leader and ``tmrun status``.
- :class:`Plan` — ``plan``: written by the leader with compare-and-set, read by every agent.
- :class:`Outcome` — ``outcome``: written once by the leader when the job ends.
- :class:`Request` — ``requests/<id>``: written by ``tmrun drain``, answered by the leader.
- :class:`EventRecord` — ``events/<seq>``: appended by the leader, read by ``tmrun events``.

Each record serialises to a dict with ``"v": SCHEMA``; a record of another version is rejected
with :class:`RecordError` rather than misread. Nothing here is pickled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

SCHEMA = 1

T = TypeVar("T", bound="Record")


class RecordError(ValueError):
    """A stored value is not a record this version understands."""


class Record:
    """Mixin: ``to_dict``/``from_dict`` with the schema version checked."""

    def to_dict(self) -> dict[str, Any]:
        return {"v": SCHEMA, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        if data.get("v") != SCHEMA:
            raise RecordError(f"{cls.__name__}: schema version {data.get('v')!r}, expected {SCHEMA}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise RecordError(f"{cls.__name__}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class RunState(Record):
    """What a node's workers are doing in generation ``gen``.

    ``state``: ``idle`` (no workers), ``running``, ``succeeded``, ``failed``, ``stopped``.
    ``exitcode``: the first failing worker's exit code (negative: killed by that signal).
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


@dataclasses.dataclass(frozen=True)
class NodeRecord(Record):
    node: str
    host: str
    pid: int
    slots: int
    standby_hint: bool = False
    joined_at: float = 0.0
    run: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def run_state(self) -> RunState:
        return RunState(**{k: v for k, v in self.run.items() if k != "v"}) if self.run else RunState()


@dataclasses.dataclass(frozen=True)
class Plan(Record):
    """One generation: who trains, in which order (group rank = index), and where the store is.

    ``out`` maps nodes that left the job to why (``drained``, ``failed``, ``lost``).
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

    @property
    def world_size(self) -> int:
        return sum(self.slots[m] for m in self.members)

    def rejoined(self, node: str, run: RunState) -> bool:
        """``node`` gave up its place with ``drain --rejoin`` and is a standby again (its workers stopped
        training: idle, or waiting warm as shadow workers)."""
        return self.out.get(node) == "rejoining" and node not in self.members and run.state in ("idle", "shadow")

    def rank_offset(self, node: str) -> int:
        offset = 0
        for member in self.members:
            if member == node:
                return offset
            offset += self.slots[member]
        raise KeyError(node)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        plan = super().from_dict(data)
        return dataclasses.replace(plan, members=tuple(plan.members), joiners=tuple(plan.joiners))


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
