"""Run ``torchrun_gpt.py`` the way a person would on one machine pretending to be two nodes.

Each "node" is its own ``torchrun`` agent (``--nnodes 2 --nproc-per-node 1``) meeting the other
through the c10d rendezvous at ``127.0.0.1:PORT``; the agents are separate processes with
distinct rendezvous node ids, exactly as on two hosts. What torchrun can do about a lost or
replaced node is what this module measures:

- a failure (:func:`kill_worker`: ``kill -9`` of one worker, not of its agent): the worker's
  agent sees it die, the peer's worker fails on its next collective, both agents stop their
  workers, rendezvous again and start new workers (up to ``--max-restarts`` times), which reload
  the latest checkpoint and recompute the steps after it;
- a planned migration (:func:`migrate`): torchrun cannot swap a node in a running job, so the job
  is stopped (SIGTERM to both agents) and started again with the replacement node (new agents),
  which reload the latest checkpoint.

:func:`recovery` reads the step log (:func:`bench.common.read_records`) of ``torchrun_gpt.py --step-log`` to say what an event cost:
the time from the event to the next committed step and the steps computed twice.

Where a restart's time goes (torch 2.13, CPU): the failed worker's agent notices within
``--monitor-interval`` (0.1 s); the other agent notices a node waiting for the next rendezvous
round (or its own worker failing on the broken collective) and SIGTERMs its worker; the c10d
rendezvous polls its store once a second (fixed in torch), so a round takes 1-2 s; then every
worker is a fresh process that imports torch, builds its process group, reloads the checkpoint
and recomputes the steps after it. None of the rendezvous timeouts (:data:`RDZV_CONF`) is on
this path as long as both agents live; ``join_timeout`` only bounds how long a (re)started job
waits for a missing node.

Demo (kills a worker at step >= 20, optionally migrates later, prints the costs)::

    python bench/competitors/torchrun_job.py --params 1M --steps 60 --kill-at 20 \\
        --step-log /tmp/x.jsonl --ckpt-every 10 [--migrate-at 40] [--reference]

Arguments it does not know are passed to the training script. Only step-log lines written after
the job started are read (the file is appended to, never truncated); the checkpoint directory
(default: a fresh temporary one) must hold no checkpoint from another run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python bench/competitors/torchrun_job.py`: the repo root, not this folder, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])
from agent.etcd_server import free_port  # noqa: E402
from agent.procfs import children, cmdline  # noqa: E402
from bench import common  # noqa: E402

SCRIPT = Path(__file__).resolve().with_name("torchrun_gpt.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the ``torchrun`` entry point runs

# c10d rendezvous settings (seconds), passed as --rdzv-conf. join_timeout bounds how long an agent
# waits for the other node (torch's default 600); with --nnodes 2 (min == max) the rendezvous
# closes as soon as both agents are in, so last_call never delays it. The others are torch's
# defaults, spelled out: they only matter when an agent itself disappears.
RDZV_CONF = {"join_timeout": 60, "last_call_timeout": 30, "close_timeout": 30, "heartbeat_timeout": 5,
             "keep_alive_interval": 5, "keep_alive_max_attempt": 3}
MONITOR_INTERVAL = 0.1  # s between an agent's checks of its workers (torch's default since 2.2; was 5)

# By default (torch >= 2.5) the c10d rendezvous shares its agent-hosted TCPStore with the workers
# and keeps it across restarts, while init_process_group assumes a fresh store per restart: the new
# workers can read the previous generation's gloo addresses and fail ("connectFullMesh ... Connection
# refused") or hang in connectFullMesh until the process group timeout (seen here with torch 2.13;
# pytorch/pytorch#135712). Opting out gives every rendezvous round a fresh store hosted by worker rank 0.
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclasses.dataclass
class Node:
    """One "node": its name and its torchrun agent process."""

    name: str
    agent: subprocess.Popen
    log: Path
    log_offset: int = 0  # where this agent's output starts in ``log`` (logs are appended to)

    @property
    def pid(self) -> int:
        return self.agent.pid


@dataclasses.dataclass
class Job:
    """The agents of one torchrun launch, and how they were started."""

    nodes: list[Node]
    train_args: list[str]
    port: int
    log_dir: Path
    started: float  # time.time() just before the first agent was started
    options: dict

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def wait(self, timeout: float | None = None) -> list[int]:
        """Wait for every agent to exit; their exit codes, in node order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return [n.agent.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                for n in self.nodes]

    def kill(self) -> None:
        """SIGKILL whatever is left of this job: every agent and its workers (cleanup)."""
        for n in self.nodes:
            for pid in worker_pids(n):
                _signal(pid, signal.SIGKILL)
            if n.agent.poll() is None:
                n.agent.kill()
                n.agent.wait()


def agent_command(port: int, train_args: list[str], *, nnodes: int | str = 2, max_restarts: int = 3,
                  rdzv_id: str = "torchrun-gpt", rdzv_conf: dict | None = None,
                  monitor_interval: float = MONITOR_INTERVAL, script: Path = SCRIPT) -> list[str]:
    """The ``torchrun`` command line of one node's agent."""
    conf = ",".join(f"{k}={v}" for k, v in {**RDZV_CONF, **(rdzv_conf or {})}.items())
    return [*TORCHRUN, "--nnodes", str(nnodes), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
            "--rdzv-conf", conf, "--max-restarts", str(max_restarts),
            "--monitor-interval", str(monitor_interval), str(script), *train_args]


def start_job(train_args: list[str], *, nodes: tuple[str, ...] | list[str] = ("node0", "node1"),
              port: int | None = None, log_dir: Path | None = None, max_restarts: int = 3,
              rdzv_id: str = "torchrun-gpt", rdzv_conf: dict | None = None,
              monitor_interval: float = MONITOR_INTERVAL, env: dict | None = None,
              nnodes: str | None = None, script: Path = SCRIPT) -> Job:
    """Start one torchrun agent per node name; they rendezvous among themselves.

    ``nnodes`` (``"MIN:MAX"``) makes the job elastic; by default it is the number of nodes.

    Each agent runs in its own session (so a terminal's Ctrl-C reaches only this process) and
    appends its output, with its workers', to ``log_dir/<name>.log``. ``LOGLEVEL=INFO`` makes the
    agents log their rendezvous and restarts with timestamps; see :data:`NO_SHARED_STORE` for the
    one setting that is not torchrun's default (``env`` can override it).
    """
    port = port or free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="torchrun-job-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    options = dict(max_restarts=max_restarts, rdzv_id=rdzv_id, rdzv_conf=rdzv_conf,
                   monitor_interval=monitor_interval, env=env, nnodes=nnodes or str(len(nodes)), script=script)
    started = time.time()
    job = Job([], list(train_args), port, log_dir, started, options)
    for name in nodes:
        add_node(job, name)
    return job


def add_node(job: Job, name: str) -> Node:
    """Start one more agent with the job's command line (an elastic job grows by it, with a restart)."""
    o = job.options
    cmd = agent_command(job.port, job.train_args, nnodes=o["nnodes"], max_restarts=o["max_restarts"],
                        rdzv_id=o["rdzv_id"], rdzv_conf=o["rdzv_conf"], monitor_interval=o["monitor_interval"],
                        script=o.get("script", SCRIPT))
    full_env = {**os.environ, "LOGLEVEL": "INFO", **NO_SHARED_STORE, **(o["env"] or {})}
    log = job.log_dir / f"{name}.log"
    with open(log, "ab") as out:
        offset = out.tell()
        out.write(f"=== {name} started at {time.time():.3f}: {' '.join(cmd)}\n".encode())
        out.flush()
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=full_env, start_new_session=True)
    node = Node(name, agent, log, offset)
    job.nodes.append(node)
    return node


def worker_pids(agent: Node | subprocess.Popen | int, script: Path = SCRIPT) -> list[int]:
    """The live worker processes of a torchrun agent: its children running ``script``."""
    pid = agent if isinstance(agent, int) else agent.pid
    return [kid for kid in children(pid) if str(script).encode() in (cmdline(kid) or [])]


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_at_step(job: Job, log: Path, step: int, node: str = "node1", timeout: float = 600.0) -> float:
    """Once ``log`` shows ``step``, ``kill -9`` the worker of ``node``; wait for the job to end (its
    agents must all exit 0). The wall time of the kill."""
    wait_for_step(log, step, job, timeout=timeout)
    _, t_kill = kill_worker(job, node)
    codes = job.wait(timeout)
    if any(codes):
        raise RuntimeError(f"torchrun agents exited {codes} (see {job.log_dir})")
    return t_kill


def kill_worker(job: Job, node: str = "node1", sig: int = signal.SIGKILL, timeout: float = 30.0) -> tuple[int, float]:
    """``kill -9`` the worker of ``node`` (not its agent); ``(pid, time.time() of the kill)``."""
    deadline = time.monotonic() + timeout
    while not (pids := worker_pids(job.node(node), job.options.get("script", SCRIPT))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node} has no worker to kill")
        time.sleep(0.05)
    t = time.time()
    _signal(pids[0], sig)
    return pids[0], t


def stop_job(job: Job, timeout: float = 60.0) -> float:
    """SIGTERM every agent (each stops its workers and leaves the rendezvous); seconds until all exited.

    Agents still alive after ``timeout`` are killed with their workers.
    """
    t0 = time.monotonic()
    for n in job.nodes:
        if n.agent.poll() is None:
            n.agent.send_signal(signal.SIGTERM)
    try:
        job.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
    return time.monotonic() - t0


def migrate(job: Job, leaving: str = "node1", joining: str = "node2", *, new_port: bool = False,
            timeout: float = 60.0) -> tuple[Job, dict]:
    """Replace node ``leaving`` by ``joining`` the only way torchrun can: stop, start again, reload.

    Returns the new job and ``{"t": time.time() of the SIGTERM, "stop_s": seconds until every old
    agent had exited}``; the new workers resume from the latest checkpoint (see :func:`recovery`).
    """
    t = time.time()
    stop_s = stop_job(job, timeout)
    names = [n.name for n in job.nodes if n.name != leaving] + [joining]
    new = start_job(job.train_args, nodes=names, port=free_port() if new_port else job.port,
                    log_dir=job.log_dir, **job.options)
    return new, {"t": t, "stop_s": stop_s}


# ---------------------------------------------------------------------------------- step log
def wait_for_step(path: Path, step: int, job: Job, *, after: float = 0.0, timeout: float = 600.0) -> dict:
    """Poll the step log until a committed step >= ``step`` logged after time ``after``; that line."""
    return common.wait_record(path, lambda r: r["step"] >= step and r["t"] > after, timeout,
                              lambda: any(n.agent.poll() is None for n in job.nodes), f"step {step} (see {job.log_dir})")


def recovery(lines: list[dict], t_event: float) -> dict:
    """What an event at ``t_event`` (a kill, a stop) cost, from the step log.

    The first ``started`` event after ``t_event`` opens the new generation; every line before it
    is the old one's (the agents stop all old workers before starting new ones). Returns:
    ``last_step`` (the old generation's last committed step), ``loaded`` (the checkpoint step
    the new one resumed at, 0 without one), ``recomputed`` (``last_step - loaded``), and seconds
    from the event to ``started`` (new workers in their process group), to ``loaded`` and to
    ``continued`` (the first step the new generation committed, step ``loaded + 1``) and to
    ``caught_up`` (its first step past ``last_step``: the event's whole cost in time).
    """
    i = next((k for k, ln in enumerate(lines) if ln.get("event") == "started" and ln["t"] > t_event), None)
    if i is None:
        raise ValueError("no generation started after the event")
    last = max((ln["step"] for ln in lines[:i] if "event" not in ln), default=0)
    loaded = next((ln for ln in lines[i:] if ln.get("event") == "loaded"), None)
    first = next((ln for ln in lines[i:] if "event" not in ln), None)
    back = next((ln for ln in lines[i:] if ln.get("step", 0) > last and "event" not in ln), None)
    return {"last_step": last, "loaded": loaded["step"] if loaded else 0,
            "recomputed": last - (loaded["step"] if loaded else 0),
            "started_s": lines[i]["t"] - t_event,
            "loaded_s": loaded["t"] - t_event if loaded else None,
            "continued_s": first["t"] - t_event if first else None,
            "continued_step": first["step"] if first else None,
            "caught_up_s": back["t"] - t_event if back else None}


def done_line(job: Job) -> str | None:
    """The training script's final ``done ... sha256=...`` line from the job's node logs."""
    for n in job.nodes:
        with open(n.log, "rb") as f:
            f.seek(n.log_offset)
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith("done steps="):
                    return line
    return None


def reference_done(train_args: list[str], world: int = 2, timeout: float = 600.0) -> str | None:
    """The ``done`` line of an uninterrupted ``torchrun --standalone`` run of the same arguments."""
    args = list(train_args)
    for flag in ("--ckpt-dir", "--step-log"):  # the reference neither resumes nor logs
        if flag in args:
            k = args.index(flag)
            del args[k:k + 2]
    out = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), str(SCRIPT), *args],
                         capture_output=True, text=True, timeout=timeout)
    return next((ln for ln in out.stdout.splitlines() if ln.startswith("done steps=")), None)


# ---------------------------------------------------------------------------------- demo
def _report(what: str, r: dict) -> None:
    loaded = "-" if r["loaded_s"] is None else f"{r['loaded_s']:.2f} s"
    print(f"{what}: training continued after {r['continued_s']:.2f} s (step {r['continued_step']}); "
          f"new workers in their group after {r['started_s']:.2f} s, checkpoint loaded after {loaded}", flush=True)
    caught_up = "-" if r["caught_up_s"] is None else f"{r['caught_up_s']:.2f} s"
    print(f"{what}: steps recomputed {r['recomputed']} (last step before: {r['last_step']}, "
          f"checkpoint step loaded: {r['loaded']}); past step {r['last_step']} again after {caught_up}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="1M")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="default: a temporary directory, removed at the end")
    p.add_argument("--step-log", type=Path, required=True, help="appended to; lines from before the start are ignored")
    p.add_argument("--kill-at", type=int, default=None, help="kill -9 a worker once step >= N committed")
    p.add_argument("--kill-node", default="node1")
    p.add_argument("--migrate-at", type=int, default=None, help="replace --kill-node by node2 at step >= N")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--log-dir", type=Path, default=None, help="agent logs (default: a temporary directory)")
    p.add_argument("--reference", action="store_true", help="also run uninterrupted and compare sha256")
    args, extra = p.parse_known_args(argv)

    ckpt_dir = args.ckpt_dir or Path(tempfile.mkdtemp(prefix="torchrun-ckpt-"))
    if (ckpt_dir / "checkpoint.pt").exists():
        p.error(f"{ckpt_dir} already holds a checkpoint: the run would resume from it")
    train_args = ["--params", str(args.params), "--steps", str(args.steps), "--threads", str(args.threads),
                  "--ckpt-dir", str(ckpt_dir), "--ckpt-every", str(args.ckpt_every),
                  "--step-log", str(args.step_log), *extra]

    job = start_job(train_args, port=args.port, log_dir=args.log_dir, max_restarts=args.max_restarts)
    t0 = job.started
    print(f"agents {[n.pid for n in job.nodes]} on 127.0.0.1:{job.port}, logs in {job.log_dir}", flush=True)
    events = []
    try:
        if args.kill_at is not None:
            wait_for_step(args.step_log, args.kill_at, job, after=t0)
            pid, t_kill = kill_worker(job, args.kill_node)
            print(f"killed worker {pid} of {args.kill_node} at +{t_kill - job.started:.2f} s", flush=True)
            events.append(("kill", t_kill))
        if args.migrate_at is not None:
            wait_for_step(args.step_log, args.migrate_at, job, after=events[-1][1] if events else t0)
            job, info = migrate(job, args.kill_node, "node2")
            print(f"migration {args.kill_node} -> node2: old agents stopped in {info['stop_s']:.2f} s", flush=True)
            events.append(("migration", info["t"]))
        codes = job.wait(timeout=1800)
    finally:
        job.kill()
        if args.ckpt_dir is None:  # the temporary one made here
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    t_end = time.time()

    lines = [ln for ln in common.read_records(args.step_log) if ln["t"] >= t0]
    for what, t in events:
        _report(what, recovery(lines, t))
    print(f"total time {t_end - t0:.2f} s, agent exit codes {codes}", flush=True)
    done = done_line(job)
    print(done or "no done line (see the agent logs)", flush=True)
    if args.reference:
        t_ref = time.time()
        ref = reference_done(train_args)
        print(f"reference (uninterrupted, torchrun --standalone, {time.time() - t_ref:.2f} s): {ref}\nsame weights as the uninterrupted run: {bool(done) and done == ref}", flush=True)
    return 0 if done and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
