"""Prometheus text metrics of one node agent, served over HTTP while the agent runs.

``tmrun --metrics-port PORT`` turns it on (off by default; 0 picks a free port); each agent
serves ``GET /metrics`` on its node's address and writes ``host:port`` into its node record, so
``tmrun status --json`` names every node's endpoint. In a local cluster the agents share one
machine: node ``i`` takes ``PORT + i`` (or a free port each with 0).

The numbers are read from the agent when Prometheus scrapes (a collector, not counters updated
on the way): what the agent last heard from its workers and what it saw of the job. Nothing here
writes to etcd or waits on it; a scrape never holds up the agent's loop (the server runs in a
thread of its own, prometheus_client's).

Link rates (``tmrun_link_rate_bytes_per_second`` with the source node as a label; the latest
measurement per source): phase 1's probe when this node joined, and, when its workers receive
state in a switch, each source's bytes over the time its last piece took to arrive.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.address import format_endpoint


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one agent shows at one moment (built by the agent, read by the scrape's thread)."""

    job: str
    node: str
    role: str  # the agent's role: idle, shadow, member, leaving, ended, gone
    generation: int = 0
    step: int = 0
    step_time: float = 0.0  # seconds, the workers' last reported step
    workers: int = 0  # this node's worker processes that have not exited
    swaps: int = 0  # switches to a new generation this node's workers made without restarting
    last_stall: float = 0.0  # seconds the last switch kept this node from training
    bytes_received: int = 0  # state received by this node's joiners, over all switches
    bytes_sent: int = 0  # state this node's leavers handed over
    watch_reconnects: int = 0  # how often this agent's etcd watch came back after etcd was away
    leader: bool = False
    links: dict = dataclasses.field(default_factory=dict)  # source node -> bytes/s measured into this node


class AgentCollector(Collector):
    """A collector over ``snapshot()``: one set of samples per scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        info = InfoMetricFamily("tmrun_node", "The job and node this agent runs, and its role.")
        info.add_metric([], {"job": s.job, "node": s.node, "role": s.role, "leader": str(s.leader).lower()})
        yield info
        for name, text, value in (
            ("tmrun_generation", "The generation (plan) this node's workers train in.", s.generation),
            ("tmrun_step", "The last step this node's workers committed.", s.step),
            ("tmrun_step_seconds", "The workers' last reported step time.", s.step_time),
            ("tmrun_workers", "This node's worker processes that have not exited.", s.workers),
            ("tmrun_last_swap_stall_seconds", "Seconds the last switch kept this node from training.", s.last_stall),
        ):
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], value)
            yield gauge
        for name, text, value in (
            ("tmrun_swaps", "Switches to a new generation made without restarting this node's workers.", s.swaps),
            ("tmrun_state_received_bytes", "Training state received by this node's joining workers.",
             s.bytes_received),
            ("tmrun_state_sent_bytes", "Training state this node's leaving workers handed over.", s.bytes_sent),
            ("tmrun_watch_reconnects", "Times this agent's etcd watch came back after etcd was away.",
             s.watch_reconnects),
        ):
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], value)
            yield counter
        links = GaugeMetricFamily("tmrun_link_rate_bytes_per_second", "Measured rate of the link from a source "
                                  "node into this one (the last state it sent here).", labels=["source"])
        for source, rate in sorted(s.links.items()):
            links.add_metric([source], rate)
        yield links


class MetricsServer:
    """``GET /metrics`` on ``host:port`` (0: a free port) until ``close()``."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)  # this agent's only: never the process-wide one
        self.registry.register(AgentCollector(snapshot))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port = self._server.server_address[1]

    @property
    def address(self) -> str:
        return format_endpoint(self.host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
