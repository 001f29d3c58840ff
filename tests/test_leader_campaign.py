"""Who campaigns for the leader key: an agent campaigns when the key is free, but not once the
job's outcome is written (its agents are leaving; the README's job used to end with a standby
announcing that it leads)."""

from __future__ import annotations

import asyncio

import pytest

from agent import leader as leader_mod
from agent.changes import Changes
from agent.config import AgentConfig, WorkerSpec
from agent.keys import JobKeys
from agent.memory_store import MemoryStore

pytestmark = pytest.mark.timeout(60)


class FakeHost:
    """The leader's spare store, without a child process."""

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
