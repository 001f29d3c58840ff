"""The worker socket never drops a worker for what it sends, at either end.

A line over the limit, a line that is not JSON, a message with a field missing or of the wrong
type: each is skipped with one warning naming the worker and what was wrong, and a valid message
on the same connection afterwards is still handled (``tmrun.protocol`` for the schema).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading

import pytest

from agent.worker_channel import WorkerChannel
from tmrun.channel import AgentChannel
from tmrun.protocol import MAX_LINE, ProtocolError, decode, encode

pytestmark = pytest.mark.timeout(30)

PID = 4242
MIB = 1024 * 1024


def line(kind: str, **fields) -> bytes:
    return (json.dumps({"v": 1, "type": kind, **fields}) + "\n").encode()


@pytest.mark.parametrize(("raw", "why"), [
    (b"not json\n", "not JSON"),
    (b"[1]\n", "not a JSON object"),
    (b'{"v": 2, "type": "ready", "gen": 1}\n', "unsupported schema version 2"),
    (b'{"v": 1, "type": "shutdown"}\n', "unknown message type 'shutdown'"),
    (line("progress", step="3", step_time=0.1, gen=1), "progress: field 'step' has a bad value '3'"),
    (line("progress", step=3, gen=1), "progress: field 'step_time' is missing"),
    (b'{"v": 1, "type": "progress", "step": 3, "step_time": NaN, "gen": 1}\n', "not JSON"),
    (line("hello", rank=0, pid=0), "hello: field 'pid' has a bad value 0"),
    (line("broken", gen=1, step=2), "broken: field 'error' is missing"),
    (line("switched", gen=1, step=2, sources=[0, 1]), "switched: field 'sources' has a bad value [0, 1]"),
    (line("switched", gen=1, step=2, handover_error=3), "switched: field 'handover_error'"),
    (line("prepare", gen=1, rank=0, world_size=2, store_host="h", store_port=1, mode="later", handover=False),
     "prepare: field 'mode'"),
])
def test_decode_names_what_is_wrong(raw: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why.replace("[", r"\[")):
        decode(raw)


def test_encode_refuses_what_the_other_end_would_refuse() -> None:
    assert decode(encode("broken", gen=1, step=2, error="")) == {"v": 1, "type": "broken", "gen": 1, "step": 2,
                                                                 "error": ""}
    with pytest.raises(ProtocolError):
        encode("progress", step=1, step_time=float("nan"), gen=1)


def test_agent_keeps_a_worker_that_sends_junk(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """A 1 MiB line over a 64 KiB limit, malformed messages, then valid ones: all on one connection."""
    got: list[dict] = []

    async def main() -> bytes:
        handled = asyncio.Event()

        def on_message(pid: int, message: dict) -> None:
            got.append({"pid": pid, **message})
            if message["type"] == "ready":
                handled.set()

        channel = WorkerChannel(str(tmp_path / "agent.sock"), on_message, limit=64 * 1024)
        await channel.start()
        try:
            reader, writer = await asyncio.open_unix_connection(channel.path)
            writer.write(line("hello", rank=0, pid=PID))
            writer.write(b"x" * MIB + b"\n")  # over the limit: discarded up to its newline
            writer.write(line("progress", step="three", step_time=0.1, gen=1))
            writer.write(line("broken", gen=1, step=3))  # no error field
            writer.write(b"\xff\xfe not utf-8\n")
            writer.write(line("ready", gen=1))
            await writer.drain()
            await asyncio.wait_for(handled.wait(), 10)
            channel.send(PID, "leave", gen=2, rejoin=False)  # the connection is still open both ways
            answer = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            return answer
        finally:
            await channel.close()

    with caplog.at_level(logging.WARNING, logger="tmrun.agent"):
        answer = asyncio.run(main())
    assert [m["type"] for m in got] == ["hello", "ready"] and all(m["pid"] == PID for m in got)
    assert decode(answer)["type"] == "leave"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 4 and all(f"worker pid {PID}" in w for w in warned), warned  # nothing else logged
    assert f"a line of {MIB + 1:,} bytes is over the limit of 65536" in warned[0]
    assert "progress: field 'step'" in warned[1] and "broken: field 'error' is missing" in warned[2]
    assert "not JSON" in warned[3]


def test_agent_takes_a_1_mib_message_within_the_default_limit(tmp_path) -> None:
    """A line of over 1 MiB (a field the schema passes through) is within the default limit."""
    note = "x" * (MIB + 10)
    got: list[dict] = []

    async def main() -> None:
        handled = asyncio.Event()
        channel = WorkerChannel(str(tmp_path / "agent.sock"), lambda pid, m: (got.append(m), handled.set()))
        await channel.start()
        try:
            _, writer = await asyncio.open_unix_connection(channel.path)
            writer.write(line("hello", rank=0, pid=PID))
            data = line("switched", gen=2, step=5, sources=3, note=note)
            assert MIB < len(data) < MAX_LINE
            writer.write(data)
            await writer.drain()
            while len(got) < 2:
                handled.clear()
                await asyncio.wait_for(handled.wait(), 10)
            writer.close()
        finally:
            await channel.close()

    asyncio.run(main())
    assert got[1]["type"] == "switched" and got[1]["sources"] == 3 and got[1]["note"] == note


def test_worker_keeps_its_agent_when_the_agent_sends_junk(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "agent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    sent = threading.Event()

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"y" * MIB + b"\n")
            conn.sendall(line("prepare", gen=2, rank="0"))
            conn.sendall(b"{not json\n")
            conn.sendall(line("leave", gen=2, rejoin=True))
            conn.recv(1)  # hold the connection until the worker closes it
        sent.set()

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    with caplog.at_level(logging.WARNING, logger="tmrun.worker"):
        channel = AgentChannel(path, limit=64 * 1024)
        try:
            message = channel.wait(timeout=10)
        finally:
            channel.close()
    thread.join(10)
    server.close()
    assert message == {"v": 1, "type": "leave", "gen": 2, "rejoin": True}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3 and all(f"worker pid {os.getpid()}" in w for w in warned), warned
    assert "over the limit of 65536" in warned[0] and "prepare: field" in warned[1] and "not JSON" in warned[2]


def test_worker_says_alive_while_its_step_loop_waits_and_stops_when_closed(tmp_path) -> None:
    """The agent's hang watchdog tells a waiting worker from a stopped one by these messages."""
    path = str(tmp_path / "agent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    channel = AgentChannel(path, alive_every=0.05)
    conn, _ = server.accept()
    stream = conn.makefile("rb")
    assert channel.wait(timeout=0.5) is None  # the step loop waits for a plan that does not come
    got = [decode(stream.readline()) for _ in range(3)]
    assert got == [{"v": 1, "type": "alive"}] * 3
    channel.close()
    conn.settimeout(5)
    rest = stream.read()  # up to the worker's end of the connection: at most the beats not yet read
    conn.close()
    server.close()
    assert set(rest.splitlines()) <= {encode("alive").strip()}, rest
