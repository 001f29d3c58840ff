"""Planned migration: move one node of a running 2-node GPT job to a spare node, tmrun vs torchrun.

What is measured, per model size (``--sizes``, the GPT of ``examples/train_gpt.py``):

- **tmrun**: a local cluster of 2 nodes + 1 standby (``common.TmrunJob``) runs
  ``examples/train_gpt.py --threads 1``. Once the plan is hot and the standby shadow-trains
  (warm), and the job has committed step ``--at`` K, ``tmrun drain node-1`` hands node-1's
  place (and its state, directly) to the standby while node-0 keeps training; the job then runs
  to ``--steps``. The swap event's timings are read with ``tmrun events`` before the job ends.
- **torchrun**: the same model under ``bench/competitors/torchrun_gpt.py`` (plain DDP, rank 0
  checkpoints every ``--ckpt-every`` N steps), one torchrun agent per "node". At step K it does
  the only thing torchrun can: stop the job (SIGTERM to both agents), start it again with the
  replacement node, reload the latest checkpoint and recompute the steps after it.

Numbers (from each job's step log, one line per committed step):

- ``median step``: the median time between committed steps before the event (warm-up skipped,
  and for tmrun the steps before the standby was warm); ``median step after``: the same after
  training resumed (is the job back to its speed?);
- ``downtime``: wall time lost against the median step, ``common.interruption``: from the last
  step committed before the event to the first *new* step after it, less one median step per
  new step; recomputed steps count as lost. For tmrun the event is the switch (the drain request
  + the swap's ``switched_s``): phase 1 runs in the background while training goes on, so the
  stall is at the switch. ``lost incl. phase 1`` also charges tmrun for the slower steps while
  the next group was built: over the window from the last step before the drain request to the
  first step after the swap's first step, the window's length less a median step per step;
- ``recomputed``: steps committed twice; ``continued``: seconds from the event (the drain
  request, the SIGTERM) to the first step committed after it;
- tmrun's swap event: ``phase1_started_s``, ``phase1_done_s``, ``switched_s``, ``first_step_s``
  (seconds after the drain request), ``stall_s`` (the longest time a member did not train),
  ``joiner_stall_s`` (the joiner's time from its promotion to training, waiting for the switch
  included, which costs the job nothing; absent from older tmrun versions), ``bytes_from_leaver``
  and ``handover_s`` (the leaver -> joiner state transfer); the JSON also has each node's
  ``last_swap`` from ``tmrun status``.

Targets (reported met/missed): tmrun's stall <= 2 median steps + state bytes / loopback
bandwidth (a plain socket copy of ``--loopback-mb`` MB between two processes over 127.0.0.1,
measured in the same run), and torchrun's downtime >= 20x tmrun's. The final weights of both
runs (``done ... sha256=``) are compared: torchrun's checkpoint resume reproduces an
uninterrupted run, so equal hashes say the swap lost nothing (``--reference`` also runs an
uninterrupted torchrun job per size and compares with it).

Output: a rich table, ``bench/results/planned_migration.json``, ``docs/bench/planned_migration.png``
and a markdown section ``bench/results/planned_migration.md``. Every job runs under
``flock /tmp/tmrun-bench.lock`` when the script itself is started that way (recommended)::

    flock /tmp/tmrun-bench.lock python bench/planned_migration.py --quick
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import common  # noqa: E402
from bench.competitors import torchrun_job as tj  # noqa: E402

NAME = "planned_migration"
SWAP_FIELDS = ("phase1_started_s", "phase1_done_s", "switched_s", "first_step_s", "stall_s", "joiner_stall_s",
               "bytes_from_leaver", "handover_s")


# ---------------------------------------------------------------------------- measures

def lost_over(steps: list[dict], start: float, end: float, median: float) -> float:
    """Wall time lost against ``median`` per step, from the last step at or before ``start`` to
    the first step at or after ``end`` (distinct new steps only)."""
    a = max((r for r in steps if r["t"] <= start), key=lambda r: r["t"])
    b = next(r for r in steps if r["t"] >= end and r["step"] > a["step"])
    return max(0.0, (b["t"] - a["t"]) - median * (b["step"] - a["step"]))


def median_after(steps: list[dict], t: float, skip: int = 2) -> float | None:
    """The median step time after wall time ``t`` (skipping ``skip`` steps): did the job get back to speed?"""
    gaps = [dt for at, dt in common.step_times([r for r in steps if r["t"] >= t])[skip:]]
    return statistics.median(gaps) if gaps else None


def done_sha(text: str) -> str | None:
    found = re.findall(r"done steps=\d+ params=\d+ sha256=([0-9a-f]+)", text)
    return found[-1] if found else None


# ---------------------------------------------------------------------------- the runs

def wait_for_gen(job: common.TmrunJob, gen: int, steps: int, timeout: float) -> None:
    """Until the step log shows ``steps`` committed steps of generation ``gen`` or later (or the job ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        if sum(r.get("gen", 0) >= gen for r in common.read_log(job.step_log)[0]) >= steps:
            return
        time.sleep(0.1)


def run_tmrun(size: str, steps: int, at: int, timeout: float) -> dict:
    wd = common.workdir("planned-tmrun")
    job = common.TmrunJob(wd, ["--params", size, "--steps", str(steps), "--threads", "1"],
                          nnodes=2, standby=1, name="planned")
    try:
        hot = job.wait_hot(1, timeout, interval=1.0)
        t_hot = time.time()
        hot_step = max((r["step"] for r in common.read_log(job.step_log)[0]), default=0)
        if hot_step + 10 > at:
            raise RuntimeError(f"the standby was warm only at step {hot_step}: use --at >= {hot_step + 10}")
        node = next(n["node"] for n in hot["nodes"] if n["role"] == "active" and 1 in n["ranks"])
        common.wait_for_step(job.step_log, at, timeout, [job.proc])
        gen = common.read_log(job.step_log)[0][-1]["gen"]
        t0, t1, _ = job.drain(node, wait=False)
        # Watch the step log (cheap) rather than poll `tmrun events` (a Python process each time,
        # which would slow the job on a small machine) until the new generation has committed a
        # few steps, then read the swap event once, before the job ends: its etcd goes with it.
        wait_for_gen(job, gen + 1, 3, timeout)
        swaps = job.swap_events(1, timeout)
        # Which member stalled how long (build, transfer, stall per node): one status call.
        per_node = {n["node"]: n["last_swap"] for n in job.status()["nodes"] if n.get("last_swap")}
        if not swaps:
            raise RuntimeError(f"no swap event after draining {node} (see {wd})")
        code = job.wait(timeout)
        if code != 0:
            raise RuntimeError(f"the tmrun job exited {code} (see {wd})")
        steps_log, _ = common.read_log(job.step_log)
        sha = done_sha((wd / "tmrun.out").read_text(errors="replace"))
    finally:
        job.stop()
        job.out.close()
        job.err.close()
    swap = swaps[0]
    requested = swap.get("requested", t0)
    # The median step from the steps after the standby was warm: before that this script polled
    # `tmrun status`, a Python process each time, which slows the job on a small machine.
    clean = [r for r in steps_log if r["t"] >= t_hot]
    inter = common.interruption(clean, requested + swap["switched_s"])
    after_request = common.interruption(clean, requested)
    median = inter.median_step
    resumed = requested + swap["first_step_s"]
    shutil.rmtree(wd, ignore_errors=True)
    return {"competitor": "tmrun", "size": size, "drained": node, "hot_at_step": hot_step,
            "event_step": after_request.last_before,
            "events": [(requested, f"drain {node}"), (requested + swap["switched_s"], "switch")],
            "median_step_s": median, "median_step_after_s": median_after(steps_log, resumed),
            "downtime_s": inter.downtime, "lost_incl_phase1_s": lost_over(steps_log, requested, resumed, median),
            "recomputed": inter.recomputed, "continued_s": after_request.continued_after,
            "drain_cli_s": t1 - t0, "swap": {k: swap.get(k) for k in SWAP_FIELDS}, "swap_event": swap,
            "last_swap_per_node": per_node, "interruption": inter.to_dict(), "sha256": sha, "steps": steps_log}


def run_torchrun(size: str, steps: int, at: int, ckpt_every: int, timeout: float) -> dict:
    wd = common.workdir("planned-torchrun")
    log = wd / "steps.jsonl"
    train = ["--params", size, "--steps", str(steps), "--threads", "1", "--ckpt-dir", str(wd / "ckpt"),
             "--ckpt-every", str(ckpt_every), "--step-log", str(log)]
    job = tj.start_job(train, log_dir=wd / "logs", rdzv_id=f"planned-{time.time_ns()}")
    try:
        tj.wait_for_step(log, at, job, timeout=timeout)
        job, info = tj.migrate(job, "node1", "node2", timeout=timeout)
        codes = job.wait(timeout)
        if any(codes):
            raise RuntimeError(f"torchrun agents exited {codes} (see {wd})")
        sha = done_sha(tj.done_line(job) or "")
    finally:
        job.kill()
    steps_log, _ = common.read_log(log)
    inter = common.interruption(steps_log, info["t"])
    rec = tj.recovery(common.read_records(log), info["t"])
    shutil.rmtree(wd, ignore_errors=True)
    return {"competitor": "torchrun", "size": size, "event_step": inter.last_before,
            "events": [(info["t"], "stop + restart")], "median_step_s": inter.median_step,
            "median_step_after_s": median_after(steps_log, info["t"] + inter.new_work_after),
            "downtime_s": inter.downtime, "lost_incl_phase1_s": inter.downtime, "recomputed": inter.recomputed,
            "continued_s": inter.continued_after, "stop_s": info["stop_s"], "recovery": rec,
            "interruption": inter.to_dict(), "sha256": sha, "steps": steps_log}


def reference_sha(size: str, steps: int) -> str | None:
    line = tj.reference_done(["--params", size, "--steps", str(steps), "--threads", "1"])
    return done_sha(line or "")


# ---------------------------------------------------------------------------- report

def targets(t: dict, r: dict, bandwidth: float) -> dict:
    state = t["swap"]["bytes_from_leaver"] or 0
    bound = 2 * t["median_step_s"] + state / bandwidth
    stall = t["swap"]["stall_s"]
    ratio = r["downtime_s"] / t["downtime_s"] if t["downtime_s"] > 0 else float("inf")
    ratio_p1 = r["downtime_s"] / t["lost_incl_phase1_s"] if t["lost_incl_phase1_s"] > 0 else float("inf")
    return {
        "stall": {"met": stall <= bound, "value_s": stall, "bound_s": bound,
                  "reason": f"stall {stall:.3f} s vs 2 x {t['median_step_s']:.3f} s + {state / 1e6:.1f} MB / "
                            f"{bandwidth / 1e9:.2f} GB/s = {bound:.3f} s"},
        "downtime_ratio": {"met": ratio >= 20, "value": ratio, "incl_phase1": ratio_p1,
                           "reason": f"torchrun {r['downtime_s']:.2f} s / tmrun {t['downtime_s']:.3f} s = {ratio:.1f}x "
                                     f"(counting tmrun's phase-1 slowdown too: {ratio_p1:.1f}x); target >= 20x"},
    }


METRICS = [  # (label, how to get it from a run); the table has one column per run
    ("median step (s)", lambda r: r["median_step_s"]),
    ("median step after the event (s)", lambda r: r["median_step_after_s"]),
    ("event at step", lambda r: r["event_step"]),
    ("downtime (s)", lambda r: r["downtime_s"]),
    ("lost incl. phase 1 (s)", lambda r: r["lost_incl_phase1_s"]),
    ("steps recomputed", lambda r: r["recomputed"]),
    ("training continued after (s)", lambda r: r["continued_s"]),
    ("swap: phase1_started_s", lambda r: r.get("swap", {}).get("phase1_started_s")),
    ("swap: phase1_done_s", lambda r: r.get("swap", {}).get("phase1_done_s")),
    ("swap: switched_s", lambda r: r.get("swap", {}).get("switched_s")),
    ("swap: first_step_s", lambda r: r.get("swap", {}).get("first_step_s")),
    ("swap: stall_s", lambda r: r.get("swap", {}).get("stall_s")),
    ("swap: joiner_stall_s", lambda r: r.get("swap", {}).get("joiner_stall_s")),
    ("swap: bytes_from_leaver (MB)",
     lambda r: None if r.get("swap", {}).get("bytes_from_leaver") is None else r["swap"]["bytes_from_leaver"] / 1e6),
    ("swap: handover_s", lambda r: r.get("swap", {}).get("handover_s")),
]


def table(runs: list[dict]) -> tuple[list[str], list[list]]:
    columns = ["metric"] + [f"{r['size']} {r['competitor']}" for r in runs]
    return columns, [[label] + [get(r) for r in runs] for label, get in METRICS]


def markdown(doc: dict, png: Path) -> str:
    columns, rows = table(doc["runs"])
    lines = ["## Planned migration", "", "```", doc["command"], "```", "",
             f"Loopback bandwidth (socket copy of {doc['parameters']['loopback_mb']} MB): "
             f"{doc['loopback_bytes_per_s'] / 1e9:.2f} GB/s. tmrun: 2 nodes + 1 standby, `tmrun drain` at step "
             f"{doc['parameters']['at']}; torchrun: checkpoint every {doc['parameters']['ckpt_every']} steps, "
             "stop + restart with the replacement node + reload at the same step.", "",
             common.md_table(columns, rows)]
    lines += ["", "Targets:", ""]
    for size, tg in doc["targets"].items():
        for key, t in tg.items():
            lines.append(f"- {size}, {key.replace('_', ' ')}: **{'met' if t['met'] else 'missed'}** ({t['reason']})")
    for size, same in doc["same_weights"].items():
        lines.append(f"- {size}: final weights {'identical' if same else 'DIFFERENT'} "
                     f"(sha256 tmrun vs torchrun{' vs reference' if doc['parameters']['reference'] else ''})")
    lines += ["", f"![Step time around a planned migration](bench/{png.name})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="5M,50M", help="comma-separated model sizes (default 5M,50M)")
    p.add_argument("--steps", type=int, default=60, help="steps per job (default 60)")
    p.add_argument("--at", type=int, default=30, help="migrate once step K is committed (default 30)")
    p.add_argument("--ckpt-every", type=int, default=20, help="torchrun's checkpoint interval (default 20)")
    p.add_argument("--loopback-mb", type=int, default=256, help="size of the loopback copy (default 256)")
    p.add_argument("--reference", action="store_true", help="also run uninterrupted and compare final weights")
    p.add_argument("--timeout", type=float, default=900, help="seconds any wait may take (default 900)")
    p.add_argument("--quick", action="store_true", help="1M params, 50 steps, migrate at 30")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.at = "1M", 50, 30
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or args.at < 1 or args.steps < args.at + 10 or args.ckpt_every < 1 or args.loopback_mb < 1:
        p.error("need sizes, --at >= 1, --steps >= --at + 10, --ckpt-every >= 1, --loopback-mb >= 1")

    bandwidth = common.loopback_bandwidth(args.loopback_mb << 20)
    print(f"loopback bandwidth: {bandwidth / 1e9:.2f} GB/s", flush=True)
    runs, tg, same = [], {}, {}
    for size in sizes:
        print(f"{size}: tmrun ...", flush=True)
        t = run_tmrun(size, args.steps, args.at, args.timeout)
        print(f"{size}: torchrun ...", flush=True)
        r = run_torchrun(size, args.steps, args.at, args.ckpt_every, args.timeout)
        runs += [t, r]
        tg[size] = targets(t, r, bandwidth)
        hashes = [t["sha256"], r["sha256"]] + ([reference_sha(size, args.steps)] if args.reference else [])
        same[size] = None not in hashes and len(set(hashes)) == 1

    common.print_table(f"Planned migration (loopback {bandwidth / 1e9:.2f} GB/s)", *table(runs))
    for size, t in tg.items():
        for key, v in t.items():
            print(f"{size} {key}: {'met' if v['met'] else 'MISSED'}: {v['reason']}")
        print(f"{size} same final weights: {same[size]}")
    png = common.plot_step_times(NAME, {f"{x['competitor']} {x['size']}": (x["steps"], x["events"]) for x in runs},
                                 "Planned migration: step time around the event")
    doc = {"parameters": {k: v for k, v in vars(args).items()} | {"sizes": sizes},
           "loopback_bytes_per_s": bandwidth,
           "runs": [{k: v for k, v in x.items() if k != "steps"} for x in runs],
           "targets": tg, "same_weights": same}
    path = common.save(NAME, doc)
    doc["command"] = common.command_line()
    md = common.RESULTS / f"{NAME}.md"
    md.write_text(markdown(doc, png))
    print(f"wrote {path}, {md}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
