"""The leader's decision core: a pure function from a snapshot of the job to the next action.

The leader's driver (:mod:`agent.leader`) reads the job's keys, builds a :class:`Cluster`, asks
:func:`decide` what to do, applies the answer with compare-and-set and waits for the next change.
Nothing here reads a clock, the store or the environment; time comes in as :class:`Clock`.

Which node takes which place (the rank policy)::

    members (group rank = index)      standby pool (join order)
    [node-0, node-1, node-2]          [node-3, node-4]
                ^ fails
    [node-0, node-3, node-2]          [node-4]          out: {node-1: failed}

- The first generation ranks its nodes by name (natural order: ``node-0`` rank 0, ``node-2``
  before ``node-10``), whatever order they joined in; later generations keep every healthy
  node's place.
- A standby takes the lost node's place, at the same index: healthy nodes never move.
- No standby left: an elastic job (``--nnodes MIN:MAX``) shrinks while it stays at MIN or above;
  otherwise the node restarts in place, at most ``--max-restarts`` times for the whole job. A
  hot job shrinks without a restart: the survivors switch to the smaller group (``swap-now``
  after a failure, ``swap-agreed`` at a step both sides vote for after a drain); the members
  after the leaver move down one place, since group ranks are contiguous.
- A lost node (lease expired) can't restart in place; the job waits ``join`` seconds for a node.
- An elastic job below MAX grows with nodes that join as regular nodes (a hot job without a
  restart: ``swap-agreed``, the newcomers appended as ``joiners``, once no swap is in progress);
  nodes started as standbys (``--standby``) and nodes that rejoined the pool (``drain --rejoin``)
  stay in the pool for failures and drains, unless ``--grow`` lets them grow the job too.

Drains (requests) wait while a swap is in progress (a joiner of the current generation has not
switched in yet), then are answered in order; a drained node with ``rejoin`` leaves its place and
comes back to the pool as a standby (``out`` says ``rejoining`` until it is picked again).

Which node is to blame (the culprit rule): a failure in one place usually makes every peer's
collective fail a moment later, so a plain non-zero exit is ambiguous. A lost lease or a worker
killed by a signal is taken as the cause at once; otherwise the leader waits ``failure_window``
seconds for such a clearer cause and then blames the node that reported first. A link that both
of its ends report cut is a clearer cause: the link rule decides when it can replace a node.

The end of the job: it succeeds when every member's workers exited 0 in the current generation.
A worker that fails after the job's last step (in the script's epilogue: a final save, a last
print) fails the job unless a swap or restart then completes the same work. In a hot job, once a
member has finished, no swap can (the state holders are gone): the job fails at once, naming the
worker's rank and exit code. A restart (a torchrun script) reruns the script as usual. A swap
that replaced a failed node and that nobody switched into before the holders finished leaves the
failure standing; one that replaced a drained node does not (the leaver ran the last steps).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Mapping

from agent.records import Plan, Request, RunState


class Action(str, enum.Enum):
    WAIT = "wait"  # nothing to do until ``until`` or the next change
    START = "start"  # write a new generation (gen + 1) with ``members``
    AMEND = "amend"  # rewrite the current plan's ``out`` without a new generation
    FINISH = "finish"  # write the job's outcome
    ANSWER = "answer"  # answer requests only


@dataclasses.dataclass(frozen=True)
class NodeView:
    """A live node as the leader sees it (its key exists, so its lease holds)."""

    name: str
    order: int  # create revision of its key: join order
    slots: int
    standby_hint: bool = False
    run: RunState = RunState()
    report_revision: int = 0  # mod revision of its key: when it last reported
    unreachable: frozenset[str] = frozenset()  # nodes its agent's link checks cannot reach now
    link_at: str = ""  # host:port where its agent answers link checks ("" when it does not)


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: Mapping[str, NodeView]
    plan: Plan | None
    requests: tuple[Request, ...] = ()  # pending, oldest first
    finished: bool = False
    leader: str = ""  # the node deciding: it hosts the next generation's store


@dataclasses.dataclass(frozen=True)
class Limits:
    min_nodes: int
    max_nodes: int
    max_restarts: int = 0
    join_timeout: float = 600.0
    last_call: float = 1.0
    failure_window: float = 6.0
    standby_fill: float = 10.0
    grow: bool = False  # standbys and rejoined nodes grow an elastic job below MAX (--grow)


@dataclasses.dataclass(frozen=True)
class Clock:
    """Times the driver observed; ``None`` where the condition does not hold now."""

    now: float
    rendezvous_since: float = 0.0
    quorum_since: float | None = None
    failure_since: float | None = None
    # Until then a member's missing key may be an agent registering again after etcd was away
    # (the leader just took over, or its own view of etcd just came back): not yet "lost".
    settled_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class Answer:
    request_id: str
    state: str  # accepted | rejected | done
    text: str


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    members: tuple[str, ...] = ()
    out: Mapping[str, str] = dataclasses.field(default_factory=dict)
    restarts: int = 0  # generations that restarted workers because of a failure
    in_place_restarts: int = 0
    hot_swaps: int = 0  # generations reached by a hot swap (a failure or a drain; nobody restarted)
    outcome: str = ""
    answers: tuple[Answer, ...] = ()
    until: float | None = None
    kind: str = ""  # event kind for the history: start, failure, drain, scale-up, ...
    hot: bool = False
    mode: str = "restart"
    joiners: tuple[str, ...] = ()
    handover: Mapping[str, str] = dataclasses.field(default_factory=dict)  # leaver -> joiner
    requested: float = 0.0  # wall time of what caused this decision (a request, a failure report)


def quorum_reached(cluster: Cluster, limits: Limits) -> bool:
    """Whether enough nodes are up for the first generation (the driver times this)."""
    return len(_eligible(cluster)) >= limits.min_nodes


def swap_in_progress(cluster: Cluster, plan: Plan) -> bool:
    """Whether a live joiner of ``plan`` has not switched into it yet; in a resize without joiners
    (a hot shrink), whether a member still training has not switched."""
    if not plan.mode.startswith("swap"):
        return False
    if plan.joiners:
        return any(j in cluster.nodes and _run(cluster, j).last_swap.get("gen") != plan.gen for j in plan.joiners)
    return any(m in cluster.nodes and _run(cluster, m).state == "running" and _run(cluster, m).last_swap.get("gen")
               != plan.gen for m in plan.members)


def failure_pending(cluster: Cluster) -> bool:
    """Whether the current generation has a failed or lost member (the driver times this)."""
    plan = cluster.plan
    return plan is not None and bool(_lost(cluster, plan) or _failed(cluster, plan))


def decide(cluster: Cluster, limits: Limits, clock: Clock) -> Decision:
    """The next action for the leader, with its reason."""
    if cluster.finished:
        return Decision(Action.WAIT, "the job has ended")
    plan = cluster.plan
    if plan is None:
        return _rendezvous(cluster, limits, clock)
    if all(_run(cluster, m).gen == plan.gen and _run(cluster, m).state == "succeeded" for m in plan.members):
        return Decision(Action.FINISH, f"all {len(plan.members)} nodes finished generation {plan.gen}",
                        outcome="succeeded", kind="succeeded")
    holders = [m for m in plan.members if m not in plan.joiners]
    if plan.joiners and holders and all(_run(cluster, m).gen == plan.gen and _run(cluster, m).state == "succeeded"
                                        for m in holders) \
            and not any(_run(cluster, m).last_swap.get("gen") == plan.gen for m in plan.members):
        return _end_race(plan, holders)
    failure = _on_failure(cluster, plan, limits, clock)
    if failure is not None:
        return failure
    cut = _on_link_cut(cluster, plan, limits, clock)
    if cut is not None:
        return cut
    if cluster.requests:
        if swap_in_progress(cluster, plan):
            return Decision(Action.WAIT, f"drain of {cluster.requests[0].node} waits: generation {plan.gen}'s "
                            f"swap ({', '.join(plan.joiners)} switching in) is in progress")
        return _on_request(cluster, plan, limits, cluster.requests[0])
    if not plan.hot and all(_run(cluster, m).gen == plan.gen and _run(cluster, m).runtime for m in plan.members):
        return Decision(Action.AMEND, f"generation {plan.gen} runs the tmrun runtime: standbys shadow-train, "
                        "swaps need no restart", members=plan.members, out=plan.out, restarts=plan.restarts,
                        in_place_restarts=plan.in_place_restarts, hot_swaps=plan.hot_swaps, kind="hot", hot=True,
                        mode=plan.mode)
    growth = _growth(cluster, plan, limits)
    if len(plan.members) < limits.max_nodes and growth:
        if swap_in_progress(cluster, plan):
            return Decision(Action.WAIT, f"scale-up with {growth[0]} waits: generation {plan.gen}'s switch "
                            "is in progress")
        joiners = tuple(growth[: limits.max_nodes - len(plan.members)])
        hot = plan.hot
        return Decision(Action.START, f"scale-up: {', '.join(joiners)} join" + (" (no restart)" if hot else ""),
                        members=plan.members + joiners, out=plan.out, restarts=plan.restarts,
                        in_place_restarts=plan.in_place_restarts, hot_swaps=plan.hot_swaps + (1 if hot else 0),
                        kind="scale-up", hot=hot, mode="swap-agreed" if hot else "restart",
                        joiners=joiners if hot else ())
    return Decision(Action.WAIT, f"generation {plan.gen} is running")


def _growth(cluster: Cluster, plan: Plan, limits: Limits) -> list[str]:
    """Pool nodes that grow an elastic job: those that joined as regular nodes, and those taken out
    for a cut link once it is back; with ``--grow``, standbys and nodes that rejoined the pool too."""
    if limits.grow:
        return _pool(cluster, plan)
    return [n for n in _pool(cluster, plan)
            if (not cluster.nodes[n].standby_hint and n not in plan.out) or plan.out.get(n) == "link"]


def cut_links(cluster: Cluster, plan: Plan) -> list[tuple[str, str]]:
    """Pairs of members whose link is down, by rank: both ends' agents report the other unreachable.

    Both, because a node whose agent died (or whose machine did) is unreachable from everyone
    and reports nothing: that is a lost node (its lease expires), not a cut link."""
    rank = {m: i for i, m in enumerate(plan.members)}
    pairs = set()
    for member in plan.members:
        view = cluster.nodes.get(member)
        for other in view.unreachable if view is not None else ():
            peer = cluster.nodes.get(other)
            if other in rank and other != member and peer is not None and member in peer.unreachable:
                pairs.add(tuple(sorted((member, other), key=rank.__getitem__)))
    return sorted(pairs, key=lambda pair: (rank[pair[0]], rank[pair[1]]))


def _on_link_cut(cluster: Cluster, plan: Plan, limits: Limits, clock: Clock) -> Decision | None:
    """Members that cannot reach each other: the node in most cut pairs leaves like a failure
    (ties: not the leader, then the higher rank), again until no pair is left; a standby takes its
    place, or an elastic job shrinks. The leader hosts the next generation's store, so every member
    must reach it: when it would be the one to leave, the members it cannot reach leave instead.
    A node taken out keeps checking: once its links are back it is a standby again."""
    pairs = cut_links(cluster, plan)
    if not pairs:
        return None
    culprits: dict[str, str] = {}
    while pairs:
        count: dict[str, int] = {}
        for a, b in pairs:
            count[a] = count.get(a, 0) + 1
            count[b] = count.get(b, 0) + 1
        culprit = max(count, key=lambda m: (count[m], m != cluster.leader, plan.members.index(m)))
        peers = [a if b == culprit else b for a, b in pairs if culprit in (a, b)]
        if culprit == cluster.leader:
            for peer in peers:
                culprits[peer] = f"{peer}'s link to {culprit} (the leader: it hosts the generation's store) is down"
            pairs = [pair for pair in pairs if not set(pair) & set(peers)]
            continue
        culprits[culprit] = f"{culprit}'s link to {', '.join(peers)} is down"
        pairs = [pair for pair in pairs if culprit not in pair]
    decision = _replace(cluster, plan, limits, clock, list(culprits), [], links=culprits)
    if decision.action is Action.START:
        return decision
    what = "; ".join(culprits.values())
    return Decision(Action.WAIT, f"{what}: no standby and the job is at its minimum size; waiting for the link "
                    "to come back or a node to join (a collective that times out fails the job's step meanwhile)")


def _rendezvous(cluster: Cluster, limits: Limits, clock: Clock) -> Decision:
    """The first generation: regular nodes first; standby-hinted nodes only fill a gap.

    Starts at once with MAX regular nodes; an elastic job starts with MIN or more regular nodes
    after ``last_call``; standby-hinted nodes make up the numbers only after ``standby_fill``
    (a regular node that never came), or at the join deadline once MIN nodes are there.
    """
    eligible = _eligible(cluster)
    regular = [n.name for n in eligible if not n.standby_hint]
    everyone = [n.name for n in eligible]
    if len(regular) >= limits.max_nodes:
        return _first(tuple(regular[: limits.max_nodes]))
    waited = clock.now - clock.quorum_since if clock.quorum_since is not None else -1.0
    join_deadline = clock.rendezvous_since + limits.join_timeout
    if len(regular) >= limits.min_nodes and waited >= limits.last_call:
        return _first(tuple(regular[: limits.max_nodes]))
    if len(everyone) >= limits.min_nodes and (waited >= limits.standby_fill or clock.now >= join_deadline):
        return _first(tuple(everyone[: limits.max_nodes]))
    if clock.now >= join_deadline:
        return Decision(Action.FINISH, f"rendezvous timed out after {limits.join_timeout:g} s: "
                        f"{len(eligible)} of {limits.min_nodes} nodes joined", outcome="failed", kind="failed")
    until = join_deadline
    if clock.quorum_since is not None:
        step = limits.last_call if len(regular) >= limits.min_nodes else limits.standby_fill
        until = min(until, clock.quorum_since + step)
    return Decision(Action.WAIT, f"waiting for nodes: {len(eligible)} joined, {limits.min_nodes} needed",
                    until=until)


def _first(chosen: tuple[str, ...]) -> Decision:
    """The first generation: chosen in join order, ranked by name (node-0 rank 0, node-2 before node-10)."""
    members = tuple(sorted(chosen, key=_name_order))
    return Decision(Action.START, f"{len(members)} nodes joined", members=members, kind="start")


def _name_order(name: str) -> list[str | int]:
    """Natural order of node names: digit runs compare as numbers."""
    return [int(part) if index % 2 else part for index, part in enumerate(re.split(r"(\d+)", name))]


def _end_race(plan: Plan, holders: list[str]) -> Decision:
    """Every node holding the state finished before the joiners could switch in (nobody switched).

    After a drain (``swap-agreed``) the leaver ran the last steps itself: the work is done. After a
    failure (``swap-now``) the swap was to redo the failed node's work, and nobody did: the failure
    stands (its worker's rank and exit code are in the plan's reason).
    """
    late = f"the job's last step ran before {', '.join(plan.joiners)} could switch in"
    if plan.mode == "swap-now":
        return Decision(Action.FINISH, f"{plan.reason}, but {late}: the failed node's work was not redone",
                        outcome="failed", kind="failed")
    return Decision(Action.FINISH, f"{late}: all {len(holders)} nodes holding the state finished",
                    outcome="succeeded", kind="succeeded")


def _on_failure(cluster: Cluster, plan: Plan, limits: Limits, clock: Clock) -> Decision | None:
    lost = _lost(cluster, plan)
    failed = _failed(cluster, plan)
    if not lost and not failed:
        return None
    killed = [m for m in failed if (_run(cluster, m).exitcode or 0) < 0]
    if lost and not failed and clock.now < clock.settled_at:
        return Decision(Action.WAIT, f"generation {plan.gen}: no key for {', '.join(lost)}; etcd was away, "
                        "waiting for its agent to register again", until=clock.settled_at)
    finished = [m for m in plan.members if _run(cluster, m).gen == plan.gen and _run(cluster, m).state == "succeeded"]
    if plan.hot and finished:
        # A step commits only when every rank votes for it, so a member that succeeded means the
        # last step was committed everywhere: this failure came after it (a final save, a last
        # print). The state holders' workers are gone, so no swap can redo it.
        what = "; ".join(f"{m} {'was lost' if m in lost else _describe(cluster, m)}" for m in lost + failed)
        return Decision(Action.FINISH, f"{what} after the job's last step ({', '.join(finished)} finished it)",
                        outcome="failed", kind="failed")
    if lost or killed:
        culprits = lost + killed
    else:
        # Collectives that failed beside a cut link between members failed for it (they time out
        # on the cut link): the link says which node leaves, not the first report of a failure.
        cut = _on_link_cut(cluster, plan, limits, clock)  # None without a cut pair
        if cut is not None and cut.action is Action.START:
            return cut
        since = clock.failure_since if clock.failure_since is not None else clock.now
        deadline = since + limits.failure_window
        if len(failed) < len(plan.members) and clock.now < deadline:
            return Decision(Action.WAIT, f"generation {plan.gen}: {failed[0]} {_describe(cluster, failed[0])}; "
                            "waiting for a clearer cause", until=deadline)
        culprits = [min(failed, key=lambda m: cluster.nodes[m].report_revision)]
    return _replace(cluster, plan, limits, clock, culprits, lost)


def _replace(cluster: Cluster, plan: Plan, limits: Limits, clock: Clock,
             culprits: list[str], lost: list[str], links: Mapping[str, str] | None = None) -> Decision:
    """``culprits`` leave: a standby takes each one's place, or the job shrinks, or (a failed
    worker) it restarts in place. ``links``: culprits taken out for a cut link, with why."""
    links = links or {}
    members = list(plan.members)
    out = dict(plan.out)
    pool = _pool(cluster, plan)
    notes: list[str] = []
    in_place: list[str] = []
    shrunk = False
    for culprit in culprits:
        cause = "link" if culprit in links else "lost" if culprit in lost else "failed"
        what = links[culprit] if cause == "link" else \
            f"{culprit} {'was lost' if cause == 'lost' else _describe(cluster, culprit)}"
        if pool:
            joiner = pool.pop(0)
            members[members.index(culprit)] = joiner
            out[culprit] = cause
            notes.append(f"{what}; {joiner} takes its place")
        elif len(members) - 1 >= limits.min_nodes:
            members.remove(culprit)
            out[culprit] = cause
            notes.append(f"{what}; no standby, the job shrinks to {len(members)} nodes")
            shrunk = True
        elif cause == "link":
            return Decision(Action.WAIT, what)  # the caller says why nothing can be done
        elif cause == "lost":
            since = clock.failure_since if clock.failure_since is not None else clock.now
            if clock.now >= since + limits.join_timeout:
                return Decision(Action.FINISH, f"{what} and no node took its place within "
                                f"{limits.join_timeout:g} s", outcome="failed", kind="failed")
            return Decision(Action.WAIT, f"{what}; no standby left, waiting for a node to join",
                            until=since + limits.join_timeout)
        else:
            in_place.append(culprit)
            notes.append(f"{what}; no standby left, restarting in place")
    in_place_restarts = plan.in_place_restarts + (1 if in_place else 0)
    if in_place_restarts > limits.max_restarts:
        return Decision(Action.FINISH, f"{'; '.join(notes).replace(', restarting in place', '')}"
                        f" and --max-restarts {limits.max_restarts} is used up",
                        outcome="failed", kind="failed")
    swap = plan.hot and not in_place  # the survivors keep their workers: a hot swap, a hot shrink or both
    before = set(plan.members)
    joiners = tuple(m for m in members if m not in before) if swap else ()
    # when a failed worker reported; a link's report time is not kept: the plan's own time stands in
    reported = [_run(cluster, c).at for c in culprits if c not in lost and c not in links and _run(cluster, c).at]
    how = (" (hot swap)" if joiners else "") + (" (no restart)" if swap and shrunk else "")
    return Decision(Action.START, "; ".join(notes) + how, members=tuple(members),
                    out=out, restarts=plan.restarts + (0 if swap else 1), in_place_restarts=in_place_restarts,
                    hot_swaps=plan.hot_swaps + (1 if swap else 0), kind="link" if links else "failure",
                    hot=plan.hot, mode="swap-now" if swap else "restart", joiners=joiners,
                    requested=min(reported) if reported else 0.0)


def _on_request(cluster: Cluster, plan: Plan, limits: Limits, request: Request) -> Decision:
    node = request.node
    if request.kind != "drain":
        return _answer(request, "rejected", f"unknown request kind {request.kind!r}")
    leaving = "rejoining" if request.rejoin else "drained"
    if plan.out.get(node) == "drained" or (node in plan.out and node not in cluster.nodes):
        if node in cluster.nodes:
            return _answer(request, "done", f"{node} is already being drained (generation {plan.gen})")
        return _answer(request, "done", f"{node} already left the job ({plan.out[node]})")
    keep = dict(restarts=plan.restarts, in_place_restarts=plan.in_place_restarts, requested=request.created)
    if node in plan.members:
        members = list(plan.members)
        pool = _pool(cluster, plan)
        mode = "restart"
        if pool:
            members[members.index(node)] = pool[0]
            mode = "swap-agreed" if plan.hot else "restart"
            text = f"drain {node}: {pool[0]} takes its place" + (" (hot swap)" if plan.hot else "")
        elif len(members) - 1 >= limits.min_nodes:
            members.remove(node)
            mode = "swap-agreed" if plan.hot else "restart"
            text = f"drain {node}: no standby, the job shrinks to {len(members)} nodes" + \
                (" (no restart)" if plan.hot else "")
        else:
            return _answer(request, "rejected", f"cannot drain {node}: no standby can take its place "
                           f"and the job is at its minimum size ({limits.min_nodes} nodes)")
        if request.rejoin:
            text += f"; {node} rejoins the pool as a standby"
        joiner = pool[0] if pool and mode != "restart" else None
        handover = {node: joiner} if joiner and cluster.nodes[joiner].slots == plan.slots[node] else {}
        return Decision(Action.START, text, members=tuple(members), out={**plan.out, node: leaving},
                        answers=(Answer(request.id, "accepted", text),), kind="drain", hot=plan.hot, mode=mode,
                        joiners=(joiner,) if joiner else (), handover=handover,
                        hot_swaps=plan.hot_swaps + (1 if mode == "swap-agreed" else 0), **keep)
    if node in cluster.nodes:
        if request.rejoin:
            return _answer(request, "done", f"{node} is a standby already")
        text = f"drain {node}: it was a standby and leaves the pool"
        return Decision(Action.AMEND, text, members=plan.members, out={**plan.out, node: "drained"},
                        answers=(Answer(request.id, "accepted", text),), kind="drain", hot=plan.hot,
                        mode=plan.mode, joiners=plan.joiners, hot_swaps=plan.hot_swaps, **keep)
    return _answer(request, "rejected", f"unknown node {node!r}")


def _answer(request: Request, state: str, text: str) -> Decision:
    return Decision(Action.ANSWER, text, answers=(Answer(request.id, state, text),), kind="request")


def _eligible(cluster: Cluster) -> list[NodeView]:
    out = cluster.plan.out if cluster.plan else {}
    nodes = [n for n in cluster.nodes.values() if n.name not in out]
    return sorted(nodes, key=lambda n: (n.standby_hint, n.order))


def _pool(cluster: Cluster, plan: Plan) -> list[str]:
    """Standbys in join order: alive, not training, not out (a rejoining node once it stopped
    training), and with a working link to every member (as the checks of both ends see it)."""
    members = set(plan.members)  # a set: 1,000 nodes against 1,000 members
    live = {m for m in members if m in cluster.nodes and _run(cluster, m).state != "failed"}
    cut_off = set().union(*(cluster.nodes[m].unreachable for m in live))
    # a member that is lost or failed is being replaced: missing it says nothing of the standby's links
    nodes = [n for n in cluster.nodes.values()
             if n.name not in members and (n.name not in plan.out or plan.rejoined(n.name, n.run))
             and n.name not in cut_off and not n.unreachable & live]
    return [n.name for n in sorted(nodes, key=lambda n: n.order)]


def _run(cluster: Cluster, node: str) -> RunState:
    view = cluster.nodes.get(node)
    return view.run if view is not None else RunState()


def _lost(cluster: Cluster, plan: Plan) -> list[str]:
    return [m for m in plan.members if m not in cluster.nodes]


def _failed(cluster: Cluster, plan: Plan) -> list[str]:
    return [m for m in plan.members if _run(cluster, m).gen == plan.gen and _run(cluster, m).state == "failed"]


def _describe(cluster: Cluster, node: str) -> str:
    run = _run(cluster, node)
    worker = "worker" if run.rank is None else f"worker rank {run.rank}"
    if run.exitcode is not None and run.exitcode < 0:
        return f"{worker} killed by signal {-run.exitcode}"
    return f"{worker} exited with code {run.exitcode}" + (f" ({run.error})" if run.error else "")
