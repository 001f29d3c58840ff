"""Rebalancing efficiency: a node moved every T seconds, committed steps per second against uninterrupted.

What is measured (the GPT of ``examples/train_gpt.py``, ``--size``, two "nodes" of one worker):

- **tmrun, drains**: 2 nodes + 1 standby (``common.TmrunJob``). Once the standby is warm and
  ``--warmup`` more steps are committed, a window of ``--rounds`` x ``--period`` T seconds
  starts; at ``(k + 1/2) T`` into it, ``tmrun drain NODE --rejoin`` moves the node holding rank
  ``k mod 2`` (the two ranks in turn) to the standby, which takes over by a hot swap; the drained
  node comes back as a standby, shadow-trains again, and is the one promoted by the next drain.
- **tmrun, uninterrupted**: the same job and window without drains: the baseline.
- **torchrun, restarts**: ``bench/competitors/torchrun_gpt.py`` (plain DDP, checkpoint every
  ``--ckpt-every`` steps) with one torchrun agent per "node"; at the same times it stops the job
  and starts it again with the spare node in place of one of the two (``torchrun_job.migrate``),
  which reloads the latest checkpoint and recomputes the steps after it.
- **torchrun, uninterrupted**: torchrun's own baseline (checkpointing included).

Each job runs with a ``--steps`` far beyond the window and is stopped when the window ends.

Numbers, from each job's step log:

- ``steps/s``: committed steps per second over the window (``common.throughput``: distinct step
  numbers, so a recomputed step counts once);
- ``vs uninterrupted``: that rate over the same competitor's uninterrupted rate;
- ``lost per event``: the window's seconds lost against the uninterrupted rate, per drain/restart;
- ``median downtime per event``: the loss measured around each event instead, against the median
  step just before it (robust to the machine's speed drifting between runs): for tmrun from the
  drain request to the swap's first step (phase 1 included), for torchrun
  ``common.interruption`` (restart and recomputation included);
- ``lost per period, local`` and ``1 - lost/window, local``: the same, but over 0.9 T after each
  event (until the window's end less 1 s for the last), so it also counts what follows the
  swap: with every "node" on one small machine, the rejoined node's new shadow workers (Python,
  torch, the model, 3 warm-up steps) take CPU from the training workers for a few seconds;
- for tmrun's drains, the median ``stall_s`` and ``first_step_s`` of the swap events.

Target: tmrun with drains keeps >= 99% of its uninterrupted rate at T = 60 s (the default).
The target is judged on ``vs uninterrupted``; runs on a shared machine differ by a few percent
from run to run, which matters at 1%, so compare with ``1 - lost/window, local``.

Output: a rich table, ``bench/results/rebalancing.json``, ``docs/bench/rebalancing.png`` and a
markdown section ``bench/results/rebalancing.md``. Run it alone on the machine::

    flock /tmp/tmrun-bench.lock python bench/rebalancing.py --quick
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import common  # noqa: E402
from bench.competitors import torchrun_job as tj  # noqa: E402
from bench.planned_migration import lost_over  # noqa: E402

NAME = "rebalancing"
STEPS = 10_000_000  # beyond any window: the job is stopped when the window ends


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def last_step(path) -> int:
    steps, _ = common.read_log(path)
    return max((r["step"] for r in steps), default=0)


def run_tmrun(size: str, period: float, rounds: int, warmup: int, drains: bool, timeout: float) -> dict:
    wd = common.workdir("rebalancing-tmrun")
    job = common.TmrunJob(wd, ["--params", size, "--steps", str(STEPS), "--threads", "1"],
                          nnodes=2, standby=1, name="rebalancing")
    events, swaps = [], []
    try:
        job.wait_hot(1, timeout, interval=1.0)
        common.wait_for_step(job.step_log, last_step(job.step_log) + warmup, timeout, [job.proc])
        start = time.time()
        for k in range(rounds if drains else 0):
            sleep_until(start + (k + 0.5) * period)
            node = job.node_of_rank(k % 2)["node"]
            t0, t1, _ = job.drain(node, rejoin=True)
            events.append({"t": t0, "node": node, "rank": k % 2, "command_s": round(t1 - t0, 3)})
        sleep_until(start + rounds * period)
        end = time.time()
        if drains:
            swaps = job.swap_events(rounds, timeout=60)  # before the job stops: its etcd goes with it
    finally:
        job.stop()
        job.out.close()
        job.err.close()
    steps, _ = common.read_log(job.step_log)
    shutil.rmtree(wd, ignore_errors=True)
    return {"competitor": "tmrun", "drains": drains, "period": period, "start": start, "end": end, "events": events,
            "swaps": swaps, "steps": steps}


def run_torchrun(size: str, period: float, rounds: int, warmup: int, ckpt_every: int, restarts: bool,
                 timeout: float) -> dict:
    wd = common.workdir("rebalancing-torchrun")
    log = wd / "steps.jsonl"
    train = ["--params", size, "--steps", str(STEPS), "--threads", "1", "--ckpt-dir", str(wd / "ckpt"),
             "--ckpt-every", str(ckpt_every), "--step-log", str(log)]
    job = tj.start_job(train, log_dir=wd / "logs", rdzv_id=f"rebalancing-{time.time_ns()}")
    events, spare = [], "node2"
    try:
        tj.wait_for_step(log, warmup, job, timeout=timeout)
        start = time.time()
        for k in range(rounds if restarts else 0):
            sleep_until(start + (k + 0.5) * period)
            leaving = job.nodes[k % 2].name
            job, info = tj.migrate(job, leaving, spare, timeout=timeout)
            events.append({"t": info["t"], "node": leaving, "stop_s": round(info["stop_s"], 3)})
            spare = leaving
        sleep_until(start + rounds * period)
        end = time.time()
        tj.stop_job(job, timeout=60)
    finally:
        job.kill()
    steps, _ = common.read_log(log)
    shutil.rmtree(wd, ignore_errors=True)
    return {"competitor": "torchrun", "drains": restarts, "period": period, "start": start, "end": end,
            "events": events,
            "swaps": [], "steps": steps}


def summarize(run: dict, base: dict | None) -> dict:
    rate = common.throughput(run["steps"], run["start"], run["end"])
    out = {"competitor": run["competitor"], "interrupted": run["drains"], "window_s": run["end"] - run["start"],
           "steps_per_s": rate, "events": run["events"], "swaps": run["swaps"]}
    if base is not None:
        base_rate = common.throughput(base["steps"], base["start"], base["end"])
        out["vs_uninterrupted"] = rate / base_rate
        out["lost_per_event_s"] = (1 - rate / base_rate) * out["window_s"] / max(1, len(run["events"]))
    # The loss measured locally around each event, against the median step before it (robust to
    # the machine's speed drifting between runs). ``downtime``: tmrun from the drain request to the
    # swap's first step (phase 1 included), torchrun ``common.interruption`` (recomputation
    # included). ``lost``: everything the event cost until shortly before the next one (0.9 T,
    # or the window's end less 1 s), e.g. the rejoined node's shadow warm-up as well.
    tmrun = run["competitor"] == "tmrun"
    times = [sw["requested"] for sw in run["swaps"]] if tmrun else [e["t"] for e in run["events"]]
    downtime, lost = [], []
    for k, t in enumerate(times):
        median = common.median_step(run["steps"], before=t)
        if tmrun:
            downtime.append(lost_over(run["steps"], t, t + run["swaps"][k]["first_step_s"], median))
        else:
            downtime.append(common.interruption(run["steps"], t).downtime)
        lost.append(lost_over(run["steps"], t, min(t + 0.9 * run["period"], run["end"] - 1.0), median))
    if times:
        out |= {"downtime_per_event_s": downtime, "median_downtime_s": statistics.median(downtime),
                "lost_per_period_s": lost, "median_lost_per_period_s": statistics.median(lost),
                "vs_uninterrupted_local": 1 - sum(lost) / out["window_s"]}
    if run["swaps"]:
        out["median_stall_s"] = statistics.median(s["stall_s"] for s in run["swaps"])
        out["median_first_step_s"] = statistics.median(s["first_step_s"] for s in run["swaps"])
    return out


def label(s: dict) -> str:
    return f"{s['competitor']}, {'drains' if s['competitor'] == 'tmrun' else 'restarts'}" if s["interrupted"] \
        else f"{s['competitor']}, uninterrupted"


METRICS = [  # (label, how to get it from a run's summary); the table has one column per run
    ("events", lambda s: len(s["events"])),
    ("steps/s over the window", lambda s: s["steps_per_s"]),
    ("vs uninterrupted", lambda s: s.get("vs_uninterrupted")),
    ("lost per event (s)", lambda s: s.get("lost_per_event_s")),
    ("median downtime per event (s)", lambda s: s.get("median_downtime_s")),
    ("median lost per period, local (s)", lambda s: s.get("median_lost_per_period_s")),
    ("1 - lost/window, local", lambda s: s.get("vs_uninterrupted_local")),
    ("median swap stall_s", lambda s: s.get("median_stall_s")),
    ("median swap first_step_s", lambda s: s.get("median_first_step_s")),
]


def table(runs: list[dict]) -> tuple[list[str], list[list]]:
    return ["metric"] + [label(s) for s in runs], [[name] + [get(s) for s in runs] for name, get in METRICS]


def markdown(doc: dict, png) -> str:
    p = doc["parameters"]
    columns, rows = table(doc["runs"])
    lines = ["## Rebalancing efficiency", "", "```", doc["command"], "```", "",
             f"GPT {p['size']}, a drain (tmrun: `tmrun drain NODE --rejoin`, the two ranks in turn) or a "
             f"stop + restart + reload (torchrun, checkpoint every {p['ckpt_every']} steps) every {p['period']:g} s "
             f"over a window of {p['rounds']} x {p['period']:g} s, against an uninterrupted run of each.", "",
             common.md_table(columns, rows)]
    t = doc["target"]
    lines += ["", f"Target: **{'met' if t['met'] else 'missed'}** ({t['reason']})", "",
              f"![Step time under rebalancing](bench/{png.name})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="5M", help="model size (default 5M)")
    p.add_argument("--period", type=float, default=60, help="seconds between drains/restarts (default 60)")
    p.add_argument("--rounds", type=int, default=10, help="drains per run; the window is rounds x period (default 10)")
    p.add_argument("--ckpt-every", type=int, default=20, help="torchrun's checkpoint interval (default 20)")
    p.add_argument("--warmup", type=int, default=10, help="steps committed before the window opens (default 10)")
    p.add_argument("--timeout", type=float, default=900, help="seconds any wait may take (default 900)")
    p.add_argument("--quick", action="store_true", help="1M params, period 15 s, 4 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.period, args.rounds = "1M", 15.0, 4
    if args.period <= 0 or args.rounds < 1 or args.ckpt_every < 1 or args.warmup < 1:
        p.error("need --period > 0, --rounds >= 1, --ckpt-every >= 1, --warmup >= 1")

    window = args.rounds * args.period
    print(f"4 runs of a {window:g} s window each (+ start-up)", flush=True)
    raw = {}
    for competitor, interrupted in (("tmrun", False), ("tmrun", True), ("torchrun", False), ("torchrun", True)):
        print(f"{competitor}, {'interrupted' if interrupted else 'uninterrupted'} ...", flush=True)
        if competitor == "tmrun":
            raw[competitor, interrupted] = run_tmrun(args.size, args.period, args.rounds, args.warmup, interrupted,
                                                     args.timeout)
        else:
            raw[competitor, interrupted] = run_torchrun(args.size, args.period, args.rounds, args.warmup,
                                                        args.ckpt_every, interrupted, args.timeout)
    runs = [summarize(raw[c, i], raw[c, False] if i else None) for c, i in raw]
    tm = next(s for s in runs if s["competitor"] == "tmrun" and s["interrupted"])
    note = "" if args.period == 60 else f"; the target is set for T = 60 s, this run used T = {args.period:g} s"
    target = {"met": tm["vs_uninterrupted"] >= 0.99, "value": tm["vs_uninterrupted"],
              "reason": f"tmrun with drains: {tm['vs_uninterrupted']:.2%} of uninterrupted, target >= 99%{note}"}

    common.print_table(f"Rebalancing: GPT {args.size}, every {args.period:g} s over {window:g} s", *table(runs))
    print(f"target {'met' if target['met'] else 'MISSED'}: {target['reason']}")
    panels = {}
    for (c, i), run in raw.items():
        kind = ("drains" if c == "tmrun" else "restarts") if i else "uninterrupted"
        marks = [(run["start"], "window"), (run["end"], "end")]
        marks += [(e["t"], f"{'drain' if c == 'tmrun' else 'restart'} {e['node']}") for e in run["events"]]
        panels[f"{c}, {kind}"] = (run["steps"], marks)
    png = common.plot_step_times(NAME, panels, f"Rebalancing: a node moved every {args.period:g} s")
    doc = {"parameters": vars(args) | {"window_s": window}, "runs": runs, "target": target}
    path = common.save(NAME, doc)
    doc["command"] = common.command_line()
    md = common.RESULTS / f"{NAME}.md"
    md.write_text(markdown(doc, png))
    print(f"wrote {path}, {md}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
