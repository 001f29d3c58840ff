"""One watch on a job's keys, shared by every loop of an agent: "something changed, look again".

Loops in the agent are level-triggered: they read the keys they care about, act, then wait for
the next change (or a deadline) with :meth:`Changes.wait`. A broken watch is re-established from
the last revision seen; if the store stays unreachable the error surfaces to every waiter.
"""

from __future__ import annotations

import asyncio

from agent.errors import StoreError
from agent.store import Store


class Changes:
    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self._prefix = prefix
        self._event = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._revision = 0
        self.version = 0

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
                return  # cancelled
            except asyncio.CancelledError:
                raise
            except StoreError as exc:
                try:  # the store's own retry policy bounds how long this may take
                    watch = await self._store.watch_prefix(self._prefix, start_revision=self._revision)
                    self._bump()  # events may have been missed: make everyone look again
                except StoreError:
                    self._error = exc
                    self._bump()
                    return

    def _bump(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, seen: int, timeout: float | None = None) -> None:
        """Return once ``version`` moved past ``seen`` or ``timeout`` seconds passed."""
        if self._error is not None:
            raise self._error
        if self.version != seen:
            return
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
