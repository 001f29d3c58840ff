"""``tmrun drain``'s wait (tmrun/admin.py) against a leader played by the test, on the in-memory store.

The case that matters here: the job ends after the drain was answered, while the node is still
leaving, and the job's etcd stops with it (as under SLURM, where it runs on the job's nodes).
The command must learn of the end from its watch and say the node is out, not fail on etcd.
"""

from __future__ import annotations

import asyncio

import pytest

from agent.errors import StoreUnavailable
from agent.keys import JobKeys
from agent.memory_store import MemoryStore
from agent.records import Plan, Request, parse
from agent.store import Entry
from tmrun import admin

pytestmark = pytest.mark.timeout(30)

JOB = "drain-test"
KEYS = JobKeys(JOB)
RUN = {"v": 1, "gen": 1, "state": "running", "worker_pids": [11]}


class StoppingStore(MemoryStore):
    """An in-memory etcd that stops answering for good once ``stop()`` was called (its watches end too)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    async def get(self, key: str) -> Entry | None:
        if self.stopped:
            raise StoreUnavailable("etcd at memory is unreachable")
        return await super().get(key)


async def _job(store: MemoryStore) -> None:
    await store.put(KEYS.plan, Plan(1, ("node-0", "node-1"), {"node-0": 1, "node-1": 1}, "h", 1, "node-0").to_dict())
    for name in ("node-0", "node-1", "node-2"):
        await store.put(KEYS.node(name), {"v": 1, "node": name, "host": "h", "pid": 7, "slots": 1, "run": RUN})


async def _first_request(store: MemoryStore) -> tuple[str, Request]:
    """The first drain request the command writes, as the leader's watch sees it."""
    _, revision = await store.stat(KEYS.plan)
    watch = await store.watch_prefix(KEYS.requests, start_revision=revision + 1)
    try:
        async for event in watch:
            if event.value is not None:
                return event.key, parse(Request, Entry(event.key, event.value, event.create_revision, event.revision))
    finally:
        await watch.cancel()
    raise AssertionError("the watch ended before a request came")


def test_a_job_that_ends_while_the_drained_node_leaves_ends_the_drain_with_success() -> None:
    said: list[str] = []

    async def main() -> str:
        store = StoppingStore()
        await _job(store)
        answered = asyncio.Event()

        def progress(line: str) -> None:
            said.append(line)
            if "takes its place" in line:
                answered.set()

        requested = asyncio.ensure_future(_first_request(store))
        drain = asyncio.ensure_future(admin.drain(store, JOB, "node-1", wait=True, timeout=20, progress=progress))
        key, request = await requested
        await store.put(key, {**request.to_dict(), "state": "accepted", "gen": 2,
                              "answer": "drain node-1: node-2 takes its place (hot swap)"})
        await answered.wait()
        await store.put(KEYS.outcome, {"v": 1, "state": "succeeded", "reason": "all done", "gen": 2})
        store.stop()  # the job's etcd goes with the job; node-1's key never went away
        return await drain

    assert asyncio.run(main()) == "drain node-1: node-2 takes its place (hot swap)"
    assert said[-1] == f"job {JOB} ended (succeeded) while node-1 was leaving: node-1 is out of it"


def test_a_job_that_ends_before_the_answer_fails_the_drain_in_one_line() -> None:
    async def main() -> None:
        store = StoppingStore()
        await _job(store)
        requested = asyncio.ensure_future(_first_request(store))
        drain = asyncio.ensure_future(admin.drain(store, JOB, "node-1", wait=True, timeout=20,
                                                  progress=lambda _: None))
        await requested  # pending: the leader never answers
        await store.put(KEYS.outcome, {"v": 1, "state": "succeeded", "reason": "all done", "gen": 1})
        await drain

    with pytest.raises(admin.TmrunError, match=f"^job {JOB} ended before the drain was answered$"):
        asyncio.run(main())
