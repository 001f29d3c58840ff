"""The node agent: registers this node, follows the plan, supervises its workers, may lead.

One agent per node (per ``node-N`` in a local cluster). Its life::

    register (nodes/<node>, bound to a lease) ─► follow the plan ─► outcome written ─► exit
                    │                                 │
                    └── keepalive ── etcd unreachable: workers keep training; keep trying
                                 ├── lease gone when etcd answers: register again, reconcile
                                 └── unreachable past the outage bound: stop workers ─► exit 3

An agent that cannot reach etcd cannot tell whether it was replaced or etcd is down for
everyone, so it never stops its workers for that alone: a control-plane outage must not cost
training time. What keeps a replaced node's workers from training beside their replacements is
the generation's group, not the lease: see "Fencing" in docs/design.md. When etcd answers again,
the agent reads the plan like after any change; if it was replaced meanwhile, the plan says so
and it stops its workers.

Following the plan is level-triggered: on every change of ``plan``, ``outcome`` or ``leader`` (the
only keys a follower watches; other nodes' reports wake nobody but the leader), on its own news
and every ``LOOK_AGAIN`` seconds, the agent follows ``outcome`` and ``plan``. Their values come
with the watch's events; every ``LOOK_AGAIN`` seconds (and after etcd was away) a full look reads
``outcome`` and asks whether ``plan`` changed unseen (a ``stat``, no value), so a watch that went
quiet cannot hide a change for long. If it is a member of a generation it is not running yet, it stops its old workers first (so no
two generations of this node ever run at once) and starts the new ones; if it is not a member it
runs none; if the plan says it was drained it leaves (``rejoining``: it stops its workers and
stays, a standby again). Worker exits are reported in its node key, where the leader reads them.

What its workers do for the job is its role (``agent/roles.py``: idle, shadow, member, leaving,
ended, gone), changed only through the role table; a move the table refuses is logged and its
action (``leave``, ``prepare``, starting workers) is not taken.

With runtime workers it also times the swap (when each worker said ``ready``, ``switched``, and
committed its first step in the new generation: ``last_swap`` in its node key, from which the
leader writes the swap's event) and watches for hangs: no committed step for ``progress``
seconds, without a broken group reported meanwhile, or a worker silent for as long, and the
workers are killed as hung (``agent/watchdogs.py``, which also watches torchrun scripts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from agent.changes import Changes
from agent.config import AgentConfig
from agent.etcd_member import MemberHost
from agent.errors import ConfigError, ControlPlaneLost, LeaseNotFound, StoreError
from agent.keys import JobKeys
from agent.leader import Leader
from agent.links import LinkChecker, LinkListener
from agent.metrics import MetricsServer, Snapshot
from agent.output import OutputRouter
from agent.records import REJOINS, NodeRecord, Outcome, Plan, RunState, parse
from agent.roles import Role, Roles
from agent.stall import Progress
from agent.store import Entry, Store
from agent.store_host import StoreHost
from agent.worker_env import worker_env
from agent.worker_channel import WorkerChannel
from agent.warm import WarmPool
from agent.watchdogs import Watchdogs
from agent.workers import GroupResult, WorkerGroup, WorkerLaunch, spawn

log = logging.getLogger("tmrun.agent")

EXIT_OK, EXIT_FAILED, EXIT_STORE = 0, 1, 3
RETRY = 1.0  # seconds between attempts to reach etcd while it is unreachable
# Even without a change from the watch, look again this often: a watch whose stream went quiet
# without an error (a member stopped and resumed, removed, partitioned) must not leave the agent
# waiting for an outcome it would never hear of.
LOOK_AGAIN = 5.0
# Seconds between reports that only carry the workers' progress (at least): PROGRESS_VIEWED while
# someone follows the job live (``tmrun top`` holds the job's ``viewer`` key), PROGRESS_REPORT else.
PROGRESS_REPORT = 10.0
PROGRESS_VIEWED = 1.0
PROGRESS_WRITES = 100.0  # progress reports a second, all nodes together, past the above
STOP_TASKS_TIMEOUT = 10.0  # seconds the agent's background tasks get to end once cancelled
REVOKE_TIMEOUT = 0.5  # seconds a leaving agent tries to revoke its lease (else it expires by itself)
WARM_DELAY = 5.0  # seconds after its workers start before a node starts warm interpreters (--warm-start)
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class NodeAgent(Watchdogs):
    def __init__(self, cfg: AgentConfig, store: Store, hosting: MemberHost | None = None) -> None:
        self.cfg = cfg
        self._hosting = hosting
        self._store = store
        self._keys = JobKeys(cfg.job_id)
        self._lease = 0
        # What a follower looks at: not the other nodes' records, so that a node's report wakes nobody else.
        self._changes = Changes(store, [self._keys.plan, self._keys.outcome, self._keys.leader,
                                        self._keys.etcd_member(cfg.node), self._keys.viewer])
        self._viewed_at_start = False  # the viewer key existed when the watch started
        self._plan: Plan | None = None  # the plan last read, at mod_revision self._plan_rev (0: none)
        self._plan_rev = 0
        self._looked_at, self._looked_reconnects = 0.0, 0  # the last full look at etcd (see _full_look_due)
        self._progress_reported = 0.0  # when a report last carried the workers' progress (monotonic)
        self._progress_timer: asyncio.TimerHandle | None = None
        self._group: WorkerGroup | None = None
        self._group_gen = 0
        self._group_wait: asyncio.Task | None = None
        self._signal = asyncio.Event()
        self._signum = 0
        self._run = RunState()
        self._joined_at = time.time()
        self._socket_dir = tempfile.mkdtemp(prefix="tmrun-sock-")
        self._channel = WorkerChannel(os.path.join(self._socket_dir, "agent.sock"), self._on_worker_message)
        self._hello: set[int] = set()
        self._heard_at: dict[int, float] = {}  # runtime worker pid -> when it last said anything (monotonic)
        self._switched_gens: set[int] = set()  # generations this node's workers switched into (metrics)
        self._bytes_received = 0  # state received by this node's joiners, over all switches (metrics)
        self._bytes_sent = 0  # state handed over by this node's leavers (metrics)
        self._links: dict[str, float] = {}  # source node -> bytes/s of the last state it sent here
        self._link_listener = LinkListener()  # answers the other agents' link checks
        self._unreachable: frozenset[str] = frozenset()  # members this agent's link checks cannot reach
        self._metrics: MetricsServer | None = None
        self._role = Roles(lambda message: log.error("%s: role %s", cfg.node, message))
        self._shadow_failed = False
        self._leave_sent = 0
        self._ready_at: dict[int, float] = {}  # gen -> when the last local worker said ready
        self._prepared_at: dict[int, float] = {}  # gen -> when this agent told its workers (phase 1 start)
        self._progress_at: float | None = None  # the hang watchdog is armed while this is set
        self._stall: Progress | None = None  # a generation's workers' signs of progress (torchrun scripts)
        self._warm = WarmPool(spawn) if cfg.worker.warm_start else None  # --warm-start (agent/warm.py)
        self._dirty = asyncio.Event()
        self._resync = False  # the node's state could not be reported: report it on the next look
        self._outage_since: float | None = None  # when etcd stopped answering (monotonic)
        self._leader: Leader | None = None
        self._registering = asyncio.Lock()  # one registration at a time (keepalive and follower)
        own_logs = cfg.worker.log_dir is None
        self._log_root = Path(tempfile.mkdtemp(prefix=f"tmrun-{cfg.node}-")) if own_logs else Path(cfg.worker.log_dir)
        self._own_log_root = own_logs

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGUSR1, self._dump_tasks)
        background: list[asyncio.Task] = []
        try:
            await self._clear_finished_job()
            self._serve_metrics()
            await self._listen_for_link_checks()
            self._lease = await self._store.grant_lease(self.cfg.timeouts.lease_ttl)
            if not await self._store.create(self._keys.node(self.cfg.node), self._record().to_dict(), lease=self._lease):
                raise ConfigError(f"node name {self.cfg.node!r} is already in use in job {self.cfg.job_id}")
            viewer, _, revision = await self._store.get_and_stat(self._keys.viewer, self._keys.plan)
            self._viewed_at_start = viewer is not None
            await self._changes.start(revision + 1)
            await self._channel.start()
            log.info("%s joined job %s (host %s, %d slots)", self.cfg.node, self.cfg.job_id, self.cfg.host,
                     self.cfg.worker.nproc_per_node)
            self._leader = Leader(self.cfg, self._store, self._lease, self._changes, stores=self._store_host())
            background = [asyncio.ensure_future(self._keepalive()), asyncio.ensure_future(self._leader.run()),
                          asyncio.ensure_future(self._watchdog()), asyncio.ensure_future(self._stall_watch()),
                          asyncio.ensure_future(self._check_links()),
                          *self._extra_tasks()]
            return await self._follow(background)
        except ControlPlaneLost as exc:
            log.error("%s: %s; stopping the workers (SIGTERM, then SIGKILL after %.0f s) and leaving",
                      self.cfg.node, exc, self.cfg.timeouts.stop_grace)
            await self._stop_workers()
            return EXIT_STORE
        finally:
            if self._progress_timer is not None:
                self._progress_timer.cancel()
            await self._stop_workers()
            if self._warm is not None:
                await self._warm.close()
            if self._role.now is not Role.GONE:
                self._role.move(Role.GONE, "the agent stops")
            for task in background:
                task.cancel()
            if background:  # bounded: a task that ignores its cancel must not keep the node (and the job) alive
                _, stuck = await asyncio.wait(background, timeout=STOP_TASKS_TIMEOUT)
                for task in stuck:
                    log.error("%s: a background task did not stop within %g s; leaving without it: %r",
                              self.cfg.node, STOP_TASKS_TIMEOUT, task)
            if self._leader is not None:
                await self._leader.close()
            await self._changes.close()
            await self._channel.close()
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            if self._lease:  # the key goes at once rather than after the TTL; not worth a wait when etcd is away
                try:
                    await asyncio.wait_for(self._store.revoke_lease(self._lease), REVOKE_TIMEOUT)
                except (StoreError, asyncio.TimeoutError):
                    pass
            await self._store.close()
            await self._link_listener.close()
            if self._metrics is not None:
                self._metrics.close()
            if self._own_log_root:
                shutil.rmtree(self._log_root, ignore_errors=True)

    def _store_host(self) -> StoreHost:
        """Where this agent's TCPStores live when it leads: a child process (:mod:`agent.store_host`)."""
        return StoreHost(self.cfg.host)

    def _serve_metrics(self) -> None:
        """``--metrics-port``: Prometheus text on this node's address, named in its node record."""
        port = self.cfg.metrics_port
        if port is None:
            return
        try:
            self._metrics = MetricsServer(self.cfg.host, port, self._snapshot)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {self.cfg.host}:{port} (--metrics-port): "
                              f"{exc.strerror or exc}") from None
        log.info("%s serves metrics at http://%s/metrics", self.cfg.node, self._metrics.address)

    async def _listen_for_link_checks(self) -> None:
        """Answer the other agents' link checks on this node's address (none when ``link_check=0``)."""
        if not self.cfg.timeouts.link_check:
            return
        try:
            port = await self._link_listener.start(self.cfg.host)
        except OSError as exc:
            log.warning("%s: cannot answer link checks on %s (%s); the other nodes will not check their link "
                        "to this one", self.cfg.node, self.cfg.host, exc.strerror or exc)
            return
        log.debug("%s answers link checks on port %d", self.cfg.node, port)

    async def _check_links(self) -> None:
        """Every ``link_check`` seconds, connect to every member's agent (agent/links.py); a change in
        who is unreachable is reported at once, and the leader takes a cut-off member out."""
        interval = self.cfg.timeouts.link_check
        if not interval:
            return await asyncio.Event().wait()  # off: never ends (a background task that ends stops the agent)
        checker = LinkChecker(timeout=min(1.0, interval))
        while True:
            plan = self._plan
            peers = {m: at for m, at in plan.link_at.items() if m != self.cfg.node} if plan is not None else {}
            started = time.monotonic()
            unreachable = await checker.check(peers)
            if unreachable != self._unreachable:
                lost, back = sorted(unreachable - self._unreachable), sorted(self._unreachable - unreachable)
                if lost:
                    log.warning("%s: cannot reach %s (link checks missed twice)", self.cfg.node, ", ".join(lost))
                if back:
                    log.info("%s: reaches %s again", self.cfg.node, ", ".join(back))
                self._unreachable = unreachable
                self._dirty.set()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def _snapshot(self) -> Snapshot:
        """What the metrics show now (called from the metrics server's thread: reads, never writes)."""
        run, group, leader = self._run, self._group, self._leader
        return Snapshot(job=self.cfg.job_id, node=self.cfg.node, role=self._role.now.value, generation=run.gen,
                        step=run.step, step_time=run.step_time, workers=len(group.running) if group else 0,
                        swaps=len(self._switched_gens), last_stall=float(run.last_swap.get("stall") or 0.0),
                        bytes_received=self._bytes_received, bytes_sent=self._bytes_sent,
                        watch_reconnects=self._changes.reconnects, leader=bool(leader and leader.is_leader),
                        links=dict(self._links))

    def _extra_tasks(self) -> list[asyncio.Task]:
        """Background tasks beside keepalive, leader and watchdog (the etcd member host, when any)."""
        if self._hosting is None:
            return []
        return [asyncio.ensure_future(self._hosting.run(self._store, self._changes, self._leader, self._keys))]

    async def _clear_finished_job(self) -> None:
        """A job id that already ran to an outcome (a persistent etcd, a requeued SLURM job) starts afresh."""
        if await self._store.get(self._keys.outcome) is None:
            return
        nodes, _ = await self._store.get_prefix(self._keys.nodes)
        if nodes:
            raise ConfigError(f"job {self.cfg.job_id} has just ended and its agents are still leaving; "
                              "use another --rdzv-id")
        log.info("job %s ended earlier: clearing its keys for a new run", self.cfg.job_id)
        await self._store.delete_prefix(self._keys.root)

    def _dump_tasks(self) -> None:
        """SIGUSR1: log where every task of the agent waits, down its chain of awaits (for a
        post-mortem of a stuck agent)."""
        for task in asyncio.all_tasks():
            chain, coro = [], task.get_coro()
            while coro is not None and len(chain) < 40:
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is None:
                    chain.append(type(coro).__name__)
                    break
                chain.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
            log.warning("%s: task %s waits in %s", self.cfg.node, task.get_name(), " -> ".join(chain))

    def _on_signal(self, sig: int) -> None:
        self._signum = sig
        self._signal.set()

    async def _follow(self, background: list[asyncio.Task]) -> int:
        while True:
            seen = self._changes.version
            if self._signal.is_set():
                log.info("%s: %s received, stopping", self.cfg.node, signal.Signals(self._signum).name)
                return 128 + self._signum
            retry = LOOK_AGAIN
            lease = self._lease
            try:
                code = await self._sync()
                if code is not None:
                    return code
                if self._outage_since is not None:
                    log.warning("%s: etcd answers again after %.1f s; the workers kept running", self.cfg.node,
                                time.monotonic() - self._outage_since)
                    self._outage_since = None
            except LeaseNotFound:
                with contextlib.suppress(StoreError):  # if etcd fails again, the next look finds out
                    await self._reregister(lease)
                retry = 0.0 if self._lease != lease else RETRY
            except StoreError as exc:  # etcd away or without a quorum: the workers go on, look again soon
                self._store_trouble()
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    log.warning("%s: %s; the workers keep running, retrying", self.cfg.node, exc)
                self._resync = True
                retry = RETRY
            waiters = [asyncio.ensure_future(self._changes.wait(seen)), asyncio.ensure_future(self._signal.wait()),
                       asyncio.ensure_future(self._dirty.wait())]
            if self._group_wait is not None:
                waiters.append(self._group_wait)
            done, _ = await asyncio.wait(waiters + background, timeout=retry, return_when=asyncio.FIRST_COMPLETED)
            for task in waiters[:3]:
                if task not in done:
                    task.cancel()
            for task in done:
                if task in background:
                    task.result()  # re-raises ControlPlaneLost or a bug
                    raise RuntimeError("a background task of the agent ended")

    async def _sync(self) -> int | None:
        """One look at etcd: follow ``outcome`` and ``plan``, then report what changed here.

        Returns an exit code when this agent is done. Raises StoreError when etcd cannot be
        reached; nothing here is lost then (the node's state stays in ``self._run`` and is
        reported on the next successful look).
        """
        if self._group_wait is not None and self._group_wait.done():
            await self._on_group_done(self._group_wait.result())
        full = self._full_look_due()
        outcome, plan_mod = None, None
        if full:  # one round trip: outcome, and whether the plan changed unseen
            entry, plan_mod, _ = await self._store.get_and_stat(self._keys.outcome, self._keys.plan)
            outcome = parse(Outcome, entry)
        else:
            seen = self._changes.latest(self._keys.outcome)
            if seen is not None and seen.value is not None:  # the watch's value: no read
                outcome = parse(Outcome, Entry(seen.key, seen.value, seen.create_revision, seen.revision))
        if outcome is not None:  # first: once the job has ended, nothing this node could report matters
            log.info("%s: the job has ended (%s: %s); leaving", self.cfg.node, outcome.state, outcome.reason)
            await self._stop_workers("the job ended")
            self._role.move(Role.GONE, f"the job ended ({outcome.state})")
            await self._store.put(self._keys.node_done(self.cfg.node), {"v": 1, "node": self.cfg.node,
                                                                         "at": time.time()})
            return EXIT_OK if outcome.state == "succeeded" else EXIT_FAILED
        plan = await self._read_plan(plan_mod)
        if full:
            self._looked_at, self._looked_reconnects = time.monotonic(), self._changes.reconnects
        # The plan first: a new generation's prepare waits for no write of this node's (a pending
        # progress report, say), and what following it changed goes out in the same report.
        leave = plan is not None and await self._reconcile(plan)
        if self._dirty.is_set() or self._resync:
            self._dirty.clear()
            await self._report(self._run)
            self._resync = False
        return EXIT_OK if leave else None

    def _full_look_due(self) -> bool:
        """Whether this look reads etcd rather than trusting the watch: every LOOK_AGAIN seconds,
        after the watch was away, and after a look that failed."""
        changes = self._changes
        return (self._resync or not changes.connected or changes.reconnects != self._looked_reconnects
                or time.monotonic() - self._looked_at >= LOOK_AGAIN)

    async def _read_plan(self, mod: int | None) -> Plan | None:
        """The plan, as the watch delivered it (parsed once per change); on a full look, ``mod``
        (the plan's mod revision, read with ``outcome``) says whether it changed unseen, and only
        then is it read. A plan names every node: at 1,000 nodes it is tens of KiB, which a read
        per look would send to every agent."""
        seen = self._changes.latest(self._keys.plan)
        if seen is not None and seen.revision > self._plan_rev:
            entry: Entry | None = None
            if seen.value is not None:
                entry = Entry(seen.key, seen.value, seen.create_revision, seen.revision)
        elif mod is not None:
            if mod == self._plan_rev:
                return self._plan
            entry = await self._store.get(self._keys.plan)
        else:
            return self._plan
        self._plan_rev = seen.revision if entry is None and seen is not None else (entry.mod_revision if entry else 0)
        self._plan = parse(Plan, entry)
        if self._plan is not None and self._leader is not None:
            self._leader.follow(self._plan)  # the plan's deputy starts its store host
        return self._plan

    async def _reregister(self, expired: int) -> None:
        """etcd answered that lease ``expired`` is gone: take a new one and publish the node again.

        Whatever happened meanwhile is in the plan, which the agent reads next: still a member,
        nothing changes; replaced, it stops its workers (``_reconcile``). The keepalive and the
        follower may both find out; the second one finds the lease already replaced.
        """
        async with self._registering:
            if self._lease != expired:
                return
            await self._register_again(expired)

    async def _register_again(self, old: int) -> None:
        self._lease = await self._store.grant_lease(self.cfg.timeouts.lease_ttl)
        if self._leader is not None:
            self._leader.lease = self._lease
        await self._store.put(self._keys.node(self.cfg.node), self._record().to_dict(), lease=self._lease)
        log.warning("%s: its lease %x had expired; registered again with lease %x", self.cfg.node, old, self._lease)
        self._dirty.set()

    async def _reconcile(self, plan: Plan) -> bool:
        """Bring this node in line with ``plan``; True when this node must leave the job."""
        node = self.cfg.node
        running = self._group_wait is not None and not self._group_wait.done()
        why = plan.out.get(node)
        role = self._role.now
        if why in ("drained", "rejoining") and plan.mode == "swap-agreed" and running \
                and role in (Role.MEMBER, Role.LEAVING):
            # planned swap: leave at the switch the ranks agree on (again if the plan moved on meanwhile)
            if self._leave_sent != plan.gen and (role is Role.LEAVING or self._role.move(
                    Role.LEAVING, f"{why} in generation {plan.gen}'s planned swap")):
                self._leave_sent = plan.gen
                self._send_leave(plan)
            return False
        if why == "drained":
            await self._stop_workers("drained")
            self._role.move(Role.GONE, "drained")
            log.info("%s was drained: leaving the job", node)
            return True
        if why is not None:
            if not (why in REJOINS and role is Role.SHADOW):  # a rejoined standby keeps its shadow workers
                await self._stop_workers(f"out of generation {plan.gen} ({why})")
            if why not in REJOINS:
                if self._run.state != "idle":
                    await self._report(RunState(plan.gen, "idle", at=time.time()))
                return False
            if self._group is None and self._run.state not in ("idle", "shadow"):
                log.info("%s left its place and rejoins the pool as a standby", node)
                await self._report(RunState(plan.gen, "idle", at=time.time()))
        if node in plan.members:
            if self._group_gen != plan.gen and plan.mode.startswith("swap") and not running \
                    and self._run.state == "succeeded" and node not in plan.joiners:
                # the swap came after this node's last step: nothing to switch, the work is done
                self._group_gen = plan.gen
                await self._report(dataclasses.replace(self._run, gen=plan.gen, at=time.time()))
                return False
            if self._group_gen != plan.gen:
                if plan.mode.startswith("swap") and running:
                    self._prepare(plan)  # hot swap: keep the workers, hand them the next generation
                elif plan.mode.startswith("swap"):
                    await self._stop_workers(f"generation {plan.gen} starts from standby workers")
                    await self._start_workers(plan, standby=True)
                    self._prepare(plan)
                else:
                    await self._stop_workers(f"generation {plan.gen} restarts the workers")
                    await self._start_workers(plan)
            return False
        if plan.hot and role is Role.IDLE and not self._shadow_failed:
            await self._start_workers(plan, standby=True)  # shadow iterations: warm, then wait
        elif not plan.hot and role.has_workers:
            await self._stop_workers(f"generation {plan.gen} has no standbys")
            await self._report(RunState(plan.gen, "idle", at=time.time()))
        return False

    def _send_leave(self, plan: Plan) -> None:
        """Tell this node's workers to leave at the agreed switch (handing over to the joiner, if any)."""
        store = {}
        if self.cfg.node in plan.handover:
            store = dict(store_host=plan.store_host, store_port=plan.store_port)
        rejoin = plan.out.get(self.cfg.node) == "rejoining"  # the workers stay, as warm standbys
        for pid in self._group.pids:
            self._channel.send(pid, "leave", gen=plan.gen, rejoin=rejoin, **store)
        log.info("%s leaves at generation %d's switch%s", self.cfg.node, plan.gen,
                 f", handing its state to {plan.handover[self.cfg.node]}" if store else "")

    def _prepare(self, plan: Plan) -> None:
        """Hand the running workers generation ``plan.gen`` without a restart (a member's next
        group, or a standby promoted)."""
        role = self._role.now
        if role not in (Role.SHADOW, Role.MEMBER):
            log.error("%s: role %s: only a member or a standby can be prepared for generation %d; not sent",
                      self.cfg.node, role.value, plan.gen)
            return
        promoted = role is Role.SHADOW
        if promoted and not self._role.move(Role.MEMBER, f"promoted into generation {plan.gen}"):
            return
        offset = plan.rank_offset(self.cfg.node)
        self._group.renumber(offset)  # a promoted standby's placeholder ranks become its real ones
        mode = "now" if plan.mode == "swap-now" else "agreed"
        handover = self.cfg.node in plan.handover.values() and promoted
        self._prepared_at[plan.gen] = time.time()
        owners = plan.rank_owners()
        # the joiners that pull from the replicas get their links probed in phase 1 (a swap-now switches
        # as soon as the group is built: no time to probe); every rank is sent the same list
        pulling = {node for node in plan.joiners if node not in plan.handover.values()}
        probe = [rank for rank, node in enumerate(owners) if node in pulling] if mode == "agreed" else []
        links, first = [], 0
        for member in plan.members:
            if member in self._links and member != self.cfg.node:
                links.append([first, first + plan.slots[member], self._links[member]])
            first += plan.slots[member]
        for local_rank, pid in enumerate(self._group.pids):
            self._channel.send(pid, "prepare", gen=plan.gen, rank=offset + local_rank, world_size=plan.world_size,
                               store_host=plan.store_host, store_port=plan.store_port, mode=mode,
                               handover=handover, probe=probe, links=links)
        log.info("%s: generation %d prepared without restart (%s, ranks %d-%d)", self.cfg.node, plan.gen,
                 plan.mode, offset, offset + len(self._group.pids) - 1)
        self._group_gen = plan.gen
        self._run = dataclasses.replace(self._run, gen=plan.gen, state="running", rank=offset, at=time.time())
        self._dirty.set()

    def _on_worker_message(self, pid: int, message: dict) -> None:
        kind = message["type"]
        group = self._group
        if group is None or pid not in group.pids:
            return
        self._heard_at[pid] = time.monotonic()
        if kind == "hello":
            self._hello.add(pid)
            if all(p in self._hello for p in group.pids) and not self._run.runtime:
                self._run = dataclasses.replace(self._run, runtime=True)
                self._dirty.set()
        elif kind == "progress":
            self._progress_at = time.monotonic()
            last = self._run.last_swap
            if last.get("gen") == message.get("gen") and "first_step_at" not in last \
                    and int(message["step"]) > int(last.get("step", 0)):
                last = {**last, "first_step_at": time.time()}  # the first committed step after a switch
            urgent = last is not self._run.last_swap  # the first step after a switch: the swap's report waits on it
            self._run = dataclasses.replace(self._run, step=int(message["step"]), step_time=float(message["step_time"]),
                                            last_swap=last)
            self._report_progress(urgent)
        elif kind == "ready":
            self._ready_at[int(message["gen"])] = time.time()
        elif kind == "switched" and message.get("left"):
            self._progress_at = None
            self._bytes_sent += int(message.get("bytes_sent") or 0)
            if message.get("handover_error"):
                log.warning("%s worker %d: no handover to the joiner in generation %s: %s", self.cfg.node, pid,
                            message.get("gen"), str(message["handover_error"])[:300])
            if message.get("rejoin") and (self._role.now is Role.SHADOW or self._role.move(
                    Role.SHADOW, f"its workers left generation {message.get('gen')} to rejoin")):
                # the leaver's workers are standbys again, warm, in the same processes
                log.info("%s worker %d left generation %s and waits as a standby", self.cfg.node, pid, message.get("gen"))
                self._group_gen = 0
                self._run = RunState(0, "shadow", worker_pids=group.pids, at=time.time(), runtime=True)
                self._dirty.set()
        elif kind == "switched":
            self._progress_at = time.monotonic()
            if message.get("handover_error"):
                log.warning("%s worker %d: the handover failed, state from the replicas: %s", self.cfg.node, pid,
                            str(message["handover_error"])[:300])
            fields = {k: v for k, v in message.items() if k not in ("v", "type")}
            gen = int(fields.get("gen", 0))
            self._switched_gens.add(gen)
            self._measure_links(gen, fields)
            self._bytes_received += int(fields.get("bytes_received") or 0)
            previous = self._run.last_swap if self._run.last_swap.get("gen") == gen else {}
            fields["stall"] = max(float(fields.get("stall", 0.0)), float(previous.get("stall", 0.0)))
            fields["switched_at"] = time.time()
            if gen in self._ready_at:
                fields["ready_at"] = self._ready_at[gen]
            if gen in self._prepared_at:
                fields["prepared_at"] = self._prepared_at[gen]
            self._run = dataclasses.replace(self._run, last_swap=fields, step=int(fields.get("step", 0)))
            log.info("%s worker %d switched to generation %s at step %s (stall %.3f s)", self.cfg.node, pid,
                     fields.get("gen"), fields.get("step"), float(fields.get("stall", 0.0)))
            self._dirty.set()
        elif kind == "failed":
            log.warning("%s worker %d cannot go on in generation %s: %s", self.cfg.node, pid, message.get("gen"),
                        message["error"][:300])
            if not self._run.error:
                self._run = dataclasses.replace(self._run, error=message["error"][:300])
        elif kind == "broken":
            self._progress_at = None  # waiting for the next generation is not a hang
            log.warning("%s worker %d: generation %s broke at step %s: %s", self.cfg.node, pid, message.get("gen"),
                        message.get("step"), (message["error"].splitlines() or ["(no error text)"])[0][:300])

    def _measure_links(self, gen: int, switched: dict) -> None:
        """Keep the rate of each link that carried state to this node in the switch into ``gen``:
        phase 1's probe (``probed``), replaced by a source rank's bytes over the seconds its last
        piece took (``links``), and the leaver's handover (``from_leaver`` over ``handover_s``).
        Reported in the node record; sent back to the workers in the next ``prepare``."""
        plan = self._plan
        if plan is None or plan.gen != gen:
            return
        owner = plan.rank_owners()
        probed = switched.get("probed") if isinstance(switched.get("probed"), dict) else {}
        for rank, rate in probed.items():  # phase 1's probe; what the transfer itself took wins below
            try:
                source, rate = owner[int(rank)] if int(rank) >= 0 else "", float(rate)
            except (IndexError, TypeError, ValueError):
                continue
            if rate > 0 and math.isfinite(rate) and source and source != self.cfg.node:
                self._links[source] = round(rate, 1)
        links = switched.get("links") if isinstance(switched.get("links"), dict) else {}
        for rank, measured in links.items():
            try:
                size, seconds = int(measured[0]), float(measured[1])
                source = owner[int(rank)] if int(rank) >= 0 else ""
            except (IndexError, TypeError, ValueError):
                continue
            if size > 0 and seconds > 0 and source and source != self.cfg.node:
                self._links[source] = round(size / seconds, 1)
        leaver = next((old for old, new in plan.handover.items() if new == self.cfg.node), None)
        handed, took = int(switched.get("from_leaver") or 0), float(switched.get("handover_s") or 0.0)
        if leaver is not None and handed > 0 and took > 0:
            self._links[leaver] = round(handed / took, 1)

    def _store_trouble(self) -> None:
        """Tell the leader loop that etcd failed this agent just now (it waits before calling nodes lost)."""
        if self._leader is not None:
            self._leader.store_trouble = time.monotonic()

    def _report_progress(self, urgent: bool) -> None:
        """Report the workers' step now and then (each of them says it once a second): the leader
        decides nothing on it, ``tmrun status`` and ``tmrun top`` show it. Every PROGRESS_REPORT
        seconds, every PROGRESS_VIEWED while ``tmrun top`` follows the job, and less often in a
        large job, so that all nodes together write about PROGRESS_WRITES a second."""
        now = time.monotonic()
        nodes = len(self._plan.members) if self._plan is not None else 1
        every = max(PROGRESS_VIEWED if self._viewed() else PROGRESS_REPORT, nodes / PROGRESS_WRITES)
        if urgent or now - self._progress_reported >= every:
            self._progress_reported = now
            if self._progress_timer is not None:
                self._progress_timer.cancel()
                self._progress_timer = None
            self._dirty.set()
        elif self._progress_timer is None:
            self._progress_timer = asyncio.get_running_loop().call_later(
                every - (now - self._progress_reported), self._flush_progress)

    def _viewed(self) -> bool:
        """Whether someone follows the job live: the ``viewer`` key as the watch last saw it."""
        seen = self._changes.latest(self._keys.viewer)
        return self._viewed_at_start if seen is None else seen.value is not None

    def _flush_progress(self) -> None:
        self._progress_timer = None
        self._progress_reported = time.monotonic()
        self._dirty.set()

    async def _start_workers(self, plan: Plan, standby: bool = False) -> None:
        cfg = self.cfg
        role, why = (Role.SHADOW, "standby workers start") if standby else (Role.MEMBER, f"generation {plan.gen} starts")
        if not self._role.move(role, why):
            return
        offset = max(0, plan.world_size - cfg.worker.nproc_per_node) if standby else plan.rank_offset(cfg.node)
        group = await self._spawn(plan, standby, offset)
        self._group, self._group_gen = group, (0 if standby else plan.gen)
        self._hello.clear()
        self._heard_at.clear()
        self._progress_at = None  # armed by the first committed step: start-up may take long
        self._group_wait = asyncio.ensure_future(group.wait())
        pids = ", ".join(map(str, group.pids))
        if standby:
            log.info("%s started shadow workers (pids %s)", cfg.node, pids)
            await self._report(RunState(0, "shadow", worker_pids=group.pids, at=time.time()))
        else:
            log.info("%s started generation %d: ranks %d-%d of %d (pids %s)", cfg.node, plan.gen, offset,
                     offset + cfg.worker.nproc_per_node - 1, plan.world_size, pids)
            await self._report(RunState(plan.gen, "running", rank=offset, worker_pids=group.pids, at=time.time()))

    async def _spawn(self, plan: Plan, standby: bool, offset: int) -> WorkerGroup:
        """Start this node's worker processes (ranks from ``offset``; a standby's are placeholders)."""
        cfg = self.cfg
        gen_dir = self._log_root / cfg.job_id / cfg.node / (f"standby{plan.gen}" if standby else f"gen{plan.gen}")
        launches = []
        for local_rank in range(cfg.worker.nproc_per_node):
            error_file = gen_dir / str(local_rank) / "error.json"
            error_file.parent.mkdir(parents=True, exist_ok=True)
            env = worker_env(os.environ, cfg, plan, local_rank, str(error_file), rank_offset=offset)
            env["TMRUN_AGENT_SOCKET"] = self._channel.path
            env["TMRUN_ROLE"] = "standby" if standby else "active"
            launches.append(WorkerLaunch(cfg.worker.argv, env, local_rank, offset + local_rank))
        router = OutputRouter(cfg.node, log_dir=gen_dir, redirects=cfg.worker.redirects, tee=cfg.worker.tee,
                              local_ranks_filter=cfg.worker.local_ranks_filter, on_line=self._on_output_line)
        group = WorkerGroup(launches, router, cfg.timeouts.stop_grace)
        self._stall = None
        await group.start(None if standby else self._warm)
        if self._warm is not None and not standby:
            self._warm.fill({launch.local_rank: launch.env for launch in launches}, WARM_DELAY)
        if not standby:
            self._stall = Progress([(pid, launch.rank, Path(launch.env["TMRUN_HEARTBEAT_FILE"]))
                                    for pid, launch in zip(group.pids, launches)], time.monotonic(), time.time())
        return group

    def _on_output_line(self, local_rank: int) -> None:
        stall, group = self._stall, self._group
        if stall is not None and group is not None and local_rank < len(group.pids):
            stall.output(group.pids[local_rank], time.monotonic(), time.time())

    async def _on_group_done(self, result: GroupResult) -> None:
        gen = self._group_gen
        self._group_wait = None
        if self._role.now is Role.SHADOW:
            self._shadow_failed = result.state == "failed"
            log.warning("%s: shadow workers ended (%s, exit %s)", self.cfg.node, result.state, result.exitcode)
            self._group = None
            self._role.move(Role.IDLE, f"the shadow workers ended ({result.state})")
            await self._report(RunState(0, "idle", at=time.time()))
            return
        self._role.move(Role.ENDED, f"generation {gen}'s workers ended ({result.state})")
        if result.state == "failed":
            if self._group is not None:  # their last words (the runtime's ``failed``) go with the exit
                await self._channel.drained(self._group.pids, 1.0)
            log.warning("%s generation %d: worker rank %s exited with %s", self.cfg.node, gen, result.rank,
                        result.exitcode)
        await self._report(dataclasses.replace(self._run, gen=gen, state=result.state, exitcode=result.exitcode,
                                               rank=result.rank, at=time.time()))

    async def _stop_workers(self, why: str = "the agent stops") -> None:
        group, wait = self._group, self._group_wait
        if group is None:
            return
        await group.stop()
        if wait is not None:
            await asyncio.gather(wait, return_exceptions=True)
        self._channel.forget(group.pids)
        self._group, self._group_wait, self._group_gen = None, None, 0
        self._role.move(Role.IDLE, f"workers stopped: {why}")

    async def _report(self, run: RunState) -> None:
        self._run = run
        try:
            await self._store.put(self._keys.node(self.cfg.node), self._record().to_dict(), lease=self._lease)
        except StoreError:
            self._resync = True  # kept in self._run: reported on the next successful look
            raise

    def _record(self) -> NodeRecord:
        cfg = self.cfg
        return NodeRecord(cfg.node, cfg.host, os.getpid(), cfg.worker.nproc_per_node, cfg.standby_hint,
                          self._joined_at, self._run.to_dict(), self._metrics.address if self._metrics else "",
                          dict(self._links), self._link_listener.port, tuple(sorted(self._unreachable)))

    async def _keepalive(self) -> None:
        """Refresh the lease every third of its TTL, for as long as the agent runs.

        etcd unreachable: keep trying, the workers keep running; past the outage bound
        (``timeouts.outage``), ControlPlaneLost ends the agent. etcd answers that the lease is
        gone: register again.
        """
        ttl, bound = self.cfg.timeouts.lease_ttl, self.cfg.timeouts.outage
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(ttl / 3)
            lease = self._lease
            try:
                if await self._store.refresh_lease(lease) <= 0:
                    await self._reregister(lease)
            except StoreError as exc:  # unreachable, no quorum, or an answer that is no answer
                self._store_trouble()
                away = time.monotonic() - last_ok
                if bound and away > bound:
                    raise ControlPlaneLost(f"etcd at {self._store.endpoint} unreachable for {away:.0f} s "
                                           f"(outage bound {bound:g} s, etcd_outage_timeout)") from exc
                continue
            last_ok = time.monotonic()


def make_store(cfg: AgentConfig) -> Store:
    # The agent forks workers while gRPC threads run; gRPC's fork handlers only add noise there.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    from agent.etcd_store import EtcdStore, Login, TlsOptions, parse_endpoint

    tls = None
    if cfg.tls_cacert or cfg.tls_cert or cfg.tls_key:
        tls = TlsOptions(cfg.tls_cacert, cfg.tls_cert, cfg.tls_key)
    login = Login(cfg.etcd_user, cfg.etcd_password_file) if cfg.etcd_user and cfg.etcd_password_file else None
    return EtcdStore(parse_endpoint(cfg.endpoint), tls=tls, login=login, retry_deadline=cfg.timeouts.store_retry)


async def run_agent(cfg: AgentConfig, hosting: MemberHost | None = None) -> int:
    return await NodeAgent(cfg, make_store(cfg), hosting).run()
