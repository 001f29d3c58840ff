"""The leader's TCPStores: each generation's comes from a spare made beforehand; a spare that
failed is replaced by one made on the spot; and the background import of torch leaves its
objects out of the garbage collector's sight."""

from __future__ import annotations

import asyncio
import gc
import itertools

import pytest

from agent import leader as leader_mod
from agent.changes import Changes
from agent.config import AgentConfig, WorkerSpec
from agent.memory_store import MemoryStore

pytestmark = pytest.mark.timeout(60)


class FakeTCPStore:
    ports = itertools.count(40000)

    def __init__(self) -> None:
        self.port = next(self.ports)


def make_leader(store: MemoryStore) -> leader_mod.Leader:
    cfg = AgentConfig(job_id="j", node="node-0", host="127.0.0.1", endpoint="", worker=WorkerSpec(("x",)))
    return leader_mod.Leader(cfg, store, 0, Changes(store, ["/tmrun/j/plan"]))


def test_a_generation_s_store_is_the_spare_and_the_next_spare_waits_for_the_leader_to_wait(monkeypatch) -> None:
    made: list[FakeTCPStore] = []

    def fake(host: str) -> FakeTCPStore:
        made.append(FakeTCPStore())
        return made[-1]

    monkeypatch.setattr(leader_mod, "_tcp_store_server", fake)

    async def body() -> None:
        leader = make_leader(MemoryStore())
        leader._make_spare()  # as on becoming leader
        await asyncio.sleep(0)
        port = await leader._new_tcp_store()
        assert port == made[0].port and len(made) == 1  # the spare, nothing made on the path
        assert leader._spare is None
        leader._make_spare()  # as when it waits next
        assert await leader._new_tcp_store() == made[1].port and len(made) == 2

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_spare_that_failed_is_made_again_on_the_spot(monkeypatch) -> None:
    calls = []

    def flaky(host: str) -> FakeTCPStore:
        calls.append(host)
        if len(calls) == 1:
            raise RuntimeError("address in use")
        return FakeTCPStore()

    monkeypatch.setattr(leader_mod, "_tcp_store_server", flaky)

    async def body() -> None:
        leader = make_leader(MemoryStore())
        leader._make_spare()
        port = await leader._new_tcp_store()
        assert port > 0 and len(calls) == 2

    asyncio.run(asyncio.wait_for(body(), 10))


def test_the_background_import_freezes_what_it_imported() -> None:
    before = gc.get_freeze_count()
    leader_mod.warm_torch().join(60)
    import torch.distributed  # noqa: F401  (imported by the thread: no cost here)

    assert gc.get_freeze_count() > before
    gc.unfreeze()  # leave the test process as it was
