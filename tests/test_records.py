"""Records read from etcd are checked field by field; readers skip a bad one with one warning.

The stores already drop values that are not JSON objects (tests/test_store_contract.py); here a
JSON object of the wrong version or shape goes through the leader's snapshot and ``tmrun status``
on the in-memory store, and is left out without an exception.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.errors import UnknownNode
from agent.keys import JobKeys
from agent.leader import read_cluster
from agent.memory_store import MemoryStore
from agent.records import NodeRecord, Outcome, Plan, RecordError, Request, RunState, parse
from agent.store import Entry
from tmrun import admin

pytestmark = pytest.mark.timeout(30)

JOB = "hostile"
KEYS = JobKeys(JOB)
GOOD_RUN = RunState(1, "running", rank=0, worker_pids=(11, 12), last_swap={"gen": 1, "stall": 0.5}).to_dict()
GOOD_NODE = {"v": 1, "node": "node-0", "host": "h", "pid": 7, "slots": 2, "run": GOOD_RUN}


@pytest.mark.parametrize(("value", "why"), [
    ({"v": 1}, "field 'node' is missing"),
    ({**GOOD_NODE, "v": 2}, "schema version 2"),
    ({**GOOD_NODE, "v": True}, "schema version True"),
    ({**GOOD_NODE, "slots": "2"}, "NodeRecord.slots: '2' is not int"),
    ({**GOOD_NODE, "slots": True}, "NodeRecord.slots: True is not int"),
    ({**GOOD_NODE, "slots": 0}, "not a positive number"),
    ({**GOOD_NODE, "pid": 1.5}, "NodeRecord.pid"),
    ({**GOOD_NODE, "node": ["node-0"]}, "NodeRecord.node"),
    ({**GOOD_NODE, "run": []}, "NodeRecord.run"),
    ({**GOOD_NODE, "run": {**GOOD_RUN, "gen": "1"}}, "RunState.gen"),
    ({**GOOD_NODE, "run": {**GOOD_RUN, "worker_pids": [1, "2"]}}, "RunState.worker_pids[]"),
    ({**GOOD_NODE, "run": {**GOOD_RUN, "exitcode": 1e300 * 10}}, "RunState.exitcode"),
    ({**GOOD_NODE, "run": {**GOOD_RUN, "last_swap": {"first_step_at": "noon"}}}, "last_swap['first_step_at']"),
    ({**GOOD_NODE, "links": {"node-1": "fast"}}, "NodeRecord.links['node-1']"),
    ({**GOOD_NODE, "links": {"node-1": -1.0}}, "the rate from 'node-1' is not"),
    ({**GOOD_NODE, "links": ["node-1"]}, "NodeRecord.links"),
])
def test_node_record_of_the_wrong_shape_is_refused(value: dict, why: str) -> None:
    with pytest.raises(RecordError, match=".*" + why.replace("[", r"\[").replace("]", r"\]")):
        NodeRecord.from_dict(value)


def test_records_round_trip_and_convert_lists() -> None:
    rec = NodeRecord.from_dict(GOOD_NODE)
    assert rec.run_state.worker_pids == (11, 12) and rec.run_state.last_swap == {"gen": 1, "stall": 0.5}
    plan = Plan(3, ("a", "b"), {"a": 1, "b": 2}, "h", 1, "a", joiners=("b",))
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.rank_owners() == ["a", "b", "b"] and [plan.rank_offset(m) for m in plan.members] == [0, 1]
    assert Plan.from_dict({**plan.to_dict(), "members": ["a", "b"], "created": 5}).created == 5.0
    for bad in ({"members": ["a", "c"]}, {"members": ["a", "a"]}, {"slots": {"a": 1, "b": -1}},
                {"out": {"a": 1}}, {"store_port": "1"}, {"members": ["a", 2]}, {"members": ["a", None]},
                {"slots": {"a": 1, "b": True}}, {"slots": {"a": 1, "b": 2.0}}, {"joiners": [["b"]]}):
        with pytest.raises(RecordError):
            Plan.from_dict({**plan.to_dict(), **bad})


def test_parse_skips_with_one_warning_per_key_and_revision(caplog: pytest.LogCaptureFixture) -> None:
    junk = Entry("/tmrun/j/nodes/x", {"v": 1}, 5, 5)
    with caplog.at_level(logging.WARNING, logger="tmrun.store"):
        assert [parse(NodeRecord, junk) for _ in range(3)] == [None] * 3
        assert parse(NodeRecord, Entry(junk.key, {"v": 1}, 5, 6)) is None
        assert parse(NodeRecord, None) is None
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["ignoring /tmrun/j/nodes/x (revision 5): NodeRecord: field 'node' is missing",
                      "ignoring /tmrun/j/nodes/x (revision 6): NodeRecord: field 'node' is missing"]


async def _hostile_job(store: MemoryStore) -> None:
    plan = Plan(1, ("node-0",), {"node-0": 2}, "h", 1, "node-0")
    await store.put(KEYS.plan, plan.to_dict())
    await store.put(KEYS.node("node-0"), GOOD_NODE)
    await store.put(KEYS.leader, {"v": 1, "node": ["not", "a", "name"]})
    await store.put_raw(KEYS.root + "junk", b"not json")
    await store.put(KEYS.node("x"), {"v": 1})  # wrong shape
    await store.put(KEYS.node("y"), {**GOOD_NODE, "node": "node-0"})  # claims another node's name
    await store.put(KEYS.request("r1"), {"v": 1, "id": 5})
    await store.put(KEYS.outcome, {"v": 1, "state": "succeeded"})  # no reason, no gen: not an outcome


def test_leader_snapshot_and_status_leave_bad_records_out() -> None:
    async def main() -> tuple:
        store = MemoryStore()
        await _hostile_job(store)
        entries, _ = await store.get_prefix(KEYS.root)
        cluster, plan_entry = read_cluster(KEYS, entries)
        doc = await admin.status(store, JOB)
        names, _ = await admin.known_nodes(store, JOB)
        return cluster, plan_entry, doc, names

    cluster, plan_entry, doc, names = asyncio.run(main())
    assert list(cluster.nodes) == ["node-0"] and cluster.requests == () and not cluster.finished
    assert cluster.plan.gen == 1 and plan_entry is not None
    assert doc["state"] == "running" and doc["leader"] is None
    assert [row["node"] for row in doc["nodes"]] == ["node-0"] and doc["nodes"][0]["worker_pids"] == [11, 12]
    assert names == {"node-0"}


def test_a_bad_request_or_outcome_does_not_stop_a_drain() -> None:
    async def main() -> None:
        store = MemoryStore()
        await _hostile_job(store)
        with pytest.raises(UnknownNode, match="unknown node 'x'"):
            await admin.drain(store, JOB, "x", wait=False, timeout=1.0, progress=lambda _: None)

    asyncio.run(main())
    assert parse(Outcome, Entry(KEYS.outcome, {"v": 1, "state": "failed", "reason": "r", "gen": 1}, 1, 1))
    assert parse(Request, Entry(KEYS.request("r"), {"v": 1, "id": "r", "kind": "drain", "node": "n",
                                                      "created": 1}, 1, 1))
