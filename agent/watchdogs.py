"""The node agent's two hang watchdogs: one for runtime workers, one for torchrun scripts.

Runtime workers commit steps and say ``alive`` once a second over their channel; a node whose
workers committed nothing for ``progress`` seconds, or one of whose workers said nothing at all
for that long, has hung workers, and the agent kills them (the failure path replaces or restarts
them). torchrun scripts say nothing to the agent: their progress is judged from outside
(``agent/stall.py``: a heartbeat file, else output and CPU time), and a node kills its workers only
when every member of the generation has stalled too.

:class:`Watchdogs` is a part of :class:`agent.node.NodeAgent`, kept apart so that the agent's
main path reads on its own. It uses the agent's ``cfg``, ``_group``, ``_role``, ``_channel``,
``_progress_at``, ``_heard_at``, ``_stall``, ``_run``, ``_dirty``, ``_plan``, ``_store`` and
``_keys``; it changes ``_progress_at``, ``_heard_at``, ``_stall`` and ``_run`` (with ``_dirty``
set, so that the node record says what it saw).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from agent.errors import StoreError
from agent.records import NodeRecord, parse
from agent.roles import Role
from agent.stall import hung

log = logging.getLogger("tmrun.agent")


class Watchdogs:
    async def _watchdog(self) -> None:
        """Kill this node's runtime workers when they are hung: they committed no step for
        ``progress`` seconds (while training), or one of them said nothing at all, not even its
        ``alive``, for that long (at any time, waiting for a plan included: a stopped or frozen
        process; a worker that waits in a collective or for its peers keeps saying ``alive``).
        A worker that ended its run (``finish``: it hung up) says nothing more: only the steps
        watch it then, so an epilogue longer than ``progress`` (a final save) counts as a hang."""
        limit = self.cfg.timeouts.progress
        if not limit:
            return await asyncio.Event().wait()  # off: never ends
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            group = self._group
            if group is None or self._role.now is Role.SHADOW:
                continue
            now, since = time.monotonic(), self._progress_at
            talking = [pid for pid in group.running if self._channel.connected(pid)]  # the rest ended their run
            silent = sorted(pid for pid in talking if now - self._heard_at.get(pid, now) >= limit)
            if since is not None and now - since >= limit:
                log.error("%s: no step committed for %.0f s and no broken group reported: the workers are hung; "
                          "killing them (pids %s)", self.cfg.node, now - since, ", ".join(map(str, group.pids)))
            elif silent:
                log.error("%s: worker pid %s said nothing for %.0f s (stopped or frozen): the workers are hung; "
                          "killing them (pids %s)", self.cfg.node, ", ".join(map(str, silent)),
                          now - self._heard_at[silent[0]], ", ".join(map(str, group.pids)))
            else:
                continue
            self._progress_at = None
            self._heard_at.clear()
            group.kill_hung()

    async def _stall_watch(self) -> None:
        """The hang watchdog of torchrun scripts, which report no steps (``agent/stall.py``): once a
        second, sample the workers' heartbeat files and CPU time. No sign of progress for half of
        ``progress`` (at most 30 s): say so in the node record. The first worker to stop idle for
        ``progress`` and every member node stalled too: the job is hung; kill this node's workers
        with the reason in the record, and the failure path restarts (or replaces) them."""
        limit = self.cfg.timeouts.progress
        if not limit:
            return await asyncio.Event().wait()  # off: never ends
        report_after = min(limit / 2, 30.0)
        waiting_for: frozenset[str] = frozenset()
        while True:
            await asyncio.sleep(1.0)
            stall, group = self._stall, self._group
            if stall is None or group is None or self._role.now is not Role.MEMBER or self._run.runtime:
                continue
            now = time.monotonic()
            stall.sample(now, time.time())
            state = stall.stall(now)
            stalled = state is not None and state.idle >= report_after
            if stalled != bool(self._run.stalled_since):
                log.warning("%s: %s", self.cfg.node, "its workers make progress again" if not stalled else
                            f"no sign of progress from its workers for {state.idle:.0f} s (rank {state.rank} "
                            f"stopped first; judged by {state.signal})")
                self._run = dataclasses.replace(self._run, stalled_since=state.since_wall if stalled else 0.0,
                                                stalled_rank=state.rank if stalled else None)
                self._dirty.set()
            if not stalled or state.first_idle < limit:
                waiting_for = frozenset()
                continue
            try:
                others = await self._members_stalled()
            except StoreError:
                continue
            why = hung(state, limit, others)
            if why is None:
                busy = frozenset(m for m, v in others.items() if v is None)
                if busy != waiting_for:
                    log.info("%s: idle for %.0f s, but %s still make progress: not a hang", self.cfg.node,
                             state.idle, ", ".join(sorted(busy)))
                waiting_for = busy
                continue
            log.error("%s: %s; killing the workers (pids %s)", self.cfg.node, why, ", ".join(map(str, group.pids)))
            self._run = dataclasses.replace(self._run, error=why)
            self._dirty.set()
            self._stall = None
            group.kill_hung()

    async def _members_stalled(self) -> dict[str, tuple[float, int] | None]:
        """Each other member node's ``(stalled_since, stalled_rank)`` in the current generation, or None."""
        plan = self._plan
        if plan is None:
            return {}
        entries, _ = await self._store.get_prefix(self._keys.nodes)
        found: dict[str, tuple[float, int] | None] = {}
        for member in plan.members:
            if member == self.cfg.node:
                continue
            record = parse(NodeRecord, entries.get(self._keys.node(member)))
            run = record.run if record is not None else {}
            since = run.get("stalled_since") or 0.0
            found[member] = (since, run.get("stalled_rank") or 0) if since and run.get("gen") == plan.gen else None
        return found
