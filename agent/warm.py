"""Warm interpreters (``--warm-start``): Python with torch already imported, waiting to become a worker.

A restart's first seconds go to what does not depend on the script: starting Python and
importing torch (1.5–2.5 s per worker on a busy 2-core machine, more with CUDA libraries), and,
for a script that calls ``torch.use_deterministic_algorithms`` or ``torch.compile``, importing
torch's compiler stack (another 1.1 s here). With
``--warm-start`` each agent keeps one such interpreter per local rank ready while the job trains;
when it starts workers (a restart after a failure, a new generation) it hands each warm
interpreter its launch and the interpreter runs the script in-process, as ``python -u SCRIPT``
or ``python -u -m MODULE`` would:

- the launch is one versioned JSON line on the interpreter's stdin (``{"v": 1, "argv", "env",
  "cwd"}``), then stdin is closed and becomes ``/dev/null``;
- ``os.environ`` is replaced by the worker's environment, ``sys.argv`` and ``sys.path[0]`` are
  set as Python sets them, and the script runs under ``runpy`` as ``__main__``;
- the process is the worker: the agent supervises its pid, output and exit code like any other.

What a script could notice: environment variables read while torch is imported (``OMP_NUM_THREADS``
and friends) come from the previous generation's environment, which tmrun computes the same way;
tracebacks show two ``runpy`` frames. ``--no-python`` commands are never warm. Each warm
interpreter costs the memory of those imports (about 290 MB on CPU); it is started
``delay`` seconds after the workers it may replace, so that its import does not compete with
their start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Mapping, Sequence

log = logging.getLogger("tmrun.agent")

VERSION = 1
MARKER = "# tmrun warm interpreter"  # the first line of its program: how to tell one in a process list

# The interpreter's program: import torch, wait for the launch, become the worker.
_PROGRAM = r"""# tmrun warm interpreter
import importlib, json, os, runpy, sys
# the point: paid while the job trains, not after a failure. torch's compiler stack comes too:
# torch.use_deterministic_algorithms() and torch.compile() import it on first use (1.1 s here)
import torch
for name in ("torch.nn.parallel", "torch.distributed.fsdp", "torch._dynamo", "torch._inductor"):
    try:
        importlib.import_module(name)
    except Exception:  # another torch: what it has is enough
        pass
line = sys.stdin.readline()
if not line:
    os._exit(0)  # the agent is done with it
order = json.loads(line)
if order.get("v") != 1:
    sys.exit(f"tmrun warm interpreter: launch version {order.get('v')!r}, expected 1")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
sys.stdin = open(0, closefd=False)
os.environ.clear()
os.environ.update(order["env"])
os.chdir(order["cwd"])
argv = order["argv"]
if argv[0] == "-m":
    sys.argv = argv[1:]
    sys.path[0] = os.getcwd()
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
"""


def script_args(argv: Sequence[str], python: str = sys.executable) -> list[str] | None:
    """What follows ``python -u`` in a worker's argv (``[SCRIPT, ...]`` or ``["-m", MODULE, ...]``),
    or None when a warm interpreter cannot run it (``--no-python``, another interpreter)."""
    if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
        return None
    rest = list(argv[2:])
    if rest[0] == "-m" and len(rest) >= 2:
        return rest
    return None if rest[0].startswith("-") else rest


def launch_line(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> bytes:
    return (json.dumps({"v": VERSION, "argv": list(argv), "env": dict(env), "cwd": cwd}) + "\n").encode()


class WarmPool:
    """Up to one warm interpreter per local rank, started by :meth:`fill`, used by :meth:`take`."""

    def __init__(self, spawn) -> None:
        self._spawn = spawn  # async (argv, env) -> asyncio.subprocess.Process with stdin/stdout/stderr pipes
        self._ready: dict[int, asyncio.subprocess.Process] = {}
        self._filling: asyncio.Task | None = None

    def fill(self, envs: Mapping[int, Mapping[str, str]], delay: float) -> None:
        """Start a warm interpreter for each local rank in ``envs`` that has none, after ``delay`` s."""
        if self._filling is None or self._filling.done():
            self._filling = asyncio.ensure_future(self._fill(dict(envs), delay))

    async def _fill(self, envs: dict[int, Mapping[str, str]], delay: float) -> None:
        await asyncio.sleep(delay)
        for local_rank, env in sorted(envs.items()):
            proc = self._ready.get(local_rank)
            if proc is not None and proc.returncode is None:
                continue
            self._ready[local_rank] = await self._spawn([sys.executable, "-u", "-c", _PROGRAM], env)
            log.debug("warm interpreter for local rank %d: pid %d", local_rank, self._ready[local_rank].pid)

    def take(self, local_rank: int) -> asyncio.subprocess.Process | None:
        """The warm interpreter of ``local_rank`` if it is alive (it leaves the pool), else None."""
        if self._filling is not None and not self._filling.done():
            return None  # still being started: a cold start is as fast
        proc = self._ready.pop(local_rank, None)
        return proc if proc is not None and proc.returncode is None else None

    async def close(self) -> None:
        """End every warm interpreter (EOF on its stdin, then SIGKILL) and the filling, if any."""
        if self._filling is not None:
            self._filling.cancel()
            await asyncio.gather(self._filling, return_exceptions=True)
        for proc in self._ready.values():
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        self._ready.clear()
