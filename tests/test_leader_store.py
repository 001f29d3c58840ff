"""The leader's TCPStores: each generation's comes from a spare made beforehand; a spare that
failed is replaced by one made on the spot; stores of long-gone generations are closed off the
decision's path."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from agent import leader as leader_mod
from agent.changes import Changes
from agent.config import AgentConfig, WorkerSpec
from agent.memory_store import MemoryStore
from agent.store_host import StoreHostError

pytestmark = pytest.mark.timeout(60)


class FakeHost:
    """A StoreHost without the child: ports handed out and closed, failures on demand."""

    def __init__(self, failures: int = 0) -> None:
        self.ports = itertools.count(40000)
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.failures = failures

    async def start(self) -> None:
        pass

    async def open(self) -> int:
        if self.failures:
            self.failures -= 1
            raise StoreHostError("address in use")
        self.opened.append(next(self.ports))
        return self.opened[-1]

    async def close(self, port: int) -> None:
        self.closed.append(port)

    async def stop(self) -> None:
        pass


def make_leader(store: MemoryStore, host: FakeHost) -> leader_mod.Leader:
    cfg = AgentConfig(job_id="j", node="node-0", host="127.0.0.1", endpoint="", worker=WorkerSpec(("x",)))
    return leader_mod.Leader(cfg, store, 0, Changes(store, ["/tmrun/j/plan"]), stores=host)


def test_a_generation_s_store_is_the_spare_and_the_next_spare_waits_for_the_leader_to_wait() -> None:
    host = FakeHost()

    async def body() -> None:
        leader = make_leader(MemoryStore(), host)
        leader._make_spare()  # as on becoming leader
        await asyncio.sleep(0)
        port = await leader._new_tcp_store()
        assert port == host.opened[0] and len(host.opened) == 1  # the spare, nothing made on the path
        assert leader._spare is None
        leader._make_spare()  # as when it waits next
        assert await leader._new_tcp_store() == host.opened[1] and len(host.opened) == 2

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_spare_that_failed_is_made_again_on_the_spot() -> None:
    host = FakeHost(failures=1)

    async def body() -> None:
        leader = make_leader(MemoryStore(), host)
        leader._make_spare()
        port = await leader._new_tcp_store()
        assert port == host.opened[0] and len(host.opened) == 1

    asyncio.run(asyncio.wait_for(body(), 10))


def test_the_stores_of_long_gone_generations_are_closed_when_the_next_spare_is_made() -> None:
    host = FakeHost()

    async def body() -> list[int]:
        leader = make_leader(MemoryStore(), host)
        ports = []
        for _ in range(6):
            leader._make_spare()
            ports.append(await leader._new_tcp_store())
            assert host.closed == ports[:max(0, len(ports) - 1 - leader_mod.KEEP_STORES)]  # none on the path
        return ports

    ports = asyncio.run(asyncio.wait_for(body(), 10))
    assert host.closed == ports[:2]  # the last KEEP_STORES + the current one stay open
