"""Link checks between agents (:mod:`agent.links`), on real loopback sockets.

A listener answers by accepting and closing; a checker marks a peer unreachable after two missed
rounds in a row and reachable again after one answer. The namespaced version, with a link cut
between two SLURM nodes while a job trains, is in tests/test_e2e_slurm.py.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from agent.links import LinkChecker, LinkListener

pytestmark = pytest.mark.timeout(30)


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_peer_is_unreachable_after_two_missed_rounds_and_back_after_one_answer() -> None:
    async def scenario() -> list[frozenset[str]]:
        listener = LinkListener()
        port = await listener.start("127.0.0.1")
        gone = closed_port()
        checker = LinkChecker(timeout=1.0)
        seen = []
        peers = {"up": f"127.0.0.1:{port}", "down": f"127.0.0.1:{gone}"}
        for _ in range(3):
            seen.append(await checker.check(peers))
        back = LinkListener()
        back._server = await asyncio.start_server(back._answer, "127.0.0.1", gone)  # the same port answers again
        seen.append(await checker.check(peers))
        seen.append(await checker.check({"up": peers["up"]}))  # a peer no longer checked is forgotten
        await listener.close()
        seen.append(await checker.check(peers))
        seen.append(await checker.check(peers))
        await back.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen == [frozenset(), frozenset({"down"}), frozenset({"down"}), frozenset(), frozenset(),
                    frozenset(), frozenset({"up"})]


def test_the_listener_sends_nothing_and_a_bad_address_is_a_miss() -> None:
    async def scenario() -> tuple[bytes, frozenset[str]]:
        listener = LinkListener()
        port = await listener.start("127.0.0.1")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = await asyncio.wait_for(reader.read(), 5)  # closed by the listener: end of stream, nothing sent
        writer.close()
        checker = LinkChecker(timeout=1.0, misses=1)
        missed = await checker.check({"junk": "no-port-here", "ipv6": f"[::1]:{closed_port()}"})
        await listener.close()
        return data, missed

    data, missed = asyncio.run(scenario())
    assert data == b""
    assert missed == {"junk", "ipv6"}
