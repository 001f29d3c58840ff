"""The worker's end of the agent socket: send messages, and receive the agent's in a queue.

A background thread reads lines from the agent and queues them; the step loop polls the queue at
iteration boundaries (never blocking training) or waits on it when it has nothing else to do (a
standby waiting to be promoted, survivors waiting for the next generation).
"""

from __future__ import annotations

import queue
import socket
import threading
from typing import Any

from tmrun.protocol import ProtocolError, decode, encode


class AgentChannel:
    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._lock = threading.Lock()
        self._inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="tmrun-agent-channel", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stream = self._sock.makefile("rb")
        try:
            for line in stream:
                try:
                    self._inbox.put(decode(line))
                except ProtocolError:
                    continue
        except OSError:
            pass
        self._inbox.put(None)  # the agent is gone

    def send(self, kind: str, **fields: Any) -> None:
        data = encode(kind, **fields)
        with self._lock:
            try:
                self._sock.sendall(data)
            except OSError:
                pass  # the agent is gone; its parent-death signal will end this process

    def poll(self) -> dict[str, Any] | None:
        """The next message from the agent, or None if none is waiting."""
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout: float) -> dict[str, Any] | None:
        """The next message, waiting up to ``timeout`` seconds; None on timeout or agent loss."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
