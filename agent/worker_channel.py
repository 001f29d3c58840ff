"""The agent's end of the worker socket (see :mod:`tmrun.protocol` for the messages).

Workers that run the tmrun runtime connect and say ``hello`` with their pid; from then on the
agent can send them ``prepare``/``leave`` and receives their ``ready``/``switched``/``progress``/
``broken``. Messages for a worker that has not said hello yet wait in its queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

from tmrun.protocol import ProtocolError, decode, encode

log = logging.getLogger("tmrun.agent")


class WorkerChannel:
    def __init__(self, path: str, on_message: Callable[[int, dict[str, Any]], None]) -> None:
        self.path = path
        self._on_message = on_message
        self._writers: dict[int, asyncio.StreamWriter] = {}  # pid -> connection
        self._queued: dict[int, list[bytes]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid = 0
        try:
            while line := await reader.readline():
                try:
                    message = decode(line)
                except ProtocolError as exc:
                    log.warning("ignoring a worker message: %s", exc)
                    continue
                if message["type"] == "hello":
                    pid = int(message["pid"])
                    self._writers[pid] = writer
                    for data in self._queued.pop(pid, []):
                        writer.write(data)
                    await writer.drain()
                if pid:
                    self._on_message(pid, message)
        except (ConnectionError, OSError):
            pass
        finally:
            if pid and self._writers.get(pid) is writer:
                del self._writers[pid]
            writer.close()

    def connected(self, pid: int) -> bool:
        return pid in self._writers

    def send(self, pid: int, kind: str, **fields: Any) -> None:
        data = encode(kind, **fields)
        writer = self._writers.get(pid)
        if writer is None:
            self._queued.setdefault(pid, []).append(data)
            return
        try:
            writer.write(data)
        except (ConnectionError, OSError):
            pass

    def forget(self, pids: tuple[int, ...]) -> None:
        for pid in pids:
            self._queued.pop(pid, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for writer in list(self._writers.values()):
            writer.close()
        self._writers.clear()
        if os.path.exists(self.path):
            os.unlink(self.path)
