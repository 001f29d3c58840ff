"""The embedded etcd cluster of a SLURM job: where its members run, and how a lost one is replaced.

Every node computes the layout alike from the allocation; nothing is passed around::

    members     the allocation's first three hosts (one host when it has fewer than three nodes:
                two members would need both for a quorum, worse than one)
    name        tmrun-<host>
    ports       client 20000 + job id % 10000, peer client - 10000, the same on every host
    listens on  the node's own IP (etcd binds IPs only); advertises its host name
    endpoints   every host of the allocation at the client port, the members first: agents and
                ``tmrun drain`` reach whichever members are up (a refused connection moves on)

Losing a member (its process killed, its node drained, killed or cut off) does not stop the job:
two of three still form a quorum. A member whose process died while its agent lives is started
again from its data directory by that agent (:mod:`agent.etcd_member`). A member whose node left
the job is replaced by the leader's agent, so that a second loss later is survived too::

    member's node left (its agent's key is gone, or the plan says it was drained)
        ─► member remove (quorum 2 of 2)
        ─► member add on the first live node of the allocation that hosts none (quorum 2 of 3)
        ─► key etcd/<node>: that node's agent starts the member (--initial-cluster-state existing)
    a member added but not started within ``START_TIMEOUT`` is removed again; another node is tried

Remove comes before add: adding first would make a fourth member with two of them gone, and the
quorum (3 of 4) would be lost. :func:`next_repair` is the decision (pure, table-tested); the
driver is :class:`agent.etcd_member.MemberHost`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable
from urllib.parse import urlsplit

from agent.slurm import SlurmAllocation, etcd_port_for_job

MAX_MEMBERS = 3
# Peers at 10000-19999, below the clients: both stay out of Linux's ephemeral range (32768-60999 by
# default), where any outgoing connection on the node (gloo, NCCL, an etcd client) may hold the port.
PEER_PORT_OFFSET = -10000
START_TIMEOUT = 60.0  # seconds a member added to the cluster has to start before another node is tried


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the job's etcd members run and listen; the same on every node."""

    hosts: tuple[str, ...]
    client_port: int
    peer_port: int
    size: int
    tls: bool = False  # members speak TLS to clients and to each other (agent/credentials.py)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def initial_hosts(self) -> tuple[str, ...]:
        return self.hosts[: self.size]

    def name(self, host: str) -> str:
        return f"tmrun-{host}"

    def peer_url(self, host: str) -> str:
        return f"{self.scheme}://{host}:{self.peer_port}"

    def initial_cluster(self) -> dict[str, str]:
        return {self.name(h): self.peer_url(h) for h in self.initial_hosts}

    @property
    def endpoint(self) -> str:
        """Client endpoints, members first (``parse_endpoint`` reads it; ``https://`` when TLS)."""
        prefix = "https://" if self.tls else ""
        return ",".join(f"{prefix}{h}:{self.client_port}" for h in self.hosts)


def layout_for(alloc: SlurmAllocation, tls: bool = False) -> Layout:
    client = etcd_port_for_job(alloc.job_id)
    size = MAX_MEMBERS if alloc.nnodes >= MAX_MEMBERS else 1
    return Layout(tuple(alloc.hosts), client, client + PEER_PORT_OFFSET, size, tls)


def host_of(peer_urls: Iterable[str]) -> str:
    """The host a member runs on, from its peer URL (names are empty until it starts)."""
    for url in peer_urls:
        host = urlsplit(url).hostname
        if host:
            return host
    return ""


@dataclasses.dataclass(frozen=True)
class MemberView:
    """A member as the keeper sees it: its id, the node it runs on, whether it has started."""

    id: int
    node: str
    started: bool


@dataclasses.dataclass(frozen=True)
class Repair:
    """What the keeper does next: ``remove`` member ``member_id``, ``add`` one on ``node``, or ``none``."""

    action: str
    reason: str
    member_id: int = 0
    node: str = ""


def next_repair(members: Iterable[MemberView], live: set[str], leaving: set[str], hosts: Iterable[str],
                stale: set[str] = frozenset(), size: int = MAX_MEMBERS) -> Repair:
    """The one membership change to make now, from a snapshot (see the module docstring).

    ``live``: nodes whose agent is registered. ``leaving``: nodes the plan has drained out.
    ``stale``: nodes given a member that did not start in time (not tried again).
    """
    members = list(members)
    for m in members:
        if m.node in leaving:
            return Repair("remove", f"{m.node} was drained from the job", m.id, m.node)
        if m.node not in live:
            return Repair("remove", f"{m.node} left the job (its agent is gone)", m.id, m.node)
        if not m.started and m.node in stale:
            return Repair("remove", f"the member added on {m.node} did not start in time", m.id, m.node)
    if len(members) >= size:
        return Repair("none", "every member's node is in the job")
    hosting = {m.node for m in members}
    for host in hosts:
        if host in live and host not in leaving and host not in hosting and host not in stale:
            return Repair("add", f"{len(members)} of {size} members: a new one on {host}", node=host)
    return Repair("none", f"{len(members)} of {size} members and no node left to host another")
