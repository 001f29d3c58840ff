"""What a warm standby costs the job it waits for, measured inside one job: the standby node's
agent and its idle worker stopped (SIGSTOP) and resumed (SIGCONT) in alternating windows.

Between jobs this machine's speed drifts by several percent (docs/benchmarks.md, "Steady-state
overhead"), more than a standby could cost; inside one job the same active workers train through
every window, so the drift between two neighbouring windows is small. One job of
``examples/train_gpt.py`` (2 nodes and 1 standby, one thread per worker), once the standby is
warm and idle: ``--pairs`` pairs of ``--window``-second windows, the standby node running in one
and stopped in the other (the order alternates from pair to pair), and in each the active
workers' committed steps per second (rank 0's step log) and their CPU time per step
(``/proc/<pid>/stat``). The ratio is running over stopped, per pair, with a 95% confidence
interval.

The job runs with ``lease_ttl=60`` so that a stopped agent keeps its lease: with the benchmarks'
3 s, the leader would count the stopped standby as lost, which is not what is measured here.

    python bench/standby_cost.py --params 5M --window 30 --pairs 4
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from agent import procfs  # noqa: E402
from bench import common, procsample  # noqa: E402

CONF = common.TMRUN_CONF.replace("lease_ttl=3", "lease_ttl=60")
COLUMNS = ["pair", "standby", "steps/s", "actives' CPU/step (ms)"]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _window(job: common.TmrunJob, actives: list[int], seconds: float) -> tuple[float, float]:
    """Steps per second and the actives' CPU ms per step over the next ``seconds``."""
    before, t0 = sum(procfs.cpu_seconds(p) or 0.0 for p in actives), time.time()
    time.sleep(seconds)
    after, t1 = sum(procfs.cpu_seconds(p) or 0.0 for p in actives), time.time()
    steps = [r for r in common.read_log(job.step_log)[0] if t0 <= r["t"] < t1]
    per_step = (after - before) * 1000.0 / len(actives) / max(1, len(steps))
    return len(steps) / (t1 - t0), per_step


def main(argv: list[str] | None = None) -> int:
    p = common.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=common.size_label, default="5M", help="model size (default 5M)")
    p.add_argument("--window", type=common.count(5), default=30, help="seconds per window (default 30)")
    p.add_argument("--pairs", type=common.count(2), default=4, help="pairs of windows (default 4)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the standby may take to warm (default 300)")
    args = p.parse_args(argv)
    job = common.TmrunJob(common.workdir("standby-cost"), ["--params", args.params, "--steps", "10000000",
                                                           "--threads", "1"], conf=CONF, name="standby-cost")
    sampler = procsample.ProcSampler(common.GPT)
    rows, pairs = [], []
    try:
        now = sampler.wait_warm_standby(job, args.timeout)
        standby = [v["pid"] for v in sampler.workers(now, "standby")]
        actives = [v["pid"] for v in sampler.workers(now, "active")]
        table = procfs.table()
        agent = table[standby[0]][0]  # the standby worker's parent: its node's agent
        node = [agent, *sorted(procfs.descendants([agent], table))]
        for pair in range(args.pairs):
            measured = {}
            for stopped in ((False, True) if pair % 2 == 0 else (True, False)):
                if stopped:
                    _signal(node, signal.SIGSTOP)
                try:
                    measured[stopped] = _window(job, actives, args.window)
                finally:
                    _signal(node, signal.SIGCONT)
                rows.append([pair + 1, "stopped" if stopped else "running", *measured[stopped]])
                print(f"[standby_cost] pair {pair + 1}, standby {rows[-1][1]}: {measured[stopped][0]:.3f} steps/s, "
                      f"{measured[stopped][1]:.1f} ms CPU per step", flush=True)
            pairs.append({"throughput": measured[False][0] / measured[True][0],
                          "cpu_per_step": measured[False][1] / measured[True][1]})
    finally:
        job.stop()

    def interval(key: str) -> str:
        mean, half = common.mean_interval([x[key] for x in pairs])
        return f"{mean:.2%} ± {half:.2%}"

    summary = [["running / stopped", "", interval("throughput"), interval("cpu_per_step")]]
    return common.finish_table("standby_cost", f"a warm standby's cost to the actives ({args.params})", COLUMNS,
                               rows + summary, {"settings": vars(args), "conf": CONF, "pairs": pairs,
                                                "standby_node_pids": node})


if __name__ == "__main__":
    sys.exit(main())
