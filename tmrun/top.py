"""``tmrun top``: the job live, refreshed in place (rich), or one JSON line per refresh (``--json``).

Each refresh reads what ``tmrun status`` and ``tmrun events`` read (the job's keys, one prefix
read each), and turns the step time each node's workers last reported into a rate (the job's:
its slowest member's; steps themselves are reported about once a second, too coarse to count
between refreshes). While it runs it holds the job's ``viewer`` key on a lease (:class:`Viewer`):
that is what makes the agents report each second; with nobody watching they report every 10 s.
It ends when the job does (the last frame says how) or on Ctrl-C; ``--count N`` stops after N
frames.

The frame (``--json``, schema 1): ``v``, ``at`` (Unix time), ``job``, ``state``, ``generation``,
``world_size``, ``hot_swaps``, ``restarts``, ``standby_pool``, ``leader``, ``steps_per_s`` (the
job's; null before a step was reported), ``outcome``, ``nodes`` (``node``, ``role``, ``state``, ``ranks``, ``step``,
``step_time``, ``steps_per_s``, ``last_stall``, ``metrics``), ``links`` (``measured``: whether any
link was; ``matrix``: destination node -> source node -> bytes/s, the rate each link last carried
state at, measured by the receiving agent in a switch) and ``events`` (the last :data:`EVENTS` of
``tmrun events``). A link that has carried no state yet is not in the matrix: nothing probes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import time
from typing import Any, Callable

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from agent.errors import StoreError
from agent.keys import JobKeys
from agent.store import Store
from tmrun import admin

SCHEMA = 1
EVENTS = 8  # the most recent events a frame shows
VIEWER_TTL = 10  # seconds (at least) the viewer key outlives a view that ended without taking it away
RELEASE_TIMEOUT = 1.0  # seconds a view that ends tries to take the viewer key away


def frame(doc: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """One frame from a status document and the job's events."""
    nodes = []
    for row in doc["nodes"]:
        step_time = row.get("step_time")
        rate = round(1.0 / step_time, 3) if step_time and row["role"] == "active" else None
        nodes.append({"node": row["node"], "role": row["role"], "state": row["state"], "ranks": row["ranks"],
                      "step": row.get("step"), "step_time": step_time, "steps_per_s": rate,
                      "last_stall": (row.get("last_swap") or {}).get("stall"), "metrics": row.get("metrics")})
    rates = [n["steps_per_s"] for n in nodes if n["steps_per_s"] is not None]
    return {
        "v": SCHEMA, "at": time.time(), "job": doc["job"], "state": doc["state"], "generation": doc["generation"],
        "world_size": doc["world_size"], "hot_swaps": doc["hot_swaps"], "restarts": doc["restarts"],
        "standby_pool": doc["standby_pool"], "leader": doc["leader"],
        "steps_per_s": min(rates) if rates else None,  # the job goes at its slowest member's pace
        "outcome": doc.get("outcome"), "nodes": nodes, "links": _links(doc["nodes"]),
        "events": events[-EVENTS:],
    }


def _links(rows: list[dict[str, Any]]) -> dict[str, Any]:
    matrix = {row["node"]: dict(sorted(row["links"].items())) for row in rows if row.get("links")}
    return {"measured": bool(matrix), "matrix": dict(sorted(matrix.items()))}


class Viewer:
    """The job's ``viewer`` key, held on a lease of its own while a view runs.

    The agents watch the key and report their workers' progress each second while it exists
    (every 10 s otherwise: nobody reads it more often). A view that cannot write it (etcd away,
    a user without write access) goes on; it shows the slower reports.
    """

    def __init__(self, store: Store, job: str, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self._key = JobKeys(job).viewer
        self._ttl = max(VIEWER_TTL, math.ceil(3 * interval))  # outlives the wait between two refreshes
        self._lease = 0
        self._refreshed = 0.0

    async def hold(self) -> None:
        """Put the key on first use, then keep its lease alive (a third of its TTL at most apart)."""
        now = self._clock()
        try:
            if not self._lease:
                self._lease = await self._store.grant_lease(self._ttl)
                await self._store.put(self._key, {"v": 1, "at": time.time()}, lease=self._lease)
                self._refreshed = now
            elif now - self._refreshed >= self._ttl / 3:
                if await self._store.refresh_lease(self._lease) <= 0:  # expired, the key with it
                    self._lease = 0
                    await self.hold()
                    return
                self._refreshed = now
        except StoreError:  # gone or refused: the next refresh puts the key again
            self._lease = 0

    async def release(self) -> None:
        """Take the key away now (else its lease expires by itself)."""
        lease, self._lease = self._lease, 0
        if lease:
            with contextlib.suppress(StoreError, asyncio.TimeoutError):
                await asyncio.wait_for(self._store.revoke_lease(lease), RELEASE_TIMEOUT)


async def follow(store: Store, job: str, interval: float, count: int | None,
                 emit: Callable[[dict[str, Any]], None]) -> None:
    """Emit a frame every ``interval`` seconds until the job ends (that frame included) or ``count``."""
    shown = 0
    viewer = Viewer(store, job, interval)
    try:
        while True:
            doc = await admin.status(store, job)  # raises JobNotFound before anything is written
            emit(frame(doc, await admin.events(store, job)))
            shown += 1
            if doc["state"] not in ("running", "starting") or (count is not None and shown >= count):
                return
            await viewer.hold()
            await asyncio.sleep(interval)
    finally:
        await viewer.release()


_ROLE_STYLE = {"active": "green", "standby": "cyan", "draining": "yellow", "drained": "dim",
               "failed": "red", "lost": "red", "joining": "yellow"}


def render(f: dict[str, Any]) -> RenderableType:
    """The frame as a person reads it: a headline, the nodes, the links, the recent events."""
    pace = f"{f['steps_per_s']:.2f} steps/s" if f["steps_per_s"] is not None else "measuring"
    head = Text.from_markup(
        f"[bold]{f['job']}[/] · {f['state']} · generation {f['generation']} · world size {f['world_size']} · "
        f"{pace} · hot swaps {f['hot_swaps']} · restarts {f['restarts']} · standby pool {f['standby_pool']} · "
        f"leader {f['leader'] or '-'} · {datetime.datetime.fromtimestamp(f['at']).strftime('%H:%M:%S')}")
    parts: list[RenderableType] = [head]
    if f.get("outcome"):
        parts.append(Text(f"outcome: {f['outcome'].get('state')}: {f['outcome'].get('reason')}"))
    nodes = Table(show_header=True, header_style="bold", expand=False)
    for column in ("node", "role", "workers", "ranks", "step", "steps/s", "step time", "last stall", "metrics"):
        nodes.add_column(column)
    for n in f["nodes"]:
        style = _ROLE_STYLE.get(n["role"], "")
        ranks = n["ranks"]
        nodes.add_row(n["node"], f"[{style}]{n['role']}[/]" if style else n["role"], n["state"],
                      "-" if not ranks else (str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"),
                      str(n["step"] if n["step"] is not None else "-"),
                      f"{n['steps_per_s']:.2f}" if n["steps_per_s"] is not None else "-",
                      f"{n['step_time']:.3f} s" if n["step_time"] else "-",
                      f"{n['last_stall']:.3f} s" if n["last_stall"] is not None else "-", n["metrics"] or "-")
    parts.append(nodes)
    parts.append(_link_matrix(f["links"]))
    events = Table(show_header=True, header_style="bold", title="recent events", title_justify="left")
    for column in ("time", "gen", "kind", "what happened"):
        events.add_column(column)
    for row in f["events"]:
        at = datetime.datetime.fromtimestamp(row["at"]).strftime("%H:%M:%S")
        events.add_row(at, str(row["gen"]), row["kind"], row["text"])
    parts.append(events)
    return Group(*parts)


def _link_matrix(links: dict[str, Any]) -> RenderableType:
    """Destinations down, sources across, in MB/s; a link that carried no state yet shows "-"."""
    matrix = links["matrix"]
    if not matrix:
        return Text("links: none measured yet (a link's rate is measured when it carries state in a switch)",
                    style="dim")
    sources = sorted({source for row in matrix.values() for source in row})
    table = Table(show_header=True, header_style="bold", title="links (MB/s, source → node)", title_justify="left")
    table.add_column("node ← source")
    for source in sources:
        table.add_column(source, justify="right")
    for node, row in matrix.items():
        table.add_row(node, *(f"{row[source] / 1e6:.1f}" if source in row else "-" for source in sources))
    return table
