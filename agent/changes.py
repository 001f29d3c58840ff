"""One watch on a job's keys, shared by every loop of an agent: "something changed, look again".

Loops in the agent are level-triggered: they read the keys they care about, act, then wait for
the next change (or a deadline) with :meth:`Changes.wait`. A broken watch is re-established from
the last revision seen, for as long as it takes: while etcd is unreachable the loops simply see
no change (their own reads fail and they decide what an outage means); when it is back, everyone
is woken once to look again. A watch whose history was compacted away restarts from the present.
The stores skip values that are not JSON objects (:mod:`agent.skipped`), so a junk value cannot
end the watch; any other error it raises is logged and the watch re-established like after an
outage: the shared watch never dies silently.
"""

from __future__ import annotations

import asyncio
import logging

import tenacity

from agent.errors import StoreCompacted, StoreError
from agent.store import Store

log = logging.getLogger("tmrun.agent")


class Changes:
    def __init__(self, store: Store, prefix: str, *, max_wait: float = 2.0) -> None:
        self._store = store
        self._prefix = prefix
        self._event = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._revision = 0
        self._max_wait = max_wait
        self.version = 0
        self.connected = True  # False while the watch is being re-established
        self.reconnects = 0  # how many times the watch came back after etcd was away

    async def start(self, start_revision: int) -> None:
        self._revision = start_revision
        watch = await self._store.watch_prefix(self._prefix, start_revision=start_revision)
        self._task = asyncio.ensure_future(self._run(watch))

    async def _run(self, watch) -> None:
        while True:
            try:
                async for event in watch:
                    self._revision = event.revision + 1
                    self._bump()
                return  # cancelled, or the store was closed
            except asyncio.CancelledError:
                raise
            except StoreCompacted:
                self._revision = 0  # events were lost: continue from the present
            except StoreError:
                pass
            except Exception:  # a bug: say it, and keep every loop of the agent woken
                log.exception("the watch on %s failed; watching again", self._prefix)
            self.connected = False
            self._bump()
            watch = await self._rewatch()
            self.connected = True
            self.reconnects += 1
            self._bump()  # events may have been missed: make everyone look again

    async def _rewatch(self):
        retrying = tenacity.AsyncRetrying(retry=tenacity.retry_if_exception_type(StoreError),
                                          wait=tenacity.wait_random_exponential(multiplier=0.2, max=self._max_wait))
        async for attempt in retrying:
            with attempt:
                if self._revision == 0:
                    _, revision = await self._store.get_prefix(self._prefix)
                    self._revision = revision + 1
                return await self._store.watch_prefix(self._prefix, start_revision=self._revision)

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

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
