"""A control-plane simulation: N node agents' real control loops against one real etcd.

Each simulated node is a real :class:`agent.node.NodeAgent` (its follower, its leader, its
keepalive, its watchdog) in one process and one event loop; only its workers are stand-ins
(:class:`StandInGroup`): no processes, they answer the agent's messages the way the runtime's
workers do (``hello``; ``ready`` and ``switched`` on ``prepare``; ``switched`` with ``left`` on
``leave``, then exit 0) and say ``progress`` once a second. The agents of one process share a few
etcd connections (:class:`CountingStore`, which also counts their requests by kind); what etcd
itself served is read from its ``/metrics``. With ``processes`` > 1 the agents are split into
shards (:class:`Shard`), the others each in a ``python -m tests.control_plane_sim`` process that
sends what its agents do as JSON lines (:func:`serve`); a :class:`Board` gathers it.

:func:`simulate` runs one job of ``nodes`` agents (``standbys`` of them standbys, ``slots`` ranks
each) through: rendezvous to the first plan, a steady state, ``drains`` drains (each hot-swaps a
standby in), a second steady state, and the job's end, and returns what it measured.
``bench/control_plane_scale.py`` runs it for N = 10, 100, 1000; tests/test_control_plane_sim.py
runs a small one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import re
import statistics
import time
import urllib.request
import uuid
from pathlib import Path
import sys
from typing import Any, Callable

from agent.config import AgentConfig, Timeouts, WorkerSpec
from agent.keys import JobKeys
from agent.node import NodeAgent
from agent.records import Outcome, Plan, Request, parse
from agent.store import Store
from agent.workers import GroupResult

REPO = Path(__file__).resolve().parents[1]
STEP_TIME = 0.1  # the stand-ins' job: 10 steps a second
FIRST_PID = 10_000_000  # stand-in process ids: never a real one on this machine's pid_max


class CountingStore:
    """One etcd connection shared by several agents; counts requests per agent and kind.

    ``close()`` does nothing: the simulation closes the real store once every agent is done.
    """

    def __init__(self, store: Store, counts: collections.Counter) -> None:
        self._store = store
        self._counts = counts
        self.endpoint = store.endpoint

    def __getattr__(self, name: str):
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def counted(*args, **kwargs):
            self._counts[name] += 1
            return method(*args, **kwargs)
        return counted

    async def close(self) -> None:
        pass


class StandInChannel:
    """Takes the place of the agent's Unix socket: messages go to the stand-in group."""

    path = "stand-in"

    def __init__(self) -> None:
        self.group: StandInGroup | None = None

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def forget(self, pids) -> None:
        pass

    def connected(self, pid: int) -> bool:
        """Whether the stand-in worker ``pid`` still holds its connection (until its group ends)."""
        return self.group is not None and pid in self.group.running

    def send(self, pid: int, kind: str, **fields: Any) -> None:
        if self.group is not None and pid in self.group.pids:
            self.group.on_message(pid, kind, fields)


class StandInGroup:
    """A node's workers without processes: they answer the agent like the runtime's workers."""

    def __init__(self, agent: SimAgent, pids: tuple[int, ...], active: bool) -> None:
        self._agent = agent
        self._pids = pids
        self._active = active
        self._gen = 0
        self._done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._ticker: asyncio.Task | None = None

    @property
    def pids(self) -> tuple[int, ...]:
        return self._pids

    @property
    def running(self) -> tuple[int, ...]:
        return () if self._done.done() else self._pids

    async def start(self) -> None:
        for pid in self._pids:
            self._say(pid, "hello")
        self._ticker = asyncio.ensure_future(self._tick())

    def renumber(self, first_rank: int) -> None:
        pass

    async def wait(self) -> GroupResult:
        return await self._done

    async def stop(self) -> None:
        self._end(GroupResult("stopped"))

    def kill_hung(self) -> None:
        self._end(GroupResult("failed", -9, None))

    def finish(self) -> None:
        """The script's last step: every worker exits 0."""
        self._end(GroupResult("succeeded", 0, None))

    def on_message(self, pid: int, kind: str, fields: dict) -> None:
        gen = int(fields.get("gen", 0))
        if kind == "prepare":  # the next group is built at once; the switch follows
            self._say(pid, "ready", gen=gen)
            self._say(pid, "switched", gen=gen, step=_step(), stall=0.0, bytes_received=0)
            self._active, self._gen = True, gen
            if pid == self._pids[0]:  # the runtime reports the first step after a switch at once
                self._say(pid, "progress", step=_step() + 1, step_time=STEP_TIME, gen=gen)
        elif kind == "leave":
            self._say(pid, "switched", gen=gen, step=_step(), stall=0.0, left=True, rejoin=bool(fields.get("rejoin")))
            if pid == self._pids[-1] and not fields.get("rejoin"):
                asyncio.get_running_loop().call_soon(self.finish)

    def _say(self, pid: int, kind: str, **fields: Any) -> None:
        """Deliver on the next turn of the loop, as a socket would (never inside the agent's send)."""
        message = {"v": 1, "type": kind, **fields}
        asyncio.get_running_loop().call_soon(self._agent._on_worker_message, pid, message)

    async def _tick(self) -> None:
        while not self._done.done():
            await asyncio.sleep(1.0)
            for pid in self._pids:  # each worker's thread says it lives, whatever it does
                self._say(pid, "alive")
            if self._active:
                self._say(self._pids[0], "progress", step=_step(), step_time=STEP_TIME, gen=self._gen)

    def _end(self, result: GroupResult) -> None:
        if not self._done.done():
            self._done.set_result(result)
        if self._ticker is not None:
            self._ticker.cancel()


def _step() -> int:
    return int(time.monotonic() / STEP_TIME)


def _tcp_store(host: str):
    from torch.distributed import TCPStore

    return TCPStore(host, 0, is_master=True, wait_for_workers=False)


class InProcessStores:
    """The leader's TCPStores made in this process (a thread each), not in a child per agent:
    a simulation runs up to 1,000 agents in one process."""

    def __init__(self, host: str) -> None:
        self._host = host
        self._stores: dict[int, Any] = {}

    async def start(self) -> None:
        pass

    async def open(self) -> int:
        store = await asyncio.to_thread(_tcp_store, self._host)  # torch's first import in a thread too
        self._stores[store.port] = store
        return store.port

    async def close(self, port: int) -> None:
        self._stores.pop(port, None)

    async def stop(self) -> None:
        self._stores.clear()


class SimAgent(NodeAgent):
    """A real node agent whose workers are stand-ins; it says (``notify``) when its watch brought
    each generation's plan (``delivered``), when it acted on it (``seen``) and when it first had
    workers. Times are wall-clock: shards in several processes compare them."""

    def __init__(self, cfg: AgentConfig, store, first_pid: int, notify: Callable[[dict], None]) -> None:
        super().__init__(cfg, store)
        self._channel = StandInChannel()
        self._first_pid = first_pid
        self._notify = notify
        self._gens: set[tuple[str, int]] = set()
        plan_key = self._keys.plan

        def on_event(event) -> None:
            if event.key == plan_key and event.value is not None and isinstance(event.value.get("gen"), int):
                self._once("delivered", event.value["gen"])
        self._changes.on_event = on_event

    def _once(self, kind: str, gen: int) -> None:
        if (kind, gen) not in self._gens:
            self._gens.add((kind, gen))
            self._notify({"kind": kind, "node": self.cfg.node, "gen": gen, "t": time.time()})

    @property
    def group(self) -> StandInGroup | None:
        return self._group  # type: ignore[return-value]

    @property
    def member(self) -> bool:
        return self._plan is not None and self.cfg.node in self._plan.members

    async def _reconcile(self, plan: Plan) -> bool:
        self._once("seen", plan.gen)
        return await super()._reconcile(plan)

    def _store_host(self) -> InProcessStores:  # type: ignore[override]
        return InProcessStores(self.cfg.host)

    async def _spawn(self, plan: Plan, standby: bool, offset: int) -> StandInGroup:  # type: ignore[override]
        n = self.cfg.worker.nproc_per_node
        self._first_pid += n  # a new group has new process ids
        group = StandInGroup(self, tuple(range(self._first_pid, self._first_pid + n)), active=not standby)
        self._channel.group = group
        await group.start()
        self._once("workers", 0)
        return group


@dataclasses.dataclass
class ShardSpec:
    """Which of a simulated job's agents one process runs (``first`` to ``last``, exclusive)."""

    endpoint: str
    job: str
    nodes: int
    standbys: int
    slots: int
    lease_ttl: int
    first: int
    last: int
    ramp: float = 0.0
    connections: int = 8


class Shard:
    """Runs agents ``spec.first`` … ``spec.last - 1``, telling ``notify`` what they do."""

    def __init__(self, spec: ShardSpec, notify: Callable[[dict], None]) -> None:
        from agent.etcd_store import EtcdStore, parse_endpoint

        self.spec = spec
        self.counts: collections.Counter = collections.Counter()
        count = spec.last - spec.first
        self.stores = [EtcdStore(parse_endpoint(spec.endpoint)) for _ in range(max(1, min(spec.connections, count)))]
        members = spec.nodes - spec.standbys
        worker = WorkerSpec(("stand-in",), nproc_per_node=spec.slots)
        self.agents = [
            SimAgent(AgentConfig(job_id=spec.job, node=f"node-{i:04d}", host="127.0.0.1", endpoint=spec.endpoint,
                                 worker=worker, min_nodes=members, max_nodes=members, standby_hint=i >= members,
                                 timeouts=Timeouts(lease_ttl=spec.lease_ttl)),
                     CountingStore(self.stores[i % len(self.stores)], self.counts), FIRST_PID + i * 4096, notify)
            for i in range(spec.first, spec.last)]
        self.tasks: list[asyncio.Task] = []
        self._notify = notify

    async def start(self) -> None:
        for agent in self.agents:  # started over ``ramp`` seconds, as nodes of a batch job come up
            task = asyncio.ensure_future(agent.run())
            task.add_done_callback(lambda t, node=agent.cfg.node: self._notify(
                {"kind": "exit", "node": node, "code": _code(t)}))
            self.tasks.append(task)
            if self.spec.ramp:
                await asyncio.sleep(self.spec.ramp / self.spec.nodes)

    def finish(self) -> None:
        """The script's last step on every member here: its workers exit 0."""
        for agent in self.agents:
            if agent.group is not None and agent.member:
                agent.group.finish()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for store in self.stores:
            await store.close()


def _code(task: asyncio.Task) -> Any:
    """An agent's exit code, or what ended it otherwise."""
    if task.cancelled():
        return "cancelled"
    return task.result() if task.exception() is None else repr(task.exception())


async def serve(spec: ShardSpec) -> None:
    """A shard in its own process: notes on stdout (JSON lines), commands on stdin (``finish``)."""
    loop = asyncio.get_running_loop()
    shard = Shard(spec, lambda note: print(json.dumps(note), flush=True))
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def counts() -> None:
        while True:
            await asyncio.sleep(0.5)
            print(json.dumps({"kind": "counts", "shard": spec.first, "counts": dict(shard.counts)}), flush=True)
    ticker = asyncio.ensure_future(counts())
    await shard.start()
    try:
        while True:
            line = (await reader.readline()).decode().strip()
            if line == "finish":
                shard.finish()
            elif line in ("", "stop"):
                break
            if all(task.done() for task in shard.tasks):
                break
    finally:
        ticker.cancel()
        print(json.dumps({"kind": "counts", "shard": spec.first, "counts": dict(shard.counts)}), flush=True)
        await shard.close()


class Board:
    """What every simulated agent did, from every shard's notes."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, float]] = collections.defaultdict(dict)  # gen -> node -> time
        self.delivered: dict[int, dict[str, float]] = collections.defaultdict(dict)
        self.workers: set[str] = set()
        self.exits: dict[str, Any] = {}
        self._counts: dict[int, dict[str, int]] = {}
        self.changed = asyncio.Event()

    def note(self, note: dict) -> None:
        kind = note["kind"]
        if kind in ("seen", "delivered"):
            getattr(self, kind)[note["gen"]].setdefault(note["node"], note["t"])
        elif kind == "workers":
            self.workers.add(note["node"])
        elif kind == "exit":
            self.exits[note["node"]] = note["code"]
        elif kind == "counts":
            self._counts[note["shard"]] = note["counts"]

    def counts(self, local: collections.Counter) -> collections.Counter:
        total = collections.Counter(local)
        for shard in self._counts.values():
            total.update(shard)
        return total


@dataclasses.dataclass
class Traffic:
    """What etcd served in a window, per second."""

    requests: float
    bytes_in: float
    bytes_out: float
    by_kind: dict[str, float]


def etcd_counters(metrics_url: str) -> dict[str, float]:
    """Requests started and bytes in and out, from etcd's Prometheus metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = collections.Counter()
    for line in text.splitlines():
        match = re.match(r"(grpc_server_started_total|etcd_network_client_grpc_received_bytes_total|"
                         r"etcd_network_client_grpc_sent_bytes_total)(\{[^}]*\})? ([0-9.e+]+)$", line)
        if match:
            found[match.group(1)] += float(match.group(3))
    return {"requests": found["grpc_server_started_total"],
            "bytes_in": found["etcd_network_client_grpc_received_bytes_total"],
            "bytes_out": found["etcd_network_client_grpc_sent_bytes_total"]}


async def measure(metrics_url: str, counts: Callable[[], collections.Counter], window: float) -> Traffic:
    before, kinds = etcd_counters(metrics_url), counts()
    started = time.monotonic()
    await asyncio.sleep(window)
    after, now, elapsed = etcd_counters(metrics_url), counts(), time.monotonic() - started
    by_kind = {k: round((now[k] - kinds[k]) / elapsed, 1) for k in now if now[k] != kinds[k]}
    return Traffic(round((after["requests"] - before["requests"]) / elapsed, 1),
                   round((after["bytes_in"] - before["bytes_in"]) / elapsed),
                   round((after["bytes_out"] - before["bytes_out"]) / elapsed), by_kind)


async def _until(check, timeout: float, what: str, every: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the simulation waited {timeout:g} s for {what}")
        await asyncio.sleep(every)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def simulate(endpoint: str, metrics_url: str, nodes: int, *, standbys: int = 2, slots: int = 8,
                   drains: int = 2, window: float = 10.0, job: str | None = None, processes: int = 1,
                   lease_ttl: int = Timeouts.lease_ttl, ramp: float = 0.0, timeout: float = 300.0) -> dict[str, Any]:
    """Run one simulated job, its agents in ``processes`` processes (this one runs the first
    share); returns its measurements (see the module's docstring)."""
    from agent.etcd_store import EtcdStore, parse_endpoint
    from torch.distributed import TCPStore  # noqa: F401  (the leader's first generation imports it: not timed)

    _quiet()
    job = job or f"sim-{uuid.uuid4().hex[:8]}"
    keys = JobKeys(job)
    bounds = [round(nodes * i / processes) for i in range(processes + 1)]
    specs = [ShardSpec(endpoint, job, nodes, standbys, slots, lease_ttl, bounds[i], bounds[i + 1], ramp)
             for i in range(processes)]
    board = Board()
    admin = EtcdStore(parse_endpoint(endpoint))
    children: list[asyncio.subprocess.Process] = []
    readers: list[asyncio.Task] = []
    local = Shard(specs[0], board.note)
    result: dict[str, Any] = {"nodes": nodes, "standbys": standbys, "slots": slots, "lease_ttl": lease_ttl,
                              "ramp_s": ramp, "processes": processes}

    async def read(child: asyncio.subprocess.Process) -> None:
        async for line in child.stdout:
            if line.startswith(b"{"):
                board.note(json.loads(line))

    def counts() -> collections.Counter:
        return board.counts(local.counts)

    started = time.time()
    try:
        for spec in specs[1:]:
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.control_plane_sim", json.dumps(dataclasses.asdict(spec)),
                cwd=str(REPO), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            children.append(child)
            readers.append(asyncio.ensure_future(read(child)))
        await local.start()
        await _until(lambda: len(board.seen[1]) == nodes, timeout, "every agent to act on the first plan")
        plan = parse(Plan, await admin.get(keys.plan))
        result["rendezvous_plan_s"] = round(plan.created - started, 3)
        result["rendezvous_all_s"] = round(max(board.seen[1].values()) - started, 3)
        result["rendezvous_delivered_s"] = round(max(board.delivered[1].values(), default=0.0) - started, 3)
        await _until(lambda: len(board.workers) == nodes, timeout, "every node's workers")
        await asyncio.sleep(3.0)  # the first reports and the swap events settle
        result["steady"] = dataclasses.asdict(await measure(metrics_url, counts, window))
        acted: list[float] = []
        written: list[float] = []  # request -> the leader wrote the plan
        delivered: list[float] = []  # request -> the plan's watch event reached each agent
        for index in range(drains):
            plan = parse(Plan, await admin.get(keys.plan))
            leader = (await admin.get(keys.leader)).value["node"]
            target = next(m for m in plan.members if m != leader)
            request = Request(uuid.uuid4().hex[:12], "drain", target, time.time())
            await admin.put(keys.request(request.id), request.to_dict())
            nxt = plan.gen + 1
            await _until(lambda: board.seen[nxt], timeout, f"drain {index + 1}'s plan")
            after = parse(Plan, await admin.get(keys.plan))
            written.append(after.created - request.created)
            told = [*after.members, target]
            await _until(lambda: all(n in board.seen[nxt] for n in told), timeout, f"drain {index + 1}'s plan everywhere")
            acted += [board.seen[nxt][n] - request.created for n in told]
            delivered += [board.delivered[nxt].get(n, board.seen[nxt][n]) - request.created for n in told]
            await _until(lambda: target in board.exits, timeout, f"{target} to leave")
            deadline = time.monotonic() + timeout
            while not any(e.value.get("kind") == "swap" and e.value.get("gen") == nxt
                          for e in (await admin.get_prefix(keys.events))[0].values()):
                if time.monotonic() > deadline:  # the swap is over once every member trained a step in it
                    raise TimeoutError(f"the simulation waited {timeout:g} s for drain {index + 1}'s swap to end")
                await asyncio.sleep(0.05)
        if drains:
            result["drain_ms"] = {"p50": round(1000 * statistics.median(acted), 1),
                                  "p99": round(1000 * _percentile(acted, 0.99), 1),
                                  "max": round(1000 * max(acted), 1), "samples": len(acted),
                                  "delivered_p50": round(1000 * statistics.median(delivered), 1),
                                  "delivered_p99": round(1000 * _percentile(delivered, 0.99), 1),
                                  "plan_written": [round(1000 * w, 1) for w in written]}
        await asyncio.sleep(3.0)
        result["steady_later"] = dataclasses.asdict(await measure(metrics_url, counts, window))
        entries, _ = await admin.get_prefix(keys.root)
        result["prefix_keys"] = len(entries)
        result["prefix_bytes"] = sum(len(k) + len(json.dumps(e.value, separators=(",", ":"))) for k, e in entries.items())
        result["largest_record_bytes"] = max(len(json.dumps(e.value, separators=(",", ":"))) for e in entries.values())
        ending = time.monotonic()
        local.finish()
        for child in children:
            child.stdin.write(b"finish\n")
            await child.stdin.drain()
        await _until(lambda: len(board.exits) == nodes, timeout, "every agent to leave", every=0.05)
        result["end_s"] = round(time.monotonic() - ending, 3)
        outcome = parse(Outcome, await admin.get(keys.outcome))
        result["outcome"] = outcome.state if outcome else None
        result["exit_codes"] = dict(collections.Counter(board.exits.values()))
    finally:
        await local.close()
        for child in children:
            if child.returncode is None:
                with contextlib.suppress(ConnectionError):
                    child.stdin.write(b"stop\n")
                    await child.stdin.drain()
                try:
                    await asyncio.wait_for(child.wait(), 30)
                except asyncio.TimeoutError:
                    child.kill()
                    await child.wait()
        await asyncio.gather(*readers, return_exceptions=True)
        try:
            await admin.delete_prefix(keys.root)
        finally:
            await admin.close()
    return result


def _quiet() -> None:
    for name in ("tmrun.agent", "tmrun.leader", "tmrun.etcd", "tmrun.skipped"):
        logging.getLogger(name).setLevel(logging.WARNING)


if __name__ == "__main__":  # one shard of a simulated job: python -m tests.control_plane_sim '<ShardSpec JSON>'
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _quiet()
    asyncio.run(serve(ShardSpec(**json.loads(sys.argv[1]))))
