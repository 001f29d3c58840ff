"""The worker's end of the agent socket: send messages, and receive the agent's in a queue.

A background thread reads lines from the agent and queues them; the step loop polls the queue at
iteration boundaries (never blocking training) or waits on it when it has nothing else to do (a
standby waiting to be promoted, survivors waiting for the next generation).

A second thread says ``alive`` every :data:`tmrun.protocol.ALIVE_EVERY` seconds for as long as the
process runs, so that the agent can tell a worker that waits (in a collective, for a plan) from
one that is stopped or frozen: only the second goes silent.

A message can also be seen the moment it arrives: ``on_arrival``, when set, is called with it in
the reader thread before it is queued (the runtime starts a ``prepare``'s group there rather than
at the next step boundary, see :mod:`tmrun.early_build`); it must be quick and must not raise.

A line from the agent that is not a valid message, or is longer than
:data:`tmrun.protocol.MAX_LINE`, is skipped with one warning (logger ``tmrun.worker``, which
reaches stderr when the script configures no logging); the connection stays open.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from typing import Any, BinaryIO, Callable

from tmrun.protocol import ALIVE_EVERY, MAX_LINE, ProtocolError, decode, encode

log = logging.getLogger("tmrun.worker")


class AgentChannel:
    def __init__(self, path: str, *, limit: int = MAX_LINE, alive_every: float = ALIVE_EVERY) -> None:
        self.limit = limit  # the longest line read, in bytes
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.on_arrival: Callable[[dict[str, Any]], None] | None = None  # see the module's docstring
        self._reader = threading.Thread(target=self._read, name="tmrun-agent-channel", daemon=True)
        self._reader.start()
        self._alive_every = alive_every
        self._heartbeat = threading.Thread(target=self._beat, name="tmrun-alive", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._closed.wait(self._alive_every):
            self.send("alive")

    def _read(self) -> None:
        stream = self._sock.makefile("rb")
        try:
            while line := self._read_line(stream):
                try:
                    message = decode(line)
                except ProtocolError as exc:
                    log.warning("worker pid %d: ignoring a message from the agent: %s", os.getpid(), exc)
                    continue
                self._arrived(message)
                self._inbox.put(message)
        except OSError:
            pass
        self._inbox.put(None)  # the agent is gone

    def _arrived(self, message: dict[str, Any]) -> None:
        hook = self.on_arrival
        if hook is None:
            return
        try:
            hook(message)
        except Exception as exc:  # a bug on this side: the message is still queued and handled as usual
            log.error("worker pid %d: handling %s on arrival failed: %s", os.getpid(), message.get("type"), exc)

    def _read_line(self, stream: BinaryIO) -> bytes | None:
        """The next line within the limit (an overlong one is skipped, warned about); None at the end."""
        while True:
            line = stream.readline(self.limit + 1)
            if not line:
                return None
            if len(line) <= self.limit:
                return line
            dropped = len(line)
            while not line.endswith(b"\n") and (line := stream.readline(self.limit + 1)):
                dropped += len(line)
            log.warning("worker pid %d: ignoring a message from the agent: a line of %s bytes is over the limit "
                        "of %d", os.getpid(), f"{dropped:,}", self.limit)

    def send(self, kind: str, **fields: Any) -> None:
        try:
            data = encode(kind, **fields)
        except ProtocolError as exc:  # a bug on this side; training goes on without the message
            log.error("worker pid %d: not sending %s to the agent: %s", os.getpid(), kind, exc)
            return
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
        """Stop saying ``alive`` and end the connection (the agent reads its end)."""
        self._closed.set()
        self._heartbeat.join(timeout=1.0)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader's file keeps the socket open otherwise
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
