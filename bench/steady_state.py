"""Steady-state overhead: what running under tmrun costs a job that is never interrupted.

Three runs of the same GPT (same ``--params``, ``--threads 1``, 2 nodes of 1 worker each, same
batch, same seed), one after the other on this machine, no interruptions:

- ``torchrun+DDP``: ``bench/competitors/torchrun_gpt.py`` under two torchrun agents (c10d
  rendezvous, plain ``DistributedDataParallel``, no checkpoints);
- ``tmrun``: ``examples/train_gpt.py`` under a tmrun local cluster, 2 nodes, no standby;
- ``tmrun+standby``: the same with 1 standby (its shadow workers warm up, then wait).

Measured, in a window of ``--measure`` committed steps that starts after ``--warmup`` steps (and,
with a standby, once the standby's worker has stopped using CPU: warm and waiting):

- committed steps per second (from the rank-0 step log: ``--measure`` / time between the first and
  the last step of the window) and the median step time;
- the peak RSS of each active worker: ``VmHWM`` of the worker processes, read from
  ``/proc/<pid>/status`` at the end of the window (the same number as ``ru_maxrss``, which
  ``train_gpt.py`` writes in its ``done`` record; the torchrun script writes none, so every run is
  measured the same way from outside; the ``done`` records of the standby-free tmrun run are kept
  as a cross-check).

Where it goes, per active worker over the same window: CPU time per step by thread (the main
thread that runs the script's loop, gloo's ``gloo_tcp_loop`` and ``pt_gloo_runloop`` threads,
other Python threads such as tmrun's agent-channel reader and ``alive`` heartbeat; from
``/proc/<pid>/task/*/stat``), and resident memory by part at the window's end and its growth over
the window (``/proc/<pid>/smaps``: ``[heap]``, glibc's main arena; other anonymous mappings; mapped
files).

Ratios against torchrun+DDP, with targets: throughput >= 99 % (the mean of each repeat's ratio, with a
95 % confidence interval: the runs of one repeat follow each other, so drift between repeats
cancels), peak RSS within +1 %; and "active
workers hold no second copy of the state for the swap": the actives' peak RSS with a standby
present within +1 % of without one.

Then, after the window, the ``tmrun+standby`` run drains a non-leader active node ``--drains``
times (``tmrun drain --rejoin``, so the pool refills) and reads each ``swap`` event: the phase-1
effect is ``phase1_step_time / normal_step_time``, the survivors' median step time while the next
group was built in the background against the median before (target <= 1.05, loose: a drain
overlaps only one or two steps); and the survivors' CPU time per step then, their cores during
phase 1 times that step time, against their cores in the steps before the drain times the
normal step time (on 2 cores the wall clock also pays for the joiner's and the agents' CPU).

The two scripts differ in one collective per step each, and both are small: torchrun_gpt.py
with ``--step-log`` all-reduces the loss (one float) every step, tmrun's ``commit()`` all-reduces
its vote (two floats) every step.

Output: a table, ``bench/results/steady_state.json``, ``docs/bench/steady_state.png`` (step time
over wall clock, one panel per run) and ``bench/results/steady_state.md`` (a section for
docs/benchmarks.md). ``--quick`` (1M parameters, short windows, suffix ``_quick``) checks that it
all works in about two minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import common, procsample  # noqa: E402
from bench.competitors import torchrun_job  # noqa: E402

NAME = "steady_state"
RUNS = ("torchrun+DDP", "tmrun", "tmrun+standby")
TARGET_THROUGHPUT = 0.99
TARGET_RSS = 1.01
TARGET_PHASE1 = 1.05
DEFAULT_MEASURE = {"5M": 200, "50M": 40}  # window lengths (steps), about a minute each on 2 cores


def standby_pids(job: common.TmrunJob, timeout: float) -> list[int]:
    """The standbys' shadow worker pids, from ``tmrun status`` (a worker's TMRUN_ROLE is the one it
    started with: after a swap a promoted standby is active and a rejoined leaver a standby)."""
    status = job.wait_until(lambda d: d["hot_swap"] and any(n["role"] == "standby" and n["state"] == "shadow"
                                                            and n["worker_pids"] for n in d["nodes"]),
                            timeout, "a standby with shadow workers")
    return [p for n in status["nodes"] if n["role"] == "standby" and n["state"] == "shadow" for p in n["worker_pids"]]


def first_step_after(path: Path, at: float) -> int:
    steps, _ = common.read_log(path)
    return next((r["step"] for r in steps if r["t"] >= at), steps[-1]["step"] + 1)


def steps_in(path: Path, before: dict[int, dict], after: dict[int, dict]) -> int:
    """Steps committed between two samples (the per-thread CPU is divided by these: with a standby the
    window's first step may already be past when the first sample is taken)."""
    steps, _ = common.read_log(path)
    return max(1, len({r["step"] for r in steps if before[0]["t"] < r["t"] <= after[0]["t"]}))


def window_stats(steps: list[dict], first: int, last: int) -> dict:
    """Steps/s, median step time and its relative standard error between committed steps first..last."""
    by_step: dict[int, float] = {}
    for r in steps:
        by_step.setdefault(r["step"], r["t"])  # a step committed twice counts at its first commit
    t0, t1 = by_step[first], by_step[last]
    gaps = [by_step[s + 1] - by_step[s] for s in range(first, last)]
    return {"first": first, "last": last, "t0": t0, "t1": t1, "steps_per_s": (last - first) / (t1 - t0),
            "median_step_s": statistics.median(gaps),
            "rel_stderr": statistics.stdev(gaps) / statistics.mean(gaps) / len(gaps) ** 0.5}


# ------------------------------------------------------------------------------ the runs

def run_torchrun(size: str, args, wd: Path) -> dict:
    log = wd / "torchrun-steps.jsonl"
    total = args.warmup + args.measure_of(size) + 5
    train = ["--params", size, "--steps", str(total), "--threads", str(args.threads), "--step-log", str(log)]
    job = torchrun_job.start_job(train, log_dir=wd / "torchrun", max_restarts=0,
                                 rdzv_id=f"steady-{os.getpid()}")
    sampler = procsample.ProcSampler(torchrun_job.SCRIPT)
    sampler.start()
    try:
        agents = [n.agent for n in job.nodes]
        common.wait_for_step(log, args.warmup, args.timeout, agents)
        first, before = args.warmup, sampler.sample()
        actives = [v["pid"] for v in sampler.workers(before, "active")]
        detail0 = procsample.worker_detail(actives)
        common.wait_for_step(log, first + args.measure_of(size), args.timeout, agents)
        after = sampler.sample()
        detail = procsample.detail_use(detail0, procsample.worker_detail(actives), steps_in(log, before, after))
        codes = job.wait(args.timeout)
    finally:
        sampler.stop()
        job.kill()
    steps, _ = common.read_log(log)
    return {"steps": steps, "first": first, "last": first + args.measure_of(size), "exit": codes,
            "active_hwm_kb": sorted(v["hwm_kb"] for v in sampler.workers(after, "active")), "drains": [],
            "active_rss_kb": sorted(v["rss_kb"] for v in sampler.workers(after, "active")),
            "done_maxrss_kb": None, "cpu_cores": procsample.cpu_use(before, after), "detail": detail}


def run_tmrun(size: str, args, wd: Path, standby: int) -> dict:
    measure = args.measure_of(size)
    total = args.warmup + measure + 5 if not standby else 10**7  # the standby run is stopped after its drains
    job = common.TmrunJob(wd, ["--params", size, "--steps", str(total), "--threads", str(args.threads)],
                          nnodes=2, standby=standby, name="steady")
    sampler = procsample.ProcSampler(common.GPT)
    sampler.start()
    drains, quiet_at = [], None
    try:
        t_warm = common.wait_for_step(job.step_log, args.warmup, args.timeout, [job.proc])
        first = args.warmup
        if standby:  # the window starts once the standby is warm and idle
            quiet_at = sampler.wait_quiet(standby_pids(job, args.timeout), 1.0, args.timeout, job.proc)
            first = max(args.warmup, first_step_after(job.step_log, max(t_warm, quiet_at)))
        before = sampler.sample()  # (no swap yet: each worker's TMRUN_ROLE is still its role)
        actives = [v["pid"] for v in sampler.workers(before, "active")]
        detail0 = procsample.worker_detail(actives)
        common.wait_for_step(job.step_log, first + measure, args.timeout, [job.proc])
        after = sampler.sample()
        detail = procsample.detail_use(detail0, procsample.worker_detail(actives),
                                       steps_in(job.step_log, before, after))
        for k in range(args.drains if standby else 0):
            drains.append(drain_once(job, sampler, args, k, drains[-1]["swap"]["at"] if drains else None))
        if standby:
            job.stop()
            code = job.proc.returncode
        else:
            code = job.wait(args.timeout)
    finally:
        sampler.stop()
        job.stop()
    steps, other = common.read_log(job.step_log)
    return {"steps": steps, "first": first, "last": first + measure, "exit": code, "standby_quiet_at": quiet_at,
            "active_hwm_kb": sorted(v["hwm_kb"] for v in sampler.workers(after, "active")),
            "active_rss_kb": sorted(v["rss_kb"] for v in sampler.workers(after, "active")),
            "standby_hwm_kb": sorted(v["hwm_kb"] for v in sampler.workers(after, "standby")),
            "cpu_cores": procsample.cpu_use(before, after), "detail": detail,
            "done_maxrss_kb": None if standby else sorted(r["maxrss_kb"] for r in other if r.get("event") == "done"),
            "drains": drains}


def drain_once(job: common.TmrunJob, sampler: procsample.ProcSampler, args, k: int, since: float | None) -> dict:
    """Drain a non-leader active node with --rejoin once the standby is warm; its swap event.

    ``normal_step_time`` is the median of the survivors' steps since the last switch (``since``):
    the steps while the rejoined standby warmed up are slower, so wait until they are a minority.
    """
    quiet_at = sampler.wait_quiet(standby_pids(job, args.timeout), 1.0, args.timeout, job.proc)
    steps, _ = common.read_log(job.step_log)
    dirty = sum(1 for r in steps if since is not None and since <= r["t"] <= quiet_at)
    calm0 = sampler.sample()  # the survivors' CPU while nothing is prepared, for the phase-1 comparison
    common.wait_for_step(job.step_log, first_step_after(job.step_log, quiet_at) + max(10, dirty + 5),
                         args.timeout, [job.proc])
    calm1 = sampler.sample()
    status = job.status()
    node = next(n["node"] for n in status["nodes"] if n["role"] == "active" and n["node"] != status["leader"])
    survivors = [p for n in status["nodes"] if n["role"] == "active" and n["node"] != node for p in n["worker_pids"]]
    classes = {}  # who is who during this drain, for the CPU used while phase 1 runs
    for n in status["nodes"]:  # (the leaver trains until the switch, like the survivors)
        role = "training" if n["role"] == "active" else "joiner" if n["role"] == "standby" else None
        classes.update({pid: f"{role} workers" for pid in n["worker_pids"] if role})
    trace = procsample.CpuTrace(sampler)
    trace.start()
    try:
        t0, t1, _ = job.drain(node, rejoin=True)
    finally:
        trace.stop()
    swaps = job.swap_events(k + 1)
    if len(swaps) <= k:
        raise RuntimeError(f"no swap event for drain {k + 1} of {node}")
    swap = swaps[k]
    ratio = (swap["phase1_step_time"] / swap["normal_step_time"]
             if swap.get("phase1_step_time") and swap.get("normal_step_time") else None)
    phase1_cpu = None
    if swap.get("phase1_started_s") is not None and swap.get("phase1_done_s") is not None:
        phase1_cpu = trace.cores(swap["requested"] + swap["phase1_started_s"],
                                 swap["requested"] + swap["phase1_done_s"], classes)
    # CPU time per step of the survivors: their CPU over whole committed steps (rank 0's step log,
    # rank 0 survives), in the steps that overlapped phase 1 and in the steps before the drain
    steps, _ = common.read_log(job.step_log)
    commits = sorted({r["step"]: r["t"] for r in reversed(steps)}.items())
    cpu_step: dict = {}
    if swap.get("phase1_started_s") is not None and swap.get("phase1_done_s") is not None:
        p1 = (swap["requested"] + swap["phase1_started_s"], swap["requested"] + swap["phase1_done_s"])
        cpu_step["phase1_ms"] = procsample.cpu_per_step(commits, trace.samples, survivors, *p1)
    cpu_step["normal_ms"] = procsample.cpu_per_step(commits, [(calm0[0]["t"], calm0), (calm1[0]["t"], calm1)], survivors,
                                          calm0[0]["t"], calm1[0]["t"], inside=True)
    if cpu_step.get("phase1_ms") and cpu_step.get("normal_ms"):
        cpu_step["ratio"] = round(cpu_step["phase1_ms"] / cpu_step["normal_ms"], 4)
    return {"node": node, "issued": t0, "returned": t1, "dirty_steps": dirty, "swap": swap, "phase1_ratio": ratio,
            "phase1_cpu_cores": phase1_cpu, "phase1_cpu_per_step": cpu_step}


# ------------------------------------------------------------------------------ report

def main(argv: list[str] | None = None) -> int:
    p = common.Parser(prog="bench/steady_state.py", description=__doc__.splitlines()[0],
                      epilog="The runs share the machine's cores: run nothing else meanwhile (on a shared machine: "
                             "flock /tmp/tmrun-bench.lock python bench/steady_state.py ...).")
    p.add_argument("--sizes", type=common.size_list, default=None, help="model sizes, comma-separated (default 5M)")
    p.add_argument("--size", type=common.size_label, default=None, help="one model size (same as --sizes SIZE)")
    p.add_argument("--warmup", type=common.count(1), default=20, help="committed steps before the window (default 20)")
    p.add_argument("--measure", type=common.count(1), default=None,
                   help="steps in the window (default: 200 at 5M, 40 at 50M, scaled for others)")
    p.add_argument("--drains", type=common.count(0), default=3,
                   help="drains in the tmrun+standby run after the window, for the phase-1 effect (default 3)")
    p.add_argument("--threads", type=common.count(1), default=1, help="torch threads per worker (default 1)")
    p.add_argument("--repeats", type=common.count(1), default=None,
                   help="run the three competitors this many times, interleaved, in rotated order (default 2; "
                        "--quick: 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait may take (default 600)")
    p.add_argument("--quick", action="store_true",
                   help="1M parameters, warm-up 5, window 30 steps, 1 drain; results get the suffix _quick")
    p.add_argument("--keep", action="store_true", help="keep the work directories (step logs, agent logs)")
    args = p.parse_args(argv)
    if args.sizes and args.size:
        p.error("give --size or --sizes, not both")
    sizes = args.sizes or ([args.size] if args.size else ["1M" if args.quick else "5M"])
    if args.quick:
        args.warmup, args.measure, args.drains = 5, args.measure or 30, min(args.drains, 1)
    args.repeats = args.repeats or (1 if args.quick else 2)

    def measure_of(size: str) -> int:
        if args.measure:
            return args.measure
        return DEFAULT_MEASURE.get(size, max(30, min(400, round(200 * 5e6 / common.params_of(size)))))

    args.measure_of = measure_of
    name = NAME + ("_quick" if args.quick else "")

    results: dict[str, dict[str, list[dict]]] = {s: {r: [] for r in RUNS} for s in sizes}
    for size in sizes:
        for rep in range(args.repeats):
            order = RUNS[rep % 3:] + RUNS[:rep % 3]  # rotate so no competitor always runs first
            for run in order:
                wd = common.workdir(f"{NAME}-{run.replace('+', '-')}")
                print(f"[{NAME}] {size} {run} (repeat {rep + 1}/{args.repeats}) in {wd}", flush=True)
                try:
                    if run == "torchrun+DDP":
                        r = run_torchrun(size, args, wd)
                    else:
                        r = run_tmrun(size, args, wd, standby=1 if run == "tmrun+standby" else 0)
                finally:
                    if not args.keep:
                        shutil.rmtree(wd, ignore_errors=True)
                r.update(window_stats(r["steps"], r["first"], r["last"]))
                print(f"[{NAME}]   {r['steps_per_s']:.3f} steps/s, median step {r['median_step_s'] * 1e3:.1f} ms, "
                      f"active peak RSS {[round(k / 1024) for k in r['active_hwm_kb']]} MiB", flush=True)
                results[size][run].append(r)
    try:  # a copy of the raw results, should the report fail
        raw = Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-results-{os.getpid()}.json"
        raw.write_text(json.dumps(results, default=str))
    except (OSError, TypeError, ValueError):
        pass
    return report(name, sizes, results, args)


def paired(per: dict[str, list[dict]], run: str) -> dict:
    """``run``'s throughput against torchrun's, paired by repeat: the runs of one repeat follow each
    other, so the machine's drift between repeats (which the plain means carry) cancels. The mean
    of the per-repeat ratios, and the half-width of its 95% confidence interval (t, n - 1)."""
    ratios = [r["steps_per_s"] / b["steps_per_s"] for r, b in zip(per[run], per["torchrun+DDP"])]
    mean, half = common.mean_interval(ratios)
    return {"mean": mean, "half": half, "ratios": ratios}


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def breakdown(sizes: list[str], results: dict) -> tuple[list, list, list, list]:
    """The per-thread CPU and the memory-parts tables (rows per size and run)."""
    names = sorted({k for size in sizes for run in RUNS for r in results[size][run] if r.get("detail")
                    for k in r["detail"]["cpu_ms_per_step"]}, key=lambda k: (k != "main", k))
    thread_cols = ["run", "size", "threads"] + names + ["sum", "main: per repeat"]
    mem_keys = ["rss", "heap", "anon", "file"]
    mem_cols = ["run", "size"] + mem_keys + ["rss growth", "heap growth", "anon growth"]
    thread_rows, mem_rows = [], []
    for size in sizes:
        for run in RUNS:
            ds = [r["detail"] for r in results[size][run] if r.get("detail")]
            if not ds:
                continue
            cpu = {k: _mean(d["cpu_ms_per_step"].get(k, 0.0) for d in ds) for k in names}
            thread_rows.append([run, size, _mean(d["threads"] for d in ds)] + [cpu[k] for k in names] +
                               [sum(cpu.values()), ", ".join(f"{d['cpu_ms_per_step'].get('main', 0):.1f}" for d in ds)])
            mem = {k: _mean(d["memory_mib"].get(k) for d in ds) for k in mem_keys + ["rss growth", "heap growth",
                                                                                       "anon growth"]}
            mem_rows.append([run, size] + [mem[k] for k in mem_keys] + [mem["rss growth"], mem["heap growth"],
                                                                        mem["anon growth"]])
    return thread_cols, thread_rows, mem_cols, mem_rows


def report(name: str, sizes: list[str], results: dict, args) -> int:
    rows, cpu_rows, targets, doc_sizes, panels = [], [], [], {}, {}
    for size in sizes:
        per = results[size]
        agg = {}
        for run in RUNS:
            rs = per[run]
            agg[run] = {
                "steps_per_s": _mean(r["steps_per_s"] for r in rs),
                "median_step_s": _mean(r["median_step_s"] for r in rs),
                "rel_stderr": _mean(r["rel_stderr"] for r in rs),
                "spread": (max(r["steps_per_s"] for r in rs) / min(r["steps_per_s"] for r in rs) - 1) if len(rs) > 1 else None,
                "active_hwm_mib": _mean(statistics.mean(r["active_hwm_kb"]) / 1024 for r in rs if r["active_hwm_kb"]),
                "active_rss_mib": _mean(statistics.mean(r["active_rss_kb"]) / 1024 for r in rs
                                        if r.get("active_rss_kb")),
                "active_hwm_runs_mib": [round(statistics.mean(r["active_hwm_kb"]) / 1024, 1) for r in rs
                                        if r["active_hwm_kb"]],
                "active_hwm_max_mib": max((max(r["active_hwm_kb"]) / 1024 for r in rs if r["active_hwm_kb"]), default=None),
                "cpu_cores": {k: _mean(r["cpu_cores"].get(k, 0.0) for r in rs)
                              for k in sorted({k for r in rs for k in r["cpu_cores"]})},
            }
            details = [r["detail"] for r in rs if r.get("detail")]
            agg[run]["detail"] = {
                "cpu_ms_per_step": {k: _mean(d["cpu_ms_per_step"].get(k, 0.0) for d in details)
                                    for k in sorted({k for d in details for k in d["cpu_ms_per_step"]})},
                "memory_mib": {k: _mean(d["memory_mib"].get(k) for d in details)
                               for k in sorted({k for d in details for k in d["memory_mib"]})},
                "threads": _mean(d["threads"] for d in details),
                "main_ms_runs": [d["cpu_ms_per_step"].get("main") for d in details],
            } if details else None
            c = agg[run]["cpu_cores"]
            agg[run]["worker_cpu_per_step_ms"] = c.get("worker-active", 0.0) / agg[run]["steps_per_s"] / 2 * 1e3
            agg[run]["control_cores"] = sum(v for k, v in c.items() if k in ("agent", "etcd", "other"))
            cpu_rows.append([run, size, c.get("worker-active"), c.get("worker-standby"), c.get("agent"),
                             c.get("etcd"), c.get("other"), c.get("outside"), agg[run]["worker_cpu_per_step_ms"]])
        base = agg["torchrun+DDP"]
        for run in RUNS:
            a = agg[run]
            a["throughput_ratio"] = a["steps_per_s"] / base["steps_per_s"]
            a["rss_ratio"] = a["active_hwm_mib"] / base["active_hwm_mib"] if a["active_hwm_mib"] else None
            rows.append([run, size, a["steps_per_s"], f"{a['throughput_ratio']:.2%}", a["median_step_s"] * 1e3,
                         a["active_hwm_mib"], f"{a['rss_ratio']:.2%}" if a["rss_ratio"] else None,
                         a["active_rss_mib"]])
        no_sb, sb = agg["tmrun"], agg["tmrun+standby"]
        state = [d["swap"]["bytes_from_leaver"] for r in per["tmrun+standby"] for d in r["drains"]]
        state_mib = (statistics.median(state) if state else 12 * common.params_of(size)) / 2**20  # fp32 + 2 AdamW moments
        second_copy = sb["active_hwm_mib"] / no_sb["active_hwm_mib"]
        noise = max(a["rel_stderr"] for a in agg.values())
        drains = [d for r in per["tmrun+standby"] for d in r["drains"]]
        ratios = [d["phase1_ratio"] for d in drains if d["phase1_ratio"] is not None]
        phase1 = _mean(ratios)
        cpu_phase1 = None

        def tgt(what, measured, met, reason=""):
            targets.append({"size": size, "target": what, "measured": measured, "met": bool(met), "reason": reason})

        for run in ("tmrun", "tmrun+standby"):
            a = agg[run]
            pair = a["paired"] = paired(per, run)
            ratio = pair["mean"]
            interval = (f" ± {pair['half']:.2%} (95%, {len(pair['ratios'])} repeats: "
                        + ", ".join(f"{x:.2%}" for x in pair["ratios"]) + ")") if pair["half"] is not None else ""
            tgt(f"{size} {run} throughput >= 99% of torchrun+DDP", f"{ratio:.2%}{interval}", ratio >= TARGET_THROUGHPUT,
                "the mean of each repeat's ratio; the ratio of the means "
                f"{a['throughput_ratio']:.2%}: "
                f"{a['steps_per_s']:.3f} vs {base['steps_per_s']:.3f} steps/s (standard error of a window's mean "
                f"step {noise:.1%}" + (f", repeats spread {max(x['spread'] or 0 for x in agg.values()):.1%}"
                                        if args.repeats > 1 else "") +
                f"); worker CPU per step {a['worker_cpu_per_step_ms']:.1f} vs {base['worker_cpu_per_step_ms']:.1f} ms, "
                f"launcher processes (agents, etcd, other) {a['control_cores']:.3f} vs {base['control_cores']:.3f} "
                f"cores" + (f"; NOT IDLE: processes this benchmark did not start used up to "
                            f"{max(x['cpu_cores'].get('outside', 0) for x in agg.values()):.2f} cores"
                            if max(x['cpu_cores'].get('outside', 0) for x in agg.values()) > 0.05 else ""))
        rss = no_sb["rss_ratio"]
        tgt(f"{size} tmrun peak RSS of an active worker within 1% of torchrun+DDP", f"{rss:.2%}", rss <= TARGET_RSS,
            f"{no_sb['active_hwm_mib'] - base['active_hwm_mib']:+.1f} MiB per worker "
            f"({no_sb['active_hwm_mib']:.1f} vs {base['active_hwm_mib']:.1f} MiB; per run "
            f"{no_sb['active_hwm_runs_mib']} vs {base['active_hwm_runs_mib']})")
        tgt(f"{size} no second copy of the state: actives' peak RSS with a standby within 1% of without",
            f"{second_copy:.2%}", second_copy <= TARGET_RSS,
            f"{sb['active_hwm_mib'] - no_sb['active_hwm_mib']:+.1f} MiB per worker (per run "
            f"{sb['active_hwm_runs_mib']} vs {no_sb['active_hwm_runs_mib']}); a second copy of the state "
            f"(model + AdamW) would be +{state_mib:.0f} MiB" + (
                "" if args.repeats > 1 else "; one run each: repeat (--repeats) to tell this from run-to-run spread"))
        if drains:
            per_drain = ", ".join(f"{x:.1%}" for x in ratios)
            if phase1 is None:
                reason = "no step overlapped phase 1 in any drain: nothing to compare"
            else:
                cpu = [d["phase1_cpu_cores"] for d in drains if d.get("phase1_cpu_cores")]
                extra_cores = _mean(sum(v for k, v in c.items() if k not in ("training workers", "seconds"))
                                    for c in cpu)
                train_cores = _mean(c.get("training workers") for c in cpu)
                reason = (f"per drain: {per_drain}; phase 1 lasted {_mean(c['seconds'] for c in cpu) or 0:.2f} s "
                          f"(sampled) and overlapped {_mean(d['swap']['phase1_steps'] for d in drains):.0f} steps; "
                          f"meanwhile the joiner, the agents, etcd, the tmrun drain command and this benchmark's "
                          f"sampling used {extra_cores or 0:.2f} cores besides the training workers' "
                          f"{train_cores or 0:.2f}, on {os.cpu_count()} cores that training fills; the survivors also "
                          "build the next group in a thread of their own, which competes for the GIL" if cpu else
                          f"per drain: {per_drain}")
            cpu_ratios = [d["phase1_cpu_per_step"]["ratio"] for d in drains
                          if (d.get("phase1_cpu_per_step") or {}).get("ratio")]
            cpu_phase1 = _mean(cpu_ratios)
            tgt(f"{size} phase 1: survivors' CPU time per step while the next group is built <= 105% of normal",
                f"{cpu_phase1:.1%}" if cpu_phase1 is not None else "-",
                cpu_phase1 is not None and cpu_phase1 <= TARGET_PHASE1,
                "per drain: " + ", ".join(f"{x:.1%}" for x in cpu_ratios) + " (a survivor's CPU over the whole "
                "steps that overlapped phase 1, per step, against the same over the steps before the drain)")
            tgt(f"{size} phase 1, wall clock: survivors' step time while the next group is built <= 105% of normal",
                f"{phase1:.1%}" if phase1 is not None else "-", phase1 is not None and phase1 <= TARGET_PHASE1,
                reason)
        for run in RUNS:
            r0 = per[run][0]
            marks = [(r0["t0"], "window"), (r0["t1"], "end")]
            marks += [(d["swap"]["requested"], "drain") for d in r0["drains"]]
            panels[f"{size} {run}"] = (r0["steps"], marks)
        doc_sizes[size] = {
            "aggregate": agg, "second_copy_ratio": second_copy, "phase1_ratio": phase1,
            "phase1_cpu_ratio": cpu_phase1,
            "runs": {run: [{k: v for k, v in r.items() if k != "steps"} for r in per[run]] for run in RUNS},
        }

    common.print_table(f"Steady state: {args.threads} thread(s) per worker, 2 nodes",
                       ["run", "size", "steps/s", "vs torchrun", "median step (ms)", "peak RSS/worker (MiB)",
                        "RSS vs torchrun", "RSS now/worker (MiB)"], rows)
    cpu_cols = ["run", "size", "active workers", "standby worker", "agents", "etcd", "other (ours)",
                "not ours", "worker CPU/step (ms)"]
    common.print_table("CPU used during the window (cores)", cpu_cols, cpu_rows)
    thread_cols, thread_rows, mem_cols, mem_rows = breakdown(sizes, results)
    common.print_table("An active worker's CPU per step by thread (ms, mean of the workers and repeats)",
                       thread_cols, thread_rows)
    common.print_table("An active worker's resident memory at the window's end (MiB; growth over the window)",
                       mem_cols, mem_rows)
    foreign = max((r[7] or 0.0) for r in cpu_rows)
    if foreign > 0.05:
        print(f"[{NAME}] warning: processes this benchmark did not start used up to {foreign:.2f} cores during a "
              "window: the machine was not idle and the comparison is unreliable", flush=True)
    def others(d):  # cores used during phase 1 besides the training workers
        c = d.get("phase1_cpu_cores") or {}
        return ", ".join(f"{k} {v:.2f}" for k, v in c.items() if k not in ("training workers", "seconds") and v >= 0.01)

    drain_rows = [[size, d["node"], d["swap"]["phase1_steps"], d["swap"]["phase1_step_time"],
                   d["swap"]["normal_step_time"], f"{d['phase1_ratio']:.1%}" if d["phase1_ratio"] else None,
                   d["swap"]["stall_s"], (d.get("phase1_cpu_cores") or {}).get("seconds"),
                   (d.get("phase1_cpu_cores") or {}).get("training workers"), others(d),
                   (d.get("phase1_cpu_per_step") or {}).get("normal_ms"),
                   (d.get("phase1_cpu_per_step") or {}).get("phase1_ms"),
                   f"{d['phase1_cpu_per_step']['ratio']:.1%}" if (d.get("phase1_cpu_per_step") or {}).get("ratio")
                   else None]
                  for size in sizes for r in results[size]["tmrun+standby"] for d in r["drains"]]
    drain_cols = ["size", "drained", "phase-1 steps", "phase-1 step (s)", "normal step (s)", "ratio", "stall (s)",
                  "phase 1 (s)", "training workers' cores in phase 1", "other cores in phase 1",
                  "survivor CPU/step normal (ms)", "survivor CPU/step phase 1 (ms)", "CPU/step ratio"]
    if drain_rows:
        common.print_table("Phase 1 during drains (tmrun+standby)", drain_cols, drain_rows)
    common.print_table("Targets", ["target", "measured", "met"],
                       [[t["target"], t["measured"], "yes" if t["met"] else f"NO: {t['reason']}"] for t in targets])

    png = common.plot_step_times(name, panels, "Step time, no interruptions (drains after the window)")
    doc = {"sizes": doc_sizes, "targets": targets, "all_met": all(t["met"] for t in targets),
           "foreign_cpu_cores_max": foreign,
           "settings": {"sizes": sizes, "warmup": args.warmup, "measure": {s: args.measure_of(s) for s in sizes},
                        "drains": args.drains, "threads": args.threads, "repeats": args.repeats,
                        "tmrun_conf": common.TMRUN_CONF},
           "plot": str(png.relative_to(common.REPO))}
    path = common.save(name, doc)
    extra = "CPU used during the window (cores, from /proc/<pid>/stat):\n\n" + common.md_table(cpu_cols, cpu_rows)
    if foreign > 0.05:
        extra += (f"\n\n**Warning:** processes this benchmark did not start used up to {foreign:.2f} cores during a "
                  "window; the machine was not idle and the comparison is unreliable.")
    extra += ("\n\nAn active worker's CPU per step by thread (ms, from /proc/<pid>/task/*/stat, mean of the "
              "workers and repeats; main: the thread that runs the script's loop):\n\n" + common.md_table(thread_cols, thread_rows))
    extra += ("\n\nAn active worker's resident memory at the window's end (MiB, from /proc/<pid>/smaps; heap: "
              "glibc's main arena; anon: other anonymous mappings; file: mapped libraries; growth: over the "
              "window):\n\n" + common.md_table(mem_cols, mem_rows))
    if drain_rows:
        extra += "\n\nDrains after the window (tmrun+standby):\n\n" + common.md_table(drain_cols, drain_rows)
    md = common.write_markdown(
        name, "Steady-state overhead",
        f"The same GPT, 2 nodes x 1 worker, {args.threads} thread(s) each, no interruptions: torchrun + plain DDP "
        f"against examples/train_gpt.py under tmrun without and with a standby. Throughput over a window of "
        f"committed steps after the warm-up (and after the standby went idle); peak RSS (VmHWM) of each active "
        f"worker at the window's end, mean of the two (and VmRSS then, for comparison).",
        [("", ["run", "size", "steps/s", "vs torchrun", "median step (ms)", "peak RSS/worker (MiB)",
               "RSS vs torchrun", "RSS now/worker (MiB)"], rows)],
        targets, [("step time over wall clock", png.name)], extra.strip())
    print(f"results: {path}\nsection: {md}\nplot: {png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
