"""One contract, two stores: MemoryStore and EtcdStore (against the session's real etcd).

Each test body is a coroutine run with ``asyncio.run`` under a deadline; the etcd store gets a
key prefix of its own per test, so tests never see each other's keys. Waiting is on watch events
with a timeout, never on sleeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import AsyncIterator, Awaitable, Callable

import pytest

from agent.errors import StoreCompacted, StoreError
from agent.etcd_store import EtcdStore, parse_endpoint
from agent.memory_store import MemoryStore
from agent.store import Event, Store, Watch

BODY_TIMEOUT = 15.0
EVENT_TIMEOUT = 5.0

pytestmark = pytest.mark.timeout(30)


@dataclasses.dataclass
class Backend:
    name: str
    make: Callable[[], Store]


@pytest.fixture(params=["memory", "etcd"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "memory":
        return Backend("memory", MemoryStore)
    server = request.getfixturevalue("etcd_server")
    return Backend("etcd", lambda: EtcdStore(parse_endpoint(server.endpoint), retry_deadline=5.0))


@pytest.fixture
def prefix() -> str:
    return f"/tmrun-test/{uuid.uuid4().hex[:12]}/"


def run(backend: Backend, body: Callable[[Store], Awaitable[None]]) -> None:
    async def main() -> None:
        store = backend.make()
        try:
            await asyncio.wait_for(body(store), BODY_TIMEOUT)
        finally:
            await store.close()

    asyncio.run(main())


async def take(events: AsyncIterator[Event], n: int, timeout: float = EVENT_TIMEOUT) -> list[Event]:
    """The next ``n`` events, or fail after ``timeout`` seconds."""
    return [await asyncio.wait_for(anext(events), timeout) for _ in range(n)]


def brief(events: list[Event]) -> list[tuple]:
    return [(e.kind, e.key, e.value) for e in events]


# -- keys and revisions ------------------------------------------------------------------------


def test_put_get_and_revisions(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        assert await store.get(prefix + "a") is None
        rev1 = await store.put(prefix + "a", {"n": 1, "s": "x"})
        rev2 = await store.put(prefix + "a", {"n": 2})
        assert rev2 == rev1 + 1
        entry = await store.get(prefix + "a")
        assert entry.key == prefix + "a"
        assert entry.value == {"n": 2}
        assert (entry.create_revision, entry.mod_revision, entry.lease) == (rev1, rev2, 0)

    run(backend, body)


def test_values_round_trip_through_json(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        value = {"t": (1, 2), "nested": {"b": [1, {"c": None}]}, "f": 1.5}
        await store.put(prefix + "v", value)
        value["nested"]["b"].append("mutated after put")
        assert (await store.get(prefix + "v")).value == {"t": [1, 2], "nested": {"b": [1, {"c": None}]}, "f": 1.5}
        with pytest.raises(TypeError):
            await store.put(prefix + "bad", ["not", "a", "dict"])

    run(backend, body)


JUNK = {
    "text": b"not json",
    "list": b"[1, 2]",
    "number": b"42",
    "nan": b'{"x": NaN}',
    "overflow": b'{"x": 1e999}',
    "latin1": b'{"x": "\xe9"}',
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "empty": b"",
}


def test_values_that_are_not_json_objects_are_skipped_with_one_warning(
        backend: Backend, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    async def body(store: Store) -> None:
        first = await store.put(prefix + "a", {"n": 1})
        for name, data in JUNK.items():
            await store.put_raw(prefix + name, data)
        await store.put(prefix + "z", {"n": 2})
        for _ in range(2):  # a loop reads the same junk again: no second warning
            for name in JUNK:
                assert await store.get(prefix + name) is None
            entries, _ = await store.get_prefix(prefix)
            assert sorted(entries) == [prefix + "a", prefix + "z"]
        watch = await store.watch_prefix(prefix, start_revision=first)
        events = aiter(watch)
        assert brief(await take(events, 2)) == [("put", prefix + "a", {"n": 1}), ("put", prefix + "z", {"n": 2})]
        await store.put_raw(prefix + "text", b"still not json")
        await store.put(prefix + "text", {"n": 3})  # the same key, a good value again: the watch is alive
        assert brief(await take(events, 1)) == [("put", prefix + "text", {"n": 3})]
        assert (await store.get(prefix + "text")).value == {"n": 3}
        await watch.cancel()
        with pytest.raises(ValueError):
            await store.put(prefix + "bad", {"x": float("nan")})  # nothing unreadable is written

    with caplog.at_level(logging.WARNING, logger="tmrun.store"):
        run(backend, body)
    warned = [r.getMessage() for r in caplog.records if r.name == "tmrun.store"]
    for name in JUNK:  # "text" was junk at two revisions: two warnings
        assert sum(f"ignoring {prefix}{name} " in line for line in warned) == (2 if name == "text" else 1), warned
    assert len(warned) == len(JUNK) + 1 and all("\n" not in line for line in warned)


def test_get_prefix_returns_entries_and_revision(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        await store.put(prefix + "x/1", {"i": 1})
        last = await store.put(prefix + "x/2", {"i": 2})
        await store.put(prefix + "y", {"i": 3})
        entries, revision = await store.get_prefix(prefix + "x/")
        assert sorted(entries) == [prefix + "x/1", prefix + "x/2"]
        assert entries[prefix + "x/2"].value == {"i": 2}
        assert revision >= last + 1  # read after the third put
        assert (await store.get_prefix(prefix + "nothing/"))[0] == {}

    run(backend, body)


def test_stat_gives_the_key_s_mod_revision_and_the_store_s_revision(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        first = await store.put(prefix + "plan", {"gen": 1})
        await store.put(prefix + "planned", {"other": True})  # a longer key with the same start is another key
        assert await store.stat(prefix + "plan") == (first, first + 1)
        later = await store.put(prefix + "plan", {"gen": 2})
        assert await store.stat(prefix + "plan") == (later, later)
        assert await store.stat(prefix + "absent") == (0, later)
        assert await store.keys(prefix + "plan") == [prefix + "plan", prefix + "planned"]
        assert await store.keys(prefix + "none/") == []

    run(backend, body)


def test_create_only_if_absent(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        assert await store.create(prefix + "c", {"who": "first"}) is True
        assert await store.create(prefix + "c", {"who": "second"}) is False
        assert (await store.get(prefix + "c")).value == {"who": "first"}
        await store.delete(prefix + "c")
        assert await store.create(prefix + "c", {"who": "third"}) is True

    run(backend, body)


def test_replace_is_compare_and_set(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        key = prefix + "plan"
        assert await store.replace(key, {"gen": 1}, mod_revision=0) is True  # 0: only if absent
        assert await store.replace(key, {"gen": 9}, mod_revision=0) is False
        entry = await store.get(key)
        assert await store.replace(key, {"gen": 2}, mod_revision=entry.mod_revision) is True
        assert await store.replace(key, {"gen": 3}, mod_revision=entry.mod_revision) is False  # stale
        now = await store.get(key)
        assert now.value == {"gen": 2}
        assert now.create_revision == entry.create_revision
        assert now.mod_revision > entry.mod_revision

    run(backend, body)


def test_delete_and_delete_prefix(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        await store.put(prefix + "d", {})
        assert await store.delete(prefix + "d") is True
        assert await store.delete(prefix + "d") is False
        assert await store.get(prefix + "d") is None
        for i in range(3):
            await store.put(f"{prefix}many/{i}", {"i": i})
        await store.put(prefix + "manyother", {})
        assert await store.delete_prefix(prefix + "many/") == 3
        assert await store.delete_prefix(prefix + "many/") == 0
        assert list((await store.get_prefix(prefix))[0]) == [prefix + "manyother"]

    run(backend, body)


# -- leases ------------------------------------------------------------------------------------


def test_lease_revoke_deletes_bound_keys_and_watch_sees_it(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        lease = await store.grant_lease(30)
        assert await store.refresh_lease(lease) > 0
        rev = await store.put(prefix + "node/a", {"role": "active"}, lease=lease)
        await store.put(prefix + "node/b", {"role": "standby"}, lease=lease)
        await store.put(prefix + "plain", {})
        assert (await store.get(prefix + "node/a")).lease == lease
        watch = await store.watch_prefix(prefix, start_revision=rev + 2)
        events = aiter(watch)
        assert brief(await take(events, 1)) == [("put", prefix + "plain", {})]

        await store.revoke_lease(lease)
        deletes = await take(events, 2)
        assert sorted(brief(deletes)) == [("delete", prefix + "node/a", None), ("delete", prefix + "node/b", None)]
        assert deletes[0].revision == deletes[1].revision  # one revision for the whole revocation
        assert await store.get(prefix + "node/a") is None
        assert await store.get(prefix + "plain") is not None
        assert await store.refresh_lease(lease) == 0
        await store.revoke_lease(lease)  # unknown leases are ignored
        with pytest.raises(StoreError):
            await store.put(prefix + "late", {}, lease=lease)
        await watch.cancel()

    run(backend, body)


def test_lease_expires_by_ttl_on_fake_clock(prefix: str) -> None:
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])

    async def body() -> None:
        lease = await store.grant_lease(10)
        rev = await store.put(prefix + "k", {"v": 1}, lease=lease)
        watch = await store.watch_prefix(prefix, start_revision=rev + 1)
        now[0] += 9
        assert await store.refresh_lease(lease) == 10  # kept alive: deadline moves to 1019
        now[0] += 9.5
        assert store.expire_leases() == []
        now[0] += 0.5
        assert store.expire_leases() == [lease]
        [event] = await take(aiter(watch), 1)
        assert (event.kind, event.key, event.revision) == ("delete", prefix + "k", rev + 1)
        assert await store.refresh_lease(lease) == 0

        lazy = await store.grant_lease(5)
        await store.put(prefix + "lazy", {}, lease=lazy)
        now[0] += 5
        assert await store.get(prefix + "lazy") is None  # reaped by the read itself
        await store.close()

    asyncio.run(asyncio.wait_for(body(), BODY_TIMEOUT))


@pytest.mark.timeout(20)
def test_lease_expires_by_real_ttl_on_etcd(etcd_server, prefix: str) -> None:
    async def body(store: Store) -> None:
        lease = await store.grant_lease(2)
        rev = await store.put(prefix + "short", {"v": 1}, lease=lease)
        watch = await store.watch_prefix(prefix, start_revision=rev + 1)
        [event] = await take(aiter(watch), 1, timeout=8.0)  # etcd checks expiry every 500 ms
        assert (event.kind, event.key) == ("delete", prefix + "short")
        assert await store.refresh_lease(lease) == 0
        await watch.cancel()

    run(Backend("etcd", lambda: EtcdStore(parse_endpoint(etcd_server.endpoint))), body)


# -- watches -----------------------------------------------------------------------------------


def test_watch_from_start_revision_replays_history(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        first = await store.put(prefix + "a", {"n": 1})
        await store.put(prefix + "b", {"n": 2})
        await store.delete(prefix + "a")
        await store.put(prefix + "elsewhere", {})  # under the prefix too, but watched below
        await store.put("/outside" + prefix, {"n": 0})
        watch = await store.watch_prefix(prefix + "a", start_revision=first)
        events = aiter(watch)
        replayed = await take(events, 2)
        assert brief(replayed) == [("put", prefix + "a", {"n": 1}), ("delete", prefix + "a", None)]
        assert replayed[0].revision == first
        assert replayed[1].revision == first + 2

        live_rev = await store.put(prefix + "a", {"n": 3})
        [live] = await take(events, 1)
        assert (live.kind, live.value, live.revision) == ("put", {"n": 3}, live_rev)
        await watch.cancel()
        await store.delete("/outside" + prefix)

    run(backend, body)


def test_watch_cancel_ends_iteration(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        _, revision = await store.get_prefix(prefix)
        watch = await store.watch_prefix(prefix, start_revision=revision + 1)
        seen: list[Event] = []
        arrived = asyncio.Event()

        async def consume() -> None:
            async for event in watch:
                seen.append(event)
                arrived.set()

        consumer = asyncio.create_task(consume())
        await store.put(prefix + "one", {})
        await asyncio.wait_for(arrived.wait(), EVENT_TIMEOUT)
        await watch.cancel()
        await asyncio.wait_for(consumer, EVENT_TIMEOUT)  # iteration ended cleanly
        assert brief(seen) == [("put", prefix + "one", {})]
        await watch.cancel()  # idempotent

    run(backend, body)


def test_watches_are_independent(backend: Backend, prefix: str) -> None:
    """Several watches at once each get their events, and cancelling one leaves the others going."""
    async def body(store: Store) -> None:
        _, revision = await store.get_prefix(prefix)
        watches = [await store.watch_prefix(prefix + key, start_revision=revision + 1) for key in ("a", "b", "a")]
        streams = [aiter(w) for w in watches]
        await store.put(prefix + "a", {"n": 1})
        await store.put(prefix + "b", {"n": 2})
        assert brief(await take(streams[0], 1)) == [("put", prefix + "a", {"n": 1})]
        assert brief(await take(streams[1], 1)) == [("put", prefix + "b", {"n": 2})]
        await watches[0].cancel()
        await store.put(prefix + "a", {"n": 3})
        assert [e.value for e in await take(streams[2], 2)] == [{"n": 1}, {"n": 3}]
        for watch in watches[1:]:
            await watch.cancel()

    run(backend, body)


def test_close_ends_watches_and_refuses_operations(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        rev = await store.put(prefix + "k", {})
        watch: Watch = await store.watch_prefix(prefix, start_revision=rev)
        consumer = asyncio.create_task(_collect(watch))
        await store.close()
        await store.close()  # idempotent
        await asyncio.wait_for(consumer, EVENT_TIMEOUT)
        with pytest.raises(StoreError):
            await store.get(prefix + "k")

    run(backend, body)


async def _collect(watch: Watch) -> list[Event]:
    return [event async for event in watch]


def test_watch_from_compacted_revision_raises(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        first = await store.put(prefix + "k", {"n": 1})
        last = await store.put(prefix + "k", {"n": 2})
        await store.compact(last)
        watch = await store.watch_prefix(prefix, start_revision=first)
        with pytest.raises(StoreCompacted) as caught:
            await take(aiter(watch), 1)
        assert caught.value.compacted_revision >= last
        ok = await store.watch_prefix(prefix, start_revision=last)
        assert brief(await take(aiter(ok), 1)) == [("put", prefix + "k", {"n": 2})]
        await ok.cancel()

    run(backend, body)


def test_rejects_start_revision_below_one_and_empty_prefixes(backend: Backend, prefix: str) -> None:
    async def body(store: Store) -> None:
        with pytest.raises(ValueError):
            await store.watch_prefix(prefix, start_revision=0)
        with pytest.raises(ValueError):
            await store.watch_prefix("", start_revision=1)
        with pytest.raises(ValueError):
            await store.get_prefix("")
        with pytest.raises(ValueError):
            await store.delete_prefix("")

    run(backend, body)
