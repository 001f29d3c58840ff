"""Launch a torchft GPT job on this machine: one lighthouse plus one process per replica group.

:func:`start` starts torchft's lighthouse (the ``torchft_lighthouse`` console script that the
PyPI package installs next to the Python interpreter) on a free loopback port, then the replicas
(``bench/competitors/torchft_gpt.py --replica-id i``), each with its own log file in ``workdir``.
Every replica hosts its own replica-group store on a free loopback port and advertises
``127.0.0.1`` to the lighthouse, so nothing leaves the machine; ``GLOO_SOCKET_IFNAME=lo`` keeps
Gloo on loopback too. The returned :class:`TorchftJob` can ``kill_replica(i)`` (SIGKILL),
``restart_replica(i)`` (a fresh process with the same arguments, as a replaced node would start:
it joins the next quorum and torchft heals it from a live peer), ``wait(timeout)`` and ``stop()``.

Lighthouse settings that decide the recovery times (``start(...)`` keywords):

* ``heartbeat_timeout_ms`` (torchft default 5000): a replica that stopped heartbeating counts as
  alive for this long. Until then the lighthouse will not form a quorum without it (with two
  replicas its split-brain rule also needs more than half of the heartbeating replicas), so this
  is, in practice, the time the survivors wait after a kill -9.
* ``join_timeout_ms`` (torchft default 60000): how long a quorum waits for replicas that
  heartbeat but have not asked to join yet.
* ``min_replicas`` (default 1 here): the smallest quorum; 1 lets a survivor go on alone.

Command line (a kill/restart experiment)::

    python bench/competitors/torchft_job.py --params 1M --steps 60 --replicas 2 --kill-at 20 \\
        --step-log /tmp/x.jsonl

waits until the step log shows step >= ``--kill-at``, kills replica 1 with SIGKILL, restarts it
at once, waits for the end and prints a summary from the step log (see ``summarize``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python bench/competitors/torchft_job.py`: the repo root, not this folder, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from agent.etcd_server import free_port  # noqa: E402
from bench import common  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "torchft_gpt.py"


def _lighthouse_exe() -> str:
    exe = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(exe) if exe.exists() else shutil.which("torchft_lighthouse")
    if not found:
        raise RuntimeError("torchft_lighthouse not found (pip install torchft)")
    return found


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft lighthouse exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"torchft lighthouse did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


class TorchftJob:
    """A running torchft job: the lighthouse process and the current process of each replica."""

    def __init__(self, workdir: Path, lighthouse: subprocess.Popen, url: str, argv: list[str], replicas: int) -> None:
        self.workdir, self.lighthouse, self.url = workdir, lighthouse, url
        self._argv, self.replicas = argv, replicas
        self.procs: list[subprocess.Popen | None] = [None] * replicas
        self._starts = [0] * replicas
        self.env = dict(os.environ, TORCHFT_LIGHTHOUSE=url, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
                        PYTHONUNBUFFERED="1")

    def _spawn(self, i: int) -> None:
        self._starts[i] += 1
        log = open(self.workdir / f"replica{i}.{self._starts[i]}.log", "wb")
        with log:
            self.procs[i] = subprocess.Popen(self._argv + ["--replica-id", str(i)], stdout=log,
                                             stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)

    def kill_replica(self, i: int) -> float:
        """SIGKILL replica ``i``; returns ``time.time()`` just before the signal."""
        proc = self.procs[i]
        t = time.time()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        return t

    def restart_replica(self, i: int) -> None:
        """Start replica ``i`` again (after ``kill_replica``); it heals from a live peer."""
        if self.procs[i] is not None and self.procs[i].poll() is None:
            raise RuntimeError(f"replica {i} is still running")
        self._spawn(i)

    def wait(self, timeout: float | None = None) -> list[int]:
        """Wait for every replica's current process to exit; their return codes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            codes.append(proc.wait(left))  # subprocess.TimeoutExpired when over time
        return codes

    def stop(self) -> None:
        """Kill whatever still runs (replicas first, then the lighthouse)."""
        for proc in [*self.procs, self.lighthouse]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start(params: str, steps: int, replicas: int, step_log: str | os.PathLike, workdir: str | os.PathLike,
          extra_args: list[str] = (), *, threads: int = 1, min_replicas: int = 1,
          heartbeat_timeout_ms: int = 5000, join_timeout_ms: int = 60000) -> TorchftJob:
    """Start the lighthouse and ``replicas`` replica processes; returns the job handle."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with open(workdir / "lighthouse.log", "wb") as log:
        lighthouse = subprocess.Popen(
            [_lighthouse_exe(), "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
             "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms)],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, lighthouse, timeout=30)
    except RuntimeError:
        lighthouse.kill()
        raise
    argv = [sys.executable, str(SCRIPT), "--params", str(params), "--steps", str(steps),
            "--replicas", str(replicas), "--min-replicas", str(min_replicas), "--threads", str(threads),
            "--lighthouse", f"http://127.0.0.1:{port}", "--step-log", str(step_log), *extra_args]
    job = TorchftJob(workdir, lighthouse, f"http://127.0.0.1:{port}", argv, replicas)
    for i in range(replicas):
        job._spawn(i)
    return job


def summarize(records: list[dict], t_kill: float, killed: int, replicas: int) -> dict:
    """Recovery numbers of one kill from the step records (``bench.common.read_log(path)[0]``).

    ``continue_s``: kill -> first step a surviving replica committed after it;
    ``full_size_s``: kill -> first step after it with ``participants == replicas``;
    ``max_step_before``: the highest step committed before the kill (any replica);
    ``first_step_after``: the first step a survivor committed after the kill;
    ``steps_recomputed``: ``max_step_before + 1 - first_step_after`` (committed steps done again);
    ``restarted_first_step``: the first step the restarted replica logged (its heal step).
    """
    before = [r for r in records if r["t"] <= t_kill]
    after = sorted((r for r in records if r["t"] > t_kill), key=lambda r: r["t"])
    survivor = next((r for r in after if r["replica"] != killed), None)
    full = next((r for r in after if r["participants"] >= replicas), None)
    restarted = next((r for r in after if r["replica"] == killed), None)
    max_before = max((r["step"] for r in before), default=0)
    return {
        "t_kill": t_kill,
        "continue_s": None if survivor is None else survivor["t"] - t_kill,
        "full_size_s": None if full is None else full["t"] - t_kill,
        "max_step_before": max_before,
        "first_step_after": None if survivor is None else survivor["step"],
        "steps_recomputed": None if survivor is None else max_before + 1 - survivor["step"],
        "restarted_first_step": None if restarted is None else restarted["step"],
        "restarted_first_t_s": None if restarted is None else restarted["t"] - t_kill,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="torchft kill -9 / restart experiment")
    p.add_argument("--params", default="1M")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=20, help="kill once the log shows this step")
    p.add_argument("--kill-replica", type=int, default=1)
    p.add_argument("--step-log", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=None, help="logs go here (default: a new temp dir)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    p.add_argument("--timeout", type=float, default=600, help="overall limit, seconds")
    args = p.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="torchft_job."))
    args.step_log.unlink(missing_ok=True)
    try:
        job = start(args.params, args.steps, args.replicas, args.step_log, workdir, threads=args.threads,
                    heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except RuntimeError as exc:
        sys.exit(f"torchft_job: {exc}")
    print(f"workdir {workdir} lighthouse {job.url}", flush=True)
    deadline = time.monotonic() + args.timeout
    try:
        try:
            common.wait_record(args.step_log, lambda r: r["step"] >= args.kill_at, deadline - time.monotonic(),
                               lambda: all(pr.poll() is None for pr in job.procs), f"step {args.kill_at}")
        except (RuntimeError, TimeoutError):
            sys.exit(f"torchft_job: never reached step {args.kill_at}; see {workdir}")
        t_kill = job.kill_replica(args.kill_replica)
        job.restart_replica(args.kill_replica)
        codes = job.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        sys.exit(f"torchft_job: timed out after {args.timeout:.0f}s; see {workdir}")
    finally:
        job.stop()
    summary = summarize(common.read_log(args.step_log)[0], t_kill, args.kill_replica, args.replicas)
    print(json.dumps({"exit_codes": codes, **summary}, indent=1))
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
