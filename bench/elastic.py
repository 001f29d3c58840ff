"""Elastic resizes: a 2:4 job loses a node, is drained, and grows back; tmrun against torchrun.

Both run ``--nnodes 2:4`` with 4 nodes of one worker and no standby, training the GPT of
``examples/`` (``--params``, default 1M), and see the same three events at the same steps:

1. ``kill -9`` (tmrun: the worker of a node, which its agent reports at once; torchrun: a node's
   agent and its worker, since a torchrun agent whose worker died restarts it in place): the job
   goes on with 3. (A tmrun node killed whole, agent and all, is noticed when its lease expires,
   ``lease_ttl``: 3 s here, which the survivors then wait, as the e2e test shows.)
2. a drain (tmrun: ``tmrun drain``; torchrun has none, its nearest is SIGTERM to one agent,
   which leaves the rendezvous): 2 nodes. torchrun's c10d store lives in one of its agents, and
   losing that agent ends the whole job: its events spare that agent;
3. a new node's agent is started: 3 nodes.

tmrun resizes without a restart; torchrun stops every worker and restarts them from the last
checkpoint (``--ckpt-every``) at each change. For each event: the survivors' *stall* (tmrun:
the swap event's ``stall_s``, time the members that kept the state did not train; torchrun:
from the event to its first step past the last one committed before, less the steps done in
between, as ``common.interruption`` counts) against the median step before the event, and
tmrun's *leader decision time* (``decision_ms`` of the event that wrote the new plan: from the
change reaching the leader's copy of the keys to the plan written) against the 20 ms goal.

Output: tables, ``bench/results/elastic.json``, ``bench/results/elastic.md`` and
``docs/bench/elastic.png`` (step time over wall-clock, events marked). ``--quick``: 1M, fewer steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import common  # noqa: E402
from bench.competitors import torchrun_job  # noqa: E402

NAME = "elastic"
GOAL_STALL_STEPS = 2.0
GOAL_DECISION_MS = 20.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="1M", help="GPT size (default 1M)")
    p.add_argument("--every", type=int, default=25, help="steps between events (default 25)")
    p.add_argument("--ckpt-every", type=int, default=10, help="torchrun's checkpoint interval (default 10)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="fewer steps between events (15)")
    args = p.parse_args(argv)
    if args.quick:
        args.every = 15
    args.first = 2 * args.every  # the first event: after warm-up
    args.steps = args.first + 4 * args.every + 20  # the joiner needs a few seconds to start and warm up
    return args


def _train_args(args, log: Path) -> list[str]:
    return ["--params", args.params, "--steps", str(args.steps), "--threads", "1", "--step-log", str(log)]


# ---------------------------------------------------------------------------- tmrun

def run_tmrun(args, wd: Path) -> dict:
    job = common.TmrunJob(wd, _train_args(args, wd / "steps.jsonl")[:-2], nnodes="2:4", standby=0, name="elastic")
    newcomer = None
    marks: list[tuple[float, str]] = []
    try:
        job.wait_until(lambda d: d["hot_swap"] and sum(1 for n in d["nodes"] if n["ranks"]) == 4, args.timeout,
                       "4 members running the runtime")
        alive = [job.proc]
        common.wait_for_step(job.step_log, args.first, args.timeout, alive)
        victim = job.node_of_rank(3)
        at = job.kill_worker(3)  # its agent reports it at once (a node killed whole waits for its lease)
        marks.append((at, f"kill -9 {victim['node']}'s worker"))
        job.swap_events(1, args.timeout)

        common.wait_for_step(job.step_log, args.first + args.every, args.timeout, alive)
        leaver = job.node_of_rank(2)["node"]
        t0, _, said = job.drain(leaver)
        marks.append((t0, f"drain {leaver}"))
        job.swap_events(2, args.timeout)

        common.wait_for_step(job.step_log, args.first + 2 * args.every, args.timeout, alive)
        endpoint = "https://" + job.status()["endpoint"]  # the embedded etcd: TLS, the user's credentials
        at = time.time()
        newcomer = subprocess.Popen(
            [sys.executable, "-m", "tmrun.cli", "--rdzv-endpoint", endpoint, "--rdzv-id", job.job, "--nnodes", "2:4",
             "--node-name", "node-9", "--local-addr", "127.0.0.1", "--rdzv-conf", common.TMRUN_CONF, str(common.GPT),
             *_train_args(args, wd / "steps.jsonl")],
            env=job.env, stdout=open(wd / "node-9.out", "w"), stderr=open(wd / "node-9.err", "w"), cwd=common.REPO)
        marks.append((at, "node-9 joins"))
        swaps = job.swap_events(3, args.timeout)
        events = job.events()
        if job.wait(args.timeout) != 0 or newcomer.wait(120) != 0:
            raise RuntimeError(f"the tmrun job failed; see {wd}")
    finally:
        job.stop()
        if newcomer is not None and newcomer.poll() is None:
            newcomer.kill()
    steps, _ = common.read_log(job.step_log)
    plans = {e["gen"]: e for e in events if e["kind"] in ("failure", "drain", "scale-up")}
    rows = []
    for (at, what), swap in zip(marks, sorted(swaps, key=lambda s: s["gen"])):
        median = common.median_step(steps, before=at)
        plan = plans.get(swap["gen"], {})
        rows.append({"event": what, "gen": swap["gen"], "nodes_after": len(plan.get("data", {}).get("members", [])),
                     "median_step_s": round(median, 4), "stall_s": swap["stall_s"],
                     "stall_steps": round(swap["stall_s"] / median, 2), "joiner_stall_s": swap["joiner_stall_s"],
                     "decision_ms": plan.get("data", {}).get("decision_ms"),
                     "plan_written_s": swap["plan_written_s"], "first_step_s": swap["first_step_s"],
                     "bytes_moved": swap["bytes_moved"], "lost_s": common.interruption(steps, at).downtime,
                     "text": plan.get("text", "")})
    worlds = sorted({r.get("world") for r in steps if r.get("world")})
    return {"rows": rows, "steps": steps, "marks": marks, "worlds": worlds, "drain_said": said.strip()}


# ---------------------------------------------------------------------------- torchrun

def _listener(port: int) -> int | None:
    """The pid that listens on TCP ``port`` (from /proc): the agent hosting torchrun's c10d store."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    return None


def run_torchrun(args, wd: Path) -> dict:
    log = wd / "steps.jsonl"
    train = [*_train_args(args, log), "--ckpt-dir", str(wd / "ckpt"), "--ckpt-every", str(args.ckpt_every)]
    names = ["node0", "node1", "node2", "node3"]
    job = torchrun_job.start_job(train, nodes=names, log_dir=wd / "agents", max_restarts=10, nnodes="2:4",
                                 env={"TMPDIR": str(wd)},
                                 rdzv_conf={"last_call_timeout": 1, "join_timeout": 60})
    marks: list[tuple[float, str]] = []
    try:
        torchrun_job.wait_for_step(log, args.first, job, timeout=args.timeout)
        # The c10d store lives in one agent (whichever bound the port first); losing that agent ends
        # the job, whatever --nnodes says. The events spare it, so that torchrun shows its best.
        host = _listener(job.port)
        spared = [n.name for n in job.nodes if n.pid != host]
        victim = job.node(spared[-1])
        pids = torchrun_job.worker_pids(victim)
        at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        marks.append((at, f"kill -9 {victim.name}"))
        torchrun_job.wait_for_step(log, args.first + args.every, job, after=at, timeout=args.timeout)
        at = time.time()
        job.node(spared[-2]).agent.send_signal(signal.SIGTERM)
        marks.append((at, f"SIGTERM {spared[-2]}'s agent"))
        torchrun_job.wait_for_step(log, args.first + 2 * args.every, job, after=at, timeout=args.timeout)
        at = time.time()
        torchrun_job.add_node(job, "node9")
        marks.append((at, "node9 joins"))
        codes = [n.agent.wait(args.timeout) for n in job.nodes if n.name not in spared[-2:]]
    finally:
        job.kill()
    if any(codes):
        raise RuntimeError(f"torchrun agents exited {codes}; see {wd}/agents")
    lines = common.read_records(log)
    steps = [ln for ln in lines if "event" not in ln]
    rows = []
    for at, what in marks:
        detail = torchrun_job.recovery(lines, at)
        median = common.median_step(steps, before=at)
        # The old workers may train on for a while after the event (a joiner's agent starting up):
        # the interruption begins at their last step before the new workers started.
        started = at + detail["started_s"]
        stopped = max(r["t"] for r in steps if r["t"] < started)
        lost = common.interruption(sorted(steps, key=lambda r: r["t"]), stopped + 1e-6).downtime
        rows.append({"event": what, "median_step_s": round(median, 4), "restarted_s": round(detail["started_s"], 3),
                     "recomputed": detail["recomputed"], "caught_up_s": detail["caught_up_s"] and round(detail["caught_up_s"], 3),
                     "lost_s": round(lost, 3), "lost_steps": round(lost / median, 2)})
    return {"rows": rows, "steps": sorted(steps, key=lambda r: r["t"]), "marks": marks}


# ---------------------------------------------------------------------------- report

def report(args, tm: dict, tr: dict) -> dict:
    common.print_table("tmrun: elastic resizes without a restart",
                       ["event", "nodes after", "median step (s)", "survivors' stall (s)", "stall (steps)",
                        "joiner's stall (s)", "decision (ms)", "time lost (s)"],
                       [(r["event"], r["nodes_after"], r["median_step_s"], r["stall_s"], r["stall_steps"],
                         r["joiner_stall_s"], r["decision_ms"], r["lost_s"]) for r in tm["rows"]])
    common.print_table("torchrun: every change restarts every worker",
                       ["event", "median step (s)", "workers restarted (s)", "steps recomputed",
                        "caught up (s)", "time lost (s)", "time lost (steps)"],
                       [(r["event"], r["median_step_s"], r["restarted_s"], r["recomputed"], r["caught_up_s"],
                         r["lost_s"], r["lost_steps"]) for r in tr["rows"]])
    ratios = [round(b["lost_s"] / a["lost_s"], 1) if a["lost_s"] > 0 else None for a, b in zip(tm["rows"], tr["rows"])]
    doc = {"machine": common.machine(), "command": common.command_line(), "params": args.params,
           "steps": args.steps, "ckpt_every": args.ckpt_every,
           "tmrun": {k: v for k, v in tm.items() if k not in ("steps", "marks")},
           "torchrun": {k: v for k, v in tr.items() if k not in ("steps", "marks")},
           "torchrun_over_tmrun_time_lost": ratios,
           "goals": {"stall_steps": GOAL_STALL_STEPS, "decision_ms": GOAL_DECISION_MS}}
    common.save(NAME, doc)
    common.plot_step_times(NAME, {"tmrun (no restart)": (tm["steps"], tm["marks"]),
                                  "torchrun (restarts)": (tr["steps"], tr["marks"])},
                           f"--nnodes 2:4, GPT {args.params}: kill -9, drain, join")
    stalls = [r["stall_steps"] for r in tm["rows"]]
    decisions = [r["decision_ms"] for r in tm["rows"] if r["decision_ms"] is not None]
    print(f"survivors' stall: median {statistics.median(stalls):.2f} steps, max {max(stalls):.2f} "
          f"(goal <= {GOAL_STALL_STEPS:g}); leader decision: max {max(decisions):.1f} ms (goal <= {GOAL_DECISION_MS:g})")
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tm = run_tmrun(args, common.workdir("elastic-tmrun"))
    tr = run_torchrun(args, common.workdir("elastic-torchrun"))
    report(args, tm, tr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
