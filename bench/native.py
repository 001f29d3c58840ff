"""Torch-native FSDP2 under tmrun against torchrun: a drain, a failure, and what ``--redundancy 1`` costs.

The script is ``examples/train_gpt_fsdp.py`` (torch's ``fully_shard`` on a mesh from the tmrun
runtime), the same under both launchers and in every run: ``--params`` (default 50M), batch 1 of
``--block-size`` bytes (CPU), one intra-op thread, a step log. Per run of this script, side by
side:

- **steady state**: ``tmrun --nnodes N`` without, then with ``--redundancy 1 --redundancy-every E``:
  the mean step time over whole snapshot cycles (throughput ratio on/off; goal >= 98%), what the
  steps after each snapshot cost inside the run against the run's other steps (free of the
  machine's drift between runs; the off run at the same positions gives the noise floor), and each
  rank's peak RSS (``maxrss`` at the end; the difference is the host memory a redundant copy costs);
- **drain** (planned): ``tmrun --nnodes N --standby 1``, ``tmrun drain`` of rank 1's node at step
  K: the leaver hands its shards to the warm standby;
- **kill -9** (unplanned): the same with ``--redundancy 1``: rank 1's worker SIGKILLed at step K;
  every rank rolls back to the last agreed copy and the standby takes the lost shards from its
  left neighbour's copy;
- **HSDP** (``--hsdp``, 4 ranks as 2 x 2): the drain and the kill -9 without ``--redundancy``
  (every shard has a replica in the other row of the mesh), no steady-state runs;
- **torchrun**: the same script under one torchrun agent per "node" (``bench/competitors``),
  sharded checkpoints every C steps (``--ckpt-dir``): a worker SIGKILLed at step K (torchrun
  restarts every worker, they reload and recompute), and a planned move (stop, start again with
  the replacement node, reload).

Each event's cost is ``common.interruption`` on the step log: the time from the last step before
the event to the first new step after it, less a median step per step, recomputed steps counted
as lost. Output: a table, ``bench/results/native.json`` and ``bench/results/native.md``::

    flock /tmp/tmrun-bench.lock python bench/native.py [--params 50M --nodes 2 --steps 40 --at 20] [--torchrun]
    flock /tmp/tmrun-bench.lock python bench/native.py --hsdp [--torchrun]   # 4 ranks, 2 x 2; native_hsdp.json
    flock /tmp/tmrun-bench.lock python bench/native.py --steady-repeats 3 --every 10   # on/off pairs only
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

NAME = "native"
SCRIPT = common.REPO / "examples" / "train_gpt_fsdp.py"


def train_args(args: argparse.Namespace) -> list[str]:
    return ["--params", args.params, "--steps", str(args.steps), "--batch-size", "1", "--block-size",
            str(args.block_size), "--threads", "1", "--log-every", "5", *(["--hsdp"] if args.hsdp else [])]


def median_step(steps: list[dict], skip: int) -> float:
    gaps = [dt for _, dt in common.step_times(steps)[skip:]]
    return statistics.median(gaps)


AFTER = 3
"""Steps after a snapshot that may pay for it: its copy on the training thread, then the sends and
receives in gloo's threads on the cores that train."""


def cycle_mean(steps: list[dict], every: int, skip: int) -> float:
    """The mean step time over whole snapshot cycles after the warm-up: a periodic cost counts in
    full (a median would leave it out)."""
    first = (skip // every + 1) * every
    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:]) if first < b["step"] <= steps[-1]["step"] // every * every]
    return statistics.mean(gaps)


FIRST = 2
"""A generation's first snapshots fault in fresh memory (two: one is agreed while the next is sent);
from the third on, the allocator hands them the pages of the snapshot they replace."""


def snapshot_cost(steps: list[dict], every: int, skip: int) -> dict:
    """What the snapshots cost inside one run, free of the run-to-run drift: the ``AFTER`` steps
    after each snapshot (taken before the step that follows a multiple of ``every``) against the
    run's median of the other steps; ``steady_*`` from the ``FIRST`` + 1-th snapshot on, as in a
    long job. Applied to a run without ``--redundancy``, the same positions give the measurement's
    noise floor."""
    gaps = [(b["step"], b["t"] - a["t"]) for a, b in zip(steps, steps[1:]) if a["step"] > skip]
    base = statistics.median(dt for s, dt in gaps if (s - 1) % every >= AFTER)
    last = steps[-1]["step"]
    excess = [sum(dt - base for s, dt in gaps if c < s <= c + AFTER)
              for c in range(every, last - AFTER + 1, every) if c > skip]
    cost = statistics.mean(excess) / (every * base)
    steady = statistics.mean(excess[FIRST:] or excess) / (every * base)
    return {"base_step_s": base, "excess_s": [round(e, 3) for e in excess], "cost": cost, "throughput": 1 / (1 + cost),
            "steady_cost": steady, "steady_throughput": 1 / (1 + steady)}


def peak_rss_mib(workdir: Path) -> list[float]:
    _, done = common.read_log(workdir / "steps.jsonl")
    return sorted(round(r["maxrss_kb"] / 1024, 1) for r in done if "maxrss_kb" in r)


def run_tmrun(args: argparse.Namespace, name: str, *, standby: int, flags: list[str], event: str | None) -> dict:
    wd = common.workdir(f"native-{name}")
    job = common.TmrunJob(wd, train_args(args), nnodes=args.nodes, standby=standby, script=SCRIPT, name=name,
                          flags=flags)
    t_event = None
    try:
        if standby:
            job.wait_hot(standby, args.timeout, interval=1.0)
        common.wait_for_step(job.step_log, args.at, args.timeout, [job.proc])
        if event is not None:
            if event == "drain":
                t_event, _, _ = job.drain(job.node_of_rank(1)["node"], wait=False)
            else:
                t_event = job.kill_worker(1)
        code = job.wait(args.timeout)
        if code != 0:
            raise RuntimeError(f"the tmrun job exited {code} (see {wd})")
        steps, _ = common.read_log(job.step_log)
        rss = peak_rss_mib(wd)
        restarts = "started generation 2" in (wd / "tmrun.err").read_text(errors="replace")
    finally:
        job.stop()
        job.out.close()
        job.err.close()
    result = {"run": name, "launcher": "tmrun", "flags": flags, "standby": standby, "event": event,
              "median_step_s": median_step(steps, args.skip), "peak_rss_mib": rss, "restarted": restarts}
    if event is None:
        result["mean_step_s"] = cycle_mean(steps, args.every, args.skip)
        result["snapshots"] = snapshot_cost(steps, args.every, args.skip)
    if t_event is not None:
        result["interruption"] = common.interruption(steps, t_event).to_dict()
    shutil.rmtree(wd, ignore_errors=True)
    return result


def run_torchrun(args: argparse.Namespace, name: str, event: str) -> dict:
    wd = common.workdir(f"native-{name}")
    log = wd / "steps.jsonl"
    train = [*train_args(args), "--ckpt-dir", str(wd / "ckpt"), "--ckpt-every", str(args.ckpt_every),
             "--step-log", str(log)]
    nodes = tuple(f"node{i}" for i in range(args.nodes))
    job = tj.start_job(train, nodes=nodes, log_dir=wd / "logs", rdzv_id=f"native-{time.time_ns()}", script=SCRIPT)
    try:
        if event == "kill":
            t_event = tj.kill_at_step(job, log, args.at, timeout=args.timeout)
        else:
            tj.wait_for_step(log, args.at, job, timeout=args.timeout)
            job, info = tj.migrate(job, "node1", f"node{args.nodes}", timeout=args.timeout)
            t_event = info["t"]
            codes = job.wait(args.timeout)
            if any(codes):
                raise RuntimeError(f"torchrun agents exited {codes} (see {wd})")
    finally:
        job.kill()
    steps, _ = common.read_log(log)
    inter = common.interruption(steps, t_event)
    shutil.rmtree(wd, ignore_errors=True)
    return {"run": name, "launcher": "torchrun", "event": event, "median_step_s": median_step(steps, args.skip),
            "interruption": inter.to_dict()}


def steady_repeats(args: argparse.Namespace, redundancy: list[str]) -> int:
    """Throughput with ``--redundancy 1`` against without, in alternating pairs: the ratio of the
    mean step times per pair and its spread (the machine's run-to-run drift is in it), and, inside
    each run, what the steps after a snapshot cost (:func:`snapshot_cost`; the runs without it give
    the noise floor)."""
    runs = []
    for i in range(args.steady_repeats):
        runs += [run_tmrun(args, f"steady-off-{i}", standby=0, flags=[], event=None),
                 run_tmrun(args, f"steady-on-{i}", standby=0, flags=redundancy, event=None)]
    ratios = [off["mean_step_s"] / on["mean_step_s"] for off, on in zip(runs[::2], runs[1::2])]
    inside = [on["snapshots"]["throughput"] for on in runs[1::2]]
    floor = [off["snapshots"]["throughput"] for off in runs[::2]]
    summary = {"ratio_per_pair": ratios, "ratio_median": statistics.median(ratios),
               "ratio_spread": max(ratios) - min(ratios),
               "within_run_throughput": inside, "within_run_median": statistics.median(inside),
               "within_run_steady": [on["snapshots"]["steady_throughput"] for on in runs[1::2]],
               "noise_floor_without": floor, "noise_floor_median": statistics.median(floor),
               "rss_extra_mib_per_rank": [round(statistics.median(on["peak_rss_mib"][k] - off["peak_rss_mib"][k]
                                                                  for off, on in zip(runs[::2], runs[1::2])), 1)
                                          for k in range(args.nodes)]}
    common.save(f"{NAME}_steady", {"args": vars(args), "runs": runs, "summary": summary})
    common.print_table(f"FSDP2 GPT {args.params}, {args.nodes} ranks: --redundancy 1 on vs off",
                       ["pair", "off s", "on s", "on/off throughput", "snapshot excess s", "within the run",
                        f"from snapshot {FIRST + 1}", "same in the off run"],
                       [(i, f"{off['mean_step_s']:.3f}", f"{on['mean_step_s']:.3f}", f"{r:.1%}",
                         " ".join(f"{e:.2f}" for e in on["snapshots"]["excess_s"]),
                         f"{on['snapshots']['throughput']:.1%}", f"{on['snapshots']['steady_throughput']:.1%}",
                         f"{off['snapshots']['throughput']:.1%}")
                        for i, (off, on, r) in enumerate(zip(runs[::2], runs[1::2], ratios))])
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="50M")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--nodes", type=int, default=0, help="ranks (default: 2, or 4 with --hsdp)")
    p.add_argument("--hsdp", action="store_true",
                   help="HSDP (2 x nodes/2): a drain and a kill -9 without --redundancy (the replica serves)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--at", type=int, default=20, help="the event's step")
    p.add_argument("--every", type=int, default=5, help="--redundancy-every")
    p.add_argument("--ckpt-every", type=int, default=10, help="torchrun's checkpoint interval")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--torchrun", action="store_true", help="also the torchrun runs (kill -9, stop-and-move)")
    p.add_argument("--steady-repeats", type=int, default=0,
                   help="only the steady state: N pairs of runs, off and on alternating (native_steady.json)")
    args = p.parse_args(argv)
    args.nodes = args.nodes or (4 if args.hsdp else 2)
    redundancy = ["--redundancy", "1", "--redundancy-every", str(args.every)]
    if args.steady_repeats:
        return steady_repeats(args, redundancy)
    runs = []
    if not args.hsdp:  # HSDP's replicas make the redundant copy unnecessary
        runs += [run_tmrun(args, "steady-off", standby=0, flags=[], event=None),
                 run_tmrun(args, "steady-on", standby=0, flags=redundancy, event=None)]
    runs += [run_tmrun(args, "drain", standby=1, flags=[], event="drain"),
             run_tmrun(args, "kill", standby=1, flags=[] if args.hsdp else redundancy, event="kill")]
    if args.torchrun:
        runs += [run_torchrun(args, "torchrun-kill", "kill"), run_torchrun(args, "torchrun-move", "move")]
    by = {r["run"]: r for r in runs}
    summary = {"planned_tmrun_s": by["drain"]["interruption"]["downtime"],
               "failure_tmrun_s": by["kill"]["interruption"]["downtime"],
               "restarted": [r["run"] for r in runs if r.get("restarted")]}
    if not args.hsdp:
        off, on = by["steady-off"], by["steady-on"]
        summary["throughput_on_vs_off"] = off["mean_step_s"] / on["mean_step_s"]
        summary["throughput_within_run"] = on["snapshots"]["throughput"]
        summary["throughput_within_run_steady"] = on["snapshots"]["steady_throughput"]
        summary["rss_extra_mib_per_rank"] = [round(b - a, 1) for a, b in zip(off["peak_rss_mib"], on["peak_rss_mib"])]
    if args.torchrun:
        summary["planned_torchrun_s"] = by["torchrun-move"]["interruption"]["downtime"]
        summary["failure_torchrun_s"] = by["torchrun-kill"]["interruption"]["downtime"]
        summary["planned_ratio"] = summary["planned_torchrun_s"] / max(summary["planned_tmrun_s"], 1e-3)
        summary["failure_ratio"] = summary["failure_torchrun_s"] / max(summary["failure_tmrun_s"], 1e-3)
    doc = {"machine": common.machine(), "command": common.command_line(), "args": vars(args), "runs": runs,
           "summary": summary}
    common.save(f"{NAME}_hsdp" if args.hsdp else NAME, doc)
    rows = [(r["run"], r["launcher"], r.get("event") or "-", f"{r['median_step_s']:.3f}",
             r.get("interruption", {}).get("downtime", "-"), r.get("interruption", {}).get("recomputed", "-"),
             r.get("peak_rss_mib", "-")) for r in runs]
    common.print_table(f"{'HSDP' if args.hsdp else 'FSDP2'} GPT {args.params}, {args.nodes} ranks", ["run", "launcher", "event", "median step s",
                                                                         "lost s", "recomputed", "peak RSS MiB"], rows)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
