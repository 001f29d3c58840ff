"""Unplanned failure: ``kill -9`` of one worker at step K, and how long each system needs to recover.

The same GPT (``examples/gpt_model.py``: same model, data, batch, optimizer, one torch thread per
worker) is trained on two "nodes" of this machine under three systems. Once the step log shows
step ``--kill-at`` (K) committed, one worker gets SIGKILL, and the system does what it does
by default:

- **tmrun**: ``examples/train_gpt.py`` on a local tmrun cluster of 2 nodes + 1 standby
  (``common.TmrunJob``). The kill waits until the standby is warm (shadow-trained). The worker of
  rank 1 is killed; a worker killed by a signal is a clear culprit, so the leader writes a
  ``swap-now`` plan at once and the standby takes rank 1; its state comes from the survivor's
  memory. ``tmrun``'s default timeouts (``--rdzv-conf join_timeout=120`` only bounds the first
  rendezvous; neither ``lease_ttl`` nor ``failure_window`` plays a part in a kill -9 of a worker).
- **torchrun**: ``bench/competitors/torchrun_gpt.py`` under two torchrun agents (``--nnodes 2
  --max-restarts 3``, c10d rendezvous, torch's defaults), rank 0 checkpointing every
  ``--ckpt-every`` steps. The worker of node1 is killed; both agents stop their workers,
  rendezvous again and start new ones, which reload the checkpoint and recompute the steps after it.
  Run twice: as is (*torchrun*; torch shares the rendezvous TCPStore with the workers, and a
  restarted gloo worker can read its peer's address of the previous generation from it and fail,
  pytorch/pytorch#135712, which costs a whole extra restart when it happens) and with the
  documented workaround ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (*torchrun-fresh*).
- **tmrun-restart**: ``bench/competitors/torchrun_gpt.py`` (the torchrun script, no tmrun runtime,
  checkpoint every ``--ckpt-every``) under tmrun's restart mode with ``--warm-start``, 2 nodes, no
  standby (``restart_mode.kill_once``): every worker is restarted from the checkpoint, from a
  Python with torch already imported. Target: time lost (*downtime*) at most 0.5x torchrun's.
- **torchft**: ``bench/competitors/torchft_gpt.py``, a lighthouse and 2 replica groups of one
  process each (torchft 0.2.0 defaults: heartbeat timeout 5000 ms, join timeout 60000 ms;
  ``min_replicas`` 1 so the survivor may go on alone). Replica 1 is killed and started again at
  once (what a node's supervisor would do); it heals from the survivor over HTTP.

Measured from each system's step log (one JSON line per committed step) against the kill's wall
time (the harness polls the step log every 20 ms and spawns nothing while a job recovers):

- *continues*: seconds until the first committed step after the kill (any replica);
- *full size*: seconds until the first committed step at full size (tmrun: the first step of the
  swapped-in generation, both ranks; torchrun: the first step after the restart; torchft: the
  first step whose ``participants`` equals the number of replicas);
- *recomputed*: steps committed twice (work lost); *reduced*: steps committed at less than full
  size before that (torchft's survivor trains alone: half the global batch per step);
- *downtime*: ``common.interruption``: wall time lost against the median step;
- the ratios torchrun/tmrun and torchft/tmrun of *full size*.

For tmrun the job's ``swap`` event is recorded too (its timings count from the failed worker's
report; this script also counts them from the kill), and the limit it is held to: *failure
reported* (kill to the failed worker's report) + *one group build* (the slowest member's, from
its ``prepare``'s arrival: ``group_build`` of the switch) + *state bytes ÷ loopback* (the bytes
the joiner received over a plain TCP copy's rate on 127.0.0.1, measured at the start of this
run) + *one median step*; target: back at full size within 1.2x of it. Targets: back at full size at least 10x
sooner than torchrun (both ways), and sooner than torchft. Note that torchrun's *full size* is
its first step after the restart, a recomputed one: the recomputation shows in *downtime*.

Output: a table, ``bench/results/unplanned_failure.json``, ``docs/bench/unplanned_failure.png``
and ``bench/results/unplanned_failure.md`` (a section for docs/benchmarks.md). Runs one job at a
time; on a shared machine wrap it in ``flock /tmp/tmrun-bench.lock``::

    python bench/unplanned_failure.py --quick
    python bench/unplanned_failure.py --sizes 5M,50M --kill-at 30
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # train_gpt's parse_count
from bench import common, restart_mode  # noqa: E402
from bench.competitors import torchft_job, torchrun_job  # noqa: E402

COMPETITORS = ("tmrun", "torchrun", "torchrun-fresh", "torchft", "tmrun-restart")
TARGET_TORCHRUN = 10.0  # back at full size at least this many times sooner than torchrun
TARGET_LIMIT = 1.2  # back at full size within this many times the limit (report + group build + bytes + a step)
TARGET_RESTART = 0.5  # restart mode's time lost at most this fraction of torchrun's
LOOPBACK_MB = 256  # the loopback copy that sets the limit's transfer term
TMRUN_CONF = "join_timeout=120"  # tmrun's defaults otherwise; join_timeout only bounds the first rendezvous
FT_HEARTBEAT_MS, FT_JOIN_MS = 5000, 60000  # torchft's lighthouse defaults
QUICK = {"sizes": "1M", "kill_at": 20, "steps": 35, "ckpt_every": 15}
DEFAULTS = {"sizes": "5M,50M", "kill_at": 30, "steps": None, "ckpt_every": 20}  # steps: kill_at + 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.Parser(prog="unplanned_failure", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help=f"model sizes, comma-separated (default {DEFAULTS['sizes']})")
    p.add_argument("--kill-at", type=int, help=f"kill once step K is committed (default {DEFAULTS['kill_at']})")
    p.add_argument("--steps", type=int, help="steps per run (default: kill-at + 20)")
    p.add_argument("--ckpt-every", type=int, help=f"torchrun's checkpoint interval (default {DEFAULTS['ckpt_every']})")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts (default 3)")
    p.add_argument("--competitors", default=",".join(COMPETITORS),
                   help="subset of " + ",".join(COMPETITORS) + " (default all; torchrun-fresh: torchrun with "
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the workaround for pytorch/pytorch#135712)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK['sizes']}, kill at {QUICK['kill_at']}, {QUICK['steps']} steps, "
                        f"checkpoint every {QUICK['ckpt_every']} (explicit flags win)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run (default 1800)")
    p.add_argument("--keep", action="store_true", help="keep the runs' working directories (logs)")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps is None:
        args.steps = args.kill_at + 20
    try:
        args.size_list = [s.strip() for s in args.sizes.split(",") if s.strip()]
        from train_gpt import parse_count
        for s in args.size_list:
            parse_count(s)
    except argparse.ArgumentTypeError as exc:
        p.error(f"--sizes: {exc}")
    if not args.size_list:
        p.error("--sizes: no size given")
    args.competitor_list = [c.strip() for c in args.competitors.split(",") if c.strip()]
    unknown = [c for c in args.competitor_list if c not in COMPETITORS]
    if unknown or not args.competitor_list:
        p.error(f"--competitors: unknown {unknown or 'empty'}; choose from {','.join(COMPETITORS)}")
    if args.kill_at < 2:
        p.error("--kill-at must be >= 2")
    if args.ckpt_every < 1 or args.max_restarts < 1:
        p.error("--ckpt-every and --max-restarts must be >= 1")
    if args.steps < args.kill_at + 5:
        p.error(f"--steps must be at least kill-at + 5 ({args.kill_at + 5}) to see the recovery")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


# ---------------------------------------------------------------------------- helpers

def wait_step(path: Path, step: int, timeout: float, alive) -> float:
    return common.wait_record(path, lambda r: r["step"] >= step, timeout, alive, f"step {step}")["t"]


def first_per_step(steps: list[dict]) -> list[dict]:
    """One record per step (the earliest): torchft's replicas each log every step they commit."""
    seen, out = set(), []
    for r in steps:
        if r["step"] not in seen:
            seen.add(r["step"])
            out.append(r)
    return out


def recovery(steps: list[dict], t_kill: float, full) -> dict:
    """The common numbers: ``full(record)`` says whether a record after the kill is at full size."""
    after = [r for r in steps if r["t"] > t_kill]
    cut = common.interruption(steps, t_kill)
    first_full = next((r for r in after if full(r)), None)
    reduced = {r["step"] for r in after if first_full is None or r["t"] < first_full["t"]}
    return {"kill_step": cut.last_before, "continue_s": round(cut.continued_after, 3),
            "full_size_s": None if first_full is None else round(first_full["t"] - t_kill, 3),
            "full_size_step": None if first_full is None else first_full["step"],
            "recomputed": cut.recomputed, "reduced": len(reduced), "new_work_s": round(cut.new_work_after, 3),
            "downtime_s": round(cut.downtime, 3), "median_step_s": round(cut.median_step, 4)}


# ---------------------------------------------------------------------------- the competitors

def run_tmrun(size: str, args, wd: Path) -> dict:
    job = common.TmrunJob(wd, ["--params", size, "--steps", str(args.steps), "--threads", "1"],
                          nnodes=2, standby=1, conf=TMRUN_CONF, name="unplanned")
    try:
        job.wait_hot(1, timeout=args.timeout)
        pid = job.node_of_rank(1)["worker_pids"][0]
        wait_step(job.step_log, args.kill_at, args.timeout, lambda: job.proc.poll() is None)
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        gen = max(r["gen"] for r in common.read_log(job.step_log)[0] if r["t"] <= t_kill)
        # read the swap event only once the job is back at full size, so that no `tmrun events`
        # process competes with the recovery for the CPU; it must be read before the job (and its etcd) ends
        alive = lambda: job.proc.poll() is None  # noqa: E731
        common.wait_record(job.step_log, lambda r: r["gen"] > gen, args.timeout, alive, "the swapped-in generation")
        swaps = job.swap_events(1, timeout=args.timeout)
        code = job.wait(args.timeout)
    finally:
        job.stop()
        job.out.close()
        job.err.close()
    if code != 0:
        raise RuntimeError(f"tmrun exited {code}; see {wd}/tmrun.err")
    steps, _ = common.read_log(job.step_log)
    gen_before = max(r["gen"] for r in steps if r["t"] <= t_kill)
    out = recovery(steps, t_kill, lambda r: r["gen"] > gen_before and r["world"] == 2)
    marks = [(t_kill, "kill -9 rank 1")]
    if swaps:
        s = swaps[0]
        report = s["requested"] - t_kill
        out["swap"] = {**s, "report_after_kill_s": round(report, 4),
                       **{f"{k[:-2]}_from_kill_s": round(report + s[k], 4) for k in
                          ("plan_written_s", "phase1_started_s", "phase1_done_s", "switched_s", "first_step_s")
                          if s.get(k) is not None}}
        if s.get("switched_s") is not None:
            marks.append((s["requested"] + s["switched_s"], "swapped in"))
    else:
        out["swap"] = None
    return {"steps": steps, "marks": marks, "result": out}


def run_torchrun(size: str, args, wd: Path, fresh_store: bool = False) -> dict:
    log = wd / "steps.jsonl"
    ckpt = wd / "ckpt"
    train = ["--params", size, "--steps", str(args.steps), "--threads", "1", "--ckpt-dir", str(ckpt),
             "--ckpt-every", str(args.ckpt_every), "--step-log", str(log)]
    # torch's default shares the rendezvous TCPStore with the workers, and restarted gloo workers can read the
    # previous generation's addresses from it (pytorch/pytorch#135712); the documented workaround turns that off
    env = {"TMPDIR": str(wd)}  # torch's launcher leaves a torchelastic_* log dir in $TMPDIR: keep it in wd
    if fresh_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    job = torchrun_job.start_job(train, log_dir=wd / "agents", max_restarts=args.max_restarts, env=env)
    try:
        wait_step(log, args.kill_at, args.timeout, lambda: any(n.agent.poll() is None for n in job.nodes))
        _, t_kill = torchrun_job.kill_worker(job, "node1")
        codes = job.wait(args.timeout)
    finally:
        job.kill()
    if any(codes):
        raise RuntimeError(f"torchrun agents exited {codes}; see {wd}/agents")
    steps, _ = common.read_log(log)
    out = recovery(steps, t_kill, lambda r: True)
    detail = torchrun_job.recovery(common.read_records(log), t_kill)
    out["restart"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in detail.items()}
    out["restart"].update(agent_rounds(job, t_kill))
    marks = [(t_kill, "kill -9 node1's worker"), (t_kill + detail["started_s"], "workers restarted")]
    return {"steps": steps, "marks": marks, "result": out}


def agent_rounds(job, t_kill: float) -> dict:
    """From the agents' logs (LOGLEVEL=INFO): worker groups started and failed after the kill.

    A restarted generation whose workers fail before ``init_process_group`` returns never shows
    in the step log; the agents' log lines (``I1202 16:43:07.446000 pid file:line] ...``, local
    time) do.
    """
    year = time.localtime(t_kill).tm_year
    started, failed, last = 0, 0, None
    pattern = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d)(\.\d+) .*\] \[default\] "
                         r"(Starting worker group|Worker group FAILED)")
    for node in job.nodes:
        for line in node.log.read_text(errors="replace").splitlines():
            m = pattern.match(line)
            if not m:
                continue
            t = time.mktime(time.strptime(f"{year}{m[1]} {m[2]}", "%Y%m%d %H:%M:%S")) + float(m[3])
            if t > t_kill:
                if m[4].startswith("Starting"):
                    started += 1
                    last = t
                else:
                    failed += 1
    # every round starts one worker group per agent; a FAILED line is one agent's own workers failing
    return {"worker_groups_started": started // len(job.nodes), "agents_whose_workers_failed": failed,
            "last_round_started_s": None if last is None else round(last - t_kill, 3)}


def run_tmrun_restart(size: str, args, wd: Path) -> dict:
    job_args = argparse.Namespace(params=size, steps=args.steps, kill_at=args.kill_at, ckpt_every=args.ckpt_every,
                                  timeout=args.timeout)
    steps, t_kill = restart_mode.kill_once(job_args, "unplanned-restart", ["--warm-start"], wd)
    return {"steps": steps, "marks": [(t_kill, "kill -9 rank 1")], "result": recovery(steps, t_kill, lambda r: True)}


def run_torchft(size: str, args, wd: Path) -> dict:
    log = wd / "steps.jsonl"
    replicas = 2
    job = torchft_job.start(size, args.steps, replicas, log, wd, threads=1, min_replicas=1,
                            heartbeat_timeout_ms=FT_HEARTBEAT_MS, join_timeout_ms=FT_JOIN_MS)
    try:
        wait_step(log, args.kill_at, args.timeout,
                  lambda: all(p.poll() is None for p in job.procs) and job.lighthouse.poll() is None)
        t_kill = job.kill_replica(1)
        job.restart_replica(1)
        t_restart = time.time()
        codes = job.wait(args.timeout)
    finally:
        job.stop()
    if any(codes):
        raise RuntimeError(f"torchft replicas exited {codes}; see {wd}")
    raw, _ = common.read_log(log)
    steps = first_per_step(raw)
    # a step is at full size once a record of it has every replica taking part
    full_steps = {r["step"] for r in raw if r["participants"] >= replicas and r["t"] > t_kill}
    out = recovery(steps, t_kill, lambda r: r["step"] in full_steps)
    # a step the survivor had begun with both replicas may still be written at full size just after
    # the kill (its all-reduce was done): full size counts from the first step at reduced size, if any
    reduced = min((r["t"] for r in raw if r["t"] > t_kill and r["participants"] < replicas), default=t_kill)
    first_full = min((r["t"] for r in raw if r["t"] > reduced and r["participants"] >= replicas), default=None)
    if first_full is not None:  # the earliest record at full size, whichever replica wrote it
        out["full_size_s"] = round(first_full - t_kill, 3)
    summary = torchft_job.summarize(raw, t_kill, 1, replicas)
    out["torchft"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in summary.items()}
    marks = [(t_kill, "kill -9 + restart replica 1")]
    if summary["restarted_first_t_s"] is not None:
        marks.append((t_kill + summary["restarted_first_t_s"], "replica 1 healed"))
    out["restart_after_kill_s"] = round(t_restart - t_kill, 3)
    return {"steps": steps, "marks": marks, "result": out}


RUNNERS = {"tmrun": run_tmrun, "torchrun": run_torchrun,
           "torchrun-fresh": lambda size, args, wd: run_torchrun(size, args, wd, fresh_store=True),
           "torchft": run_torchft, "tmrun-restart": run_tmrun_restart}


# ---------------------------------------------------------------------------- output

COLUMNS = ["size / system", "kill at step", "continues (s)", "full size (s)", "new work (s)", "recomputed",
           "reduced steps",
           "downtime (s)", "full size vs tmrun"]


def rows(results: dict) -> list[list]:
    out = []
    for size, per in results.items():
        base = (per.get("tmrun") or {}).get("full_size_s")
        for name in COMPETITORS:
            r = per.get(name)
            if r is None:
                continue
            if "error" in r:
                out.append([f"{size} {name}", "failed"] + [None] * (len(COLUMNS) - 2))
                continue
            ratio = None
            if base and r.get("full_size_s") is not None:
                ratio = f"{r['full_size_s'] / base:.1f}x" if name != "tmrun" else "1x"
            out.append([f"{size} {name}", r["kill_step"], r["continue_s"], r["full_size_s"], r["new_work_s"],
                        r["recomputed"], r["reduced"], r["downtime_s"], ratio])
    return out


def swap_rows(results: dict) -> list[list]:
    out = []
    for size, per in results.items():
        s = (per.get("tmrun") or {}).get("swap")
        if s:
            out.append([size, s["report_after_kill_s"], s.get("plan_written_from_kill_s"),
                        s.get("phase1_done_from_kill_s"), s.get("switched_from_kill_s"),
                        s.get("first_step_from_kill_s"), s["stall_s"], round(s["bytes_moved"] / 1e6, 1)])
    return out


SWAP_COLUMNS = ["size", "failure reported", "plan written", "group built", "switched", "first step", "stall",
                "MB moved"]


TORCHRUN_LABEL = {"torchrun": "torchrun", "torchrun-fresh": "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"}


def limit(result: dict, bandwidth: float) -> dict | None:
    """The terms a failure cannot go below, measured in this run, and tmrun against their sum."""
    s = result.get("swap") or {}
    if not s or s.get("group_build_s") is None or result.get("full_size_s") is None:
        return None
    terms = {"failure_reported_s": s["report_after_kill_s"], "group_build_s": s["group_build_s"],
             "bytes_over_loopback_s": round(s["bytes_moved"] / bandwidth, 4), "median_step_s": result["median_step_s"]}
    total = sum(terms.values())
    return {**terms, "limit_s": round(total, 4), "full_size_s": result["full_size_s"],
            "ratio": round(result["full_size_s"] / total, 3), "store_connect_s": s.get("store_connect_s"),
            "gloo_connect_s": s.get("gloo_connect_s")}


LIMIT_COLUMNS = ["size", "failure reported", "one group build", "state bytes / loopback", "one median step",
                 "limit (sum)", "back at full size", "ratio"]


def limit_rows(results: dict) -> list[list]:
    return [[size, x["failure_reported_s"], x["group_build_s"], x["bytes_over_loopback_s"], x["median_step_s"],
             x["limit_s"], x["full_size_s"], f"{x['ratio']:.2f}x"]
            for size, per in results.items() if (x := (per.get("tmrun") or {}).get("limit"))]


def targets(results: dict) -> list[dict]:
    out = []
    for size, per in results.items():
        tm = per.get("tmrun") or {}
        if "limit" in tm:
            x = tm["limit"]
            out.append({"size": size, "target": f"within {TARGET_LIMIT:g}x of the limit",
                        "ratio": None if x is None else x["ratio"],
                        "met": x is not None and x["ratio"] <= TARGET_LIMIT,
                        "reason": "no swap event with the group's build time" if x is None else
                        f"{x['full_size_s']:.2f} s against {x['limit_s']:.2f} s = failure reported "
                        f"{x['failure_reported_s']} + one group build {x['group_build_s']} (store "
                        f"{x['store_connect_s']}, gloo {x['gloo_connect_s']}) + state bytes / loopback "
                        f"{x['bytes_over_loopback_s']} + one median step {x['median_step_s']}"})
        restart = per.get("tmrun-restart") or {}
        for name in ("torchrun", "torchrun-fresh"):
            other = per.get(name) or {}
            if restart.get("downtime_s") is None or not other.get("downtime_s"):
                continue
            ratio = restart["downtime_s"] / other["downtime_s"]
            out.append({"size": size, "target": f"restart mode loses <= {TARGET_RESTART:g}x of {TORCHRUN_LABEL[name]}'s"
                        " time", "ratio": round(ratio, 3), "met": ratio <= TARGET_RESTART,
                        "reason": f"lost {restart['downtime_s']:.2f} s vs {other['downtime_s']:.2f} s ({ratio:.2f}x); "
                                  f"first step after the kill {restart['continue_s']} s vs {other['continue_s']} s, "
                                  f"{restart['recomputed']} vs {other['recomputed']} steps recomputed"})
        base = tm.get("full_size_s")
        checks = [(name, TARGET_TORCHRUN, f">= {TARGET_TORCHRUN:g}x sooner than {TORCHRUN_LABEL[name]}")
                  for name in ("torchrun", "torchrun-fresh")] + [("torchft", 1.0, "sooner than torchft")]
        for name, need, text in checks:
            other = per.get(name)
            if other is None:
                continue
            if not base or other.get("full_size_s") is None:
                why = "; ".join(x for x in (tm.get("error"), other.get("error")) if x) or "no full-size step seen"
                out.append({"size": size, "target": text, "met": False, "ratio": None, "reason": why})
                continue
            ratio = other["full_size_s"] / base
            met = ratio >= need if need > 1 else ratio > need
            reason = f"tmrun {base:.2f} s vs {name} {other['full_size_s']:.2f} s ({ratio:.1f}x)"
            if not met:
                reason += f"; {name}'s recovery is {', '.join(where(name, other))}"
            out.append({"size": size, "target": text, "met": met, "ratio": round(ratio, 2), "reason": reason})
    return out


def where(name: str, r: dict) -> list[str]:
    """Where a competitor's recovery time went, seconds from the kill."""
    if "error" in r:
        return [r["error"]]
    if name == "tmrun":
        s = r.get("swap") or {}
        return [f"failure reported {s.get('report_after_kill_s')}", f"plan written {s.get('plan_written_from_kill_s')}",
                f"new group built {s.get('phase1_done_from_kill_s')}", f"switched {s.get('switched_from_kill_s')}",
                f"first step {s.get('first_step_from_kill_s')}", f"survivor stalled {s.get('stall_s')}"]
    if name == "tmrun-restart":
        return [f"first step after the kill {r['continue_s']}", f"{r['recomputed']} steps recomputed",
                f"new work {r['new_work_s']}"]
    if name.startswith("torchrun"):
        rs = r.get("restart", {})
        return [f"{rs.get('worker_groups_started')} worker generation(s) started "
                f"({max(0, (rs.get('worker_groups_started') or 1) - 1)} failed at start)",
                f"last rendezvous round {rs.get('last_round_started_s')}",
                f"workers in their process group {rs.get('started_s')}", f"checkpoint loaded {rs.get('loaded_s')}",
                f"first step {rs.get('continued_s')}",
                f"{r['recomputed']} steps recomputed, new work {r['new_work_s']}"]
    ft = r.get("torchft", {})
    return [f"survivor's first step {ft.get('continue_s')} (lighthouse heartbeat timeout {FT_HEARTBEAT_MS} ms)",
            f"replica 1 restarted {r.get('restart_after_kill_s')}",
            f"its first (healed) step {ft.get('restarted_first_t_s')}", f"full size {r['full_size_s']}",
            f"{r['reduced']} step(s) at half size"]


def breakdown(results: dict) -> list[str]:
    """One line per size and competitor: where the recovery time went."""
    return [f"{size} {name}: " + ", ".join(where(name, r)) for size, per in results.items()
            for name, r in per.items()]


def markdown(doc: dict, table: list[list], swaps: list[list], limits: list[list], goals: list[dict]) -> str:
    m = doc["machine"]
    text = [f"## Unplanned failure (kill -9 at step {doc['kill_at']})", "",
            f"`{doc['command']}` on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, "
            f"{doc['steps']} steps per run, one torch thread per worker.", "",
            "Times are seconds from the kill. *continues*: first committed step after it; *full size*: first "
            "step with every rank/replica taking part; *new work*: first step beyond the last one committed before "
            "the kill; *recomputed*: steps committed twice; *reduced steps*: steps "
            "committed at less than full size before that; *downtime*: wall time lost against the median step.", "",
            common.md_table(COLUMNS, table), ""]
    if swaps:
        text += ["tmrun's swap, seconds from the kill (the `swap` event counts from the failed worker's report):",
                 "", common.md_table(SWAP_COLUMNS, swaps), ""]
    if limits:
        text += [f"tmrun against the limit, each term measured in this run (seconds; loopback "
                 f"{doc['loopback_bytes_per_s'] / 1e9:.2f} GB/s, a socket copy of {LOOPBACK_MB} MB):", "",
                 common.md_table(LIMIT_COLUMNS, limits), ""]
    text += ["Where the time goes (seconds from the kill):", ""]
    text += [f"- {line}" for line in breakdown(doc["results"])]
    text += ["", "Targets:", ""]
    text += [f"- {g['size']}, back at full size {g['target']}: **{'met' if g['met'] else 'missed'}**: {g['reason']}"
             for g in goals]
    text += ["", "Settings:", ""] + [f"- {k}: {v}" for k, v in doc["settings"].items()]
    text += ["", f"The whole run took {doc['total_s'] / 60:.0f} min.", "",
             "![Step times around the kill, per system and size](bench/unplanned_failure.png)", ""]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict] = {}
    panels: dict = {}
    walls: dict[str, float] = {}
    dirs: list[Path] = []
    failed = False
    t_start = time.time()
    bandwidth = common.loopback_bandwidth(LOOPBACK_MB << 20)
    print(f"loopback bandwidth: {bandwidth / 1e9:.2f} GB/s", flush=True)
    try:
        for size in args.size_list:
            results[size] = {}
            for name in args.competitor_list:
                wd = common.workdir(f"unplanned-{name}")
                dirs.append(wd)
                print(f"[{size} {name}] running in {wd} ...", flush=True)
                t0 = time.monotonic()
                try:
                    run = RUNNERS[name](size, args, wd)
                except Exception as exc:  # noqa: BLE001 - one competitor failing must not lose the others
                    failed = True
                    results[size][name] = {"error": f"{type(exc).__name__}: {exc}"}
                    print(f"[{size} {name}] failed: {exc}", flush=True)
                    if args.keep:
                        traceback.print_exc()
                    continue
                walls[f"{size} {name}"] = round(time.monotonic() - t0, 1)
                r = run["result"]
                if name == "tmrun":
                    r["limit"] = limit(r, bandwidth)
                results[size][name] = r
                panels[f"{size} {name}"] = (run["steps"], run["marks"])
                print(f"[{size} {name}] {walls[f'{size} {name}']:.0f} s: continues after {r['continue_s']} s, "
                      f"full size after {r['full_size_s']} s, {r['recomputed']} steps recomputed", flush=True)
    finally:
        if not args.keep:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
        elif dirs:
            print("kept: " + " ".join(map(str, dirs)))

    table, swaps, limits, goals = rows(results), swap_rows(results), limit_rows(results), targets(results)
    common.print_table(f"Unplanned failure: kill -9 at step {args.kill_at}, seconds from the kill", COLUMNS, table)
    if swaps:
        common.print_table("tmrun's swap, seconds from the kill", SWAP_COLUMNS, swaps)
    if limits:
        common.print_table("tmrun against the limit (seconds)", LIMIT_COLUMNS, limits)
    for line in breakdown(results):
        print(line)
    for g in goals:
        print(f"target {g['size']} {g['target']}: {'MET' if g['met'] else 'MISSED'} ({g['reason']})")
    settings = {"tmrun": f"2 nodes + 1 standby, --rdzv-conf {TMRUN_CONF}, other timeouts default",
                "torchrun": f"2 agents, --nnodes 2 --max-restarts {args.max_restarts}, c10d rendezvous "
                            f"(torch's defaults), monitor interval {torchrun_job.MONITOR_INTERVAL} s, checkpoint "
                            f"every {args.ckpt_every} steps",
                "torchrun-fresh": "the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (workers get their own "
                                  "store; workaround for pytorch/pytorch#135712)",
                "torchft": f"torchft 0.2.0, lighthouse + 2 replica groups, heartbeat_timeout_ms {FT_HEARTBEAT_MS}, "
                           f"join_timeout_ms {FT_JOIN_MS}, min_replicas 1, "
                           "replica restarted at once",
                "tmrun-restart": "restart mode (the torchrun script, no runtime), 2 nodes, no standby, --warm-start, "
                                 f"--max-restarts 3, checkpoint every {args.ckpt_every} steps"}
    settings = {k: v for k, v in settings.items() if k in args.competitor_list}
    doc = {"sizes": args.size_list, "kill_at": args.kill_at, "steps": args.steps, "ckpt_every": args.ckpt_every,
           "settings": settings, "results": results, "targets": goals, "wall_s": walls,
           "loopback_bytes_per_s": bandwidth,
           "total_s": round(time.time() - t_start, 1)}
    path = common.save("unplanned_failure", doc)
    if panels:
        plot = common.plot_step_times("unplanned_failure", panels,
                                      f"kill -9 of one worker at step {args.kill_at}")
        print(f"plot: {plot.relative_to(common.REPO)}")
    md = common.RESULTS / "unplanned_failure.md"
    saved = {**doc, "command": common.command_line(), "machine": common.machine()}
    md.write_text(markdown(saved, table, swaps, limits, goals))
    print(f"results: {path.relative_to(common.REPO)}, {md.relative_to(common.REPO)}; total {doc['total_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
