"""Restart mode against torchrun: a torchrun script, ``kill -9`` of one worker, the time it costs.

The script is ``bench/competitors/torchrun_gpt.py`` (plain torchrun: no tmrun runtime, DDP over
gloo, rank 0 checkpointing every ``--ckpt-every`` steps), the same in every run. Side by side, in
one run of this script, on two "nodes" of this machine with no standby:

- **torchrun**: two torchrun agents (``bench/competitors/torchrun_job.py``, c10d rendezvous,
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that a restart never reads the old round's gloo
  addresses); both agents restart their workers, which reload the checkpoint;
- **tmrun**: ``tmrun --nnodes 2 --max-restarts 3``: the killed worker's agent reports it, the
  leader writes a restart plan, both agents start new workers, which reload the checkpoint;
- **tmrun --warm-start**: the same, but each agent keeps a Python with torch imported waiting
  (``agent/warm.py``); the kill waits until both are there.

Once the step log shows step ``--kill-at`` committed, rank 1's worker gets SIGKILL. The cost is
``common.interruption``: wall time from the last step before the kill until new work, less a
median step per step (the steps recomputed since the checkpoint count as lost, the same number
under every launcher). Target (issue 12): time lost per failure ≤ 0.5 × torchrun's. Output: a
table, ``bench/results/restart_mode.json``::

    flock /tmp/tmrun-bench.lock python bench/restart_mode.py [--params 4M --steps 80 --kill-at 50 --ckpt-every 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from agent.procfs import descendants, running  # noqa: E402
from agent.warm import MARKER  # noqa: E402
from bench import common  # noqa: E402
from bench.competitors import torchrun_job as tj  # noqa: E402

NAME = "restart_mode"
SCRIPT = Path(tj.SCRIPT)


def train_args(args: argparse.Namespace, wd: Path) -> list[str]:
    return ["--params", args.params, "--steps", str(args.steps), "--threads", "1", "--ckpt-dir", str(wd / "ckpt"),
            "--ckpt-every", str(args.ckpt_every)]


def warm_interpreters(pid: int) -> int:
    return len(running(descendants(pid), MARKER))


def run_tmrun(args: argparse.Namespace, name: str, flags: list[str]) -> dict:
    wd = common.workdir(f"restart-{name}")
    steps, t_kill = kill_once(args, name, flags, wd)
    result = {"run": name, "launcher": "tmrun", "flags": flags, "interruption": common.interruption(steps, t_kill).to_dict(),
              "first_step_after_kill_s": first_after(steps, t_kill)}
    shutil.rmtree(wd, ignore_errors=True)
    return result


def kill_once(args: argparse.Namespace, name: str, flags: list[str], wd: Path) -> tuple[list[dict], float]:
    """The torchrun script under tmrun's restart mode (2 nodes, no standby), rank 1 killed once step
    ``args.kill_at`` is committed (with ``--warm-start``: once both warm interpreters are there);
    the step log and the kill's wall time. Also unplanned_failure.py's restart-mode row."""
    job = common.TmrunJob(wd, train_args(args, wd), nnodes=2, standby=0, script=SCRIPT, name=name,
                          flags=["--max-restarts", "3", *flags])
    try:
        deadline = time.monotonic() + args.timeout
        while "--warm-start" in flags and warm_interpreters(job.proc.pid) < 2:  # a /proc scan, no process
            if job.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no two warm interpreters (see {wd})")
            time.sleep(0.2)
        if common.read_log(job.step_log)[0] and max(r["step"] for r in common.read_log(job.step_log)[0]) >= args.kill_at:
            raise RuntimeError(f"step {args.kill_at} passed before the warm interpreters were ready: raise --kill-at")
        common.wait_for_step(job.step_log, 0, args.timeout, [job.proc])
        pid = job.node_of_rank(1)["worker_pids"][0]  # looked up now: a `tmrun status` takes steps
        common.wait_for_step(job.step_log, args.kill_at, args.timeout, [job.proc])
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        code = job.wait(args.timeout)
        if code != 0:
            raise RuntimeError(f"the tmrun job exited {code} (see {wd})")
    finally:
        job.stop()
        job.out.close()
        job.err.close()
    return common.read_log(job.step_log)[0], t_kill


def run_torchrun(args: argparse.Namespace) -> dict:
    wd = common.workdir("restart-torchrun")
    log = wd / "steps.jsonl"
    job = tj.start_job([*train_args(args, wd), "--step-log", str(log)], log_dir=wd / "agents",
                       rdzv_id=f"restart-{time.time_ns()}", env={"TMPDIR": str(wd)})
    try:
        t_kill = tj.kill_at_step(job, log, args.kill_at, timeout=args.timeout)
    finally:
        job.kill()
    steps, _ = common.read_log(log)
    result = {"run": "torchrun", "launcher": "torchrun", "interruption": common.interruption(steps, t_kill).to_dict(),
              "first_step_after_kill_s": first_after(steps, t_kill)}
    shutil.rmtree(wd, ignore_errors=True)
    return result


def first_after(steps: list[dict], t: float) -> float:
    return round(min(r["t"] for r in steps if r["t"] > t) - t, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="4M")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--kill-at", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the three runs (medians reported)")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    runs = []
    for _ in range(args.repeats):
        runs += [run_torchrun(args), run_tmrun(args, "tmrun", []), run_tmrun(args, "tmrun-warm", ["--warm-start"])]
    lost = {name: statistics.median(r["interruption"]["downtime"] for r in runs if r["run"] == name)
            for name in ("torchrun", "tmrun", "tmrun-warm")}
    summary = {"lost_s": lost, "ratio_tmrun": lost["tmrun"] / lost["torchrun"],
               "ratio_tmrun_warm": lost["tmrun-warm"] / lost["torchrun"], "target_ratio": 0.5}
    common.save(NAME, {"args": vars(args), "runs": runs, "summary": summary})
    common.print_table(f"kill -9 of rank 1, GPT {args.params}, checkpoint every {args.ckpt_every}",
                       ["run", "first step after the kill s", "lost s", "recomputed", "median step s"],
                       [(r["run"], r["first_step_after_kill_s"], r["interruption"]["downtime"],
                         r["interruption"]["recomputed"], r["interruption"]["median_step"]) for r in runs])
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
