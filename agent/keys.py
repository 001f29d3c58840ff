"""The etcd key layout of one job, in one place (see docs/design.md, "Keys").

All keys live under ``/tmrun/<job>/``; values are versioned JSON written by :mod:`agent.records`.
"""

from __future__ import annotations

import dataclasses

ROOT = "/tmrun/"


@dataclasses.dataclass(frozen=True)
class JobKeys:
    job: str

    @property
    def root(self) -> str:
        return f"{ROOT}{self.job}/"

    @property
    def nodes(self) -> str:
        return self.root + "nodes/"

    def node(self, name: str) -> str:
        return self.nodes + name

    @property
    def leader(self) -> str:
        return self.root + "leader"

    @property
    def plan(self) -> str:
        return self.root + "plan"

    @property
    def outcome(self) -> str:
        return self.root + "outcome"

    @property
    def viewer(self) -> str:
        """Present while someone follows the job live (``tmrun top``, on a lease): the agents then
        report their workers' progress every second instead of every few."""
        return self.root + "viewer"

    @property
    def requests(self) -> str:
        return self.root + "requests/"

    def request(self, request_id: str) -> str:
        return self.requests + request_id

    @property
    def events(self) -> str:
        return self.root + "events/"

    def event(self, seq: int) -> str:
        return f"{self.events}{seq:020d}"

    @property
    def done(self) -> str:
        return self.root + "done/"

    def node_done(self, node: str) -> str:
        """``node``'s agent saw the outcome and leaves (the etcd members wait for these)."""
        return self.done + node

    def etcd_member(self, node: str) -> str:
        """The keeper's word to ``node``: start a new member of the job's etcd cluster."""
        return f"{self.root}etcd/{node}"

    def relative(self, key: str) -> str:
        """``/tmrun/job/nodes/node-0`` → ``nodes/node-0``."""
        return key[len(self.root):] if key.startswith(self.root) else key
