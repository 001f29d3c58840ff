"""Link checks between agents: can this node reach each member of the job right now?

Each agent accepts TCP connections on a port of its own (:class:`LinkListener`; the leader
copies ``host:port`` of every member into the plan, ``link_at``) and closes each one at once,
reading nothing, so a check costs a handshake and carries no data. Every ``interval`` seconds
(rdzv-conf ``link_check``) a :class:`LinkChecker` connects to every other member, all at once,
each within ``timeout``; a peer that failed ``misses`` checks in a row is *unreachable*, one that
answers once is reachable again. The agent reports the unreachable set in its node record, and
the leader takes out a member whose link to another member is down (``cut_links`` in
agent/policy.py); that node's agent goes on checking, and its links back, it is a standby again.

The checks go where the workers' traffic goes (the agents' host addresses), so a cut link
between two nodes shows in both ends' checks. They do not see a link that passes handshakes but
drops bulk data, nor a rate that fell (the pull's passive measurement does, in ``links``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Mapping


class LinkListener:
    """Accept and close: a peer's connect succeeding is the whole answer."""

    def __init__(self) -> None:
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str) -> int:
        self._server = await asyncio.start_server(self._answer, host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @staticmethod
    async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None


class LinkChecker:
    """Rounds of connects to the peers; :meth:`check` returns who is unreachable after each."""

    def __init__(self, timeout: float = 1.0, misses: int = 2) -> None:
        self.timeout = timeout
        self.misses = misses
        self._missed: dict[str, int] = {}

    async def check(self, peers: Mapping[str, str]) -> frozenset[str]:
        """One round over ``peers`` (node -> ``host:port``); the nodes missed ``misses`` times in a row."""
        names = sorted(peers)
        answers = await asyncio.gather(*(self._reach(peers[name]) for name in names))
        self._missed = {name: 0 if ok else self._missed.get(name, 0) + 1 for name, ok in zip(names, answers)}
        return frozenset(name for name, missed in self._missed.items() if missed >= self.misses)

    async def _reach(self, address: str) -> bool:
        host, _, port = address.rpartition(":")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), self.timeout)
        except (OSError, asyncio.TimeoutError, ValueError):
            return False
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
        return True
