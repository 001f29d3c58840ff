"""What ``tmrun status``, ``drain`` and ``events`` do, over the narrow store interface.

The functions here read and write the job's keys; the CLI turns their results into tables or
JSON (:mod:`tmrun.console`). ``status`` builds a stable, versioned JSON document that scripts can
rely on (documented in docs/cli.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, Callable

from agent.changes import Changes
from agent.errors import JobNotFound, RequestRejected, StoreError, TmrunError, UnknownNode
from agent.history import read_events
from agent.keys import JobKeys
from agent.records import REJOINS, NodeRecord, Outcome, Plan, Request, parse
from agent.store import Entry, Store

STATUS_SCHEMA = 1


async def status(store: Store, job: str) -> dict[str, Any]:
    """The job as a JSON-able document: generation, leader, and one row per node."""
    keys = JobKeys(job)
    entries, _ = await store.get_prefix(keys.root)
    if not entries:
        raise JobNotFound(f"no job {job!r} at {store.endpoint}")
    plan = parse(Plan, entries.get(keys.plan))
    outcome = parse(Outcome, entries.get(keys.outcome))
    leader = entries[keys.leader].value.get("node") if keys.leader in entries else None
    alive = _node_records(keys, entries)
    names = list(plan.members) if plan else []
    names += sorted(n for n in alive if n not in names)
    names += sorted(n for n in (plan.out if plan else {}) if n not in names)
    nodes = [_node_row(name, alive.get(name), plan, outcome is not None) for name in names]
    state = outcome.state if outcome else ("running" if plan else "starting")
    return {
        "v": STATUS_SCHEMA,
        "job": job,
        "endpoint": store.endpoint,
        "state": state,
        "outcome": outcome.to_dict() if outcome else None,
        "leader": leader if isinstance(leader, str) else None,
        "generation": plan.gen if plan else 0,
        "world_size": plan.world_size if plan else 0,
        "restarts": plan.restarts if plan else 0,
        "in_place_restarts": plan.in_place_restarts if plan else 0,
        "hot_swaps": plan.hot_swaps if plan else 0,
        "hot_swap": plan.hot if plan else False,
        "mode": plan.mode if plan else None,
        "standby_pool": sum(1 for row in nodes if row["role"] == "standby"),
        "nodes": nodes,
    }


def _node_row(name: str, rec: NodeRecord | None, plan: Plan | None, ended: bool) -> dict[str, Any]:
    run = rec.run_state if rec else None
    if ended and rec is None:
        role = "left"  # the job has ended and this node's agent is gone
    elif plan is not None and name in plan.out:
        reason = plan.out[name]
        if reason in REJOINS and rec is not None:
            if not plan.rejoined(name, rec.run_state):  # still stopping its workers
                role = "draining" if reason == "rejoining" else "cut-off"
            else:  # taken out for a cut link: a standby again once its agent reaches every member
                role = "cut-off" if reason == "link" and rec.unreachable else "standby"
        else:
            role = "draining" if reason == "drained" and rec is not None else reason
    elif plan is not None and name in plan.members:
        role = "active" if rec is not None else "lost"
    elif rec is not None:
        role = "standby" if plan is not None else "joining"
    else:
        role = "left"
    ranks: list[int] = []
    if plan is not None and name in plan.members:
        start = plan.rank_offset(name)
        ranks = list(range(start, start + plan.slots[name]))
    return {
        "node": name,
        "role": role,
        "host": rec.host if rec else None,
        "agent_pid": rec.pid if rec else None,
        "slots": rec.slots if rec else (plan.slots.get(name) if plan else None),
        "ranks": ranks,
        "generation": run.gen if run else None,
        "state": run.state if run else "gone",
        "exitcode": run.exitcode if run else None,
        "worker_pids": list(run.worker_pids) if run else [],
        "step": run.step if run else None,
        "step_time": run.step_time if run else None,
        "last_swap": run.last_swap if run else {},
        "metrics": f"http://{rec.metrics}/metrics" if rec and rec.metrics else None,
        "links": dict(rec.links) if rec else {},  # source node -> bytes/s measured into this node
        "unreachable": list(rec.unreachable) if rec else [],  # members its agent's link checks miss
    }


async def events(store: Store, job: str) -> list[dict[str, Any]]:
    """The job's events in time order; the same rows a finished job's history file holds."""
    return await read_events(store, job)


def _node_records(keys: JobKeys, entries: dict[str, Entry]) -> dict[str, NodeRecord]:
    """The node records that parse and name the node of their key; others are skipped (warned once)."""
    found = {}
    for key, entry in entries.items():
        name = keys.relative(key)[len("nodes/"):] if keys.relative(key).startswith("nodes/") else None
        rec = parse(NodeRecord, entry) if name else None
        if rec is not None and rec.node == name:
            found[name] = rec
    return found


async def known_nodes(store: Store, job: str) -> tuple[set[str], Plan | None]:
    names, plan, _, _ = _known(JobKeys(job), *await store.get_prefix(JobKeys(job).root))
    return names, plan


def _known(keys: JobKeys, entries: dict[str, Entry], revision: int) -> tuple[set[str], Plan | None,
                                                                             dict[str, Entry], int]:
    plan = parse(Plan, entries.get(keys.plan))
    names = set(_node_records(keys, entries))
    if plan is not None:
        names |= set(plan.members) | set(plan.out)
    return names, plan, entries, revision


async def drain(store: Store, job: str, node: str, *, wait: bool, timeout: float,
                progress: Callable[[str], None], rejoin: bool = False) -> str:
    """Ask the leader to drain ``node``; with ``wait``, return once the node has left the job
    (with ``rejoin``: once it stopped training and is back in the pool as a standby).

    One read of the job's keys before the request (the nodes, the plan, whether the job ended,
    and the revision the watch starts from); then the request's answer, the node's key and the
    plan come with the watch's events. After the watch was away they are read again, once."""
    keys = JobKeys(job)
    names, _, entries, revision = _known(keys, *await store.get_prefix(keys.root))
    if node not in names:
        listed = ", ".join(sorted(names)) or "none"
        raise UnknownNode(f"unknown node {node!r} in job {job} (nodes: {listed})")
    if parse(Outcome, entries.get(keys.outcome)) is not None:
        raise TmrunError(f"job {job} has already ended")
    request = Request(uuid.uuid4().hex[:12], "drain", node, time.time(), rejoin=rejoin)
    # What this command waits on: its request's answer, the node's key, the plan, the job's end.
    watched = [keys.request(request.id), keys.node(node), keys.plan, keys.outcome]
    changes = Changes(store, watched)
    await changes.start(revision + 1)
    known = {key: entries.get(key) for key in watched}
    reconnects = changes.reconnects

    async def current(key: str) -> Entry | None:
        """``key`` as the watch last delivered it (or as first read); read again after an outage."""
        event = changes.latest(key)
        if event is not None:
            known[key] = None if event.value is None else Entry(event.key, event.value, event.create_revision,
                                                                 event.revision)
        return known[key]

    try:
        await store.put(keys.request(request.id), request.to_dict())
        known[keys.request(request.id)] = None  # until the watch brings it back (answered or not)
        progress(f"drain {node}: requested (request {request.id})")
        deadline = time.monotonic() + timeout
        answered: Request | None = None
        while True:
            seen = changes.version
            ended = _ended(changes, keys)
            if ended is not None:  # from the watch: the job's etcd may stop right after the job ends
                if answered is None:
                    answered = parse(Request, await current(keys.request(request.id)))
                    if answered is None:
                        with contextlib.suppress(StoreError):
                            answered = parse(Request, await store.get(keys.request(request.id)))
                if answered is None or answered.state == "pending":
                    raise TmrunError(f"job {job} ended before the drain was answered")
                if answered.state == "rejected":
                    raise RequestRejected(answered.answer)
                progress(f"job {job} ended ({ended.state}) while {node} was leaving: {node} is out of it")
                return answered.answer
            if changes.reconnects != reconnects or not changes.connected:  # events may have been missed
                for key in watched:
                    known[key] = await store.get(key)
                reconnects = changes.reconnects
            current_request = parse(Request, await current(keys.request(request.id))) or request
            if answered is None and current_request.state != "pending":
                answered = current_request
                if current_request.state == "rejected":
                    raise RequestRejected(current_request.answer)
                progress(current_request.answer)
                if not wait:
                    return current_request.answer
            record = await current(keys.node(node))
            if answered is not None and record is None:
                progress(f"{node} has left the job")
                return answered.answer
            if answered is not None and rejoin and _back_in_pool(await current(keys.plan), record, node):
                progress(f"{node} is back in the pool as a standby")
                return answered.answer
            if answered is None and parse(Outcome, await current(keys.outcome)) is not None:
                raise TmrunError(f"job {job} ended before the drain was answered")
            left = deadline - time.monotonic()
            if left <= 0:
                what = "answered" if answered is None else "done"
                raise TmrunError(f"drain {node}: not {what} after {timeout:g} s")
            await changes.wait(seen, left)
    finally:
        await changes.close()


def _ended(changes: Changes, keys: JobKeys) -> Outcome | None:
    """The job's outcome, if the watch has seen it written."""
    event = changes.latest(keys.outcome)
    if event is None or event.value is None:
        return None
    return parse(Outcome, Entry(event.key, event.value, event.create_revision, event.revision))


def _back_in_pool(plan_entry: Entry | None, node_entry: Entry | None, node: str) -> bool:
    plan, rec = parse(Plan, plan_entry), parse(NodeRecord, node_entry)
    if plan is None or rec is None:
        return False
    return plan.rejoined(node, rec.run_state)


def run(coro):
    """Run one admin coroutine to completion (the CLI is synchronous)."""
    return asyncio.run(coro)
