"""The agent's cheap looks, on both stores: ``get_and_stat`` (a full look: ``outcome`` and whether
``plan`` changed, one round trip on etcd) and the lease keepalive on a stream kept open."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from agent.etcd_store import EtcdStore, parse_endpoint
from agent.memory_store import MemoryStore
from agent.store import Store

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["memory", "etcd"])
def make(request: pytest.FixtureRequest):
    if request.param == "memory":
        return MemoryStore
    server = request.getfixturevalue("etcd_server")
    return lambda: EtcdStore(parse_endpoint(server.endpoint), retry_deadline=5.0)


def run(make, body) -> None:
    async def main() -> None:
        store: Store = make()
        try:
            await asyncio.wait_for(body(store, f"/tmrun-test/{uuid.uuid4().hex[:12]}/"), 15)
        finally:
            await store.close()

    asyncio.run(main())


def test_get_and_stat_reads_one_key_and_the_mod_revision_of_another(make) -> None:
    async def body(store: Store, prefix: str) -> None:
        entry, mod, revision = await store.get_and_stat(prefix + "outcome", prefix + "plan")
        assert entry is None and mod == 0 and revision >= 0
        plan_rev = await store.put(prefix + "plan", {"v": 1, "gen": 1})
        await store.put(prefix + "planned", {"v": 1})  # a key that starts like it is not it
        out_rev = await store.put(prefix + "outcome", {"v": 1, "state": "succeeded"})
        entry, mod, revision = await store.get_and_stat(prefix + "outcome", prefix + "plan")
        assert entry is not None and entry.value == {"v": 1, "state": "succeeded"} and entry.mod_revision == out_rev
        assert mod == plan_rev and revision == out_rev

    run(make, body)


def test_a_lease_kept_alive_many_times_then_revoked_reads_as_gone(make) -> None:
    async def body(store: Store, prefix: str) -> None:
        lease = await store.grant_lease(10)
        await store.put(prefix + "k", {"v": 1}, lease=lease)
        for _ in range(5):  # the same stream each time (etcd)
            assert 0 < await store.refresh_lease(lease) <= 10
        await store.revoke_lease(lease)
        assert await store.refresh_lease(lease) == 0
        assert await store.get(prefix + "k") is None
        other = await store.grant_lease(10)  # another lease on the same stream
        assert await store.refresh_lease(other) > 0

    run(make, body)


def test_a_keepalive_stream_that_ended_between_refreshes_is_opened_again(etcd_server) -> None:
    """etcd restarted between two refreshes ends the idle stream; the next refresh must not fail
    on it (gRPC raises InvalidStateError for a write on an ended call: it killed the agents)."""
    async def body() -> None:
        store = EtcdStore(parse_endpoint(etcd_server.endpoint), retry_deadline=5.0)
        try:
            lease = await store.grant_lease(10)
            assert await store.refresh_lease(lease) > 0
            client = next(iter(store._clients.values()))
            client._lease_stream.cancel()  # as when the connection drops while the stream is idle
            await asyncio.sleep(0.1)
            assert await store.refresh_lease(lease) > 0
            client._lease_stream.cancel()
            await asyncio.sleep(0.1)
            assert await store.refresh_lease(lease) > 0
        finally:
            await store.close()

    asyncio.run(asyncio.wait_for(body(), 15))
