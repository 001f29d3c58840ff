"""Supervision of one node's worker processes behind one interface: start, wait, stop.

Each worker runs in its own session (its own process group, so that its children are stopped
with it) with a parent-death signal set by a tiny exec wrapper: if the agent dies, the kernel
kills the workers. Stopping
sends SIGTERM to each group, waits ``grace`` seconds, then SIGKILLs what is left. Output goes
through :class:`agent.output.OutputRouter` (prefixed console lines, log files).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from typing import Mapping, Sequence

from agent.output import OutputRouter
from agent.warm import WarmPool, launch_line, script_args

# Exec wrapper that sets the parent-death signal and then becomes the real program. Doing this in
# a preexec_fn is unsafe in a process with threads (gRPC's, the TCPStore's): the forked child can
# crash before exec. PR_SET_PDEATHSIG survives execve. If the parent is already gone, exit.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, int(sys.argv[1]))\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def die_with_parent(argv: Sequence[str], sig: int = signal.SIGKILL) -> list[str]:
    """``argv`` wrapped so that the process gets ``sig`` when this process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(int(sig)), str(os.getpid()), *argv]


@dataclasses.dataclass(frozen=True)
class WorkerLaunch:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    local_rank: int
    rank: int


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """How a worker group ended. ``exitcode`` < 0: killed by that signal."""

    state: str  # succeeded | failed | stopped
    exitcode: int | None = None
    rank: int | None = None


class WorkerGroup:
    """The workers of one generation on this node."""

    def __init__(self, launches: Sequence[WorkerLaunch], output: OutputRouter, grace: float) -> None:
        self._launches = list(launches)
        self._ranks = [launch.rank for launch in self._launches]  # global ranks now (renumber)
        self._output = output
        self._grace = grace
        self._procs: list[asyncio.subprocess.Process] = []
        self._pumps: list[asyncio.Task] = []
        self._stopping = False
        self.result: GroupResult | None = None

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs)

    @property
    def running(self) -> tuple[int, ...]:
        """The pids of the workers that have not exited (as far as this process reaped them)."""
        return tuple(p.pid for p in self._procs if p.returncode is None)

    async def start(self, warm: WarmPool | None = None) -> None:
        """Start every worker: a warm interpreter of ``warm`` where one is ready, else a new process."""
        for launch in self._launches:
            args = script_args(launch.argv) if warm is not None else None
            proc = warm.take(launch.local_rank) if warm is not None and args is not None else None
            if proc is not None:
                proc.stdin.write(launch_line(args, launch.env, os.getcwd()))
                await proc.stdin.drain()
                proc.stdin.close()
            else:
                proc = await spawn(launch.argv, launch.env, stdin=asyncio.subprocess.DEVNULL)
            self._procs.append(proc)
            self._pumps += self._output.attach(proc, launch.local_rank, launch.rank)

    def renumber(self, first_rank: int) -> None:
        """The workers now hold ranks ``first_rank + local_rank`` (a standby promoted without a
        restart): output prefixes and a failure's rank say so from now on."""
        for index, launch in enumerate(self._launches):
            self._ranks[index] = first_rank + launch.local_rank
            self._output.set_rank(launch.local_rank, self._ranks[index])

    async def wait(self) -> GroupResult:
        """Wait until every worker exited, or one failed (then stop the rest)."""
        pending = {asyncio.ensure_future(p.wait()): index for index, p in enumerate(self._procs)}
        failure: GroupResult | None = None
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                code = task.result()
                if code != 0 and failure is None and not self._stopping:
                    failure = GroupResult("failed", code, self._ranks[index])
            if failure is not None and pending:
                await self.stop()
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if failure is not None:
            self.result = failure
        elif self._stopping:
            self.result = GroupResult("stopped")
        else:
            self.result = GroupResult("succeeded", 0)
        return self.result

    async def stop(self) -> None:
        """SIGTERM every worker's process group, then SIGKILL after the grace period."""
        self._stopping = True
        alive = [p for p in self._procs if p.returncode is None]
        _signal_groups(alive, signal.SIGTERM)
        if not alive:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in alive)), self._grace)
        except asyncio.TimeoutError:
            _signal_groups([p for p in alive if p.returncode is None], signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in alive))

    def kill_hung(self) -> None:
        """SIGKILL every worker, as a failure (the hang watchdog): the group's result says signal 9."""
        _signal_groups([p for p in self._procs if p.returncode is None], signal.SIGKILL)

    def kill_now(self) -> None:
        """SIGKILL everything at once (fencing: the lease is gone, no grace)."""
        self._stopping = True
        _signal_groups([p for p in self._procs if p.returncode is None], signal.SIGKILL)


async def spawn(argv: Sequence[str], env: Mapping[str, str], *,
                stdin: int = asyncio.subprocess.PIPE) -> asyncio.subprocess.Process:
    """A worker process (or a warm interpreter): its own session, dies with this process, output piped."""
    return await asyncio.create_subprocess_exec(
        *die_with_parent(argv), env=dict(env), stdin=stdin, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=1 << 20)


def _signal_groups(procs: Sequence[asyncio.subprocess.Process], sig: int) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            proc.send_signal(sig)
