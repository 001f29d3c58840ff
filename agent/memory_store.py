"""An in-process :class:`~agent.store.Store` with etcd's semantics, for fast tests of pure logic.

What it copies from etcd (``tests/test_store_contract.py`` checks both against one suite):

- one store revision, starting at 1, raised by one per write (a put, a delete, a prefix delete
  or a lease's expiry or revocation, however many keys it touches); ``create_revision`` and
  ``mod_revision`` per key;
- values are kept as the bytes etcd would hold and decoded on every read, so a test sees what
  etcd would hand back; a value that is not a JSON object (:meth:`put_raw`) is skipped on reads
  and watches with one warning, as :class:`agent.etcd_store.EtcdStore` does;
- leases with a TTL on an injectable ``clock`` (default ``time.monotonic``). Expired leases are
  reaped lazily, at the start of every operation, and by an explicit :meth:`expire_leases`;
  their keys are deleted in one revision and watches see the deletes;
- watches are asyncio queues (``cancel`` ends iteration at once, ``close`` after the queued
  events); ``start_revision`` replays the history kept in memory, which
  :meth:`compact` can drop (a watch from below it then raises StoreCompacted when iterated).

Unlike etcd it is not shared between processes, and it never fails to be reachable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import AsyncIterator, Callable

from agent.errors import LeaseNotFound, StoreCompacted, StoreError
from agent.skipped import decode_value
from agent.store import Entry, Event, Store, Watch

FIRST_LEASE_ID = 0x7E57_0000_0001


@dataclasses.dataclass
class _Lease:
    ttl: int
    deadline: float


@dataclasses.dataclass(frozen=True)
class _Kv:
    """A key as kept: the value's bytes, as etcd keeps them."""

    data: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True)
class _Change:
    """One change in the history; ``data`` is None for deletes."""

    key: str
    data: bytes | None
    revision: int
    create_revision: int = 0

    def event(self) -> Event | None:
        if self.data is None:
            return Event("delete", self.key, None, self.revision)
        value = decode_value(self.key, self.data, self.revision)
        return None if value is None else Event("put", self.key, value, self.revision, self.create_revision)


def _check_prefix(prefix: str) -> None:
    if not prefix:
        raise ValueError("an empty prefix would mean every key; give a non-empty prefix")


def _encode(value: dict) -> bytes:
    """The value as etcd would store it."""
    if not isinstance(value, dict):
        raise TypeError(f"store values are dicts, not {type(value).__name__}")
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def _entry(key: str, kv: _Kv) -> Entry | None:
    value = decode_value(key, kv.data, kv.mod_revision)
    return None if value is None else Entry(key, value, kv.create_revision, kv.mod_revision, kv.lease)


class MemoryStore(Store):
    """A Store in this process's memory."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, endpoint: str = "memory") -> None:
        self.endpoint = endpoint
        self._clock = clock
        self._revision = 1
        self._compacted = 0  # history below this revision is gone
        self._data: dict[str, _Kv] = {}
        self._history: list[_Change] = []
        self._leases: dict[int, _Lease] = {}
        self._next_lease = FIRST_LEASE_ID
        self._watches: set[_MemoryWatch] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"MemoryStore(revision={self._revision}, keys={len(self._data)}, leases={len(self._leases)})"

    # -- the one write path --------------------------------------------------------------------

    def _begin(self) -> None:
        """Every operation starts here: refuse after close, reap expired leases."""
        if self._closed:
            raise StoreError(f"store {self.endpoint} is closed")
        self.expire_leases()

    def _commit(self, changes: list[tuple[str, bytes | None, int]]) -> int:
        """Apply (key, value's bytes or None for delete, lease) changes at one new revision."""
        if not changes:
            return self._revision
        self._revision += 1
        revision = self._revision
        done = []
        for key, data, lease in changes:
            created = 0
            if data is None:
                del self._data[key]
            else:
                old = self._data.get(key)
                created = old.create_revision if old else revision
                self._data[key] = _Kv(data, created, revision, lease)
            done.append(_Change(key, data, revision, created))
        self._history.extend(done)
        for watch in list(self._watches):
            for change in done:
                watch._offer(change)
        return revision

    def _check_lease(self, lease: int) -> None:
        if lease and lease not in self._leases:
            raise LeaseNotFound(f"lease {lease:x} not found")

    # -- reads and writes ----------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        self._begin()
        kv = self._data.get(key)
        return None if kv is None else _entry(key, kv)

    async def stat(self, key: str) -> tuple[int, int]:
        self._begin()
        kv = self._data.get(key)
        return (0 if kv is None else kv.mod_revision), self._revision

    async def keys(self, prefix: str) -> list[str]:
        _check_prefix(prefix)
        self._begin()
        return sorted(key for key in self._data if key.startswith(prefix))

    async def get_prefix(self, prefix: str) -> tuple[dict[str, Entry], int]:
        _check_prefix(prefix)
        self._begin()
        found = (_entry(key, kv) for key, kv in sorted(self._data.items()) if key.startswith(prefix))
        return {entry.key: entry for entry in found if entry is not None}, self._revision

    async def put(self, key: str, value: dict, *, lease: int = 0) -> int:
        self._begin()
        self._check_lease(lease)
        return self._commit([(key, _encode(value), lease)])

    async def put_raw(self, key: str, data: bytes) -> int:
        """Write ``data`` as it is, as another etcd client could (tests of what tmrun reads)."""
        self._begin()
        return self._commit([(key, bytes(data), 0)])

    async def create(self, key: str, value: dict, *, lease: int = 0) -> bool:
        return await self.replace(key, value, mod_revision=0, lease=lease)

    async def replace(self, key: str, value: dict, *, mod_revision: int, lease: int = 0) -> bool:
        self._begin()
        data = _encode(value)
        current = self._data.get(key)
        if (current.mod_revision if current else 0) != mod_revision:
            return False
        self._check_lease(lease)
        self._commit([(key, data, lease)])
        return True

    async def delete(self, key: str) -> bool:
        self._begin()
        if key not in self._data:
            return False
        self._commit([(key, None, 0)])
        return True

    async def delete_prefix(self, prefix: str) -> int:
        _check_prefix(prefix)
        self._begin()
        keys = sorted(k for k in self._data if k.startswith(prefix))
        self._commit([(key, None, 0) for key in keys])
        return len(keys)

    async def compact(self, revision: int) -> None:
        """Forget the history below ``revision``, as etcd's compaction does."""
        revision = min(revision, self._revision)
        self._history = [e for e in self._history if e.revision >= revision]
        self._compacted = max(self._compacted, revision)

    # -- leases --------------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        self._begin()
        if ttl < 1:
            raise StoreError(f"lease TTL must be at least 1 s, not {ttl}")
        lease, self._next_lease = self._next_lease, self._next_lease + 1
        self._leases[lease] = _Lease(ttl, self._clock() + ttl)
        return lease

    async def refresh_lease(self, lease: int) -> int:
        self._begin()
        held = self._leases.get(lease)
        if held is None:
            return 0
        held.deadline = self._clock() + held.ttl
        return held.ttl

    async def revoke_lease(self, lease: int) -> None:
        self._begin()
        self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        if self._leases.pop(lease, None) is None:
            return
        bound = sorted(key for key, kv in self._data.items() if kv.lease == lease)
        self._commit([(key, None, 0) for key in bound])

    def expire_leases(self) -> list[int]:
        """Revoke every lease whose TTL has run out on the clock; returns their ids."""
        now = self._clock()
        expired = [lease for lease, held in self._leases.items() if held.deadline <= now]
        for lease in expired:
            self._drop_lease(lease)
        return expired

    # -- watches -------------------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, *, start_revision: int) -> Watch:
        _check_prefix(prefix)
        self._begin()
        if start_revision < 1:
            raise ValueError(f"start_revision must be >= 1 (get_prefix's revision + 1), not {start_revision}")
        watch = _MemoryWatch(self, prefix)
        if start_revision < self._compacted:
            watch._fail(StoreCompacted(self._compacted))
            return watch
        for change in self._history:
            if change.revision >= start_revision:
                watch._offer(change)
        self._watches.add(watch)
        return watch

    async def close(self) -> None:
        self._closed = True
        for watch in list(self._watches):
            watch._end()


_END = object()


class _MemoryWatch(Watch):
    """Events under one prefix, through an unbounded queue; ends on cancel or store close."""

    def __init__(self, store: MemoryStore, prefix: str) -> None:
        self._store = store
        self._prefix = prefix
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False

    def _offer(self, change: _Change) -> None:
        if change.key.startswith(self._prefix):
            event = change.event()  # a fresh value per watch; junk is skipped
            if event is not None:
                self._queue.put_nowait(event)

    def _fail(self, error: Exception) -> None:
        self._queue.put_nowait(error)

    def _end(self) -> None:
        self._store._watches.discard(self)
        self._queue.put_nowait(_END)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            item = await self._queue.get()
            if item is _END or self._cancelled:
                self._queue.put_nowait(_END)  # a later iteration ends at once too
                return
            if isinstance(item, Exception):
                raise item
            yield item

    async def cancel(self) -> None:
        """Stop at once: events still queued are dropped, as with etcd."""
        if not self._cancelled:
            self._cancelled = True
            self._end()
