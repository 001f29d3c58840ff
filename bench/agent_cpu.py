"""What tmrun's control plane costs while a job trains, by process and thread, with the agents'
link checks on (the default, one TCP handshake to each member a second) and off (``link_check=0``).

One job of ``examples/train_gpt.py``, 2 nodes and 1 standby (the steady-state benchmark's
settings), per configuration and repeat: once the standby is warm, the CPU time of each agent
(its main thread: the asyncio loop; gRPC's ``event_engine`` threads; the rest), of etcd, of the
standby's worker and of the two store hosts (the leader's and its deputy's TCPStore hosts) over
``--window`` seconds, from ``/proc/<pid>/task/*/stat``. CPU time, not wall clock: it depends on
what wakes up, much less on how fast the machine happens to be (though on a shared virtual
machine the same work costs more CPU time when the neighbours are busy: compare runs made in
the same hour).

    python bench/agent_cpu.py --params 1M --window 60 --repeats 2
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench import common  # noqa: E402
from bench.procsample import CLK_TCK, ProcSampler, thread_cpu  # noqa: E402

CONFIGS = {"link checks on (1 s)": "link_check=1", "link checks off": "link_check=0"}
COLUMNS = ["configuration", "agents (ms/s, each)", "agents: main thread", "agents: gRPC threads", "agents: other",
           "etcd (ms/s)", "standby worker (ms/s)", "store hosts (ms/s, both)", "control plane (cores)"]


def _threads(pids: list[int]) -> dict[int, dict[str, int]]:
    return {pid: thread_cpu(pid) for pid in pids}


def measure(label: str, conf: str, args) -> dict:
    """One job: the CPU (ms per second of wall clock) of each agent by thread, etcd, the standby's worker."""
    job = common.TmrunJob(common.workdir("agent-cpu"), ["--params", args.params, "--steps", "1000000", "--threads", "1"],
                          conf=f"{common.TMRUN_CONF},{conf}", name="agent-cpu")
    try:
        sampler = ProcSampler(common.GPT)
        first = sampler.wait_warm_standby(job, args.timeout)
        standby = [v["pid"] for v in sampler.workers(first, "standby")]
        launcher = sorted(p for p, v in first.items() if v["kind"] == "agent")
        hosts = [p for p in launcher if b"agent.store_host" in Path(f"/proc/{p}/cmdline").read_bytes()]
        agents = [p for p in launcher if p not in hosts]
        etcd = [p for p, v in first.items() if v["kind"] == "etcd"]
        before, t0 = _threads(agents), time.monotonic()
        time.sleep(args.window)
        after, seconds, last = _threads(agents), time.monotonic() - t0, sampler.sample()
    finally:
        job.stop()
    per_s = 1000.0 / CLK_TCK / seconds

    def used(pids: list[int]) -> float:
        return sum(last[p]["cpu"] - first[p]["cpu"] for p in pids if p in last) * per_s

    rows = []
    for pid in agents:
        delta = {k: after[pid].get(k, 0) - v for k, v in before[pid].items() if k != "threads"}
        grpc = sum(v for k, v in delta.items() if k.startswith("event_engine"))
        rows.append({"total": sum(delta.values()) * per_s, "main": delta.get("main", 0) * per_s,
                     "grpc": grpc * per_s, "other": (sum(delta.values()) - delta.get("main", 0) - grpc) * per_s})
    return {"configuration": label, "conf": conf, "seconds": round(seconds, 1), "agents": rows,
            "etcd_ms_s": used(etcd), "standby_ms_s": used(standby), "store_hosts_ms_s": used(hosts)}


def summary(label: str, runs: list[dict]) -> list:
    agents = [a for run in runs for a in run["agents"]]

    def mean(key: str) -> float:
        return statistics.fmean(a[key] for a in agents)
    etcd, standby = statistics.fmean(r["etcd_ms_s"] for r in runs), statistics.fmean(r["standby_ms_s"] for r in runs)
    hosts = statistics.fmean(r.get("store_hosts_ms_s", 0.0) for r in runs)
    cores = (sum(a["total"] for a in agents) / len(runs) + etcd + standby + hosts) / 1000.0
    each = ", ".join(f"{a['total']:.1f}" for a in agents)
    return [label, f"{mean('total'):.1f} ({each})", round(mean("main"), 1),
            round(mean("grpc"), 1), round(mean("other"), 1), round(etcd, 1), round(standby, 1), round(hosts, 1),
            round(cores, 4)]


def main(argv: list[str] | None = None) -> int:
    p = common.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=common.size_label, default="1M", help="model size (default 1M)")
    p.add_argument("--window", type=common.count(10), default=60, help="seconds measured per job (default 60)")
    p.add_argument("--repeats", type=common.count(1), default=2, help="jobs per configuration (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the standby may take to warm (default 300)")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {label: [] for label in CONFIGS}
    for _ in range(args.repeats):  # interleaved: on, off, on, off
        for label, conf in CONFIGS.items():
            runs[label].append(measure(label, conf, args))
    rows = [summary(label, found) for label, found in runs.items()]
    return common.finish_table("agent_cpu", "control plane CPU while training", COLUMNS, rows,
                               {"settings": vars(args), "runs": runs})


if __name__ == "__main__":
    sys.exit(main())
