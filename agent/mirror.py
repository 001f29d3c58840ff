"""The leader's copy of the job's keys: one read, then a watch keeps it current (list and watch).

The leader decides on every change, and a job of 1,000 nodes changes often; reading the whole
prefix for each decision would cost the job's size per change. A :class:`Mirror` reads the prefix
once and applies each watch event to its copy, so a decision costs no etcd request at all, and
the copy is as current as the watch.

Nodes report their training progress (``run.step``, ``run.step_time``) every few seconds;
that changes no decision, so such a change updates the copy without waking the leader
(:func:`progress_only`). Everything else wakes it through :meth:`Mirror.wait`.

While the watch is broken (etcd away) :meth:`Mirror.snapshot` raises StoreUnavailable: a copy
that may have missed changes is not decided on. The watch is re-established from the last
revision seen; after a compaction the prefix is read again.
"""

from __future__ import annotations

import asyncio
import logging

import tenacity

from agent.changes import Versioned
from agent.errors import StoreCompacted, StoreError, StoreUnavailable
from agent.store import Entry, Event, Store

log = logging.getLogger("tmrun.leader")

PROGRESS_FIELDS = frozenset({"step", "step_time", "stalled_since", "stalled_rank"})


def progress_only(old: Entry | None, event: Event) -> bool:
    """True when ``event`` changes a node record's progress (its step) and nothing else."""
    if old is None or event.kind != "put" or event.value is None:
        return False
    before, after = old.value, event.value
    if before.keys() != after.keys() or any(before[k] != after[k] for k in before if k != "run"):
        return False
    run_before, run_after = before.get("run"), after.get("run")
    if not isinstance(run_before, dict) or not isinstance(run_after, dict) or run_before.keys() != run_after.keys():
        return False
    return all(run_before[k] == run_after[k] for k in run_before if k not in PROGRESS_FIELDS)


class Mirror(Versioned):
    """Entries under ``prefix``, kept current by a watch; ``version`` moves on every change that
    matters (see :func:`progress_only`)."""

    def __init__(self, store: Store, prefix: str, *, max_wait: float = 2.0) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix
        self._entries: dict[str, Entry] = {}
        self._changed: dict[str, int] = {}  # key -> revision of its last change that was not progress only
        self._task: asyncio.Task | None = None
        self._max_wait = max_wait
        self.revision = 0  # of the last change applied (or of the read)
        self.connected = False
        self.reconnects = 0  # how many times the copy came back after etcd was away

    async def start(self) -> None:
        revision = await self._list()
        watch = await self._store.watch_prefix(self._prefix, start_revision=revision + 1)
        self.connected = True
        self._task = asyncio.ensure_future(self._run(watch, revision + 1))

    def snapshot(self) -> dict[str, Entry]:
        """The entries as of the last event seen (a new dict; the entries are immutable)."""
        if not self.connected:
            raise StoreUnavailable(self._store.endpoint, "the watch on the job's keys is being re-established")
        return dict(self._entries)

    def changed_at(self, key: str) -> int:
        """The revision of ``key``'s last change that was not progress only (0: unknown)."""
        return self._changed.get(key, 0)

    def keys_under(self, prefix: str) -> list[str]:
        return [key for key in self._entries if key.startswith(prefix)]

    async def _list(self) -> int:
        entries, revision = await self._store.get_prefix(self._prefix)
        self._entries = entries
        self._changed = {key: entry.mod_revision for key, entry in entries.items()}
        self.revision = max(self.revision, revision)
        return revision

    def _apply(self, event: Event) -> None:
        self.revision = max(self.revision, event.revision)
        old = self._entries.get(event.key)
        if event.kind == "delete":
            self._entries.pop(event.key, None)
            self._changed.pop(event.key, None)
        else:
            created = event.create_revision or (old.create_revision if old else event.revision)
            self._entries[event.key] = Entry(event.key, event.value, created, event.revision)
        if not progress_only(old, event):
            if event.kind == "put":
                self._changed[event.key] = event.revision
            self._bump()

    async def _run(self, watch, revision: int) -> None:
        while True:
            try:
                async for event in watch:
                    revision = event.revision + 1
                    self._apply(event)
                return  # cancelled, or the store was closed
            except asyncio.CancelledError:
                raise
            except StoreCompacted:
                revision = 0  # events were lost: read the prefix again
            except StoreError:
                pass
            except Exception:  # a bug: say it, and keep the copy honest by reading it again
                log.exception("the watch on %s failed; reading the job's keys again", self._prefix)
                revision = 0
            self.connected = False
            self._bump()
            watch, revision = await self._rewatch(revision)
            self.connected = True
            self.reconnects += 1
            self._bump()

    async def _rewatch(self, revision: int):
        retrying = tenacity.AsyncRetrying(retry=tenacity.retry_if_exception_type(StoreError),
                                          wait=tenacity.wait_random_exponential(multiplier=0.2, max=self._max_wait))
        async for attempt in retrying:
            with attempt:
                if revision == 0:
                    revision = await self._list() + 1
                return await self._store.watch_prefix(self._prefix, start_revision=revision), revision

    async def caught_up(self, revision: int, timeout: float) -> bool:
        """Wait until the copy holds every change up to ``revision`` (a write of the caller's)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.revision < revision:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            await self.wait(self.version, left)
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
