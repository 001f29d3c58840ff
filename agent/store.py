"""The narrow key-value interface the agent needs from etcd.

Everything outside ``etcd_store`` sees only this: get with revision, compare-and-set, leases and
a prefix watch. Values are JSON objects (``dict``); keys are ``str``. Two implementations follow
the same contract (``tests/test_store_contract.py`` runs against both):

- :class:`agent.etcd_store.EtcdStore`, a real etcd through ``aetcd``;
- :class:`agent.memory_store.MemoryStore`, in-process, for fast tests of pure logic.

Errors are :class:`agent.errors.StoreError` and its subclasses, never the client's own. Reads and
watches hand out only JSON objects: a value that is not one (written by another client) is skipped
with one warning per key and revision (:mod:`agent.skipped`); its shape is checked by
:mod:`agent.records`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import AsyncIterator, Literal


@dataclasses.dataclass(frozen=True)
class Entry:
    """One key as read from the store."""

    key: str
    value: dict
    create_revision: int
    mod_revision: int
    lease: int = 0  # 0: not bound to a lease


@dataclasses.dataclass(frozen=True)
class Event:
    """One change seen by a watch. ``value`` is None for deletes; ``create_revision`` is the key's
    (0 for deletes), so that a watcher can keep entries as a read would give them."""

    kind: Literal["put", "delete"]
    key: str
    value: dict | None
    revision: int
    create_revision: int = 0


class Watch(abc.ABC):
    """A running prefix watch: iterate for events, ``cancel()`` to stop (iteration then ends).

    Each watch is its own object (equal only to itself): a store keeps its watches in a set.
    """

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[Event]: ...

    @abc.abstractmethod
    async def cancel(self) -> None: ...


class Store(abc.ABC):
    """Compare-and-set key-value store with leases and watches (the etcd v3 model).

    A store belongs to the event loop that first uses it. Operations after ``close()`` raise
    StoreError. Values must be JSON objects (TypeError otherwise; ValueError for NaN or infinity)
    and come back as fresh dicts.
    """

    endpoint: str = ""

    @abc.abstractmethod
    async def get(self, key: str) -> Entry | None:
        """The entry at ``key`` or None."""

    @abc.abstractmethod
    async def stat(self, key: str) -> tuple[int, int]:
        """``key``'s mod_revision (0 when absent) and the store's revision, without the value.

        A cheap look: is the key still what was read (or delivered by a watch) earlier? Where to
        start a watch from now?
        """

    async def get_and_stat(self, key: str, other: str) -> tuple[Entry | None, int, int]:
        """``get(key)`` and ``stat(other)`` at once: the entry, ``other``'s mod_revision (0 when
        absent) and the store's revision. One round trip where the store can (etcd: one txn); an
        agent's look every few seconds reads ``outcome`` and asks whether ``plan`` changed."""
        entry = await self.get(key)
        mod, revision = await self.stat(other)
        return entry, mod, revision

    @abc.abstractmethod
    async def keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, in order, without their values."""

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> tuple[dict[str, Entry], int]:
        """All entries under ``prefix`` and the store revision they were read at.

        Prefixes (here, in ``delete_prefix`` and in ``watch_prefix``) must not be empty:
        ValueError otherwise.
        """

    @abc.abstractmethod
    async def put(self, key: str, value: dict, *, lease: int = 0) -> int:
        """Write unconditionally; returns the new revision."""

    @abc.abstractmethod
    async def create(self, key: str, value: dict, *, lease: int = 0) -> bool:
        """Write only if ``key`` does not exist; True when written."""

    @abc.abstractmethod
    async def replace(self, key: str, value: dict, *, mod_revision: int, lease: int = 0) -> bool:
        """Compare-and-set: write only if ``key``'s mod_revision equals ``mod_revision``.

        ``mod_revision=0`` means "only if absent". True when written.
        """

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many."""

    @abc.abstractmethod
    async def grant_lease(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""

    @abc.abstractmethod
    async def refresh_lease(self, lease: int) -> int:
        """Keep ``lease`` alive; returns the remaining TTL, 0 when it has already expired."""

    @abc.abstractmethod
    async def revoke_lease(self, lease: int) -> None:
        """Revoke ``lease``, deleting every key bound to it. Unknown leases are ignored."""

    @abc.abstractmethod
    async def watch_prefix(self, prefix: str, *, start_revision: int) -> Watch:
        """Watch every change under ``prefix`` from ``start_revision`` (inclusive).

        ``start_revision`` must be at least 1 (ValueError otherwise); to see only what happens
        after a read, pass ``get_prefix``'s revision + 1. Iterating a watch whose history was
        compacted away raises StoreCompacted. Iteration ends after ``cancel()`` and after the
        store's ``close()``.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Idempotent."""
