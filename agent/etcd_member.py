"""Keeping this machine's embedded etcd member alive while the job runs.

A member that dies (its process killed, a crash) is started again from its data directory, on
the same ports, so that it rejoins its cluster with everything it had: the local cluster's
single member comes back with the job's keys and leases (etcd extends every lease when it
elects a leader, so agents reconnect without registering again), and a member of a SLURM job's
three comes back as itself. A member that keeps failing to start (for example because it was
removed from its cluster) is given up after a few tries, with one line saying why::

    ┌──────────► wait for the process to exit (pidfd: no polling, no thread)
    │                      │ exited, and nobody asked it to stop
    │                      ▼
    └──── healthy ◄── spawn again from the data directory ── fails 3× within a minute ─► give up

Processes are spawned from the event loop's thread (the agent's or launcher's main thread),
because the member's parent-death signal is tied to the thread that spawned it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Callable

from agent.errors import StoreError
from agent.etcd_server import EmbeddedEtcd

log = logging.getLogger("tmrun.etcd")

RESTARTS_PER_MINUTE = 3
READY_TIMEOUT = 60.0


async def wait_exit(pid: int) -> None:
    """Return when process ``pid`` (a child of ours) has exited."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    done = loop.create_future()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def start(server: EmbeddedEtcd, timeout: float = READY_TIMEOUT) -> None:
    """Spawn ``server`` here, wait in a thread until it serves (the loop stays free)."""
    server.spawn()
    await asyncio.to_thread(server.wait_ready, timeout)


async def keep_alive(server: EmbeddedEtcd, report: Callable[[str], None] = log.warning,
                     clock: Callable[[], float] = time.monotonic) -> None:
    """Restart ``server`` whenever its process exits, until cancelled or it keeps failing.

    ``server.stop()`` (which the owner calls when the job ends) is not a failure: this returns.
    """
    failures: collections.deque[float] = collections.deque()
    while True:
        if server.pid is not None and server.running():
            await wait_exit(server.pid)
        if server.stopped:
            return
        code = server.returncode
        failures.append(clock())
        while failures and clock() - failures[0] > 60.0:
            failures.popleft()
        if len(failures) > RESTARTS_PER_MINUTE:
            report(f"etcd member {server.name} exited {len(failures)} times within a minute "
                   f"(last: {server.last_error() or f'exit code {code}'}); not restarting it")
            return
        report(f"etcd member {server.name} exited with code {code}: restarting it from {server.data_dir}")
        try:
            server.pin_ports()
            await start(server)
        except StoreError as exc:
            report(f"etcd member {server.name} did not come back: {exc}")
            continue
        report(f"etcd member {server.name} is back at {server.endpoint}")
