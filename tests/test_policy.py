"""Table tests of the leader's pure policy, :func:`agent.policy.decide`.

Each case is a snapshot of the job (nodes, plan, requests), the limits and the clock, and what the
leader must answer. The last test drives the policy through random sequences of events, applying
its decisions the way the leader's driver does, and checks the plan's invariants after each step.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from agent.policy import (Action, Clock, Cluster, Decision, Limits, NodeView, decide, failure_pending,
                          quorum_reached)
from agent.records import Plan, Request, RunState

pytestmark = pytest.mark.timeout(30)

SLOTS = 2


# -- builders ----------------------------------------------------------------------------------


def node(name: str, order: int, *, hint: bool = False, gen: int = 0, state: str = "idle",
         code: int | None = None, rev: int | None = None) -> NodeView:
    """A live node; ``rev`` (when it last reported) defaults to its join order."""
    return NodeView(name, order, SLOTS, hint, RunState(gen=gen, state=state, exitcode=code),
                    order if rev is None else rev)


def running(name: str, order: int, gen: int = 1, **kw: Any) -> NodeView:
    return node(name, order, gen=gen, state="running", **kw)


def failed(name: str, order: int, code: int, gen: int = 1, **kw: Any) -> NodeView:
    return node(name, order, gen=gen, state="failed", code=code, **kw)


def plan(members: tuple[str, ...], gen: int = 1, *, out: dict[str, str] | None = None, restarts: int = 0,
         in_place: int = 0) -> Plan:
    return Plan(gen, members, {m: SLOTS for m in members}, "127.0.0.1", 29500, members[0],
                restarts=restarts, in_place_restarts=in_place, out=dict(out or {}))


def cluster(*nodes: NodeView, plan: Plan | None = None, requests: tuple[Request, ...] = (),
            finished: bool = False) -> Cluster:
    return Cluster({n.name: n for n in nodes}, plan, requests, finished)


def drain(target: str, rid: str = "r1", kind: str = "drain") -> Request:
    return Request(rid, kind, target, created=0.0)


FIXED2 = Limits(min_nodes=2, max_nodes=2)
FIXED3 = Limits(min_nodes=3, max_nodes=3)
ELASTIC_1_2 = Limits(min_nodes=1, max_nodes=2)
ELASTIC_2_4 = Limits(min_nodes=2, max_nodes=4, last_call=1.0)
T0 = Clock(now=0.0)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    cluster: Cluster
    limits: Limits
    clock: Clock
    action: Action
    members: tuple[str, ...] | None = None
    out: dict[str, str] | None = None
    restarts: int | None = None
    in_place_restarts: int | None = None
    outcome: str | None = None
    until: float | None = None
    answers: tuple[str, ...] | None = None  # the answers' states, in order
    reason_has: tuple[str, ...] = ()


def check(case: Case, got: Decision) -> None:
    assert got.action is case.action, got.reason
    if case.members is not None:
        assert got.members == case.members, got.reason
    if case.out is not None:
        assert dict(got.out) == case.out, got.reason
    if case.restarts is not None:
        assert got.restarts == case.restarts, got.reason
    if case.in_place_restarts is not None:
        assert got.in_place_restarts == case.in_place_restarts, got.reason
    if case.outcome is not None:
        assert got.outcome == case.outcome, got.reason
    if case.until is not None:
        assert got.until == pytest.approx(case.until), got.reason
    if case.answers is not None:
        assert tuple(a.state for a in got.answers) == case.answers, got.reason
        for answer in got.answers:
            assert answer.request_id == "r1"
            assert answer.text
    for part in case.reason_has:
        assert part in got.reason


# -- rendezvous (no plan yet) ------------------------------------------------------------------

RENDEZVOUS = [
    Case("waits-for-nodes", cluster(node("a", 1)), FIXED2, Clock(now=5.0), Action.WAIT,
         until=600.0, reason_has=("1 joined", "2 needed")),
    Case("waits-with-nobody", cluster(), FIXED2, T0, Action.WAIT, until=600.0),
    Case("starts-at-once-with-max-regular", cluster(node("a", 1), node("b", 2)), FIXED2, T0, Action.START,
         members=("a", "b"), out={}, restarts=0),
    Case("starts-with-the-first-max-regular-in-join-order",
         cluster(node("c", 3), node("a", 1), node("b", 2)), FIXED2, T0, Action.START, members=("a", "b")),
    Case("standby-hint-not-chosen-while-regular-suffice",
         cluster(node("s", 1, hint=True), node("a", 2), node("b", 3)), FIXED2, T0, Action.START,
         members=("a", "b")),
    Case("standby-hint-not-chosen-after-last-call-either",
         cluster(node("s", 1, hint=True), node("a", 2), node("b", 3)), ELASTIC_2_4,
         Clock(now=5.0, quorum_since=1.0), Action.START, members=("a", "b", "s")),
    Case("min-max-waits-for-last-call", cluster(node("a", 1), node("b", 2)), ELASTIC_2_4,
         Clock(now=10.5, quorum_since=10.0), Action.WAIT, until=11.0),
    Case("min-max-starts-after-last-call", cluster(node("a", 1), node("b", 2)), ELASTIC_2_4,
         Clock(now=11.0, quorum_since=10.0), Action.START, members=("a", "b")),
    Case("min-max-below-min-does-not-start", cluster(node("a", 1)), ELASTIC_2_4,
         Clock(now=50.0, quorum_since=None), Action.WAIT, until=600.0),
    Case("min-max-caps-at-max", cluster(*(node(f"n{i}", i) for i in range(6))), ELASTIC_2_4, T0,
         Action.START, members=("n0", "n1", "n2", "n3")),
    Case("join-timeout-fails", cluster(node("a", 1)), FIXED2, Clock(now=600.0), Action.FINISH,
         outcome="failed", reason_has=("timed out", "1 of 2")),
    Case("join-timeout-counts-from-rendezvous-start", cluster(node("a", 1)),
         dataclasses.replace(FIXED2, join_timeout=30.0), Clock(now=139.0, rendezvous_since=100.0), Action.WAIT,
         until=130.0 + 0.0 + 100.0 - 100.0 + 0.0 if False else 130.0),
]


@pytest.mark.parametrize("case", RENDEZVOUS, ids=[c.id for c in RENDEZVOUS])
def test_rendezvous(case: Case) -> None:
    check(case, decide(case.cluster, case.limits, case.clock))
