"""Keeping this machine's embedded etcd member alive while the job runs, and the SLURM cluster whole.

A member that dies (its process killed, a crash) is started again from its data directory, on
the same ports, so that it rejoins its cluster with everything it had: the local cluster's
single member comes back with the job's keys and leases (etcd extends every lease when it
elects a leader, so agents reconnect without registering again), and a member of a SLURM job's
three comes back as itself. A member that keeps failing to start (for example because it was
removed from its cluster) is given up after a few tries, with one line saying why::

    ┌──────────► wait for the process to exit (pidfd: no polling, no thread)
    │                      │ killed or crashed (exit 0, SIGTERM, SIGINT, SIGHUP: asked to stop)
    │                      ▼
    └──── healthy ◄── spawn again from the data directory ── fails 3× within a minute ─► give up

Processes are spawned from the event loop's thread (the agent's or launcher's main thread),
because the member's parent-death signal is tied to the thread that spawned it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

import tenacity

from agent.credentials import UserCredentials, server_certificate
from agent.errors import StoreError
from agent.etcd_cluster import START_TIMEOUT, Layout, MemberView, host_of, next_repair
from agent.etcd_server import EmbeddedEtcd
from agent.history import append_event
from agent.records import EventRecord, MemberAssignment, Plan, parse
from agent.shared_dirs import private_dir

log = logging.getLogger("tmrun.etcd")

RESTARTS_PER_MINUTE = 3
READY_TIMEOUT = 60.0
# Exits that mean "stop": a clean exit (etcd does that when asked, or when it was removed from its
# cluster) and the polite signals (SLURM ends a step with SIGTERM). Anything else is restarted.
STOPPED = (0, -signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)
CLOSE_GRACE = 1.0  # seconds from SIGTERM to SIGKILL when the member's node is done with the job
NO_QUORUM_WAIT = 3.0  # seconds of failed reads after which a job that ended stops waiting on the others
# Seconds a job that ended waits for a host of the allocation whose key is gone (an agent away in an
# outage, or killed: etcd cannot tell which) to say it saw the outcome; registered nodes get release's limit.
KEYLESS_WAIT = 10.0
KEEPER_TICK = 2.0  # seconds between looks at the member list when no key changes


async def wait_exit(pid: int) -> None:
    """Return when process ``pid`` (a child of ours) has exited."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    done = loop.create_future()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def start(server: EmbeddedEtcd, timeout: float = READY_TIMEOUT) -> None:
    """Spawn ``server`` here, wait in a thread until it serves (the loop stays free)."""
    server.spawn()
    await asyncio.to_thread(server.wait_ready, timeout)


async def keep_alive(server: EmbeddedEtcd, report: Callable[[str], None] = log.warning,
                     clock: Callable[[], float] = time.monotonic) -> None:
    """Restart ``server`` whenever its process exits, until cancelled or it keeps failing.

    ``server.stop()`` (which the owner calls when the job ends) is not a failure: this returns.
    """
    failures: collections.deque[float] = collections.deque()
    while True:
        if server.pid is not None and server.running():
            await wait_exit(server.pid)
        if server.stopped:
            return
        code = server.returncode
        if code in STOPPED:  # asked to stop (SLURM ends the step, someone stopped it), or removed
            report(f"etcd member {server.name} stopped ({'exit code 0' if code == 0 else signal.Signals(-code).name}): "
                   f"{server.last_error() or 'not restarting it'}")
            return
        failures.append(clock())
        while failures and clock() - failures[0] > 60.0:
            failures.popleft()
        if len(failures) > RESTARTS_PER_MINUTE:
            report(f"etcd member {server.name} exited {len(failures)} times within a minute "
                   f"(last: {server.last_error() or f'exit code {code}'}); not restarting it")
            return
        report(f"etcd member {server.name} (pid {server.pid}) exited with code {code}: restarting it from "
               f"{server.data_dir}")
        try:
            server.pin_ports()
            await start(server)
        except StoreError as exc:
            report(f"etcd member {server.name} did not come back: {exc}")
            continue
        report(f"etcd member {server.name} is back at {server.endpoint} (pid {server.pid})")


class MemberHost:
    """This node's part in a SLURM job's embedded etcd cluster (see :mod:`agent.etcd_cluster`).

    ``boot`` (before the agent registers, in the main thread) starts the member when this node is
    one of the first hosts. While the agent runs, ``run`` keeps the member alive, starts one when
    the keeper assigns this node a member (key ``etcd/<node>``), and, on the leader's agent, runs
    the keeper. After the agent is done, ``release`` keeps the member up until it is no longer
    needed (the other agents left, or the cluster removed it), and ``close`` stops it and removes
    its data.
    """

    def __init__(self, layout: Layout, node: str, address: str, data_root: Path,
                 report: Callable[[str], None] = log.warning, wall: Callable[[], float] = time.time,
                 grace: float = 10.0, credentials: UserCredentials | None = None) -> None:
        self.layout = layout
        self.node = node
        self.address = address
        self.data_dir = data_root / f"etcd-{node}"
        self.server: EmbeddedEtcd | None = None
        self._report = report
        self._wall = wall
        self._alive: asyncio.Task | None = None
        self._assignment_at: float | None = None
        self._stale: set[str] = set()
        self._missing_since: dict[str, float] = {}  # node -> when the keeper first saw it unregistered
        self.grace = grace
        self.credentials = credentials  # members speak TLS with certificates of the user's CA

    def _server(self, cluster: dict[str, str], state: str) -> EmbeddedEtcd:
        private_dir(self.data_dir.parent, "remove it, or set TMPDIR to a directory of your own")
        shutil.rmtree(self.data_dir, ignore_errors=True)  # a fresh member: no state of another run
        tls = None
        if self.credentials is not None:
            names = list(dict.fromkeys([self.node, self.address, "localhost", "127.0.0.1"]))
            tls = server_certificate(self.credentials, self.data_dir / "tls", names)
        return EmbeddedEtcd(self.data_dir, host=self.address, advertise_host=self.node,
                            client_port=self.layout.client_port, peer_port=self.layout.peer_port,
                            name=self.layout.name(self.node), initial_cluster=cluster, cluster_state=state, tls=tls)

    def boot(self, timeout: float = READY_TIMEOUT) -> None:
        """Start this node's initial member, if it has one, and wait until the cluster serves."""
        if self.node not in self.layout.initial_hosts:
            return
        self.server = self._server(self.layout.initial_cluster(), "new")
        self.server.spawn()
        try:
            self.server.wait_ready(timeout)
        except StoreError:
            self.close()
            raise

    async def run(self, store, changes, leader, keys) -> None:
        """Keep the member alive, start an assigned one, and keep the cluster whole while leading."""
        if self.server is not None:
            self._alive = asyncio.ensure_future(keep_alive(self.server, self._report))
        try:
            while True:
                seen = changes.version
                try:
                    await self._follow_assignment(store, keys)
                    if leader.is_leader:
                        await self._keep(store, keys)
                except StoreError as exc:  # unreachable or no quorum: the next change or tick tries again
                    log.debug("etcd cluster check failed: %s", exc)
                except Exception:  # a bug here must not cost the job its training: say it, go on
                    log.exception("%s: the etcd cluster check failed", self.node)
                await changes.wait(seen, KEEPER_TICK)
        finally:
            if self._alive is not None:
                self._alive.cancel()
                await asyncio.gather(self._alive, return_exceptions=True)

    async def _follow_assignment(self, store, keys) -> None:
        assignment = parse(MemberAssignment, await store.get(keys.etcd_member(self.node)))
        if assignment is None or assignment.at == self._assignment_at:
            return
        self._assignment_at = assignment.at
        cluster = assignment.cluster
        if self._alive is not None:
            self._alive.cancel()
            await asyncio.gather(self._alive, return_exceptions=True)
        if self.server is not None:
            self.server.stop(grace=1.0)
        self._report(f"{self.node} joins the job's etcd cluster as a new member ({len(cluster)} members)")
        self.server = self._server(cluster, "existing")
        try:
            await start(self.server)
        except StoreError as exc:
            self._report(f"{self.node}: the new etcd member did not start: {exc}")
            return
        self._report(f"{self.node}: etcd member {self.server.name} serves at {self.server.endpoint}")
        self._alive = asyncio.ensure_future(keep_alive(self.server, self._report))

    async def _keep(self, store, keys) -> None:
        """The leader's agent: one repair of the member list when a member's node left the job."""
        entries, _ = await store.get_prefix(keys.root)
        if keys.plan not in entries or keys.outcome in entries:
            return  # before the first generation nodes are still arriving; after the end, nothing to keep
        plan = parse(Plan, entries[keys.plan])
        if plan is None:
            return
        registered = {keys.relative(k)[len("nodes/"):] for k in entries if keys.relative(k).startswith("nodes/")}
        live = self._live(registered)
        leaving = {node for node, why in plan.out.items() if why == "drained"}
        members = await store.members()
        views = [MemberView(m.id, host_of(m.peer_urls), bool(m.name)) for m in members]
        now = self._wall()
        for key, entry in entries.items():
            rel = keys.relative(key)
            assignment = parse(MemberAssignment, entry) if rel.startswith("etcd/") else None
            if assignment is not None and now - assignment.at > START_TIMEOUT \
                    and any(v.node == rel[5:] and not v.started for v in views):
                self._stale.add(rel[5:])
        repair = next_repair(views, live, leaving, self.layout.hosts, self._stale, self.layout.size)
        if repair.action == "remove":
            await store.remove_member(repair.member_id)
            await store.delete(keys.etcd_member(repair.node))
        elif repair.action == "add":
            cluster = {m.name: m.peer_urls[0] for m in members if m.name and m.peer_urls}
            cluster[self.layout.name(repair.node)] = self.layout.peer_url(repair.node)
            await store.add_member(self.layout.peer_url(repair.node))
            await store.put(keys.etcd_member(repair.node), MemberAssignment(repair.node, cluster, now).to_dict())
        else:
            return
        self._report(f"etcd cluster: {repair.action} a member: {repair.reason}")
        record = EventRecord(now, "etcd", f"etcd member {repair.action}: {repair.reason}", plan.gen,
                             {"node": repair.node, "members": len(members) + (1 if repair.action == "add" else -1)})
        await append_event(store, keys, time.time_ns(), record)

    def _live(self, registered: set[str]) -> set[str]:
        """Nodes to count as in the job: registered, or missing for less than ``grace`` seconds.

        A key can vanish for a moment when etcd was away and the agent's lease expired meanwhile;
        the agent then registers again. Only a node gone for longer has left.
        """
        now = time.monotonic()
        for node in registered:
            self._missing_since.pop(node, None)
        for node in self.layout.hosts:
            if node not in registered:
                self._missing_since.setdefault(node, now)
        return registered | {n for n, since in self._missing_since.items() if now - since < self.grace}

    async def release(self, store, keys, job_ended: bool, limit: float = 30.0) -> None:
        """Keep the member up while it is still needed, at most ``limit`` seconds.

        The job ended: until every other agent of the job said it saw the outcome (``done/<node>``);
        a node whose key vanished with an expired lease may still be waiting for it, but it may as
        well be dead (a killed agent): such hosts are waited for ``KEYLESS_WAIT`` seconds only. And
        not while the cluster has no quorum for ``NO_QUORUM_WAIT`` seconds: the other members stopped
        (the last member up cannot serve anyone alone), and waiting would only hold the job's
        end. This node left a running job: until the keeper removed its member (the cluster
        stays whole).
        """
        if self.server is None or not self.server.running():
            return
        deadline = time.monotonic() + limit
        retrying = tenacity.AsyncRetrying(stop=tenacity.stop_before_delay(limit), wait=tenacity.wait_fixed(0.5),
                                          retry=tenacity.retry_if_result(bool), retry_error_callback=lambda _: None)
        if job_ended:
            waiting: set[str] | None = None
            failing_since: float | None = None
            started = time.monotonic()
            given_up: set[str] = set()  # keyless hosts no longer waited for

            async def others() -> bool:
                nonlocal waiting, failing_since, given_up
                asked = time.monotonic()
                try:
                    entries, _ = await store.get_prefix(keys.root)
                except StoreError:  # cannot tell who still needs this member's vote, unless nobody can use it
                    failing_since = failing_since or asked
                    return waiting != set() and time.monotonic() - failing_since < NO_QUORUM_WAIT
                failing_since = None
                left = awaiting_ack(entries, keys, self.layout.hosts, self.node)
                if asked - started >= KEYLESS_WAIT:
                    registered = awaiting_ack(entries, keys, (), self.node)
                    given_up |= left - registered
                    left = registered
                if left and left != waiting:
                    log.info("%s: the etcd member stays until %s saw the job's end", self.node, ", ".join(sorted(left)))
                waiting = left
                return bool(left)
            await retrying(others)
            if failing_since is not None:
                self._report(f"{self.node}: stopping the etcd member: the job has ended and etcd has had no quorum "
                             f"for {time.monotonic() - failing_since:.0f} s (the other members stopped)")
            elif waiting:
                self._report(f"{self.node}: stopping the etcd member after {limit:g} s; "
                             f"{', '.join(sorted(waiting))} did not say they saw the job's end")
            elif given_up:
                self._report(f"{self.node}: stopping the etcd member; {', '.join(sorted(given_up))} did not say they "
                             f"saw the job's end within {KEYLESS_WAIT:g} s and their keys are gone (an agent "
                             "killed, or cut off from etcd)")
        else:
            name = self.layout.name(self.node)

            async def still_member() -> bool:
                try:
                    return any(m.name == name for m in await store.members())
                except StoreError:
                    return time.monotonic() < deadline
            await retrying(still_member)

    def close(self) -> None:
        """Stop the member and remove its data (the job's cluster is over for this node). Its data
        goes, so a graceful stop buys nothing: a member left without a quorum takes seconds to
        stop on SIGTERM, and the SLURM step (and the job) would wait for it."""
        if self.server is not None:
            self.server.stop(grace=CLOSE_GRACE)
        shutil.rmtree(self.data_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.data_dir.parent.rmdir()  # the job's directory, once the last member on this file system is gone


def awaiting_ack(entries: dict, keys, hosts: tuple[str, ...] | list[str], me: str) -> set[str]:
    """The job's nodes that have not yet said they saw the outcome.

    Every registered node, and every host of the allocation that the plan does not count as out
    of the pool (a host whose lease expired during an outage is still running its agent).
    """
    expected = {keys.relative(k)[len("nodes/"):] for k in entries if keys.relative(k).startswith("nodes/")}
    expected |= set(hosts)
    plan = parse(Plan, entries.get(keys.plan))
    if plan is not None:
        expected -= set(plan.out)
    acked = {keys.relative(k)[len("done/"):] for k in entries if keys.relative(k).startswith("done/")}
    return expected - acked - {me}
