"""Control-plane latency: from a drain request or a killed worker to the new plan and phase 1.

One tmrun job (a small GPT, ``--params`` 1M, 2 nodes, standbys) trains throughout; then:

- ``--drains`` times: ``tmrun drain NODE --rejoin`` of an active node that is not the leader's
  (``--rejoin``: the node goes back to the pool, so the pool never runs dry), each once the
  standby's shadow worker is warm and idle. From the ``swap`` event: ``plan_written_s`` (request
  created -> the leader wrote the plan) and ``phase1_started_s`` (-> the last member's agent told
  its workers to build the next group, ``prepare``); from ``tmrun status``, each member's own
  ``prepared_at``. Target: request -> phase 1 started on every member <= 50 ms.
- ``--kills`` times: ``kill -9`` of the worker of an active non-leader node (a standby per kill is
  started with the job, since a failed node does not come back). The swap event's times count
  from the failed worker's report (``requested``); with the kill's wall time: kill -> report,
  kill -> plan written (``requested + plan_written_s - kill``), kill -> phase 1 started.
- the etcd round trip on this machine, against the job's own etcd while the job trains:
  ``--rtt`` sequential gets and puts with aetcd, and the same through tmrun's ``EtcdStore``
  (plus its ``get_prefix`` of the whole job, the leader's read, a compare-and-set ``replace``, and
  put -> watch event, how long a change takes to reach a watcher).

The sequential etcd round trips on the drain path (read from agent/leader.py, agent/node.py and
tmrun/admin.py) are listed with the results; two writes, each until a watcher has its event (the
request, then the plan), are the etcd floor of request -> phase 1, and what the measurement adds to it is Python, asyncio and the
CPU the training workers leave over (2 of them keep this machine's 2 cores busy).

Output: tables, ``bench/results/control_plane.json``, ``docs/bench/control_plane.png`` (the
latencies as a strip plot) and ``bench/results/control_plane.md``. ``--profile`` also samples the
agents with py-spy during each drain (``bench/results/control_plane_profile/``; it perturbs the
timings it runs alongside). ``--quick``: 2 drains, 1 kill, 50 round trips.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from agent import procfs  # noqa: E402
from bench import common  # noqa: E402

NAME = "control_plane"
TARGET_PHASE1_S = 0.050
CLK_TCK = procfs.CLOCK_TICKS

# The drain path, read from the code: every etcd round trip in order, and whether the request ->
# phase 1 interval waits for it. "push": etcd delivers a watch event (half a round trip, no request).
DRAIN_PATH = [
    ("tmrun drain", "get_prefix(job): the nodes, the plan, the outcome and the watch's revision", "tmrun/admin.py drain",
     "before"),
    ("tmrun drain", "watch create (request, node, plan, outcome)", "agent/changes.py Changes.start", "before"),
    ("tmrun drain", "put(requests/ID)  [Request.created is stamped just before]", "tmrun/admin.py drain", "yes"),
    ("etcd", "push: watch event -> the leader's copy of the keys", "agent/mirror.py Mirror._run", "yes (push)"),
    ("leader", "(no etcd) read_cluster on its copy (only changed records parsed), decide(); the TCPStore "
     "from a spare made beforehand [Plan.created stamped after]", "agent/leader.py _lead/_apply/_new_tcp_store",
     "yes (not etcd)"),
    ("leader", "txn replace(plan) compare mod_revision", "agent/leader.py _apply", "yes"),
    ("etcd", "push: watch event (with the plan's value) -> every agent", "agent/changes.py Changes._run",
     "yes (push)"),
    ("member agent", "(no etcd) the plan from the watch event, parsed once; _reconcile -> _prepare stamps "
     "prepared_at, sends prepare", "agent/node.py NodeAgent._sync/_read_plan", "yes (not etcd)"),
    ("leader", "put(events/SEQ)", "agent/leader.py _event", "no (after the plan)"),
    ("leader", "txn replace(requests/ID) = accepted (the request from its copy: no read)", "agent/leader.py _apply",
     "no (after the plan)"),
    ("leader", "stat(plan), stat(requests/ID): waits until its copy shows its writes", "agent/leader.py _lead",
     "no (after the plan)"),
    ("member agent", "put(nodes/NODE) run state after prepare", "agent/node.py _report (via _dirty)", "no"),
]


# ------------------------------------------------------------------------------ small helpers

def cpu_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def sched_ns(pid: int) -> tuple[int, int, int]:
    """(ns on a CPU, ns runnable but waiting for a CPU, times put on a CPU) of all threads of
    ``pid`` (/proc/PID/task/*/schedstat)."""
    cpu = wait = runs = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0, 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                on, waiting, count = f.read().split()
        except (OSError, ValueError):
            continue
        cpu, wait, runs = cpu + int(on), wait + int(waiting), runs + int(count)
    return cpu, wait, runs


def kind_of(pid: int, script: bytes) -> str | None:
    """What one of this benchmark's processes is: worker (runs ``script``), agent, etcd, other."""
    argv = procfs.cmdline(pid)
    if not argv:
        return None
    if script in argv[1:3]:
        return "worker"
    if b"agent" in argv[1:3]:
        return "agent"
    return "etcd" if os.path.basename(argv[0]) == b"etcd" else "other"


def cpu_sample(script: Path = common.GPT) -> dict:
    """Now: per process of ours (this one's descendants) its kind, CPU ticks and times it was put
    on a CPU (/proc/PID/task/*/schedstat: a wake-up or a return from preemption); and the CPU
    ticks of every process that is not ours."""
    table = procfs.table()
    ours = procfs.descendants(os.getpid(), table)
    procs = {}
    for pid in ours:
        kind = kind_of(pid, str(script).encode())
        if kind is not None:
            procs[pid] = {"kind": kind, "ticks": table[pid][1], "runs": sched_ns(pid)[2]}
    return {"t": time.monotonic(), "procs": procs,
            "foreign": {pid: ticks for pid, (_, ticks, _) in table.items() if pid not in ours and pid != os.getpid()}}


def cpu_between(before: dict, after: dict) -> dict:
    """Cores used per kind of our processes between two samples, ``outside`` for the others, and
    per agent and etcd process the times a second it was put on a CPU."""
    seconds = after["t"] - before["t"]
    cores: dict[str, float] = collections.defaultdict(float)
    runs: dict[str, float] = {}
    for pid, v in after["procs"].items():
        old = before["procs"].get(pid)
        if old is None or old["kind"] != v["kind"]:
            continue  # started meanwhile (an exec wrapper that became a worker): not comparable
        cores[v["kind"]] += (v["ticks"] - old["ticks"]) / CLK_TCK / seconds
        if v["kind"] in ("agent", "etcd"):
            runs[f"{v['kind']} {pid}"] = round((v["runs"] - old["runs"]) / seconds, 1)
    outside = sum(max(0, t - before["foreign"].get(p, t)) for p, t in after["foreign"].items())
    cores["outside"] = outside / CLK_TCK / seconds
    return {"seconds": round(seconds, 1), "cores": {k: round(x, 4) for k, x in sorted(cores.items())},
            "on_cpu_per_s": runs}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# ------------------------------------------------------------------------------ the job

def wait_standbys_quiet(job: common.TmrunJob, timeout: float, quiet: float = 1.0) -> dict:
    """Until every standby runs shadow workers that used no CPU for ``quiet`` s (warm, waiting)."""
    deadline = time.monotonic() + timeout
    seen: dict[int, tuple[int, float]] = {}
    while time.monotonic() < deadline:
        status = job.wait_until(lambda d: d["hot_swap"], timeout, "hot swap")
        pids = [p for n in status["nodes"] if n["role"] == "standby" and n["state"] == "shadow"
                for p in n["worker_pids"]]
        standbys = [n for n in status["nodes"] if n["role"] == "standby"]
        if pids and len(pids) == len(standbys):
            t_end = time.monotonic() + quiet + 0.2
            while time.monotonic() < t_end:  # watch the CPU without calling tmrun status meanwhile
                now = time.monotonic()
                for pid in pids:
                    ticks = cpu_ticks(pid)
                    if ticks is not None and (pid not in seen or seen[pid][0] != ticks):
                        seen[pid] = (ticks, now)
                time.sleep(0.1)
            if all(pid in seen and time.monotonic() - seen[pid][1] >= quiet for pid in pids):
                return status
        else:
            time.sleep(0.5)
    raise TimeoutError(f"the standbys did not become warm and idle within {timeout:g} s")


def pick_node(status: dict) -> dict:
    """An active node that is not the leader's (draining the leader's node hands leadership over)."""
    return next(n for n in status["nodes"] if n["role"] == "active" and n["node"] != status["leader"])


def next_swap(job: common.TmrunJob, known: int, timeout: float) -> dict:
    swaps = job.swap_events(known + 1, timeout)
    if len(swaps) <= known:
        raise TimeoutError(f"swap event {known + 1} not written within {timeout:g} s")
    return swaps[known]


def member_prepared(job: common.TmrunJob, swap: dict) -> list[dict]:
    """Each member's own phase-1 start (from ``tmrun status``), relative to the request."""
    rows = []
    status = job.status()
    for n in status["nodes"]:
        last = n.get("last_swap") or {}
        if n["role"] == "active" and last.get("gen") == swap["gen"] and "prepared_at" in last:
            rows.append({"node": n["node"], "joiner": n["node"] in swap["joiners"],
                         "leader": n["node"] == status["leader"],
                         "prepared_s": round(last["prepared_at"] - swap["requested"], 4)})
    return rows


class Profiler:
    """py-spy record (raw collapsed stacks) of some agents while one drain happens."""

    def __init__(self, pids: dict[str, int], outdir: Path, tag: str) -> None:
        outdir.mkdir(parents=True, exist_ok=True)
        self.files = {name: outdir / f"{tag}-{name}.txt" for name in pids}
        self.procs = [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "1000", "--format", "raw",
                                        "--nonblocking", "--output", str(self.files[name])],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for name, pid in pids.items()]
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> dict[str, dict]:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {name: summarize_profile(path) for name, path in self.files.items() if path.exists()}


def summarize_profile(path: Path, top: int = 8) -> dict:
    """Samples per leaf function and per tmrun/agent function on the stack (inclusive)."""
    leaf, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        total += int(n)
        leaf[frames[-1]] += int(n)
        for frame in set(frames):
            if "agent/" in frame or "tmrun/" in frame:
                inclusive[frame] += int(n)
    return {"samples": total, "file": str(path.relative_to(common.REPO)) if common.REPO in path.parents else str(path),
            "top_leaf": leaf.most_common(top), "top_tmrun_inclusive": inclusive.most_common(top)}


def drain_once(job: common.TmrunJob, args, known: int, profile_dir: Path | None, k: int) -> dict:
    wait_standbys_quiet(job, args.timeout)
    steps, _ = common.read_log(job.step_log)
    common.wait_for_step(job.step_log, steps[-1]["step"] + 5, args.timeout, [job.proc])
    status = job.status()
    node = pick_node(status)["node"]
    agents = {n["node"]: n["agent_pid"] for n in status["nodes"] if n["role"] in ("active", "standby")}
    profiler = Profiler(agents, profile_dir, f"drain{k + 1}") if profile_dir is not None else None
    watched = {**{f"agent {name}": pid for name, pid in agents.items()}, "etcd": common.etcd_pid(job.proc.pid)}
    before = {name: sched_ns(pid) for name, pid in watched.items() if pid}
    t0, t1, _ = job.drain(node, rejoin=True)
    after = {name: sched_ns(pid) for name, pid in watched.items() if pid}
    swap = next_swap(job, known, args.timeout)
    profile = profiler.stop() if profiler else None
    members = member_prepared(job, swap)
    sched = {name: {"cpu_ms": round((after[name][0] - before[name][0]) / 1e6, 1),
                    "runqueue_wait_ms": round((after[name][1] - before[name][1]) / 1e6, 1)} for name in before}
    return {"node": node, "leader": status["leader"], "issued": t0, "returned": t1,
            "cli_to_request_s": round(swap["requested"] - t0, 4), "swap": swap, "members": members,
            "sched_during_drain_command": sched, "profile": profile}


def kill_once(job: common.TmrunJob, args, known: int) -> dict:
    wait_standbys_quiet(job, args.timeout)
    steps, _ = common.read_log(job.step_log)
    common.wait_for_step(job.step_log, steps[-1]["step"] + 5, args.timeout, [job.proc])
    status = job.status()
    victim = pick_node(status)
    t_kill = time.time()
    os.kill(victim["worker_pids"][0], signal.SIGKILL)
    swap = next_swap(job, known, args.timeout)
    r = swap["requested"]
    return {"node": victim["node"], "leader": status["leader"], "killed_at": t_kill, "swap": swap,
            "kill_to_report_s": round(r - t_kill, 4),
            "kill_to_plan_s": round(r + swap["plan_written_s"] - t_kill, 4),
            "kill_to_phase1_s": round(r + swap["phase1_started_s"] - t_kill, 4) if swap["phase1_started_s"] else None,
            "kill_to_first_step_s": round(r + swap["first_step_s"] - t_kill, 4) if swap["first_step_s"] else None}


def steady_state(job: common.TmrunJob, seconds: float) -> dict:
    """The agents' and etcd's CPU in steady state: ``seconds`` of training with the standbys warm,
    in which this benchmark asks the job nothing (no ``tmrun status``)."""
    print(f"[{NAME}] steady state: {seconds:g} s of training, nobody asks anything", flush=True)
    steps, _ = common.read_log(job.step_log)
    first = steps[-1]["step"]
    before = cpu_sample()
    time.sleep(seconds)
    used = cpu_between(before, cpu_sample())
    steps, _ = common.read_log(job.step_log)
    used["steps_per_s"] = round((steps[-1]["step"] - first) / used["seconds"], 2)
    print(f"[{NAME}] steady state: cores {used['cores']}, on a CPU per second {used['on_cpu_per_s']}, "
          f"{used['steps_per_s']} steps/s", flush=True)
    return used


# ------------------------------------------------------------------------------ etcd round trips

async def _round_trips(endpoint: str, job: str, n: int) -> dict[str, list[float]]:
    from agent.credentials import credentials_dir
    from agent.etcd_store import EtcdStore, _Client, client_tls, parse_endpoint
    from agent.keys import JobKeys

    host, port = parse_endpoint(endpoint)[0]
    prefix = f"/tmrun-bench-rtt/{os.getpid()}/"
    key = prefix + "k"
    times: dict[str, list[float]] = collections.defaultdict(list)

    async def timed(label: str, make) -> None:
        for _ in range(n):
            t = time.perf_counter()
            await make()
            times[label].append(time.perf_counter() - t)

    tls = client_tls(endpoint, None, None, None, credentials_dir(os.environ))
    raw = _Client(host, port, timeout=5.0, credentials=tls.credentials() if tls else None)  # aetcd, our channel
    store = EtcdStore(parse_endpoint(endpoint), tls=tls)
    try:
        await raw.put(key.encode(), b'{"v":1}')  # connect
        await timed("aetcd get", lambda: raw.get(key.encode()))
        await timed("aetcd put", lambda: raw.put(key.encode(), b'{"v":1}'))
        await store.put(key, {"v": 1})
        await timed("EtcdStore get", lambda: store.get(key))
        await timed("EtcdStore put", lambda: store.put(key, {"v": 1}))
        for _ in range(n):  # compare-and-set on the current mod revision, as the leader writes the plan
            entry = await store.get(key)
            t = time.perf_counter()
            if not await store.replace(key, {"v": 1}, mod_revision=entry.mod_revision):
                raise RuntimeError("the benchmark's own key changed under it")
            times["EtcdStore replace (txn)"].append(time.perf_counter() - t)
        root = JobKeys(job).root
        await timed(f"EtcdStore get_prefix(job) [{len((await store.get_prefix(root))[0])} keys]",
                    lambda: store.get_prefix(root))
        _, rev = await store.get_prefix(prefix)
        watch = await store.watch_prefix(prefix, start_revision=rev + 1)
        events = watch.__aiter__()
        for i in range(n):
            t = time.perf_counter()
            await store.put(prefix + "w", {"v": 1, "i": i})
            await events.__anext__()
            times["put -> watch event"].append(time.perf_counter() - t)
        await watch.cancel()
        await store.delete_prefix(prefix)
    finally:
        await store.close()
        await raw.close()
    return dict(times)


def round_trips(job: common.TmrunJob, n: int) -> dict[str, dict]:
    runtime = json.loads((job.workdir / "runtime" / f"{job.job}.json").read_text())
    raw = asyncio.run(_round_trips(runtime["endpoint"], job.job, n))
    return {label: {"n": len(v), "median_ms": ms(statistics.median(v)), "p90_ms": ms(pct(v, 0.9)),
                    "max_ms": ms(max(v))} for label, v in raw.items()}


# ------------------------------------------------------------------------------ report

def plot(name: str, drains: list[dict], kills: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("drain: request\n→ plan written", [d["swap"]["plan_written_s"] for d in drains]),
              ("drain: request\n→ phase 1 started", [d["swap"]["phase1_started_s"] for d in drains]),
              ("kill -9\n→ failure reported", [k["kill_to_report_s"] for k in kills]),
              ("kill -9\n→ plan written", [k["kill_to_plan_s"] for k in kills]),
              ("kill -9\n→ phase 1 started", [k["kill_to_phase1_s"] for k in kills])]
    series = [(label, [v * 1e3 for v in values if v is not None]) for label, values in series if values]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, (label, values) in enumerate(series):
        ax.plot([i + (j - (len(values) - 1) / 2) * 0.06 for j in range(len(values))], values, "o", markersize=5)
        if values:
            ax.hlines(statistics.median(values), i - 0.3, i + 0.3, color="black", linewidth=1)
    ax.hlines(TARGET_PHASE1_S * 1e3, -0.4, 1.4, color="red", linestyle="--", linewidth=1)  # drains only
    ax.annotate("target: drain request → phase 1 ≤ 50 ms", (-0.4, TARGET_PHASE1_S * 1e3), color="red", fontsize=8,
                va="bottom")
    ax.set_xticks(range(len(series)), [label for label, _ in series], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("Control-plane latency (points: one drain or kill each; bars: median)", fontsize=10)
    fig.tight_layout()
    common.PLOTS.mkdir(parents=True, exist_ok=True)
    path = common.PLOTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = common.Parser(prog="bench/control_plane.py", description=__doc__.splitlines()[0],
                      epilog="Run nothing else on the machine meanwhile (on a shared machine: "
                             "flock /tmp/tmrun-bench.lock python bench/control_plane.py ...).")
    p.add_argument("--params", default="1M", help="model size of the running job (default 1M)")
    p.add_argument("--drains", type=common.count(1), default=5, help="drains with --rejoin (default 5)")
    p.add_argument("--kills", type=common.count(0), default=2, help="kill -9 of a worker, one standby each (default 2)")
    p.add_argument("--rtt", type=common.count(1), default=200, help="sequential etcd calls per kind (default 200)")
    p.add_argument("--steady", type=float, default=30.0,
                   help="seconds of steady state (standbys warm, nobody asks anything) in which the agents' and "
                        "etcd's CPU and wake-ups are measured first (default 30; 0: none)")
    p.add_argument("--threads", type=common.count(1), default=1, help="torch threads per worker (default 1)")
    p.add_argument("--profile", action="store_true", help="py-spy record the agents during each drain")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take (default 300)")
    p.add_argument("--quick", action="store_true", help="2 drains, 1 kill, 50 round trips; suffix _quick")
    p.add_argument("--keep", action="store_true", help="keep the work directory (step log, agent logs)")
    args = p.parse_args(argv)
    if args.quick:
        args.drains, args.kills, args.rtt = min(args.drains, 2), min(args.kills, 1), min(args.rtt, 50)
        args.steady = min(args.steady, 10.0)
    name = NAME + ("_quick" if args.quick else "")
    profile_dir = common.RESULTS / f"{name}_profile" if args.profile else None
    if profile_dir is not None and shutil.which("py-spy") is None:
        p.error("--profile needs py-spy on PATH")

    standby = max(1, args.kills)
    wd = common.workdir(NAME)
    print(f"[{NAME}] job: {args.params}, 2 nodes + {standby} standby, in {wd}", flush=True)
    job = common.TmrunJob(wd, ["--params", args.params, "--steps", "100000000", "--threads", str(args.threads)],
                          nnodes=2, standby=standby, name="control")
    drains, kills = [], []
    try:
        common.wait_for_step(job.step_log, 5, args.timeout, [job.proc])
        job.wait_hot(standby, args.timeout)
        wait_standbys_quiet(job, args.timeout)
        steady = steady_state(job, args.steady) if args.steady else None
        print(f"[{NAME}] etcd round trips ({args.rtt} each)", flush=True)
        before = cpu_sample()
        rtt = round_trips(job, args.rtt)
        for k in range(args.drains):
            drains.append(drain_once(job, args, len(drains) + len(kills), profile_dir, k))
            d = drains[-1]
            print(f"[{NAME}] drain {k + 1}: {d['node']}: plan written {ms(d['swap']['plan_written_s'])} ms, "
                  f"phase 1 started on all {ms(d['swap']['phase1_started_s'])} ms after the request", flush=True)
        for k in range(args.kills):
            kills.append(kill_once(job, args, len(drains) + len(kills)))
            x = kills[-1]
            print(f"[{NAME}] kill {k + 1}: {x['node']}: reported {ms(x['kill_to_report_s'])} ms, plan written "
                  f"{ms(x['kill_to_plan_s'])} ms, phase 1 started {ms(x['kill_to_phase1_s'])} ms after the kill",
                  flush=True)
        cpu = cpu_between(before, cpu_sample())["cores"]
    finally:
        job.stop()
        if not args.keep:
            shutil.rmtree(wd, ignore_errors=True)
    return report(name, args, rtt, drains, kills, cpu, steady)


def report(name: str, args, rtt: dict, drains: list[dict], kills: list[dict], cpu: dict,
           steady: dict | None) -> int:
    drain_cols = ["#", "drained", "leader", "tmrun drain start → request", "→ plan written", "→ phase 1 started (all)",
                  "slowest member", "→ phase 1 done", "→ switched", "→ first step"]
    drain_rows = []
    for i, d in enumerate(drains, 1):
        s = d["swap"]
        slowest = max(d["members"], key=lambda m: m["prepared_s"]) if d["members"] else None
        who = None
        if slowest:
            who = f"{slowest['node']} ({'joiner' if slowest['joiner'] else 'survivor'}" \
                  f"{', leader' if slowest['leader'] else ''})"
        drain_rows.append([i, d["node"], d["leader"], ms(d["cli_to_request_s"]), ms(s["plan_written_s"]),
                           ms(s["phase1_started_s"]), who, ms(s["phase1_done_s"]), ms(s["switched_s"]),
                           ms(s["first_step_s"])])
    common.print_table("Drains (ms after the request was created, unless said)", drain_cols, drain_rows)
    kill_cols = ["#", "killed", "leader", "kill → failure reported", "→ plan written", "→ phase 1 started",
                 "→ first step"]
    kill_rows = [[i, k["node"], k["leader"], ms(k["kill_to_report_s"]), ms(k["kill_to_plan_s"]),
                  ms(k["kill_to_phase1_s"]), ms(k["kill_to_first_step_s"])] for i, k in enumerate(kills, 1)]
    if kills:
        common.print_table("Kills (ms after kill -9)", kill_cols, kill_rows)
    rtt_cols = ["etcd call (sequential, this machine)", "n", "median (ms)", "p90 (ms)", "max (ms)"]
    rtt_rows = [[label, v["n"], v["median_ms"], v["p90_ms"], v["max_ms"]] for label, v in rtt.items()]
    common.print_table("etcd round trips against the job's etcd, while it trains", rtt_cols, rtt_rows)
    path_cols = ["who", "etcd call", "where", "on the request → phase 1 path"]
    path_rows = [list(row) for row in DRAIN_PATH]
    common.print_table("Sequential etcd round trips of a drain", path_cols, path_rows)

    sched_cols = ["#", "drain command (s)", "agents on CPU (ms)", "agents waiting for a CPU (ms)",
                  "etcd on CPU (ms)", "etcd waiting (ms)"]
    sched_rows = []
    for i, d in enumerate(drains, 1):
        sc = d["sched_during_drain_command"]
        agents = [v for name, v in sc.items() if name.startswith("agent")]
        sched_rows.append([i, round(d["returned"] - d["issued"], 2), sum(v["cpu_ms"] for v in agents),
                           sum(v["runqueue_wait_ms"] for v in agents), sc.get("etcd", {}).get("cpu_ms"),
                           sc.get("etcd", {}).get("runqueue_wait_ms")])
    common.print_table("While each tmrun drain command ran: CPU time and run-queue wait (/proc/PID/task/*/schedstat)",
                       sched_cols, sched_rows)
    phase1 = [d["swap"]["phase1_started_s"] for d in drains if d["swap"]["phase1_started_s"] is not None]
    written = [d["swap"]["plan_written_s"] for d in drains]
    txn = rtt["EtcdStore replace (txn)"]["median_ms"]
    push = rtt["put -> watch event"]["median_ms"]
    # request put + push (= put -> watch event), plan txn + push (~ put -> watch event); nothing is read between
    floor_ms = round(push + (push - rtt["EtcdStore put"]["median_ms"] + txn), 1)
    median_phase1 = statistics.median(phase1) if phase1 else None
    worst = max(phase1) if phase1 else None
    met = worst is not None and worst <= TARGET_PHASE1_S
    member_by_kind = collections.defaultdict(list)
    for d in drains:
        for m in d["members"]:
            member_by_kind["joiner" if m["joiner"] else "survivor"].append(m["prepared_s"])
    waits = [row[3] for row in sched_rows]
    slowest_is_leader = sum(1 for d in drains if d["members"] and max(d["members"], key=lambda m: m["prepared_s"])["leader"])
    leader_note = ""
    if drains and slowest_is_leader * 2 > len(drains):
        leader_note = (f" The last member to start phase 1 was the leader's own node in {slowest_is_leader} of "
                       f"{len(drains)} drains: that agent runs the leader's writes after the plan (the event, the "
                       "request's answer) in the same event loop as its own reading of the plan.")
    breakdown = ""
    if phase1:
        breakdown = (f"Where the time goes: request → phase 1 started on all took {ms(median_phase1)} ms (median; "
                     f"worst {ms(worst)} ms) against an etcd floor of {floor_ms} ms (the request's put and the plan's "
                     f"txn, each until its watch event, at this machine's medians); the leader wrote the plan after {ms(statistics.median(written))} ms "
                     f"(median), and the members' own phase-1 starts were, median: " +
                     ", ".join(f"{kind} {ms(statistics.median(v))} ms" for kind, v in member_by_kind.items()) +
                     f".{leader_note} The rest is Python and asyncio in the agents (the watch's events, the decision, gRPC) "
                     f"on cores the training workers keep busy: during a drain command the agents were runnable "
                     f"but waiting for a CPU for {statistics.median(waits):.0f} ms in total (median).")
    reason = breakdown if not met else ""
    targets = [{"target": "drain request → phase 1 started on every member ≤ 50 ms (every drain)",
                "measured": f"median {ms(median_phase1)} ms, max {ms(worst)} ms" if phase1 else "-",
                "met": met, "reason": reason}]
    if kills:
        to_plan = [k["kill_to_plan_s"] for k in kills]
        targets.append({"target": "kill -9 → plan written ≤ 50 ms (every kill)",
                        "measured": f"median {ms(statistics.median(to_plan))} ms, max {ms(max(to_plan))} ms",
                        "met": max(to_plan) <= TARGET_PHASE1_S,
                        "reason": f"of which kill → failure reported {ms(statistics.median(k['kill_to_report_s'] for k in kills))} ms "
                                  "(median): the agent notices the exit and reads the worker's last lines"})
    steady_cols = ["process", "cores", "on a CPU per second"]
    steady_rows = []
    if steady:
        steady_rows = [[kind, steady["cores"].get(kind), None] for kind in ("worker", "agent", "etcd", "other", "outside")]
        steady_rows += [[name, None, runs] for name, runs in sorted(steady["on_cpu_per_s"].items())]
        common.print_table(f"Steady state: {steady['seconds']} s, {steady['steps_per_s']} steps/s, nobody asks anything",
                           steady_cols, steady_rows)
    common.print_table("Targets", ["target", "measured", "met"],
                       [[t["target"], t["measured"], "yes" if t["met"] else f"NO: {t['reason']}"] for t in targets])
    print(f"[{NAME}] {breakdown}", flush=True)
    print(f"[{NAME}] etcd floor of request → phase 1: {floor_ms} ms (put→watch event {push} + txn→watch event "
          f"~{round(push - rtt['EtcdStore put']['median_ms'] + txn, 1)} (txn alone {txn}))", flush=True)

    foreign = cpu.get("outside", 0.0)
    warning = ""
    if foreign > 0.05:
        warning = (f"**Warning:** processes this benchmark did not start used {foreign:.2f} cores on average while "
                   "it measured: the machine was not idle and the latencies include that contention.")
        print(f"[{NAME}] {warning}", flush=True)
    png = plot(name, drains, kills)
    summary = {
        "drain_plan_written_ms": {"median": ms(statistics.median(written)), "max": ms(max(written))},
        "drain_phase1_started_ms": {"median": ms(median_phase1), "max": ms(worst)},
        "member_prepared_ms_median": {kind: ms(statistics.median(v)) for kind, v in member_by_kind.items()},
        "kill_to_plan_ms": {"median": ms(statistics.median([k["kill_to_plan_s"] for k in kills])),
                            "max": ms(max(k["kill_to_plan_s"] for k in kills))} if kills else None,
        "kill_to_report_ms_median": ms(statistics.median(k["kill_to_report_s"] for k in kills)) if kills else None,
        "steady_state": steady,
        "etcd_floor_ms": floor_ms,
        "agents_runqueue_wait_ms_median": statistics.median(waits) if waits else None,
        "where_the_time_goes": breakdown,
    }
    doc = {"summary": summary, "targets": targets, "all_met": all(t["met"] for t in targets),
           "cpu_cores_while_measuring": cpu,
           "drains": drains, "kills": kills, "etcd_round_trips": rtt,
           "drain_path": [dict(zip(["who", "call", "where", "on_path"], row)) for row in DRAIN_PATH],
           "settings": {"params": args.params, "drains": args.drains, "kills": args.kills, "rtt": args.rtt,
                        "steady": args.steady,
                        "threads": args.threads, "profile": args.profile, "tmrun_conf": common.TMRUN_CONF},
           "plot": str(png.relative_to(common.REPO))}
    path = common.save(name, doc)
    md = common.write_markdown(
        name, "Control-plane latency",
        f"A running tmrun job ({args.params} GPT, 2 nodes x 1 worker, {args.threads} thread(s) each, standbys warm): "
        f"`tmrun drain --rejoin` of a non-leader active node, and `kill -9` of a worker. Times from the swap "
        f"events (request created, or the failed worker's report, as time zero) and the kill's wall time. The "
        f"etcd floor of request → phase 1 is {floor_ms} ms: the request's put and the plan's txn, each until "
        f"its watch event (listed below), at the medians measured here.\n\n{breakdown}" + (f"\n\n{warning}" if warning else ""),
        [("Drains (ms after the request was created, unless said):", drain_cols, drain_rows)] +
        ([("Kills (ms after kill -9):", kill_cols, kill_rows)] if kills else []) +
        ([(f"Steady state before the drains: {steady['seconds']} s of training ({steady['steps_per_s']} steps/s, "
           "standbys warm, nobody asks the job anything): cores per kind of process (`outside`: processes this "
           "benchmark did not start) and how often each agent and etcd was put on a CPU (a wake-up or a return "
           "from preemption, /proc/PID/task/*/schedstat):", steady_cols, steady_rows)] if steady else []) +
        [("While each `tmrun drain` command ran (start to return, the whole swap): the agents' and etcd's CPU "
          "time and their time runnable but waiting for a CPU, from /proc/PID/task/*/schedstat:", sched_cols,
          sched_rows),
         ("etcd round trips against the job's etcd while it trains:", rtt_cols, rtt_rows),
         ("Sequential etcd round trips of a drain (from the code):", path_cols, path_rows)],
        targets, [("control-plane latencies", png.name)])
    print(f"results: {path}\nsection: {md}\nplot: {png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
