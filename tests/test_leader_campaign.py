"""Who campaigns for the leader key: an agent campaigns when the key is free, but not once the
job's outcome is written (its agents are leaving; the README's job used to end with a standby
announcing that it leads). The plan's deputy starts its store host before it leads and campaigns
first; the others take a vacant key only after DEPUTY_HEAD_START."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent import leader as leader_mod
from agent.changes import Changes
from agent.config import AgentConfig, WorkerSpec
from agent.keys import JobKeys
from agent.memory_store import MemoryStore
from agent.records import Plan

pytestmark = pytest.mark.timeout(60)


class FakeHost:
    """The leader's spare store, without a child process."""

    async def start(self) -> None:
        pass

    async def open(self) -> int:
        return 40000


async def campaign_once(outcome: bool) -> tuple[bool, list[str]]:
    """One campaign by node-1 with the leader key free: (whether the key is node-1's, what it did
    after: ``lead`` or ``wait``)."""
    store, keys = MemoryStore(), JobKeys("j")
    changes = Changes(store, [keys.plan, keys.outcome, keys.leader])
    await changes.start(1)
    if outcome:
        seen = changes.version
        await store.put(keys.outcome, {"v": 1, "outcome": "succeeded"})
        while changes.version == seen:  # the watch delivers the put
            await changes.wait(seen, 5)
    lease = await store.grant_lease(10)
    cfg = AgentConfig(job_id="j", node="node-1", host="127.0.0.1", endpoint="", worker=WorkerSpec(("x",)))
    leader = leader_mod.Leader(cfg, store, lease, changes, stores=FakeHost())
    did: list[str] = []

    async def lead(mirror) -> None:
        did.append("lead")

    async def leader_changed(seen: int) -> None:
        did.append("wait")

    leader._lead, leader._leader_changed = lead, leader_changed
    await leader._campaign()
    entry = await store.get(keys.leader)
    await changes.close()
    return entry is not None and entry.value["node"] == "node-1", did


def test_a_free_leader_key_is_taken():
    assert asyncio.run(asyncio.wait_for(campaign_once(outcome=False), 10)) == (True, ["lead"])


def test_no_one_takes_the_leader_key_once_the_job_has_ended():
    assert asyncio.run(asyncio.wait_for(campaign_once(outcome=True), 10)) == (False, ["wait"])


def plan_of(members: tuple[str, ...], leader: str) -> Plan:
    return Plan(gen=1, members=members, slots={m: 1 for m in members}, store_host="h", store_port=1, leader=leader)


def test_the_deputy_is_the_first_member_other_than_the_leader():
    assert leader_mod.deputy(plan_of(("node-0", "node-1", "node-2"), "node-0")) == "node-1"
    assert leader_mod.deputy(plan_of(("node-1", "node-2"), "node-0")) == "node-1"  # a standby leads
    assert leader_mod.deputy(plan_of(("node-0",), "node-0")) is None


class CountingHost(FakeHost):
    """Counts the starts of the store host (the child's torch import)."""

    def __init__(self) -> None:
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1


def make_agent(store: MemoryStore, changes: Changes, lease: int, node: str, host: FakeHost) -> leader_mod.Leader:
    cfg = AgentConfig(job_id="j", node=node, host="127.0.0.1", endpoint="", worker=WorkerSpec(("x",)))
    return leader_mod.Leader(cfg, store, lease, changes, stores=host)


def test_only_the_deputy_starts_its_store_host_before_it_leads():
    async def body() -> tuple[int, int]:
        store, keys = MemoryStore(), JobKeys("j")
        changes = Changes(store, [keys.leader])
        hosts = {node: CountingHost() for node in ("node-1", "node-2")}
        agents = {node: make_agent(store, changes, 0, node, hosts[node]) for node in hosts}
        for agent in agents.values():
            agent.follow(plan_of(("node-0", "node-1", "node-2"), "node-0"))
        await asyncio.gather(*(agent._warming for agent in agents.values() if agent._warming))
        return hosts["node-1"].starts, hosts["node-2"].starts

    assert asyncio.run(asyncio.wait_for(body(), 10)) == (1, 0)


async def vacancy(deputy_campaigns: bool) -> tuple[str, float]:
    """The leader key is free and node-2 (not the deputy) campaigns first; node-1, the plan's
    deputy, campaigns once node-2 has deferred to it, or never (it is gone). Returns who holds the
    key and how long node-2 took to hold it or to see it taken."""
    store, keys = MemoryStore(), JobKeys("j")
    changes = Changes(store, [keys.plan, keys.outcome, keys.leader])
    await changes.start(1)
    agents = {}
    for node in ("node-1", "node-2"):
        agents[node] = make_agent(store, changes, await store.grant_lease(10), node, FakeHost())
        agents[node].follow(plan_of(("node-0", "node-1", "node-2"), "node-0"))

        async def lead(mirror) -> None:
            pass
        agents[node]._lead = lead
    started = time.monotonic()
    second = asyncio.ensure_future(agents["node-2"].run())
    if deputy_campaigns:
        while agents["node-2"]._vacant_since is None:  # node-2 found the key free and deferred
            await asyncio.sleep(0.01)
        await agents["node-1"]._campaign()
    while (await store.get(keys.leader)) is None:
        await asyncio.sleep(0.01)
    took = time.monotonic() - started
    second.cancel()
    await changes.close()
    return (await store.get(keys.leader)).value["node"], took


def test_a_vacant_leadership_goes_to_the_deputy_though_another_agent_campaigned_first():
    holder, _ = asyncio.run(asyncio.wait_for(vacancy(deputy_campaigns=True), 10))
    assert holder == "node-1"


def test_without_its_deputy_another_agent_leads_after_the_head_start():
    holder, took = asyncio.run(asyncio.wait_for(vacancy(deputy_campaigns=False), 10))
    assert holder == "node-2"
    assert took >= leader_mod.DEPUTY_HEAD_START
