"""The leader's TCPStores, hosted in a child process: the agent itself never imports torch.

Each generation's workers rendezvous through a ``torch.distributed.TCPStore`` that the leader
hosts (``TCPStore(host, 0, is_master=True)``). Importing torch takes seconds, and while its
libraries load the importing thread holds the GIL. Done in a background thread of the agent (as
tmrun did until this module), that stalled the agent's event loop: 0.2 s on an idle 2-core
machine; with the thread niced, 1.5-2.3 s beside two busy processes of the agent's session and
6.2-8.0 s beside six (the niced holder of the GIL waits for a core while the event loop waits for
the GIL). A lease of 3 s expired in such a stall (CI saw a node that had just joined a job
declared lost). In a child process the import costs the agent's loop nothing.

Two agents of a job run a host: the leader (from its election) and its deputy, the agent the
current plan names to lead next (:func:`agent.leader.deputy`), which campaigns first when the
leadership falls vacant, so that a new leader's first plan does not wait for the import. The
others never import torch: 1.4 s of CPU and about 200 MB of memory per node saved. The child
imports ``torch.distributed`` in a niced thread, so that the import gives way to the workers'
start, and serves from its main thread, whose TCPStore server threads run at normal priority. It
dies with its agent: stdin's end, or SIGKILL on the agent's death (``die_with_parent``).

Protocol: one versioned JSON line each way (nothing pickled). The child says
``{"v": 1, "ready": true}`` once torch is imported; then ``{"v": 1, "id": N, "op": "open"}`` is
answered ``{"v": 1, "id": N, "port": P}`` (a new store) and ``{"v": 1, "id": N, "op": "close",
"port": P}`` is answered ``{"v": 1, "id": N, "closed": P}``; a failure is answered ``{"v": 1,
"id": N, "error": "..."}``. The ids pair each answer with its request: a request whose waiter
was cancelled leaves an answer that the next request skips.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import threading

from agent.workers import die_with_parent

VERSION = 1
STOP_TIMEOUT = 5.0  # seconds a host gets to exit after its stdin closes, before SIGKILL


class StoreHostError(RuntimeError):
    """The host could not make or close a store, or it is gone."""


class StoreHost:
    """The agent's side: start the child early, then ask it for stores (one request at a time)."""

    def __init__(self, host: str) -> None:
        self._host = host
        self._proc: asyncio.subprocess.Process | None = None
        self._ready = False
        self._lock = asyncio.Lock()  # one request at a time
        self._spawning = asyncio.Lock()  # one child at a time, whoever starts it
        self._ids = itertools.count(1)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        """Start the child unless it runs (it imports torch in the background; :meth:`open` waits
        for that)."""
        async with self._spawning:
            if self._proc is not None and self._proc.returncode is None:
                return
            self._ready = False
            self._proc = await asyncio.create_subprocess_exec(
                *die_with_parent([sys.executable, "-m", "agent.store_host", self._host]),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True)

    async def open(self) -> int:
        """A new TCPStore's port. A host that died is started again (its import is waited for)."""
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                await self.start()
            reply = await self._ask({"op": "open"})
            return int(reply["port"])

    async def close(self, port: int) -> None:
        """Stop serving ``port`` (its generation is over); a host that is gone has nothing to close."""
        async with self._lock:
            if self._proc is not None and self._proc.returncode is None:
                await self._ask({"op": "close", "port": port})

    async def stop(self) -> None:
        """End the child: its stdin closes and it exits (SIGKILL after STOP_TIMEOUT; at once while
        it is still importing torch, with no store to serve)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT if self._ready else 0)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _ask(self, request: dict) -> dict:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        if not self._ready:
            said = await self._reply(proc)
            if "error" in said:  # torch could not be imported
                raise StoreHostError(str(said["error"]))
            self._ready = True
        request_id = next(self._ids)
        try:
            proc.stdin.write((json.dumps({"v": VERSION, "id": request_id, **request}) + "\n").encode())
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise StoreHostError(f"the TCPStore host (pid {proc.pid}) is gone") from exc
        while True:  # an answer with an older id was for a request whose waiter was cancelled
            reply = await self._reply(proc)
            if reply.get("id") == request_id:
                if "error" in reply:
                    raise StoreHostError(str(reply["error"]))
                return reply

    @staticmethod
    async def _reply(proc: asyncio.subprocess.Process) -> dict:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if not line:
            code = await proc.wait()
            raise StoreHostError(f"the TCPStore host (pid {proc.pid}) exited with code {code}")
        try:
            reply = json.loads(line)
        except ValueError:
            raise StoreHostError(f"the TCPStore host said something that is not JSON: {line[:200]!r}") from None
        if not isinstance(reply, dict) or reply.get("v") != VERSION:
            raise StoreHostError(f"the TCPStore host answered in another protocol version: {line[:200]!r}")
        return reply


def _import_niced() -> None:
    """Import torch.distributed in a thread of low priority (Linux: the nice is the thread's only)."""
    failure: list[BaseException] = []

    def run() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            import torch.distributed  # noqa: F401
        except BaseException as exc:  # said by the main thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="tmrun-import-torch")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps({"v": VERSION, **message}) + "\n")
    sys.stdout.flush()


def serve(host: str) -> int:
    """The child: import torch, say so, then make and close stores until stdin ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle
    try:
        _import_niced()
        from torch.distributed import TCPStore
    except Exception as exc:
        _say({"error": f"importing torch.distributed failed: {exc}"})
        return 1
    _say({"ready": True})
    stores: dict[int, object] = {}
    for line in sys.stdin:
        request_id = None
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or request.get("v") != VERSION:
                raise ValueError(f"not a version {VERSION} request: {line.strip()[:200]}")
            request_id = request.get("id")
            if request.get("op") == "open":
                store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
                stores[store.port] = store
                _say({"id": request_id, "port": store.port})
            elif request.get("op") == "close":
                stores.pop(int(request["port"]), None)
                _say({"id": request_id, "closed": int(request["port"])})
            else:
                raise ValueError(f"unknown op {request.get('op')!r}")
        except Exception as exc:  # the agent says it; the host goes on serving
            _say({"id": request_id, "error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m agent.store_host HOST\n")
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
