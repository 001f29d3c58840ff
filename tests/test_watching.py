"""What an agent watches and how the leader keeps its copy of the job's keys (agent.changes,
agent.mirror), on the in-memory store: a follower is woken by the keys it follows and not by
other nodes' reports; the leader's copy follows every change but wakes it only for those that
can change a decision."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent.changes import Changes
from agent.errors import StoreUnavailable
from agent.keys import JobKeys
from agent.memory_store import MemoryStore
from agent.mirror import Mirror, progress_only
from agent.records import NodeRecord, RunState
from agent.store import Entry, Event, Watch

pytestmark = pytest.mark.timeout(30)

KEYS = JobKeys("watching")


def node(step: int, state: str = "running", **run) -> dict:
    """A node record as JSON gives it back (lists, not tuples)."""
    record = NodeRecord("node-1", "h", 7, 8, run=RunState(1, state, rank=8, step=step, step_time=0.1, **run).to_dict())
    return json.loads(json.dumps(record.to_dict()))


def test_progress_only_tells_a_step_from_a_change_that_matters() -> None:
    old = Entry(KEYS.node("node-1"), node(5), 3, 4)
    assert progress_only(old, Event("put", old.key, node(9), 5))
    assert not progress_only(old, Event("put", old.key, node(9, state="failed"), 5))
    assert not progress_only(old, Event("put", old.key, node(5, last_swap={"gen": 1, "first_step_at": 1.0}), 5))
    assert not progress_only(old, Event("delete", old.key, None, 5))
    assert not progress_only(None, Event("put", old.key, node(9), 5))
    assert not progress_only(Entry(KEYS.plan, {"gen": 1}, 3, 4), Event("put", KEYS.plan, {"gen": 2}, 5))


def test_a_follower_is_woken_by_the_plan_and_not_by_other_nodes_reports() -> None:
    async def body() -> None:
        store = MemoryStore()
        _, revision = await store.stat(KEYS.plan)
        changes = Changes(store, [KEYS.plan, KEYS.outcome, KEYS.leader])
        seen_events: list[str] = []
        changes.on_event = lambda event: seen_events.append(event.key)
        await changes.start(revision + 1)
        version = changes.version
        await store.put(KEYS.node("node-1"), node(5))
        await store.put(KEYS.request("r1"), {"v": 1})
        await store.put(KEYS.node("node-1"), node(6))
        await store.put(KEYS.plan, {"v": 1, "gen": 2})
        await asyncio.wait_for(changes.wait(version), 5)
        assert seen_events == [KEYS.plan]  # the reports and the request woke nobody
        latest = changes.latest(KEYS.plan)
        assert latest is not None and latest.value == {"v": 1, "gen": 2} and latest.create_revision == latest.revision
        assert changes.latest(KEYS.outcome) is None
        await changes.close()

    asyncio.run(body())


def test_the_leader_s_copy_follows_every_change_and_wakes_only_for_those_that_matter() -> None:
    async def body() -> None:
        store = MemoryStore()
        await store.put(KEYS.node("node-1"), node(5))
        mirror = Mirror(store, KEYS.root)
        await mirror.start()
        assert mirror.snapshot()[KEYS.node("node-1")].value == node(5)
        version = mirror.version
        written = await store.put(KEYS.node("node-1"), node(6))
        for _ in range(100):  # the watch delivers on the loop's next turns
            await asyncio.sleep(0)
        assert mirror.revision == written and mirror.version == version  # copied, nobody woken
        assert mirror.snapshot()[KEYS.node("node-1")].value == node(6)
        assert mirror.changed_at(KEYS.node("node-1")) < written  # the last change that mattered is older
        written = await store.put(KEYS.node("node-1"), node(6, state="failed"))
        await asyncio.wait_for(mirror.wait(version), 5)
        assert mirror.changed_at(KEYS.node("node-1")) == written
        await store.delete(KEYS.node("node-1"))
        await store.put(KEYS.plan, {"v": 1})
        assert await mirror.caught_up((await store.stat(KEYS.plan))[0], 5)
        snapshot = mirror.snapshot()
        assert KEYS.node("node-1") not in snapshot and snapshot[KEYS.plan].value == {"v": 1}
        assert mirror.keys_under(KEYS.nodes) == []
        await mirror.close()
        await store.close()

    asyncio.run(body())


class AwayStore(MemoryStore):
    """Its watches fail (as a watch does when etcd goes away) from the first event after ``away``."""

    away = False

    async def watch_prefix(self, prefix: str, *, start_revision: int):
        if self.away:
            raise StoreUnavailable(self.endpoint, "etcd is away")
        inner = await super().watch_prefix(prefix, start_revision=start_revision)
        store = self

        class Failing(Watch):
            async def __aiter__(self):
                async for event in inner:
                    if store.away:
                        raise StoreUnavailable(store.endpoint, "etcd is away")
                    yield event

            async def cancel(self) -> None:
                await inner.cancel()
        return Failing()


def test_the_leader_s_copy_is_not_decided_on_while_its_watch_is_away_and_is_read_again_after() -> None:
    async def body() -> None:
        store = AwayStore()
        mirror = Mirror(store, KEYS.root, max_wait=0.05)
        await mirror.start()
        version = mirror.version
        store.away = True
        await store.put(KEYS.plan, {"v": 1, "gen": 1})  # the event that finds the watch broken
        await asyncio.wait_for(mirror.wait(version), 5)
        assert not mirror.connected
        with pytest.raises(StoreUnavailable):
            mirror.snapshot()
        store.away = False
        while not mirror.connected:
            await asyncio.wait_for(mirror.wait(mirror.version), 5)
        assert mirror.reconnects == 1
        assert mirror.snapshot()[KEYS.plan].value == {"v": 1, "gen": 1}  # the missed event, replayed
        await mirror.close()

    asyncio.run(body())
