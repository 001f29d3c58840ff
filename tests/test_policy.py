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
         code: int | None = None, rev: int | None = None, rank: int | None = None) -> NodeView:
    """A live node; ``rev`` (when it last reported) defaults to its join order."""
    return NodeView(name, order, SLOTS, hint, RunState(gen=gen, state=state, exitcode=code, rank=rank),
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
    hot_swaps: int | None = None
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
    if case.hot_swaps is not None:
        assert got.hot_swaps == case.hot_swaps, got.reason
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
    Case("first-generation-ranks-follow-node-names-not-join-order",
         cluster(node("node-1", 1), node("node-0", 2)), FIXED2, T0, Action.START, members=("node-0", "node-1")),
    Case("first-generation-names-in-natural-order",
         cluster(node("node-10", 1), node("node-9", 2), node("node-2", 3)), FIXED3, T0, Action.START,
         members=("node-2", "node-9", "node-10")),
    Case("first-generation-chosen-in-join-order-then-ranked-by-name",
         cluster(node("c", 1), node("b", 2), node("a", 3)), FIXED2, T0, Action.START, members=("b", "c")),
    Case("standby-hint-not-chosen-while-regular-suffice",
         cluster(node("s", 1, hint=True), node("a", 2), node("b", 3)), FIXED2, T0, Action.START,
         members=("a", "b")),
    Case("last-call-starts-with-regular-nodes-and-keeps-standbys",
         cluster(node("s", 1, hint=True), node("a", 2), node("b", 3)), ELASTIC_2_4,
         Clock(now=5.0, quorum_since=1.0), Action.START, members=("a", "b")),
    Case("standby-fills-a-missing-regular-node-after-standby-fill",
         cluster(node("s", 1, hint=True), node("a", 2)), FIXED2,
         Clock(now=11.0, quorum_since=1.0), Action.START, members=("a", "s")),
    Case("standby-does-not-fill-before-standby-fill",
         cluster(node("s", 1, hint=True), node("a", 2)), FIXED2,
         Clock(now=5.0, quorum_since=1.0), Action.WAIT, until=11.0),
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
         dataclasses.replace(FIXED2, join_timeout=30.0), Clock(now=129.0, rendezvous_since=100.0), Action.WAIT,
         until=130.0),
    Case("join-timeout-at-deadline", cluster(node("a", 1)),
         dataclasses.replace(FIXED2, join_timeout=30.0), Clock(now=130.0, rendezvous_since=100.0), Action.FINISH,
         outcome="failed"),
    Case("wait-until-is-the-earlier-of-last-call-and-join", cluster(node("a", 1), node("b", 2)),
         dataclasses.replace(ELASTIC_2_4, join_timeout=10.0, last_call=5.0), Clock(now=8.0, quorum_since=7.0),
         Action.WAIT, until=10.0),
]


@pytest.mark.parametrize("case", RENDEZVOUS, ids=[c.id for c in RENDEZVOUS])
def test_rendezvous(case: Case) -> None:
    check(case, decide(case.cluster, case.limits, case.clock))


def test_quorum_reached_needs_min_eligible_nodes() -> None:
    assert not quorum_reached(cluster(node("a", 1)), ELASTIC_2_4)
    assert quorum_reached(cluster(node("a", 1), node("s", 2, hint=True)), ELASTIC_2_4)


def test_quorum_reached_before_join_deadline_does_not_time_out() -> None:
    limits = dataclasses.replace(ELASTIC_2_4, join_timeout=10.0, last_call=5.0)
    got = decide(cluster(node("a", 1), node("b", 2)), limits, Clock(now=10.0, quorum_since=7.0))
    assert got.action is not Action.FINISH, got.reason


# -- a running generation: success, failures, lost nodes ---------------------------------------

AB = plan(("a", "b"))
ABC = plan(("a", "b", "c"))

RUNNING = [
    Case("running-waits", cluster(running("a", 1), running("b", 2), plan=AB), FIXED2, T0, Action.WAIT),
    Case("outcome-written-waits",
         cluster(failed("a", 1, -9), plan=AB, requests=(drain("b"),), finished=True), FIXED2, T0, Action.WAIT,
         reason_has=("ended",)),
    Case("all-succeeded-finishes",
         cluster(node("a", 1, gen=3, state="succeeded"), node("b", 2, gen=3, state="succeeded"),
                 node("s", 3), plan=plan(("a", "b"), gen=3)),
         FIXED2, T0, Action.FINISH, outcome="succeeded", reason_has=("generation 3",)),
    Case("success-in-an-older-generation-does-not-count",
         cluster(node("a", 1, gen=3, state="succeeded"), node("b", 2, gen=2, state="succeeded"),
                 plan=plan(("a", "b"), gen=3)),
         FIXED2, T0, Action.WAIT),
    Case("failure-in-an-older-generation-does-not-count",
         cluster(running("a", 1, gen=2), failed("b", 2, -9, gen=1), node("s", 3), plan=plan(("a", "b"), gen=2)),
         FIXED2, T0, Action.WAIT),
    Case("killed-by-signal-first-standby-same-index",
         cluster(running("a", 1), failed("b", 2, -9), running("c", 3), node("t", 5), node("s", 4),
                 plan=plan(("a", "b", "c"), restarts=2)),
         FIXED3, T0, Action.START, members=("a", "s", "c"), out={"b": "failed"}, restarts=3,
         in_place_restarts=0, reason_has=("b", "signal 9", "s takes its place")),
    Case("killed-node-keeps-out-entries",
         cluster(failed("a", 1, -11, gen=4), running("b", 2, gen=4), node("s", 4),
                 plan=plan(("a", "b"), gen=4, out={"x": "drained"}, restarts=1)),
         FIXED2, T0, Action.START, members=("s", "b"), out={"x": "drained", "a": "failed"}, restarts=2),
    Case("standby-hint-does-not-matter-in-the-pool-join-order-does",
         cluster(running("a", 1), failed("b", 2, -9), node("h", 4, hint=True), node("r", 5), plan=AB),
         FIXED2, T0, Action.START, members=("a", "h")),
    Case("lost-member-replaced",
         cluster(running("a", 1), node("s", 3), plan=AB),
         FIXED2, T0, Action.START, members=("a", "s"), out={"b": "lost"}, restarts=1, reason_has=("b was lost",)),
    Case("lost-waits-while-agents-register-again-after-etcd-was-away",
         cluster(running("a", 1), node("s", 3), plan=AB),
         FIXED2, Clock(now=5.0, settled_at=6.0), Action.WAIT, reason_has=("no key for b", "register again")),
    Case("lost-after-the-settling-time-is-replaced",
         cluster(running("a", 1), node("s", 3), plan=AB),
         FIXED2, Clock(now=6.0, settled_at=6.0), Action.START, members=("a", "s"), out={"b": "lost"}),
    Case("plain-exit-waits-for-failure-window",
         cluster(running("a", 1), failed("b", 2, 1), node("s", 3), plan=AB),
         FIXED2, Clock(now=12.0, failure_since=10.0), Action.WAIT, until=16.0,
         reason_has=("exited with code 1", "clearer cause")),
    Case("plain-exit-window-counts-from-now-without-failure-since",
         cluster(running("a", 1), failed("b", 2, 1), node("s", 3), plan=AB),
         FIXED2, Clock(now=3.0), Action.WAIT, until=9.0),
    Case("plain-exit-blamed-after-failure-window",
         cluster(running("a", 1), failed("b", 2, 1), node("s", 3), plan=AB),
         FIXED2, Clock(now=16.0, failure_since=10.0), Action.START, members=("a", "s"), out={"b": "failed"},
         restarts=1),
    Case("every-member-failed-blames-earliest-reporter-at-once",
         cluster(failed("a", 1, 1, rev=20), failed("b", 2, 1, rev=15), node("s", 3), plan=AB),
         FIXED2, Clock(now=10.0, failure_since=10.0), Action.START, members=("a", "s"), out={"b": "failed"},
         restarts=1),
    Case("earliest-reporter-is-by-report-revision-not-join-order",
         cluster(failed("a", 1, 1, rev=7), failed("b", 2, 2, rev=9), failed("c", 3, 1, rev=8), node("s", 4),
                 plan=ABC),
         FIXED3, T0, Action.START, members=("s", "b", "c"), out={"a": "failed"}),
    Case("signal-killed-preferred-over-earlier-plain-exit",
         cluster(failed("a", 1, 1, rev=10), failed("b", 2, -9, rev=12), node("s", 3), plan=AB),
         FIXED2, T0, Action.START, members=("a", "s"), out={"b": "failed"}),
    Case("lost-preferred-over-plain-exit",
         cluster(failed("a", 1, 1, rev=10), node("s", 3), plan=AB),
         FIXED2, T0, Action.START, members=("a", "s"), out={"b": "lost"}),
    Case("two-killed-two-standbys-both-replaced",
         cluster(failed("a", 1, -9), running("b", 2), failed("c", 3, -15), node("s", 4), node("t", 5), plan=ABC),
         FIXED3, T0, Action.START, members=("s", "b", "t"), out={"a": "failed", "c": "failed"}, restarts=1),
    Case("killed-and-lost-two-standbys-both-replaced",
         cluster(failed("a", 1, -9), running("b", 2), node("s", 4), node("t", 5), plan=ABC),
         FIXED3, T0, Action.START, out={"a": "failed", "c": "lost"}, restarts=1),
    Case("no-standby-fixed-size-restarts-in-place",
         cluster(running("a", 1), failed("b", 2, -9), plan=plan(("a", "b"), restarts=1)),
         dataclasses.replace(FIXED2, max_restarts=2), T0, Action.START, members=("a", "b"), out={},
         restarts=2, in_place_restarts=1, reason_has=("restarting in place",)),
    Case("no-standby-fixed-size-past-max-restarts-fails",
         cluster(running("a", 1), failed("b", 2, -9), plan=plan(("a", "b"), restarts=3, in_place=2)),
         dataclasses.replace(FIXED2, max_restarts=2), T0, Action.FINISH, outcome="failed",
         reason_has=("--max-restarts 2",)),
    Case("no-standby-max-restarts-zero-fails-at-once",
         cluster(running("a", 1), failed("b", 2, -9), plan=AB), FIXED2, T0, Action.FINISH, outcome="failed"),
    Case("no-standby-elastic-shrinks",
         cluster(running("a", 1), failed("b", 2, -9), plan=AB), ELASTIC_1_2, T0, Action.START, members=("a",),
         out={"b": "failed"}, restarts=1, in_place_restarts=0, reason_has=("shrinks to 1",)),
    Case("no-standby-elastic-lost-shrinks",
         cluster(running("b", 2), plan=AB), ELASTIC_1_2, T0, Action.START, members=("b",), out={"a": "lost"}),
    Case("lost-no-standby-no-shrink-waits",
         cluster(running("a", 1), plan=AB), FIXED2, Clock(now=11.0, failure_since=10.0), Action.WAIT,
         until=610.0, reason_has=("b was lost", "waiting for a node")),
    Case("lost-no-standby-no-shrink-fails-after-join-timeout",
         cluster(running("a", 1), plan=AB), FIXED2, Clock(now=610.0, failure_since=10.0), Action.FINISH,
         outcome="failed", reason_has=("b was lost", "600 s")),
    Case("lost-then-a-node-joins-replaces",
         cluster(running("a", 1), node("late", 9), plan=AB), FIXED2, Clock(now=300.0, failure_since=10.0),
         Action.START, members=("a", "late"), out={"b": "lost"}),
    Case("failure-is-handled-before-requests",
         cluster(running("a", 1), failed("b", 2, -9), node("s", 3), plan=AB, requests=(drain("a"),)),
         FIXED2, T0, Action.START, members=("a", "s"), out={"b": "failed"}, answers=()),
]


@pytest.mark.parametrize("case", RUNNING, ids=[c.id for c in RUNNING])
def test_running_generation(case: Case) -> None:
    check(case, decide(case.cluster, case.limits, case.clock))


def test_killed_and_lost_keep_healthy_nodes_in_place() -> None:
    c = cluster(failed("a", 1, -9), running("b", 2), node("s", 4), node("t", 5), plan=ABC)
    got = decide(c, FIXED3, T0)
    assert got.members[1] == "b"
    assert sorted(got.members) == ["b", "s", "t"]


def test_failure_pending() -> None:
    assert not failure_pending(cluster(node("a", 1)))
    assert not failure_pending(cluster(running("a", 1), running("b", 2), plan=AB))
    assert failure_pending(cluster(running("a", 1), plan=AB))
    assert failure_pending(cluster(running("a", 1), failed("b", 2, 1), plan=AB))
    assert not failure_pending(cluster(running("a", 1, gen=2), failed("b", 2, 1, gen=1), plan=plan(("a", "b"), 2)))


# -- requests (drain) and scale-up -------------------------------------------------------------

REQUESTS = [
    Case("drain-active-standby-takes-its-place",
         cluster(running("a", 1), running("b", 2), node("s", 3), plan=plan(("a", "b"), restarts=2, in_place=1),
                 requests=(drain("b"),)),
         dataclasses.replace(FIXED2, max_restarts=3), T0, Action.START, members=("a", "s"),
         out={"b": "drained"}, restarts=2, in_place_restarts=1, answers=("accepted",),
         reason_has=("drain b", "s takes its place")),
    Case("drain-active-no-standby-at-min-rejected",
         cluster(running("a", 1), running("b", 2), plan=AB, requests=(drain("b"),)), FIXED2, T0, Action.ANSWER,
         answers=("rejected",), reason_has=("cannot drain b", "no standby", "minimum size (2 nodes)")),
    Case("drain-active-no-standby-elastic-shrinks",
         cluster(running("a", 1), running("b", 2), plan=AB, requests=(drain("a"),)), ELASTIC_1_2, T0,
         Action.START, members=("b",), out={"a": "drained"}, restarts=0, answers=("accepted",)),
    Case("drain-standby-amends",
         cluster(running("a", 1), running("b", 2), node("s", 3), plan=plan(("a", "b"), gen=5, restarts=1),
                 requests=(drain("s"),)),
         FIXED2, T0, Action.AMEND, members=("a", "b"), out={"s": "drained"}, restarts=1,
         answers=("accepted",), reason_has=("standby",)),
    Case("drain-already-drained-done",
         cluster(running("a", 1), running("s", 3), plan=plan(("a", "s"), out={"b": "drained"}),
                 requests=(drain("b"),)),
         FIXED2, T0, Action.ANSWER, answers=("done",), reason_has=("already left", "drained")),
    Case("drain-failed-node-done",
         cluster(running("a", 1), running("s", 3), plan=plan(("a", "s"), out={"b": "failed"}),
                 requests=(drain("b"),)),
         FIXED2, T0, Action.ANSWER, answers=("done",)),
    Case("drain-unknown-node-rejected",
         cluster(running("a", 1), running("b", 2), plan=AB, requests=(drain("zz"),)), FIXED2, T0, Action.ANSWER,
         answers=("rejected",), reason_has=("unknown node 'zz'",)),
    Case("unknown-request-kind-rejected",
         cluster(running("a", 1), running("b", 2), plan=AB, requests=(drain("a", kind="reboot"),)), FIXED2, T0,
         Action.ANSWER, answers=("rejected",), reason_has=("'reboot'",)),
    Case("scale-up-below-max-with-standby",
         cluster(running("a", 1), node("s", 2), plan=plan(("a",), restarts=1)), ELASTIC_1_2, T0, Action.START,
         members=("a", "s"), restarts=1, reason_has=("scale-up",)),
    Case("scale-up-takes-only-up-to-max",
         cluster(running("a", 1), running("b", 2), node("t", 4), node("s", 3), plan=AB), ELASTIC_2_4, T0,
         Action.START, members=("a", "b", "s", "t")),
    Case("scale-up-stops-at-max",
         cluster(running("a", 1), node("s", 2), node("t", 3), node("u", 4), plan=plan(("a",))),
         Limits(min_nodes=1, max_nodes=3), T0, Action.START, members=("a", "s", "t")),
    Case("no-scale-up-at-max", cluster(running("a", 1), running("b", 2), node("s", 3), plan=AB), ELASTIC_1_2, T0,
         Action.WAIT),
    Case("no-scale-up-with-a-node-that-left",
         cluster(running("a", 1), node("b", 2), plan=plan(("a",), out={"b": "drained"})), ELASTIC_1_2, T0,
         Action.WAIT),
    Case("request-before-scale-up",
         cluster(running("a", 1), node("s", 2), plan=plan(("a",)), requests=(drain("s"),)), ELASTIC_1_2, T0,
         Action.AMEND, out={"s": "drained"}, answers=("accepted",)),
]


@pytest.mark.parametrize("case", REQUESTS, ids=[c.id for c in REQUESTS])
def test_requests_and_scale_up(case: Case) -> None:
    check(case, decide(case.cluster, case.limits, case.clock))


def test_oldest_request_is_answered_first() -> None:
    c = cluster(running("a", 1), running("b", 2), plan=AB, requests=(drain("zz", "r1"), drain("b", "r2")))
    got = decide(c, FIXED2, T0)
    assert [a.request_id for a in got.answers] == ["r1"]


# -- random sequences of events ----------------------------------------------------------------


class Sim:
    """A job driven by :func:`decide`, with decisions applied as the leader's driver applies them."""

    def __init__(self, rng: random.Random, limits: Limits) -> None:
        self.rng = rng
        self.limits = limits
        self.nodes: dict[str, NodeView] = {}
        self.plan: Plan | None = None
        self.requests: list[Request] = []
        self.finished = False
        self.now = 0.0
        self.quorum_since: float | None = None
        self.failure_since: tuple[int, float] | None = None
        self.seq = 0
        self.rev = 0
        self.starts = 0

    def cluster(self) -> Cluster:
        return Cluster(dict(self.nodes), self.plan, tuple(self.requests), self.finished)

    def _report(self, name: str, **run: Any) -> None:
        self.rev += 1
        view = self.nodes[name]
        self.nodes[name] = dataclasses.replace(view, run=dataclasses.replace(view.run, **run), report_revision=self.rev)

    def event(self) -> None:
        kind = self.rng.choice(["join", "join", "lose", "kill", "exit", "exit", "drain", "succeed", "time"])
        members = list(self.plan.members) if self.plan else []
        alive_members = [m for m in members if m in self.nodes]
        if kind == "join":
            self.seq += 1
            self.rev += 1
            name = f"n{self.seq}"
            self.nodes[name] = NodeView(name, self.rev, SLOTS, self.rng.random() < 0.3, RunState(), self.rev)
        elif kind == "lose" and self.nodes:
            del self.nodes[self.rng.choice(sorted(self.nodes))]
        elif kind in ("kill", "exit") and alive_members:
            code = -self.rng.choice([9, 15]) if kind == "kill" else self.rng.choice([1, 2])
            self._report(self.rng.choice(alive_members), gen=self.plan.gen, state="failed", exitcode=code)
        elif kind == "succeed" and alive_members:
            for m in alive_members:
                if self.rng.random() < 0.7:
                    self._report(m, gen=self.plan.gen, state="succeeded", exitcode=0)
        elif kind == "drain":
            names = sorted(set(self.nodes) | set(members)) + ["ghost"]
            self.seq += 1
            self.requests.append(Request(f"r{self.seq}", "drain", self.rng.choice(names), created=self.now))
        self.now += self.rng.choice([0.0, 0.5, 2.0, 7.0, 30.0])

    def step(self) -> Decision:
        """One pass of the leader's loop: observe, decide, apply."""
        c = self.cluster()
        self.quorum_since = (self.quorum_since if self.quorum_since is not None else self.now) \
            if quorum_reached(c, self.limits) else None
        gen = self.plan.gen if self.plan else 0
        if failure_pending(c):
            if self.failure_since is None or self.failure_since[0] != gen:
                self.failure_since = (gen, self.now)
        else:
            self.failure_since = None
        clock = Clock(self.now, 0.0, self.quorum_since, self.failure_since[1] if self.failure_since else None)
        decision = decide(c, self.limits, clock)
        if decision.action is Action.FINISH:
            self.finished = True
        elif decision.action in (Action.START, Action.AMEND):
            old = self.plan
            new_gen = (old.gen if old else 0) + (1 if decision.action is Action.START else 0)
            self.plan = Plan(new_gen, tuple(decision.members), {m: self.nodes[m].slots for m in decision.members},
                             "127.0.0.1", 1, "leader", decision.reason, decision.restarts,
                             decision.in_place_restarts, dict(decision.out))
            self.check_plan(old, self.plan, decision)
            if decision.action is Action.START:
                self.starts += 1
                for m in self.plan.members:
                    self._report(m, gen=new_gen, state="running", exitcode=None)
        answered = {a.request_id for a in decision.answers}
        self.requests = [r for r in self.requests if r.id not in answered]
        return decision

    def check_plan(self, old: Plan | None, new: Plan, decision: Decision) -> None:
        why = decision.reason
        assert len(set(new.members)) == len(new.members), why
        assert not set(new.members) & set(new.out), why
        assert all(m in self.nodes for m in new.members), why
        assert self.limits.min_nodes <= len(new.members) <= self.limits.max_nodes, why
        assert new.world_size <= self.limits.max_nodes * SLOTS, why
        if old is None:
            return
        assert set(old.out).issubset(new.out), why  # a node that left never comes back
        assert new.restarts >= old.restarts and new.in_place_restarts >= old.in_place_restarts, why
        assert new.in_place_restarts <= self.limits.max_restarts, why
        if decision.action is Action.AMEND:
            assert new.members == old.members, why
        if len(new.members) >= len(old.members):  # no shrink: healthy nodes never move
            for index, member in enumerate(old.members):
                if member in new.members:
                    assert new.members.index(member) == index, why


LIMITS = [Limits(2, 2, max_restarts=2), Limits(1, 3, max_restarts=1), Limits(3, 3), Limits(2, 4, max_restarts=5)]


@pytest.mark.parametrize("seed", range(40))
def test_random_events_keep_plan_invariants(seed: int) -> None:
    rng = random.Random(seed)
    limits = dataclasses.replace(LIMITS[seed % len(LIMITS)], join_timeout=300.0, last_call=1.0,
                                 failure_window=6.0)
    sim = Sim(rng, limits)
    for _ in range(150):
        if sim.finished:
            break
        sim.event()
        for _ in range(20):  # the leader acts until it has nothing to do
            if sim.step().action is Action.WAIT:
                break
        else:
            pytest.fail(f"the policy never settles (seed {seed})")
    assert sim.starts >= 1 or sim.finished


# -- hot swaps: handover, drains during a swap, rejoin -----------------------------------------


def hot_plan(members: tuple[str, ...], gen: int = 1, **kw: Any) -> Plan:
    return dataclasses.replace(plan(members, gen), hot=True, **kw)


def switched(view: NodeView, gen: int) -> NodeView:
    return dataclasses.replace(view, run=dataclasses.replace(view.run, last_swap={"gen": gen, "step": 10}))


SWAPPED_ONCE = dict(restarts=1, in_place_restarts=1, hot_swaps=1)

HOT_COUNTS = [
    Case("a-hot-swap-after-a-failure-is-not-a-restart",
         cluster(running("a", 1), failed("b", 2, -9), node("s", 3, state="shadow"),
                 plan=hot_plan(("a", "b"), **SWAPPED_ONCE)),
         dataclasses.replace(FIXED2, max_restarts=1), T0, Action.START, members=("a", "s"), restarts=1,
         in_place_restarts=1, hot_swaps=2),
    Case("a-hot-swap-after-a-drain-is-counted-as-a-hot-swap",
         cluster(running("a", 1), running("b", 2), node("s", 3, state="shadow"),
                 plan=hot_plan(("a", "b"), **SWAPPED_ONCE), requests=(drain("b"),)),
         dataclasses.replace(FIXED2, max_restarts=1), T0, Action.START, members=("a", "s"), restarts=1,
         hot_swaps=2),
    Case("a-hot-job-without-standby-restarts-in-place-and-counts-a-restart",
         cluster(running("a", 1), failed("b", 2, -9), plan=hot_plan(("a", "b"), hot_swaps=1)),
         dataclasses.replace(FIXED2, max_restarts=1), T0, Action.START, members=("a", "b"), restarts=1,
         in_place_restarts=1, hot_swaps=1),
    Case("amend-and-scale-up-keep-the-counts",
         cluster(running("a", 1), node("s", 2), plan=dataclasses.replace(plan(("a",)), **SWAPPED_ONCE)),
         dataclasses.replace(ELASTIC_1_2, max_restarts=1), T0, Action.START, members=("a", "s"), restarts=1,
         hot_swaps=1),
    Case("a-restart-mode-swap-with-a-standby-is-a-restart",
         cluster(running("a", 1), failed("b", 2, -9), node("s", 3), plan=AB), FIXED2, T0, Action.START,
         members=("a", "s"), restarts=1, hot_swaps=0),
]


@pytest.mark.parametrize("case", HOT_COUNTS, ids=[c.id for c in HOT_COUNTS])
def test_hot_swaps_and_restarts_are_counted_apart(case: Case) -> None:
    check(case, decide(case.cluster, case.limits, case.clock))


def test_planned_drain_pairs_the_leaver_with_the_joiner_for_a_handover() -> None:
    c = cluster(running("a", 1), running("b", 2), node("s", 3, state="shadow"), plan=hot_plan(("a", "b")),
                requests=(dataclasses.replace(drain("b"), created=12.5),))
    got = decide(c, FIXED2, T0)
    assert (got.action, got.mode, got.members, got.joiners) == (Action.START, "swap-agreed", ("a", "s"), ("s",))
    assert dict(got.handover) == {"b": "s"}
    assert got.requested == 12.5  # the swap's timings start at the request


def test_no_handover_between_nodes_of_different_sizes() -> None:
    small = dataclasses.replace(node("s", 3, state="shadow"), slots=1)
    c = cluster(running("a", 1), running("b", 2), small, plan=hot_plan(("a", "b")), requests=(drain("b"),))
    got = decide(c, FIXED2, T0)
    assert got.mode == "swap-agreed" and dict(got.handover) == {}  # the state comes from the replicas


def test_a_drain_waits_while_a_joiner_has_not_switched_in() -> None:
    during = hot_plan(("a", "s"), gen=2, mode="swap-agreed", joiners=("s",), out={"b": "drained"})
    nodes = (running("a", 1, gen=2), running("b", 2, gen=1), running("s", 3, gen=2), node("t", 4, state="shadow"))
    got = decide(cluster(*nodes, plan=during, requests=(drain("a"),)), FIXED2, T0)
    assert got.action is Action.WAIT and got.answers == ()
    assert "in progress" in got.reason and "drain of a waits" in got.reason
    # once the joiner switched in, the drain goes ahead, with the second standby
    nodes = nodes[:2] + (switched(nodes[2], 2), nodes[3])
    got = decide(cluster(*nodes, plan=during, requests=(drain("a"),)), FIXED2, T0)
    assert got.action is Action.START and got.members == ("t", "s") and got.joiners == ("t",)


def test_a_drain_of_a_node_still_leaving_says_so() -> None:
    during = hot_plan(("a", "s"), gen=2, mode="swap-agreed", joiners=("s",), out={"b": "drained"})
    nodes = (running("a", 1, gen=2), running("b", 2, gen=1), switched(running("s", 3, gen=2), 2))
    got = decide(cluster(*nodes, plan=during, requests=(drain("b"),)), FIXED2, T0)
    assert got.action is Action.ANSWER and got.answers[0].state == "done"
    assert "already being drained" in got.answers[0].text


def test_rejoin_marks_the_leaver_and_returns_it_to_the_pool_once_it_stopped() -> None:
    request = dataclasses.replace(drain("b"), rejoin=True)
    c = cluster(running("a", 1), running("b", 2), node("s", 3, state="shadow"), plan=hot_plan(("a", "b")),
                requests=(request,))
    got = decide(c, FIXED2, T0)
    assert dict(got.out) == {"b": "rejoining"} and "rejoins the pool" in got.answers[0].text
    after = hot_plan(("a", "s"), gen=2, mode="swap-agreed", joiners=("s",), out={"b": "rejoining"})
    still_training = (switched(running("a", 1, gen=2), 2), running("b", 2, gen=1), switched(running("s", 3, gen=2), 2))
    got = decide(cluster(*still_training, plan=after, requests=(drain("a"),)), FIXED2, T0)
    assert got.action is Action.ANSWER and got.answers[0].state == "rejected"  # b is not a standby yet
    back = still_training[:1] + (node("b", 2, gen=2, state="shadow"),) + still_training[2:]
    got = decide(cluster(*back, plan=after, requests=(drain("a"),)), FIXED2, T0)
    assert got.action is Action.START and got.members == ("b", "s") and got.joiners == ("b",)


def test_rejoin_of_a_standby_changes_nothing() -> None:
    c = cluster(running("a", 1), running("b", 2), node("s", 3, state="shadow"), plan=hot_plan(("a", "b")),
                requests=(dataclasses.replace(drain("s"), rejoin=True),))
    got = decide(c, FIXED2, T0)
    assert got.action is Action.ANSWER and got.answers[0].state == "done" and "standby already" in got.answers[0].text


# -- hot elastic jobs: shrink and grow without a restart ---------------------------------------

HOT_ABC = hot_plan(("a", "b", "c"))
ELASTIC_1_3 = Limits(min_nodes=1, max_nodes=3)

ELASTIC_HOT = [
    Case("a-failure-shrinks-a-hot-job-without-a-restart",
         cluster(running("a", 1), failed("b", 2, -9), running("c", 3), plan=HOT_ABC), ELASTIC_1_3, T0,
         Action.START, members=("a", "c"), out={"b": "failed"}, restarts=0, hot_swaps=1,
         reason_has=("shrinks to 2", "no restart")),
    Case("a-lost-node-shrinks-a-hot-job-without-a-restart",
         cluster(running("a", 1), running("c", 3), plan=HOT_ABC), ELASTIC_1_3, T0,
         Action.START, members=("a", "c"), out={"b": "lost"}, restarts=0, hot_swaps=1),
    Case("a-drain-shrinks-a-hot-job-without-a-restart",
         cluster(running("a", 1), running("b", 2), running("c", 3), plan=HOT_ABC, requests=(drain("a"),)),
         ELASTIC_1_3, T0, Action.START, members=("b", "c"), out={"a": "drained"}, restarts=0, hot_swaps=1,
         answers=("accepted",), reason_has=("shrinks to 2", "no restart")),
    Case("a-hot-job-at-its-minimum-restarts-in-place-instead",
         cluster(running("a", 1), failed("b", 2, -9), plan=hot_plan(("a", "b"))),
         Limits(min_nodes=2, max_nodes=3, max_restarts=1), T0, Action.START, members=("a", "b"), restarts=1,
         in_place_restarts=1, hot_swaps=0),
    Case("a-regular-node-grows-a-hot-job-without-a-restart",
         cluster(running("a", 1), running("c", 3), node("d", 4), plan=hot_plan(("a", "c"))), ELASTIC_1_3, T0,
         Action.START, members=("a", "c", "d"), restarts=0, hot_swaps=1, reason_has=("scale-up", "no restart")),
    Case("a-standby-does-not-grow-the-job-by-default",
         cluster(running("a", 1), running("c", 3), node("s", 4, hint=True), plan=hot_plan(("a", "c"))),
         ELASTIC_1_3, T0, Action.WAIT),
    Case("with-grow-a-standby-grows-the-job",
         cluster(running("a", 1), running("c", 3), node("s", 4, hint=True), plan=hot_plan(("a", "c"))),
         dataclasses.replace(ELASTIC_1_3, grow=True), T0, Action.START, members=("a", "c", "s")),
    Case("a-rejoined-node-does-not-grow-the-job-by-default",
         cluster(running("a", 1), node("b", 2, state="shadow"), plan=hot_plan(("a",), gen=2, out={"b": "rejoining"})),
         ELASTIC_1_3, T0, Action.WAIT),
    Case("with-grow-a-rejoined-node-grows-the-job",
         cluster(running("a", 1), node("b", 2, state="shadow"), plan=hot_plan(("a",), gen=2, out={"b": "rejoining"})),
         dataclasses.replace(ELASTIC_1_3, grow=True), T0, Action.START, members=("a", "b")),
]


@pytest.mark.parametrize("case", ELASTIC_HOT, ids=[c.id for c in ELASTIC_HOT])
def test_hot_elastic_jobs_resize_without_a_restart(case: Case) -> None:
    check(case, decide(case.cluster, case.limits, case.clock))


def test_a_hot_shrink_and_growth_are_swaps_with_and_without_joiners() -> None:
    lost = decide(cluster(running("a", 1), running("c", 3), plan=HOT_ABC), ELASTIC_1_3, T0)
    assert (lost.mode, lost.joiners, lost.kind) == ("swap-now", (), "failure")
    drained = decide(cluster(running("a", 1), running("b", 2), running("c", 3), plan=HOT_ABC,
                             requests=(drain("b"),)), ELASTIC_1_3, T0)
    assert (drained.mode, drained.joiners, dict(drained.handover)) == ("swap-agreed", (), {})
    grown = decide(cluster(running("a", 1), running("c", 3), node("d", 4), plan=hot_plan(("a", "c"))),
                   ELASTIC_1_3, T0)
    assert (grown.mode, grown.joiners, grown.kind) == ("swap-agreed", ("d",), "scale-up")


def test_growth_and_drains_wait_while_the_survivors_of_a_shrink_have_not_switched() -> None:
    shrunk = hot_plan(("a", "c"), gen=2, mode="swap-now", out={"b": "failed"})
    waiting = (running("a", 1, gen=2), running("c", 3, gen=2), node("d", 4))
    got = decide(cluster(*waiting, plan=shrunk), ELASTIC_1_3, T0)
    assert got.action is Action.WAIT and "in progress" in got.reason
    got = decide(cluster(*waiting, plan=shrunk, requests=(drain("a"),)), ELASTIC_1_3, T0)
    assert got.action is Action.WAIT and got.answers == ()
    switched_in = (switched(waiting[0], 2), switched(waiting[1], 2), waiting[2])
    got = decide(cluster(*switched_in, plan=shrunk), ELASTIC_1_3, T0)
    assert got.action is Action.START and got.members == ("a", "c", "d") and got.joiners == ("d",)


# -- link events: members whose agents cannot reach each other ----------------------------------


def cut(view: NodeView, *unreachable: str) -> NodeView:
    """``view`` whose agent's link checks miss ``unreachable``."""
    return dataclasses.replace(view, unreachable=frozenset(unreachable))


LINKS = [
    Case("a-cut-pair-the-higher-rank-leaves-and-a-standby-takes-its-place",
         cluster(running("a", 1), cut(running("b", 2), "c"), cut(running("c", 3), "b"), node("s", 4, state="shadow"),
                 plan=HOT_ABC), FIXED3, T0, Action.START, members=("a", "b", "s"), out={"c": "link"}, restarts=0,
         hot_swaps=1, reason_has=("c's link to b is down", "s takes its place", "hot swap")),
    Case("one-end-alone-is-not-a-cut-a-dead-agent-reports-nothing",
         cluster(running("a", 1), cut(running("b", 2), "c"), running("c", 3), node("s", 4, state="shadow"),
                 plan=HOT_ABC), FIXED3, T0, Action.WAIT),
    Case("the-node-in-most-cut-pairs-leaves",
         cluster(cut(running("a", 1), "b"), cut(running("b", 2), "a", "c"), cut(running("c", 3), "b"),
                 node("s", 4, state="shadow"), plan=HOT_ABC), FIXED3, T0, Action.START, members=("a", "s", "c"),
         out={"b": "link"}, reason_has=("b's link to a, c is down",)),
    Case("an-elastic-job-without-a-standby-shrinks",
         cluster(running("a", 1), cut(running("b", 2), "c"), cut(running("c", 3), "b"), plan=HOT_ABC),
         ELASTIC_1_3, T0, Action.START, members=("a", "b"), out={"c": "link"}, restarts=0,
         reason_has=("shrinks to 2", "no restart")),
    Case("at-the-minimum-without-a-standby-it-waits",
         cluster(running("a", 1), cut(running("b", 2), "c"), cut(running("c", 3), "b"), plan=HOT_ABC),
         FIXED3, T0, Action.WAIT, reason_has=("c's link to b is down", "no standby", "minimum")),
    Case("a-standby-cut-off-from-a-member-is-passed-over",
         cluster(running("a", 1), cut(running("b", 2), "c"), cut(running("c", 3), "b"), cut(node("s", 4, state="shadow"), "a"),
                 node("t", 5, state="shadow"), plan=HOT_ABC), FIXED3, T0, Action.START, members=("a", "b", "t")),
    Case("a-standby-a-member-cannot-reach-is-passed-over",
         cluster(running("a", 1), cut(running("b", 2), "c", "s"), cut(running("c", 3), "b"), node("s", 4, state="shadow"),
                 node("t", 5, state="shadow"), plan=HOT_ABC), FIXED3, T0, Action.START, members=("a", "b", "t")),
    Case("a-standby-that-misses-the-lost-member-it-replaces-is-picked",
         cluster(running("a", 1), running("b", 2), cut(node("s", 4, state="shadow"), "c"), plan=HOT_ABC),
         FIXED3, T0, Action.START, members=("a", "b", "s"), out={"c": "lost"}),
    Case("a-standby-that-misses-the-failed-member-it-replaces-is-picked",
         cluster(running("a", 1), running("b", 2), failed("c", 3, -9), cut(node("s", 4, state="shadow"), "c"),
                 plan=HOT_ABC), FIXED3, T0, Action.START, members=("a", "b", "s"), out={"c": "failed"}),
    Case("a-job-without-the-runtime-restarts-without-the-node",
         cluster(running("a", 1), cut(running("b", 2), "c"), cut(running("c", 3), "b"), node("s", 4), plan=ABC),
         FIXED3, T0, Action.START, members=("a", "b", "s"), out={"c": "link"}, restarts=1),
    Case("a-failure-comes-first",
         cluster(failed("a", 1, -9), cut(running("b", 2), "c"), cut(running("c", 3), "b"), node("s", 4, state="shadow"),
                 plan=HOT_ABC), FIXED3, T0, Action.START, members=("s", "b", "c"), out={"a": "failed"}),
    Case("failed-collectives-beside-a-cut-link-the-link-says-who-leaves",
         cluster(running("a", 1), cut(failed("b", 2, 1), "c"), cut(failed("c", 3, 1), "b"), node("s", 4, state="shadow"),
                 plan=HOT_ABC), FIXED3, T0, Action.START, members=("a", "b", "s"), out={"c": "link"},
         reason_has=("c's link to b is down",)),
    Case("its-links-back-the-node-grows-the-elastic-job-again",
         cluster(running("a", 2, gen=2), running("b", 3, gen=2), node("c", 4, gen=2, state="idle"),
                 plan=hot_plan(("a", "b"), gen=2, out={"c": "link"})),
         ELASTIC_1_3, T0, Action.START, members=("a", "b", "c"), reason_has=("scale-up",)),
    Case("while-its-link-is-down-it-stays-out",
         cluster(running("a", 2, gen=2), cut(running("b", 3, gen=2), "c"), cut(node("c", 4, gen=2, state="idle"), "b"),
                 plan=hot_plan(("a", "b"), gen=2, out={"c": "link"})),
         ELASTIC_1_3, T0, Action.WAIT),
    Case("its-links-back-it-is-a-standby-of-a-fixed-job",
         cluster(running("a", 1, gen=2), failed("b", 2, -9, gen=2), running("s", 3, gen=2),
                 node("c", 4, gen=2, state="shadow"), plan=hot_plan(("a", "b", "s"), gen=2, out={"c": "link"})),
         FIXED3, T0, Action.START, members=("a", "c", "s"), reason_has=("c takes its place",)),
]


def led_by(view: Cluster, leader: str) -> Cluster:
    return dataclasses.replace(view, leader=leader)


LINKS += [
    Case("a-tie-with-the-leader-takes-the-other-end-out",
         led_by(cluster(running("a", 1), cut(running("b", 2), "c"), cut(running("c", 3), "b"), node("s", 4, state="shadow"),
                        plan=HOT_ABC), "c"), FIXED3, T0, Action.START, members=("a", "s", "c"), out={"b": "link"}),
    Case("the-leader-in-most-pairs-stays-and-the-nodes-it-cannot-reach-leave",
         led_by(cluster(cut(running("a", 1), "b", "c"), cut(running("b", 2), "a"), cut(running("c", 3), "a"), node("s", 4, state="shadow"),
                        node("t", 5, state="shadow"), plan=HOT_ABC), "a"), FIXED3, T0, Action.START,
         members=("a", "s", "t"), out={"b": "link", "c": "link"}, reason_has=("the leader",)),
]


@pytest.mark.parametrize("case", LINKS, ids=[c.id for c in LINKS])
def test_a_member_with_a_cut_link_leaves_like_a_failure(case: Case) -> None:
    check(case, decide(case.cluster, case.limits, case.clock))


def test_a_link_event_is_a_swap_now_of_kind_link() -> None:
    got = decide(cluster(running("a", 1), cut(running("b", 2), "c"), cut(running("c", 3), "b"), node("s", 4, state="shadow"),
                         plan=HOT_ABC), FIXED3, T0)
    assert (got.mode, got.joiners, got.kind) == ("swap-now", ("s",), "link")


# -- the end of the job: a failure after the last step is the job's failure --------------------


def succeeded(name: str, order: int, gen: int = 1, **kw: Any) -> NodeView:
    return node(name, order, gen=gen, state="succeeded", code=0, **kw)


SWAP_AFTER_FAILURE = hot_plan(("s", "b"), gen=2, mode="swap-now", joiners=("s",), out={"a": "failed"},
                              reason="a worker rank 0 exited with code 1; s takes its place (hot swap)")
SWAP_AFTER_DRAIN = hot_plan(("s", "b"), gen=2, mode="swap-agreed", joiners=("s",), out={"a": "drained"},
                            reason="drain a: s takes its place (hot swap)")

END = [
    Case("hot-failure-after-a-member-finished-fails-at-once",
         cluster(failed("a", 1, 1, rank=0), succeeded("b", 2), node("s", 3, state="shadow"), plan=hot_plan(("a", "b"))),
         FIXED2, T0, Action.FINISH, outcome="failed",
         reason_has=("a worker rank 0 exited with code 1 after the job's last step", "b finished it")),
    Case("hot-kill-after-a-member-finished-fails",
         cluster(failed("a", 1, -9, rank=0), succeeded("b", 2), node("s", 3, state="shadow"), plan=hot_plan(("a", "b"))),
         FIXED2, T0, Action.FINISH, outcome="failed", reason_has=("a worker rank 0 killed by signal 9",)),
    Case("hot-lost-after-a-member-finished-fails",
         cluster(succeeded("b", 2), node("s", 3, state="shadow"), plan=hot_plan(("a", "b"))),
         FIXED2, T0, Action.FINISH, outcome="failed", reason_has=("a was lost after the job's last step",)),
    Case("hot-failure-while-the-others-still-run-waits-for-a-clearer-cause",
         cluster(failed("a", 1, 1, rank=0), running("b", 2), node("s", 3, state="shadow"), plan=hot_plan(("a", "b"))),
         FIXED2, Clock(now=1.0, failure_since=1.0), Action.WAIT, until=7.0,
         reason_has=("a worker rank 0 exited with code 1",)),
    Case("restart-mode-failure-after-a-member-finished-restarts-with-the-standby",
         cluster(failed("a", 1, 1, rank=0), succeeded("b", 2), node("s", 3), plan=AB),
         FIXED2, Clock(now=10.0, failure_since=1.0), Action.START, members=("s", "b"), out={"a": "failed"}),
    Case("restart-mode-failure-after-a-member-finished-without-restarts-fails",
         cluster(failed("a", 1, 1, rank=0), succeeded("b", 2), plan=AB),
         FIXED2, Clock(now=10.0, failure_since=1.0), Action.FINISH, outcome="failed",
         reason_has=("a worker rank 0 exited with code 1", "--max-restarts 0")),
    Case("swap-after-a-failure-that-nobody-switched-into-fails",
         cluster(succeeded("b", 2, gen=2), running("s", 3, gen=2), node("a", 1, gen=2), plan=SWAP_AFTER_FAILURE),
         FIXED2, T0, Action.FINISH, outcome="failed",
         reason_has=("a worker rank 0 exited with code 1", "before s could switch in", "not redone")),
    Case("swap-after-a-drain-that-nobody-switched-into-succeeds",
         cluster(succeeded("b", 2, gen=2), running("s", 3, gen=2), plan=SWAP_AFTER_DRAIN),
         FIXED2, T0, Action.FINISH, outcome="succeeded", reason_has=("before s could switch in",)),
    Case("a-holder-switched-in-so-the-joiner-did-too-wait-for-it",
         cluster(switched(succeeded("b", 2, gen=2), 2), running("s", 3, gen=2), plan=SWAP_AFTER_FAILURE),
         FIXED2, T0, Action.WAIT),
    Case("the-joiner-redid-the-work-and-finished-succeeds",
         cluster(switched(succeeded("b", 2, gen=2), 2), switched(succeeded("s", 3, gen=2), 2), plan=SWAP_AFTER_FAILURE),
         FIXED2, T0, Action.FINISH, outcome="succeeded"),
    Case("the-joiner-failed-after-the-last-step-fails",
         cluster(switched(succeeded("b", 2, gen=2), 2), switched(failed("s", 3, 1, gen=2, rank=0), 2),
                 plan=SWAP_AFTER_FAILURE),
         FIXED2, T0, Action.FINISH, outcome="failed", reason_has=("s worker rank 0 exited with code 1",)),
]


@pytest.mark.parametrize("case", END, ids=[c.id for c in END])
def test_end_of_the_job(case: Case) -> None:
    check(case, decide(case.cluster, case.limits, case.clock))
