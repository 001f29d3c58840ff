"""Watches on a job's keys, shared by every loop of an agent: "something changed, look again".

Loops in the agent are level-triggered: they read the keys they care about, act, then wait for
the next change (or a deadline) with :meth:`Changes.wait`. A :class:`Changes` watches only the
keys it is given (a follower: ``plan``, ``outcome``, ``leader``; not the other nodes' records, so
that one node's progress wakes nobody else), one watch per key or prefix, all bumping one
version. It keeps the last change it saw of each key (:meth:`latest`), so that a loop can take a
value from the watch instead of reading it again.

A broken watch is re-established from the last revision it saw, for as long as it takes: while
etcd is unreachable the loops simply see no change (their own reads fail and they decide what an
outage means); when it is back, everyone is woken once to look again. A watch whose history was
compacted away restarts from the present and forgets its last changes (they may be stale). The
stores skip values that are not JSON objects (:mod:`agent.skipped`), so a junk value cannot end
the watch; any other error it raises is logged and the watch re-established like after an
outage: the shared watch never dies silently.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Sequence

import tenacity

from agent.errors import StoreCompacted, StoreError
from agent.store import Event, Store

log = logging.getLogger("tmrun.agent")


class Versioned:
    """A version that moves on every change, and a wait for the next move (shared by Changes and
    agent.mirror.Mirror)."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def _bump(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, seen: int, timeout: float | None = None) -> None:
        """Return once ``version`` moved past ``seen`` or ``timeout`` seconds passed."""
        if self.version != seen:
            return
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass


class Changes(Versioned):
    def __init__(self, store: Store, prefixes: str | Sequence[str], *, max_wait: float = 2.0) -> None:
        super().__init__()
        self._store = store
        self._prefixes = (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
        self._tasks: list[asyncio.Task] = []
        self._latest: dict[str, Event] = {}
        self._max_wait = max_wait
        self.connected = True  # False while a watch is being re-established
        self.reconnects = 0  # how many times a watch came back after etcd was away
        self.on_event: Callable[[Event], None] | None = None  # told of each event as it arrives (timing)

    async def start(self, start_revision: int) -> None:
        for prefix in self._prefixes:
            watch = await self._store.watch_prefix(prefix, start_revision=start_revision)
            self._tasks.append(asyncio.ensure_future(self._run(prefix, watch, start_revision)))

    def latest(self, key: str) -> Event | None:
        """The last change of ``key`` this watch saw since it started (None: none, or forgotten)."""
        return self._latest.get(key)

    async def _run(self, prefix: str, watch, revision: int) -> None:
        while True:
            try:
                async for event in watch:
                    revision = event.revision + 1
                    self._latest[event.key] = event
                    if self.on_event is not None:
                        self.on_event(event)
                    self._bump()
                return  # cancelled, or the store was closed
            except asyncio.CancelledError:
                raise
            except StoreCompacted:
                revision = 0  # events were lost: continue from the present
                for key in [k for k in self._latest if k.startswith(prefix)]:
                    del self._latest[key]
            except StoreError:
                pass
            except Exception:  # a bug: say it, and keep every loop of the agent woken
                log.exception("the watch on %s failed; watching again", prefix)
            self.connected = False
            self._bump()
            watch, revision = await self._rewatch(prefix, revision)
            self.connected = True
            self.reconnects += 1
            self._bump()  # events may have been missed: make everyone look again

    async def _rewatch(self, prefix: str, revision: int):
        retrying = tenacity.AsyncRetrying(retry=tenacity.retry_if_exception_type(StoreError),
                                          wait=tenacity.wait_random_exponential(multiplier=0.2, max=self._max_wait))
        async for attempt in retrying:
            with attempt:
                if revision == 0:
                    _, now = await self._store.stat(prefix)
                    revision = now + 1
                return await self._store.watch_prefix(prefix, start_revision=revision), revision

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
