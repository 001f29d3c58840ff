"""The leader: elected through etcd, it turns the job's state into generations.

Any agent can lead. Each campaigns by creating the ``leader`` key bound to its lease; the winner
runs the driver below until it loses the key (its lease expired or it stopped), and then another
agent wins. The driver keeps a copy of the job's keys (:class:`agent.mirror.Mirror`: one read,
then the watch's values), asks :func:`agent.policy.decide` on it, applies the decision with
compare-and-set on ``plan``, waits until its copy shows its own writes, and waits for the next
change or the decision's deadline. Nodes' progress reports change no decision and wake nobody.
A campaigning agent looks again only when the ``leader`` key changes. The leader hosts the
torch TCPStore of each generation it starts, in a child process (:mod:`agent.store_host`).

Each plan names a deputy (:func:`deputy`): the agent that starts its store host ahead of need and,
when the leadership falls vacant, campaigns at once; the others campaign ``DEPUTY_HEAD_START``
later, so that the next leader is one whose first plan does not wait for torch's import. A deputy
that is gone costs the others that head start, and the winner its import.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, Callable

from agent.changes import Changes
from agent.config import AgentConfig
from agent.errors import LeaseNotFound, StoreError
from agent.history import append_event
from agent.keys import JobKeys
from agent.mirror import Mirror
from agent.policy import Action, Cluster, Clock, Decision, Limits, NodeView, decide, failure_pending, quorum_reached
from agent.records import EventRecord, NodeRecord, Outcome, Plan, Request, parse
from agent.skipped import warn_skipped
from agent.store import Entry, Store
from agent.store_host import StoreHost, StoreHostError
from agent.swap_report import describe, summarize

log = logging.getLogger("tmrun.leader")

RETRY = 1.0  # seconds before looking again while etcd is unavailable
CATCH_UP = 2.0  # seconds the leader waits for its own writes to show in its copy of the keys
KEEP_STORES = 3  # TCPStores of past generations kept open (a late worker may still read its own)
DEPUTY_HEAD_START = 0.5  # seconds a vacant leadership is left to the deputy before the others campaign


def deputy(plan: Plan) -> str | None:
    """Who leads next if the leader goes: the plan's first member other than its leader (members
    train; a standby may be the next one swapped in and out). None: the plan has no such member."""
    return next((member for member in plan.members if member != plan.leader), None)


def read_cluster(keys: JobKeys, entries: dict[str, Entry], parsed: dict[str, tuple[int, Any]] | None = None,
                 changed_at: Callable[[str], int] | None = None) -> tuple[Cluster, Entry | None]:
    """A :class:`Cluster` snapshot from the job's keys, and the plan's entry (for CAS).

    A value that is not a valid record is left out (one warning per key and revision): a node
    record that does not parse, or that names another node than its key, is as good as absent.
    ``parsed`` keeps the node records and the plan parsed by an earlier call, by key and the
    revision ``changed_at`` gives (default: the entry's mod_revision; the leader's copy gives the
    last change that was not progress only): a leader of 1,000 nodes parses only what changed.
    """
    nodes: dict[str, NodeView] = {}
    requests: list[tuple[int, Request]] = []
    parsed = {} if parsed is None else parsed
    for key in [k for k in parsed if k not in entries]:
        del parsed[key]

    def cached(cls, key: str, entry: Entry):
        revision = (changed_at(key) if changed_at else 0) or entry.mod_revision
        known = parsed.get(key)
        if known is None or known[0] != revision:
            record = parse(cls, entry)
            if cls is NodeRecord and record is not None:
                record = (record, record.run_state)  # parsed once, not on every look
            known = parsed[key] = (revision, record)
        return known[1]

    for key, entry in entries.items():
        rel = keys.relative(key)
        if rel.startswith("nodes/"):
            rec, run = cached(NodeRecord, key, entry) or (None, None)
            if rec is not None and rec.node != rel[len("nodes/"):]:
                warn_skipped(key, entry.mod_revision, f"the record names node {rec.node!r}")
            elif rec is not None:
                nodes[rec.node] = NodeView(rec.node, entry.create_revision, rec.slots, rec.standby_hint, run,
                                           entry.mod_revision, frozenset(rec.unreachable),
                                           f"{rec.host}:{rec.link_port}" if rec.link_port else "")
        elif rel.startswith("requests/"):
            req = cached(Request, key, entry)  # requests stay for the job's life: parsed once each
            if req is not None and req.state == "pending":
                requests.append((entry.create_revision, req))
    plan_entry = entries.get(keys.plan)
    plan = None if plan_entry is None else cached(Plan, keys.plan, plan_entry)
    finished = parse(Outcome, entries.get(keys.outcome)) is not None
    ordered = tuple(req for _, req in sorted(requests, key=lambda item: item[0]))
    return Cluster(nodes, plan, ordered, finished), plan_entry


class Leader:
    """Campaigns for leadership and, while leader, drives the job's generations."""

    def __init__(self, cfg: AgentConfig, store: Store, lease: int, changes: Changes,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 stores: StoreHost | None = None) -> None:
        self._cfg = cfg
        self._store = store
        self.lease = lease  # the agent gives its new lease here after registering again
        self._changes = changes
        self._keys = JobKeys(cfg.job_id)
        self._clock = clock
        self._wall = wall
        t = cfg.timeouts
        self._limits = Limits(cfg.min_nodes, cfg.max_nodes, cfg.worker.max_restarts, t.join, t.last_call,
                              t.failure_window, t.standby_fill, cfg.grow)
        self._stores = StoreHost(cfg.host) if stores is None else stores
        self._tcp_ports: collections.deque[int] = collections.deque()  # open stores' ports, oldest first
        self._swaps_reported: set[int] = set()
        self._parsed: dict[str, tuple[int, Any]] = {}
        self._mirror: Mirror | None = None
        self._spare: asyncio.Future | None = None  # the next generation's TCPStore, being made or made
        self._deputy: str | None = None  # as the last plan this agent read names it
        self._vacant_since: float | None = None  # when this agent, not the deputy, found no leader
        self._warming: asyncio.Future | None = None
        self.is_leader = False
        # When this agent last failed to reach etcd (monotonic; its keepalive and follower set it):
        # the copy's watch may stall silently in an outage, and keys may vanish right after one.
        self.store_trouble = 0.0

    async def run(self) -> None:
        """Campaign forever; lead whenever elected (not while this node is being drained, nor once
        the job has ended).

        While etcd is unreachable (or this agent's lease is being replaced) there is nothing to
        lead: look again after a short wait. A leader that lost its key stops leading on its next
        read; its writes are fenced by compare-and-set on the plan's revision.
        """
        while True:
            seen = self._changes.version
            try:
                await self._campaign()
                continue
            except LeaseNotFound:  # the agent's lease expired: it registers again, then this campaigns with the new one
                self.is_leader = False
                log.info("%s: not leading until this agent registers again (its lease %x expired)", self._cfg.node,
                         self.lease)
                await self._changes.wait(seen, RETRY)
                continue
            except StoreError as exc:  # unreachable, no quorum: nothing to lead now
                self.is_leader = False
                log.warning("%s: not leading while etcd is unavailable (%s)", self._cfg.node, exc)
                await self._changes.wait(seen, RETRY)
                continue

    async def _campaign(self) -> None:
        seen = self._changes.version
        current = await self._store.get(self._keys.leader)
        mine = current is not None and current.lease == self.lease and current.value.get("node") == self._cfg.node
        if mine:  # this agent's term was cut by an etcd error while its key lived on: lead again
            log.info("%s leads job %s again", self._cfg.node, self._cfg.job_id)
        elif current is None and not self._job_ended() and not await self._drain_pending():
            if await self._defer_to_deputy(seen):
                return
            record = {"v": 1, "node": self._cfg.node, "host": self._cfg.host, "since": self._wall()}
            mine = await self._store.create(self._keys.leader, record, lease=self.lease)
            if mine:
                log.info("%s leads job %s", self._cfg.node, self._cfg.job_id)
        if current is not None or mine:
            self._vacant_since = None
        if mine:
            self.is_leader = True
            self._make_spare()
            self._mirror = Mirror(self._store, self._keys.root)
            try:
                await self._mirror.start()
                await self._lead(self._mirror)
            finally:
                self.is_leader = False  # a spare being made is kept: a leader that comes back uses it
                await self._mirror.close()
            return
        await self._leader_changed(seen)

    async def _defer_to_deputy(self, seen: int) -> bool:
        """True while a vacant leadership is still the deputy's to take: this agent waits for a
        change (the deputy's key) or the rest of ``DEPUTY_HEAD_START``, then looks again."""
        if self._deputy is None or self._deputy == self._cfg.node:
            return False
        now = self._clock()
        if self._vacant_since is None:
            self._vacant_since = now
        left = self._vacant_since + DEPUTY_HEAD_START - now
        if left <= 0:
            return False
        await self._changes.wait(seen, left)
        return True

    def follow(self, plan: Plan) -> None:
        """The plan this agent just read: if it names this agent the deputy, its store host starts
        now (the import takes seconds of one core, in a niced child)."""
        self._deputy = deputy(plan)
        if self._deputy == self._cfg.node and (self._warming is None or self._warming.done()):
            self._warming = asyncio.ensure_future(self._stores.start())
            self._warming.add_done_callback(self._warmed)

    def _warmed(self, task: asyncio.Future) -> None:
        """A deputy's store host that did not start is started again when it is needed (its
        first ``open``); say why it failed now."""
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s: the deputy's store host did not start: %s", self._cfg.node, task.exception())

    async def _leader_changed(self, seen: int) -> None:
        """Wait until the ``leader`` key changes (or the watch was away): the shared watch also
        wakes for every new plan, which decides no campaign."""
        changes, known, reconnects = self._changes, self._changes.latest(self._keys.leader), self._changes.reconnects
        while True:
            await changes.wait(seen)
            if changes.latest(self._keys.leader) is not known or changes.reconnects != reconnects \
                    or not changes.connected:
                return
            seen = changes.version

    async def _lead(self, mirror: Mirror) -> None:
        rendezvous_since = self._clock()
        settle = 2.0 * self._cfg.timeouts.lease_ttl  # agents whose lease expired meanwhile register again
        settled_at, reconnects = rendezvous_since + settle, mirror.reconnects
        trouble = self.store_trouble
        quorum_since: float | None = None
        failure_since: tuple[int, float] | None = None
        last_reason = ""
        while True:
            seen = mirror.version
            woke = time.monotonic()  # the change that woke this pass has reached the leader's copy
            entries = mirror.snapshot()
            leader = entries.get(self._keys.leader)
            if leader is None or leader.value.get("node") != self._cfg.node:
                ended = self._keys.outcome in entries  # agents leaving an ended job give up their keys: expected
                log.log(logging.INFO if ended else logging.WARNING, "%s is no longer the leader%s", self._cfg.node,
                        " (the job has ended)" if ended else "")
                return
            cluster, plan_entry = read_cluster(self._keys, entries, self._parsed, mirror.changed_at)
            cluster = dataclasses.replace(cluster, leader=self._cfg.node)  # it hosts the next generation's store
            await self._report_swap(cluster)
            now = self._clock()
            if mirror.reconnects != reconnects or self.store_trouble != trouble:
                # etcd was away: keys may be missing for a moment (leases expire, agents register again)
                settled_at, reconnects, trouble = now + settle, mirror.reconnects, self.store_trouble
            if quorum_reached(cluster, self._limits):
                quorum_since = now if quorum_since is None else quorum_since
            else:
                quorum_since = None
            gen = cluster.plan.gen if cluster.plan else 0
            if failure_pending(cluster):
                if failure_since is None or failure_since[0] != gen:
                    failure_since = (gen, now)
            else:
                failure_since = None
            clock = Clock(now, rendezvous_since, quorum_since, failure_since[1] if failure_since else None, settled_at)
            decision = decide(cluster, self._limits, clock)
            if decision.reason != last_reason:
                log.info("decision %s: %s", decision.action.value, decision.reason)
                last_reason = decision.reason
            if decision.action is Action.WAIT:
                self._make_spare()  # now, not beside the plan's write: making a store holds the GIL for ms
                timeout = None if decision.until is None else max(0.0, decision.until - self._clock())
                await mirror.wait(seen, timeout)
                continue
            me = self._cfg.node
            if decision.action in (Action.START, Action.AMEND) and decision.out.get(me) == "drained" \
                    and cluster.plan and me not in cluster.plan.out:
                # This node leaves as soon as the plan says so, and the next generation's store must
                # outlive it: let another agent apply the drain.
                log.info("%s is being drained: handing leadership over", me)
                await self._store.delete(self._keys.leader)
                return
            written = await self._apply(decision, cluster, plan_entry, woke, entries)
            # Decide next on a copy that holds these writes (the watch brings them a moment later).
            latest = max([(await self._store.stat(key))[0] for key in written], default=0)
            if not await mirror.caught_up(latest, CATCH_UP):
                log.warning("%s: the job's keys did not show the leader's own write within %g s", self._cfg.node,
                            CATCH_UP)

    async def _apply(self, decision: Decision, cluster: Cluster, plan_entry: Entry | None,
                     woke: float, cluster_entries: dict[str, Entry]) -> list[str]:
        """Carry ``decision`` out; returns the keys written. A new plan's event says how long the
        leader took from the change reaching its copy of the keys to the plan written
        (``decision_ms``: reading the copy, deciding, the generation's TCPStore, the write)."""
        plan = cluster.plan
        gen = plan.gen if plan else 0
        written: list[str] = []
        if decision.action is Action.FINISH:
            outcome = Outcome(decision.outcome, decision.reason, gen, self._wall())
            written.append(self._keys.outcome)
            if await self._store.create(self._keys.outcome, outcome.to_dict()):
                await self._event(decision, gen)
        elif decision.action in (Action.START, Action.AMEND):
            if decision.action is Action.START:
                gen, host, port = gen + 1, self._cfg.host, await self._new_tcp_store()
            else:
                assert plan is not None
                host, port = plan.store_host, plan.store_port
            slots = {m: cluster.nodes[m].slots for m in decision.members}
            out = {node: why for node, why in decision.out.items() if node not in decision.members}
            new_plan = Plan(gen, decision.members, slots, host, port, self._cfg.node, decision.reason,
                            decision.restarts, decision.in_place_restarts, out, self._wall(),
                            decision.hot, decision.mode, decision.joiners, dict(decision.handover),
                            decision.requested or (plan.requested if plan and decision.action is Action.AMEND
                                                   else self._wall()), decision.hot_swaps,
                            {m: cluster.nodes[m].link_at for m in decision.members if cluster.nodes[m].link_at})
            written.append(self._keys.plan)
            if not await self._store.replace(self._keys.plan, new_plan.to_dict(),
                                             mod_revision=plan_entry.mod_revision if plan_entry else 0):
                return written  # someone else changed the plan: look again
            await self._event(decision, gen, decision_ms=round((time.monotonic() - woke) * 1e3, 2))
        for answer in decision.answers:  # from the copy the decision was made on: no read
            key = self._keys.request(answer.request_id)
            request = next((req for req in cluster.requests if req.id == answer.request_id), None)
            entry = cluster_entries.get(key)
            if request is None or entry is None:
                continue
            request = dataclasses.replace(request, state=answer.state, answer=answer.text, gen=gen)
            await self._store.replace(key, request.to_dict(), mod_revision=entry.mod_revision)
            written.append(key)
        if decision.action is Action.ANSWER:
            await self._event(decision, gen)
        return written

    def _job_ended(self) -> bool:
        """The watch saw the job's outcome written: its agents are leaving, and a leader that
        stepped down for that is not replaced."""
        seen = self._changes.latest(self._keys.outcome)
        return seen is not None and seen.kind == "put"

    async def _drain_pending(self) -> bool:
        entries, _ = await self._store.get_prefix(self._keys.requests)
        for entry in entries.values():
            request = parse(Request, entry)
            if request is None:
                continue
            if request.kind == "drain" and request.node == self._cfg.node and request.state == "pending":
                return True
        return False

    async def _report_swap(self, cluster: Cluster) -> None:
        """Write the ``swap`` event once every member committed a step in the swapped-into generation.

        Its key derives from the reported times, so a leader that takes over writes the same key
        (``create`` keeps the first).
        """
        plan = cluster.plan
        if plan is None or plan.gen in self._swaps_reported:
            return
        summary = summarize(plan, {name: view.run for name, view in cluster.nodes.items()})
        if summary is None:
            return
        self._swaps_reported.add(plan.gen)
        record = EventRecord(summary["at"], "swap", describe(summary), plan.gen, summary)
        await append_event(self._store, self._keys, int(summary["at"] * 1e9), record, once=True,
                           known=self._known_events())

    async def _event(self, decision: Decision, gen: int, **data: Any) -> None:
        record = EventRecord(self._wall(), decision.kind or decision.action.value, decision.reason, gen,
                             {"members": list(decision.members), "out": dict(decision.out),
                              "leader": self._cfg.node, **data})
        await append_event(self._store, self._keys, time.time_ns(), record, known=self._known_events())

    def _known_events(self) -> list[str] | None:
        return None if self._mirror is None else self._mirror.keys_under(self._keys.events)

    async def close(self) -> None:
        """The agent stops: its stores go (the generations they served end with this node)."""
        for task in (self._spare, self._warming):
            if task is not None:
                task.cancel()
        await self._stores.stop()

    async def _new_tcp_store(self) -> int:
        """A fresh TCPStore's port for the new generation; the last few stay open.

        The store comes from a spare made beforehand (when this agent became leader, and when it
        next waits after using one), so that a decision waits neither for torch's import in the
        host (seconds) nor for the store's start. Without a spare, or if making it failed, one
        is made now.
        """
        spare, self._spare = self._spare, None
        port = None
        if spare is not None:
            try:
                port = await spare
            except Exception as exc:  # said here; a store made now may still work
                log.warning("%s: the spare TCPStore could not be made (%s); making one now", self._cfg.node, exc)
        if port is None:
            port = await self._stores.open()
        self._tcp_ports.append(port)  # the next spare is made once the leader waits (see _lead)
        return port

    def _make_spare(self) -> None:
        """Start making the next generation's TCPStore, and closing the stores of generations
        long gone, off the decision's path (see _new_tcp_store)."""
        if self._spare is None:
            self._spare = asyncio.ensure_future(self._refill())
            self._spare.add_done_callback(lambda task: task.cancelled() or task.exception())  # one dropped: no noise

    async def _refill(self) -> int:
        while len(self._tcp_ports) > KEEP_STORES:
            port = self._tcp_ports.popleft()
            try:
                await self._stores.close(port)
            except StoreHostError as exc:
                log.warning("%s: could not close the TCPStore at port %d: %s", self._cfg.node, port, exc)
        return await self._stores.open()
