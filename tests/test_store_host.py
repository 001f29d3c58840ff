"""The TCPStore host (agent/store_host.py), a real child process: the stores it opens serve real
torch clients, a closed store stops serving, the agent's process never imports torch (its import
stalled the agent's event loop past a 3 s lease), and the host dies with its agent, even by
SIGKILL. Requests that are not version 1 JSON get an error line, not a crash."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from agent.procfs import descendants
from agent.store_host import StoreHost
from tests.harness import alive

pytestmark = pytest.mark.timeout(120)

# An "agent": a StoreHost in a process that never imported torch. It opens two stores, says their
# ports and whether torch is in its modules, closes the first when told (a line on stdin), and
# stops its host at stdin's end.
AGENT = r"""
import asyncio, json, sys
from agent.store_host import StoreHost

async def main():
    host = StoreHost("127.0.0.1")
    await host.start()
    first, second = await host.open(), await host.open()
    print(json.dumps({"ports": [first, second], "torch": "torch" in sys.modules, "host": host.pid}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)
    await host.close(first)
    print(json.dumps({"closed": first}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    await host.stop()

asyncio.run(main())
"""


def gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``timeout`` s (SIGKILL by a parent's death is asynchronous)."""
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def start_agent() -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))


def test_stores_serve_clients_until_closed_and_the_agent_never_imports_torch() -> None:
    proc, said = start_agent()
    try:
        assert said["torch"] is False
        first, second = said["ports"]
        assert first != second
        a, b = client(first), client(second)
        a.set("k", "one")
        b.set("k", "two")
        assert client(first).get("k") == b"one" and client(second).get("k") == b"two"  # two stores, not one
        proc.stdin.write("close\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"closed": first}
        with pytest.raises(Exception):  # nothing listens at the closed store's port
            client(first)
        assert client(second).get("k") == b"two"
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
        assert not alive(said["host"])  # stop() waited for it
    finally:
        proc.kill()
        proc.wait()


def test_the_host_dies_with_its_agent_killed_by_sigkill() -> None:
    proc, said = start_agent()
    try:
        assert said["host"] in descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert gone(said["host"], 10), "the host outlived its SIGKILLed agent"
    finally:
        proc.kill()
        proc.wait()


def test_a_request_that_is_not_version_1_json_is_answered_with_an_error() -> None:
    host = subprocess.Popen([sys.executable, "-m", "agent.store_host", "127.0.0.1"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(host.stdout.readline()) == {"v": 1, "ready": True}
        for line, request_id in [("not json", None), (json.dumps({"v": 2, "id": 1, "op": "open"}), None),
                                 (json.dumps({"v": 1, "id": 2, "op": "fly"}), 2)]:
            host.stdin.write(line + "\n")
            host.stdin.flush()
            reply = json.loads(host.stdout.readline())
            assert reply["v"] == 1 and reply["id"] == request_id and reply["error"], reply
        host.stdin.write(json.dumps({"v": 1, "id": 3, "op": "open"}) + "\n")  # it goes on serving
        host.stdin.flush()
        reply = json.loads(host.stdout.readline())
        assert reply["id"] == 3 and reply["port"] > 0, reply
        host.stdin.close()
        assert host.wait(30) == 0
    finally:
        host.kill()
        host.wait()


def test_an_answer_whose_waiter_was_cancelled_is_not_taken_for_the_next_one() -> None:
    """Without the ids the next open would take the cancelled one's port, the close after it the
    open's answer, and the open after that a ``closed`` answer (no port)."""

    async def body() -> None:
        host = StoreHost("127.0.0.1")
        await host.start()
        try:
            await host.open()  # torch imported: the next requests are answered at once
            cancelled = asyncio.ensure_future(host.open())
            await asyncio.sleep(0)  # it runs to its first wait, its answer: the request is written
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            second = await host.open()
            await host.close(second)
            third = await host.open()
            assert third != second
            client(third).set("k", "v")  # the store the answer named
            with pytest.raises(Exception):  # and the closed one is closed
                await asyncio.to_thread(client, second)
        finally:
            await host.stop()

    asyncio.run(asyncio.wait_for(body(), 60))
