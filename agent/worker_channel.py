"""The agent's end of the worker socket (see :mod:`tmrun.protocol` for the messages).

Workers that run the tmrun runtime connect and say ``hello`` with their pid; from then on the
agent can send them ``prepare``/``leave`` and receives their ``ready``/``switched``/``progress``/
``broken``. Messages for a worker that has not said hello yet wait in its queue.

A worker is never dropped for what it sends: a line that is not a valid message (not JSON, a
field missing or of the wrong type) or is longer than :data:`tmrun.protocol.MAX_LINE` is skipped
with one warning naming the worker and what was wrong, and the connection stays open. Only the
worker closing its end (or the agent closing the channel) ends it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

from tmrun.protocol import MAX_LINE, ProtocolError, decode, encode

log = logging.getLogger("tmrun.agent")


class WorkerChannel:
    def __init__(self, path: str, on_message: Callable[[int, dict[str, Any]], None], *,
                 limit: int = MAX_LINE) -> None:
        self.path = path
        self.limit = limit  # the longest line read, in bytes
        self._on_message = on_message
        self._writers: dict[int, asyncio.StreamWriter] = {}  # pid -> connection
        self._queued: dict[int, list[bytes]] = {}
        self._ended: dict[int, asyncio.Event] = {}  # pid -> set once its connection was read to the end
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=self.limit)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid = 0
        try:
            while line := await _read_line(reader, lambda: pid, self.limit):
                try:
                    message = decode(line)
                except ProtocolError as exc:
                    log.warning("ignoring a message from worker %s: %s", _who(pid), exc)
                    continue
                if message["type"] == "hello" and not pid:
                    pid = message["pid"]
                    self._writers[pid] = writer
                    self._ended.setdefault(pid, asyncio.Event())
                    for data in self._queued.pop(pid, []):
                        writer.write(data)
                    await writer.drain()
                if not pid:
                    log.warning("ignoring a %s message from a worker that has not said hello", message["type"])
                    continue
                try:
                    self._on_message(pid, message)
                except Exception:  # a bug in handling one message must not drop the worker
                    log.exception("handling %s from worker pid %d failed", message["type"], pid)
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:  # the agent is closing: end this connection's task quietly
            pass
        finally:
            if pid and self._writers.get(pid) is writer:
                del self._writers[pid]
            if pid:
                self._ended.setdefault(pid, asyncio.Event()).set()
            writer.close()

    def connected(self, pid: int) -> bool:
        return pid in self._writers

    def send(self, pid: int, kind: str, **fields: Any) -> None:
        try:
            data = encode(kind, **fields)
        except ProtocolError as exc:  # a bug on this side: say it, the worker waits as if not sent
            log.error("not sending %s to worker pid %d: %s", kind, pid, exc)
            return
        writer = self._writers.get(pid)
        if writer is None:
            self._queued.setdefault(pid, []).append(data)
            return
        try:
            writer.write(data)
        except (ConnectionError, OSError):
            pass

    async def drained(self, pids: tuple[int, ...], timeout: float) -> None:
        """Until every line the workers ``pids`` wrote before they exited was handled (their
        connections read to the end), at most ``timeout`` seconds: a worker says why it fails just
        before it exits, and the exit must not be reported without it."""
        waits = [asyncio.ensure_future(self._ended[pid].wait()) for pid in pids if pid in self._ended]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for wait in pending:
                wait.cancel()

    def forget(self, pids: tuple[int, ...]) -> None:
        for pid in pids:
            self._queued.pop(pid, None)
            self._ended.pop(pid, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for writer in list(self._writers.values()):
            writer.close()
        self._writers.clear()
        if os.path.exists(self.path):
            os.unlink(self.path)


def _who(pid: int) -> str:
    return f"pid {pid}" if pid else "(no hello yet)"


async def _read_line(reader: asyncio.StreamReader, pid: Callable[[], int], limit: int) -> bytes:
    """The next line; a line over the limit is read up to its newline, discarded and warned about.
    Empty bytes at the end of the stream."""
    while True:
        try:
            return await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial  # the worker closed its end (a last line without a newline is still read)
        except asyncio.LimitOverrunError as exc:
            dropped = await _discard_line(reader, exc.consumed)
            log.warning("ignoring a message from worker %s: a line of %s bytes is over the limit of %d",
                        _who(pid()), f"{dropped:,}", limit)


async def _discard_line(reader: asyncio.StreamReader, consumed: int) -> int:
    """Skip the rest of an overlong line, newline included; how many bytes were dropped."""
    dropped = 0
    while True:
        try:
            chunk = await reader.readuntil(b"\n")
            return dropped + len(chunk)
        except asyncio.LimitOverrunError as exc:
            chunk = await reader.readexactly(exc.consumed)
            dropped += len(chunk)
        except asyncio.IncompleteReadError as exc:
            return dropped + len(exc.partial)
