"""Control-plane failure: the job's etcd is killed (and later frozen) while a tmrun job trains.

One local tmrun cluster (``common.TmrunJob``: 2 nodes + 1 standby, embedded etcd) runs
``examples/train_gpt.py --params 1M --threads 1 --steps N``. Once the standby shadow-trains
(warm) and the job has committed step ``--kill-at``, this script hits the job's etcd, the
launcher's child process whose ``argv[0]`` ends with ``/etcd`` (found through ``/proc``):

1. ``kill -9`` of etcd. The launcher (``tmrun/launch.py``, ``agent/etcd_member.keep_alive``)
   starts it again from its data directory on the same port and says so on stderr
   (``tmrun: etcd member tmrun (pid …) exited with code -9: restarting it from …`` and
   ``… is back at …``);
   the agents keep their workers training and retry until etcd answers again.
2. At step ``--stop-at``: ``SIGSTOP`` to the (new) etcd for ``--stop-for`` seconds, then
   ``SIGCONT``: an outage of the control plane without a restart (etcd's process is there, its
   port open, nothing answers), longer than the agents' lease (5 s by default).

The same command then runs again uninterrupted (the *baseline*, same harness: it too waits for the
standby to be warm), for its final weights and its step times over the same steps.

Measured from the step log (one JSON line per committed step, ``--step-log``) and the job's stderr:

- *steps lost*: step indices committed twice (recomputed) plus indices 1..N never committed;
- *stall* per event: the largest step time (time between consecutive committed steps) among the
  steps committed from the event's start to ``--window`` seconds after its end, minus the median
  step time (steps after the standby was warm and before the first event). The baseline's stall
  over the same step indices says how large such a maximum is with no event at all;
- the job's exit code (must be 0), the final weights' sha256 (``done … sha256=``) against the
  baseline's, the generations seen in the step log (a new generation would mean the workers were
  restarted or re-grouped), etcd's time to come back after the kill (the launcher's
  ``is back at`` line, seen by polling the job's stderr every 20 ms), the launcher's and agents'
  lines about etcd, and the job's events (from its history file);
- the CPU used per kind of process (training workers, standby, agents, etcd, launcher, and *not
  ours*: every process on the machine this script did not start), from ``/proc`` every 0.5 s
  (``procsample.ProcSampler``), before the events, in each event's window, and in the
  uninterrupted run over the same steps. A step is *quiet* when *not ours* used at most 0.25
  cores in every sample interval that overlaps it; each stall is also given over quiet steps
  only, and the medians are taken over quiet steps, so that other users of a shared machine do
  not pass for a stall (the plot greys the other steps).

While the events happen the harness polls files only (the step log and stderr, every 20 ms,
reading them only when they grew) and samples ``/proc``: it starts no process that would compete
with the job for CPU.

Output: a table, ``bench/results/etcd_failure.json``, ``docs/bench/etcd_failure.png`` and
``bench/results/etcd_failure.md`` (a section for docs/benchmarks.md). On a shared machine wrap it
in ``flock /tmp/tmrun-bench.lock``::

    python bench/etcd_failure.py --quick
    python bench/etcd_failure.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # train_gpt
from bench import common  # noqa: E402
from bench.procsample import CLK_TCK, CpuTrace, ProcSampler  # noqa: E402

NAME = "etcd_failure"
TMRUN_CONF = "join_timeout=120"  # tmrun's defaults otherwise (lease_ttl 5 s, store_timeout 20 s, outage bound 900 s)
DEFAULTS = {"size": "1M", "steps": 420, "kill_at": 120, "stop_at": 220, "stop_for": 20.0, "window": 10.0}
QUICK = {"size": "1M", "steps": 150, "kill_at": 50, "stop_at": 80, "stop_for": 8.0, "window": 5.0}
POLL = 0.02
QUIET_LIMIT = 0.25  # a step is "quiet" when the rest of the machine used at most this many cores meanwhile
CPU_INTERVAL = 0.5  # seconds between samples of /proc (CPU time of the job's processes and of the rest)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.Parser(prog="etcd_failure", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", help=f"model size (default {DEFAULTS['size']})")
    p.add_argument("--steps", type=int, help=f"steps per run (default {DEFAULTS['steps']})")
    p.add_argument("--kill-at", type=int, help=f"kill -9 etcd once step K is committed (default {DEFAULTS['kill_at']})")
    p.add_argument("--stop-at", type=int,
                   help=f"SIGSTOP etcd once step K is committed (default {DEFAULTS['stop_at']}; 0: no outage)")
    p.add_argument("--stop-for", type=float, help=f"seconds between SIGSTOP and SIGCONT (default {DEFAULTS['stop_for']:g})")
    p.add_argument("--window", type=float,
                   help=f"seconds after each event's end in which its stall is measured (default {DEFAULTS['window']:g})")
    p.add_argument("--conf", default=TMRUN_CONF, help=f"tmrun --rdzv-conf (default {TMRUN_CONF})")
    p.add_argument("--no-baseline", action="store_true", help="skip the uninterrupted run (no weights comparison)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK['steps']} steps, kill at {QUICK['kill_at']}, SIGSTOP at "
                        f"{QUICK['stop_at']} for {QUICK['stop_for']:g} s, window {QUICK['window']:g} s "
                        "(explicit flags win)")
    p.add_argument("--timeout", type=float, default=300, help="seconds any wait may take (default 300)")
    p.add_argument("--keep", action="store_true", help="keep the runs' working directories (logs)")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        from train_gpt import parse_count
        parse_count(args.size)
    except argparse.ArgumentTypeError as exc:
        p.error(f"--size: {exc}")
    if args.kill_at < 2:
        p.error("--kill-at must be >= 2")
    if args.stop_at and args.stop_at <= args.kill_at:
        p.error("--stop-at must come after --kill-at (or be 0)")
    last = args.stop_at or args.kill_at
    if args.steps < last + 10:
        p.error(f"--steps must be at least {last + 10} (the last event's step + 10)")
    if args.stop_for <= 0 or args.window <= 0 or args.timeout <= 0:
        p.error("--stop-for, --window and --timeout must be positive")
    return args


# ---------------------------------------------------------------------------- the job's etcd

def etcd_pid(launcher: int) -> int:
    pid = common.etcd_pid(launcher)
    if pid is None:
        raise RuntimeError(f"no etcd process under the launcher (pid {launcher})")
    return pid


# ---------------------------------------------------------------------------- waiting on files

def wait_stderr(job: common.TmrunJob, pattern: str, after: int, timeout: float) -> tuple[float, str] | None:
    """Poll the job's stderr from byte ``after`` for a line matching ``pattern``: (when seen, the line)."""
    path = job.workdir / "tmrun.err"
    deadline, size = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        now = path.stat().st_size
        if now != size:
            size = now
            with open(path, "rb") as f:
                f.seek(after)
                text = f.read().decode(errors="replace")
            hit = next((line for line in text.splitlines() if re.search(pattern, line)), None)
            if hit is not None:
                return time.time(), hit
        if job.proc.poll() is not None:
            return None
        time.sleep(POLL)
    return None


    raise TimeoutError(f"the standby was not warm within {timeout:g} s")


def done_sha(text: str) -> str | None:
    found = re.findall(r"done steps=\d+ params=\d+ sha256=([0-9a-f]+)", text)
    return found[-1] if found else None


# ---------------------------------------------------------------------------- one run

def run(args, wd: Path, *, events: bool) -> dict:
    """One job; with ``events`` the etcd kill and outage. Returns what happened (times are wall times)."""
    os.environ["TMRUN_LOG_DIR"] = str(wd / "logs")  # the job's history file stays in its working directory
    job = common.TmrunJob(wd, ["--params", args.size, "--steps", str(args.steps), "--threads", "1"],
                          nnodes=2, standby=1, conf=args.conf, name="cpfail" if events else "cpbase")
    out: dict = {"events": []}
    trace = CpuTrace(ProcSampler(common.GPT), interval=CPU_INTERVAL)  # CPU time per process, all run long
    trace.start()
    try:
        job.wait_hot(1, args.timeout, interval=1.0)
        out["t_hot"] = time.time()
        out["hot_at_step"] = max((r["step"] for r in common.read_log(job.step_log)[0]), default=0)
        if events:
            if out["hot_at_step"] + 10 > args.kill_at:
                raise RuntimeError(f"the standby was warm only at step {out['hot_at_step']}: "
                                   f"use --kill-at >= {out['hot_at_step'] + 10}")
            pid = etcd_pid(job.proc.pid)
            common.wait_for_step(job.step_log, args.kill_at, args.timeout, [job.proc])
            err_at = (wd / "tmrun.err").stat().st_size
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            back = wait_stderr(job, r"etcd member .* is back at", err_at, args.timeout)
            kill = {"kind": "kill", "pid": pid, "start": t_kill, "end": back[0] if back else None,
                    "back_line": back[1] if back else None}
            out["events"].append(kill)
            if args.stop_at:
                common.wait_for_step(job.step_log, args.stop_at, args.timeout, [job.proc])
                pid2 = etcd_pid(job.proc.pid)
                t_stop = time.time()
                os.kill(pid2, signal.SIGSTOP)
                try:
                    time.sleep(args.stop_for)
                finally:
                    t_cont = time.time()
                    os.kill(pid2, signal.SIGCONT)
                out["events"].append({"kind": "stop", "pid": pid2, "start": t_stop, "end": t_cont,
                                      "restarted_pid": pid2 != pid})
        out["exit_code"] = job.wait(args.timeout + args.steps * 2.0)
    finally:
        trace.stop()
        job.stop()
        job.out.close()
        job.err.close()
    out["cpu"] = trace.samples
    out["steps"], _ = common.read_log(job.step_log)
    out["sha256"] = done_sha((wd / "tmrun.out").read_text(errors="replace"))
    err = (wd / "tmrun.err").read_text(errors="replace").splitlines()
    about = re.compile(r"etcd member|lease|leader|leads job|outage|unreachable|store|retry|exit", re.I)
    out["stderr_etcd_lines"] = [line for line in err if about.search(line)][:40]
    out["history"] = read_history(wd / "logs", job.job)
    out["job"] = job.job
    return out


def read_history(root: Path, job: str) -> list[dict]:
    """The job's events from its history file (``tmrun events`` reads the same), kind and time only."""
    path = root / job / "events.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "kind" in row:  # the first line is the job's outcome
                rows.append({k: row[k] for k in ("kind", "at", "gen", "text") if k in row})
    return rows


# ---------------------------------------------------------------------------- numbers

def lost_steps(steps: list[dict], total: int) -> dict:
    counts = Counter(r["step"] for r in steps)
    twice = sum(c - 1 for c in counts.values() if c > 1)
    missing = sorted(set(range(1, total + 1)) - set(counts))
    return {"recomputed": twice, "missing": len(missing), "missing_steps": missing[:20],
            "lost": twice + len(missing), "last_step": max(counts, default=0)}


def gaps(steps: list[dict], quiet: set[int] | None = None) -> list[tuple[int, float, float]]:
    """(step index, wall time committed, seconds since the previous committed step); only the steps in
    ``quiet`` when given."""
    return [(b["step"], b["t"], b["t"] - a["t"]) for a, b in zip(steps, steps[1:])
            if quiet is None or b["step"] in quiet]


def quiet_steps(steps: list[dict], samples: list, limit: float) -> set[int]:
    """The steps during which the rest of the machine (*not ours*) used at most ``limit`` cores in every
    CPU sample interval that overlaps the step: steps that other users' load did not slow down."""
    _, series = cpu_series(samples, ("not ours",))
    spans = [(t0, t1, v) for (t0, _), (t1, _), v in zip(samples, samples[1:], series["not ours"])]
    out = set()
    for a, b in zip(steps, steps[1:]):
        load = [v for t0, t1, v in spans if t1 > a["t"] and t0 < b["t"]]
        if load and max(load) <= limit:
            out.add(b["step"])
    return out


def median_between(steps: list[dict], t0: float, t1: float, quiet: set[int] | None = None) -> float:
    """The median step time of the steps committed in (t0, t1], of the quiet ones if there are 20 of them."""
    inside = [(s, dt) for s, t, dt in gaps(steps) if t0 < t <= t1]
    calm = [dt for s, dt in inside if quiet is None or s in quiet]
    chosen = calm if len(calm) >= 20 else [dt for _, dt in inside]
    return statistics.median(chosen) if chosen else statistics.median(dt for _, _, dt in gaps(steps))


def worst(inside: list[tuple[int, float, float]], median: float, start: float | None = None) -> dict:
    """The largest step time among ``inside`` (gaps), and that minus ``median`` (the stall, at least 0)."""
    if not inside:
        return {"stall_s": None, "max_step_s": None}
    w = max(inside, key=lambda x: x[2])
    out = {"stall_s": round(max(0.0, w[2] - median), 4), "excess_s": round(w[2] - median, 4),
           "max_step_s": round(w[2], 4), "max_at_step": w[0], "n_steps": len(inside),
           "median_in_window_s": round(statistics.median(dt for _, _, dt in inside), 4)}
    if start is not None:
        out["max_after_s"] = round(w[1] - start, 3)
    return out


def stall(steps: list[dict], quiet: set[int], start: float, end: float, window: float, median: float) -> dict:
    """The largest step time among steps committed in (start, end + window], minus ``median``; and the
    same among the quiet steps only (``quiet``)."""
    inside = [(s, t, dt) for s, t, dt in gaps(steps) if start < t <= end + window]
    out = worst(inside, median, start)
    out["steps"] = [inside[0][0], inside[-1][0]] if inside else [None, None]
    out["quiet"] = worst([x for x in inside if x[0] in quiet], median, start)
    return out


def same_steps(steps: list[dict], quiet: set[int], first: int, last: int, median: float) -> dict:
    """The uninterrupted run's largest step time over step indices first..last, minus its median; and
    the same among its quiet steps."""
    inside = [(s, t, dt) for s, t, dt in gaps(steps) if first <= s <= last]
    return {**worst(inside, median), "quiet": worst([x for x in inside if x[0] in quiet], median)}


CPU_KINDS = {"worker-active": "training workers", "worker-standby": "standby worker", "agent": "agents",
             "etcd": "etcd", "other": "launcher + this script", "foreign": "not ours"}


def cores(samples: list, start: float, end: float) -> dict[str, float] | None:
    """Cores used from ``start`` to ``end`` (widened to the samples around them) per kind of process;
    ``not ours``: every process on the machine that this script did not start (other users)."""
    before = [x for x in samples if x[0] <= start]
    after = [x for x in samples if x[0] >= end]
    if not before or not after:
        return None
    (t0, a), (t1, b) = before[-1], after[0]
    used = dict.fromkeys(CPU_KINDS.values(), 0.0)
    for pid, v in b.items():
        kind = "foreign" if pid == 0 else (f"worker-{v.get('role')}" if v["kind"] == "worker" else v["kind"])
        used[CPU_KINDS[kind]] += (v["cpu"] - a.get(pid, {"cpu": 0})["cpu"]) / CLK_TCK / (t1 - t0)
    return {k: round(x, 2) for k, x in used.items()} | {"seconds": round(t1 - t0, 2)}


def span_of_steps(steps: list[dict], first: int, last: int) -> tuple[float, float] | None:
    """Wall time from the commit before step ``first`` to the commit of step ``last``."""
    ts = {r["step"]: r["t"] for r in steps}
    return (ts[first - 1], ts[last]) if first - 1 in ts and last in ts else None


def analyse(r: dict, args, base: dict | None) -> dict:
    steps = r["steps"]
    quiet = quiet_steps(steps, r["cpu"], QUIET_LIMIT)
    first_event = min((e["start"] for e in r["events"]), default=steps[-1]["t"])
    median = median_between(steps, r["t_hot"], first_event, quiet)
    res = {"exit_code": r["exit_code"], "sha256": r["sha256"], "hot_at_step": r["hot_at_step"],
           "median_step_s": round(median, 4), "quiet_steps": len(quiet), **lost_steps(steps, args.steps),
           "generations": sorted({x.get("gen") for x in steps}), "worlds": sorted({x.get("world") for x in steps}),
           "events": [], "cpu_before_events": cores(r["cpu"], r["t_hot"], first_event)}
    base_median, base_quiet = None, set()
    if base is not None:
        base_quiet = quiet_steps(base["steps"], base["cpu"], QUIET_LIMIT)
        base_median = median_between(base["steps"], base["t_hot"], base["steps"][-1]["t"], base_quiet)
    for e in r["events"]:
        end = e["end"] or e["start"]
        s = stall(steps, quiet, e["start"], end, args.window, median)
        cut = common.interruption(steps, e["start"])
        ev = {"kind": e["kind"], "etcd_pid": e["pid"], "at_step": cut.last_before,
              "duration_s": round(end - e["start"], 3), **s, "downtime_s": round(cut.downtime, 4)}
        if e["kind"] == "kill":
            ev["etcd_back_s"] = None if e["end"] is None else round(e["end"] - e["start"], 3)
            ev["back_line"] = e["back_line"]
        ev["cpu"] = cores(r["cpu"], e["start"], min(end + args.window, steps[-1]["t"]))
        if base is not None and s["steps"][0] is not None:
            ev["baseline_same_steps"] = same_steps(base["steps"], base_quiet, s["steps"][0], s["steps"][1],
                                                   base_median)
            span = span_of_steps(base["steps"], s["steps"][0], s["steps"][1])
            ev["baseline_same_steps"]["cpu"] = span and cores(base["cpu"], *span)
        res["events"].append(ev)
    if base is not None:
        res["baseline"] = {"exit_code": base["exit_code"], "sha256": base["sha256"],
                           "median_step_s": round(base_median, 4), "quiet_steps": len(base_quiet),
                           **lost_steps(base["steps"], args.steps),
                           "generations": sorted({x.get("gen") for x in base["steps"]})}
        res["identical_weights"] = r["sha256"] is not None and r["sha256"] == base["sha256"]
    return res


# ---------------------------------------------------------------------------- output

EVENT_LABEL = {"kill": "kill -9 etcd", "stop": "SIGSTOP etcd"}


def both(x: dict | None) -> str | None:
    """``stall (quiet steps: stall)``."""
    if not x or x.get("stall_s") is None:
        return None
    q = (x.get("quiet") or {}).get("stall_s")
    return f"{common._fmt(x['stall_s'])} ({'-' if q is None else common._fmt(q)})"


def summary_rows(res: dict, args) -> tuple[list[str], list[list]]:
    events = res["events"]
    kill = next((e for e in events if e["kind"] == "kill"), {})
    stop = next((e for e in events if e["kind"] == "stop"), None)
    columns = ["run", "steps lost (twice + missing)", "stall at kill -9, s (quiet steps only)"]
    if stop:
        columns.append(f"stall at {args.stop_for:g} s SIGSTOP, s (quiet steps only)")
    columns += ["median step (s)", "exit code", "identical weights"]
    row = ["etcd killed" + (", then stopped" if stop else ""), f"{res['lost']} ({res['recomputed']} + {res['missing']})",
           both(kill)]
    if stop:
        row.append(both(stop))
    same = res.get("identical_weights")
    row += [res["median_step_s"], res["exit_code"], "-" if same is None else ("yes" if same else "NO")]
    rows = [row]
    b = res.get("baseline")
    if b:
        brow = ["uninterrupted (same steps)", f"{b['lost']} ({b['recomputed']} + {b['missing']})",
                both(kill.get("baseline_same_steps"))]
        if stop:
            brow.append(both(stop.get("baseline_same_steps")))
        brow += [b["median_step_s"], b["exit_code"], "-"]
        rows.append(brow)
    return columns, rows


EVENT_COLUMNS = ["event", "at step", "etcd away (s)", "window steps (quiet/all)", "max step (s)", "stall (s)",
                 "stall, quiet steps (s)", "uninterrupted: stall (s)", "uninterrupted: stall, quiet (s)"]


def event_rows(res: dict) -> list[list]:
    out = []
    for e in res["events"]:
        b = e.get("baseline_same_steps", {})
        q = e.get("quiet") or {}
        away = e.get("etcd_back_s") if e["kind"] == "kill" else e["duration_s"]
        out.append([EVENT_LABEL[e["kind"]], e["at_step"], away,
                    f"{e['steps'][0]}–{e['steps'][1]} ({q.get('n_steps', 0)}/{e.get('n_steps')})", e["max_step_s"],
                    e["stall_s"], q.get("stall_s"), b.get("stall_s"), (b.get("quiet") or {}).get("stall_s")])
    return out


CPU_COLUMNS = ["window", "seconds", *CPU_KINDS.values()]


def cpu_rows(res: dict) -> list[list]:
    """Cores used per kind of process: before the events, in each event's window, and in the
    uninterrupted run over the same steps (``cores``; sampled every 0.5 s)."""
    out = []

    def add(label, c):
        if c:
            out.append([label, c["seconds"], *(c[k] for k in CPU_KINDS.values())])

    add("after warm-up, before the events", res.get("cpu_before_events"))
    for e in res["events"]:
        add(f"{EVENT_LABEL[e['kind']]}: start to end + window", e.get("cpu"))
        add(f"uninterrupted, same steps as {EVENT_LABEL[e['kind']]}", e.get("baseline_same_steps", {}).get("cpu"))
    return out


def markdown(doc: dict, columns, rows, ev_rows, c_rows) -> str:
    m, a, res = doc["machine"], doc["parameters"], doc["result"]
    kill = next((e for e in res["events"] if e["kind"] == "kill"), {})
    lease = re.search(r"lease_ttl=(\d+)", a["conf"])
    lease_s = int(lease[1]) if lease else 5  # tmrun's default
    text = ["## Control-plane failure: etcd killed and frozen mid-run", "", "```", doc["command"], "```", "",
            f"On {m['cpu']} ({m['cores']} cores), torch {m['torch']}, tmrun at {m['tmrun_commit']}: "
            f"`tmrun --nnodes 2 --standby 1 --rdzv-conf {a['conf']} examples/train_gpt.py --params {a['size']} "
            f"--steps {a['steps']} --threads 1 --step-log …` (a local cluster, embedded etcd). Once the standby was warm "
            f"and step {a['kill_at']} committed: `kill -9` of the job's etcd (the launcher restarts it from its data "
            "directory on the same port"
            + (f"; it was back after {kill['etcd_back_s']:.2f} s" if kill.get("etcd_back_s") is not None else "")
            + ")"
            + (f"; at step {a['stop_at']}: `SIGSTOP` to etcd for {a['stop_for']:g} s, then `SIGCONT` (an outage "
               f"without a restart, longer than the agents' {lease_s} s lease)" if a["stop_at"] else "")
            + ". Then the same command uninterrupted, for the final weights and the same steps' times.", "",
            f"*Stall*: the largest step time among the steps committed from the event's start to {a['window']:g} s "
            "after its end, minus the median step (after the standby was warm, before the first event), at least 0; the "
            "uninterrupted run's row is the same maximum over the same step indices, minus its own median. "
            f"*Quiet steps*: steps during which the rest of the machine (other users' processes) used at most "
            f"{QUIET_LIMIT:g} cores in every 0.5 s CPU sample that overlaps them; the medians are taken over quiet "
            "steps. "
            "*Steps lost*: step indices committed twice plus indices never committed.", "",
            common.md_table(columns, rows), "", common.md_table(EVENT_COLUMNS, ev_rows), "",
            "CPU used (cores, from /proc/PID/stat every 0.5 s; *not ours*: every other process on the machine):", "",
            common.md_table(CPU_COLUMNS, c_rows), "",
            f"Generations seen in the step log: {res['generations']}; world sizes: {res['worlds']}. "
            f"The whole benchmark took {doc['total_s'] / 60:.1f} min.", "",
            f"![Step time with etcd killed and frozen](bench/{NAME}.png)", ""]
    return "\n".join(text)


def cpu_series(samples: list, kinds: tuple[str, ...]) -> tuple[list[float], dict[str, list[float]]]:
    """Per interval between CPU samples: its midpoint (wall time) and the cores used by each kind."""
    mids, series = [], {k: [] for k in kinds}
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        mids.append((t0 + t1) / 2)
        used = dict.fromkeys(kinds, 0.0)
        for pid, v in b.items():
            kind = "foreign" if pid == 0 else (f"worker-{v.get('role')}" if v["kind"] == "worker" else v["kind"])
            if CPU_KINDS[kind] in used:
                used[CPU_KINDS[kind]] += (v["cpu"] - a.get(pid, {"cpu": v["cpu"]})["cpu"]) / CLK_TCK / (t1 - t0)
        for k in kinds:
            series[k].append(used[k])
    return mids, series


def plot(hit: dict, base: dict | None, args) -> Path:
    """Step time over wall-clock (as ``common.plot_step_times``) for both runs, etcd's time away
    shaded, and a panel of the cores the control plane and everything else on the machine used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    common.PLOTS.mkdir(parents=True, exist_ok=True)
    rows = 3 if base is not None else 2
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.6 * rows), sharex=False)
    t0 = hit["steps"][0]["t"]

    def steps_panel(ax, run, title, events):
        steps = run["steps"]
        start = steps[0]["t"]
        quiet = quiet_steps(steps, run["cpu"], QUIET_LIMIT)
        for calm, style in ((True, {"color": "C0", "label": "step"}),
                            (False, {"color": "0.6", "label": f"step while others used > {QUIET_LIMIT:g} cores"})):
            points = [(t, dt) for st, t, dt in gaps(steps) if (st in quiet) == calm]
            ax.plot([t - start for t, _ in points], [dt for _, dt in points], ".", markersize=3, **style)
        for e in events:
            end = e["end"] or e["start"]
            label = (f"kill -9 etcd\nback after {end - e['start']:.1f} s" if e["kind"] == "kill"
                     else f"SIGSTOP etcd,\nSIGCONT {end - e['start']:.0f} s later")
            ax.axvspan(e["start"] - start, max(end, e["start"] + 0.15) - start, color="red", alpha=0.15)
            ax.axvline(e["start"] - start, color="red", linestyle="--", linewidth=1)
            ax.annotate(label, (e["start"] - start, 0.97), xycoords=("data", "axes fraction"), xytext=(3, 0),
                        textcoords="offset points", va="top", ha="left", fontsize=8, color="red")
        ax.set_yscale("log")
        ax.set_ylabel("step time (s)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper right", markerscale=2)

    steps_panel(axes[0], hit, "etcd killed" + (", then stopped" if args.stop_at else ""), hit["events"])
    if base is not None:
        steps_panel(axes[1], base, "uninterrupted, same command", [])
    ax = axes[-1]
    kinds = ("agents", "etcd", "launcher + this script", "not ours")
    mids, series = cpu_series(hit["cpu"], kinds)
    for k in kinds:
        ax.plot([m - t0 for m in mids], series[k], label=k, linewidth=1)
    if base is not None:
        b_mids, b_series = cpu_series(base["cpu"], ("not ours",))
        ax.plot([m - base["steps"][0]["t"] for m in b_mids], b_series["not ours"], color="grey", linestyle=":",
                linewidth=1, label="not ours, during the uninterrupted run")
    for e in hit["events"]:
        ax.axvspan(e["start"] - t0, max(e["end"] or e["start"], e["start"] + 0.15) - t0, color="red", alpha=0.15)
    ax.set_ylabel("cores")
    ax.set_title("CPU besides the training workers, etcd killed run (sampled every 0.5 s); "
                 "not ours: other users of the machine", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    right = max(a.get_xlim()[1] for a in axes)
    for a in axes:
        a.set_xlim(-1, right)
    axes[-1].set_xlabel("wall-clock since the job's first step (s)")
    fig.suptitle(f"GPT {args.size}, 2 nodes + 1 standby: the job's etcd killed, then frozen")
    fig.tight_layout()
    path = common.PLOTS / f"{NAME}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    dirs: list[Path] = []
    try:
        wd = common.workdir("etcd-failure")
        dirs.append(wd)
        print(f"[etcd failures] running in {wd} ...", flush=True)
        t0 = time.monotonic()
        hit = run(args, wd, events=True)
        walls = {"etcd failures": round(time.monotonic() - t0, 1)}
        print(f"[etcd failures] {walls['etcd failures']:.0f} s, exit {hit['exit_code']}", flush=True)
        base = None
        if not args.no_baseline:
            wd = common.workdir("etcd-baseline")
            dirs.append(wd)
            print(f"[uninterrupted] running in {wd} ...", flush=True)
            t0 = time.monotonic()
            base = run(args, wd, events=False)
            walls["uninterrupted"] = round(time.monotonic() - t0, 1)
            print(f"[uninterrupted] {walls['uninterrupted']:.0f} s, exit {base['exit_code']}", flush=True)
    finally:
        if not args.keep:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
        elif dirs:
            print("kept: " + " ".join(map(str, dirs)))

    res = analyse(hit, args, base)
    columns, rows = summary_rows(res, args)
    ev_rows, c_rows = event_rows(res), cpu_rows(res)
    common.print_table("etcd killed / frozen while training", columns, rows)
    common.print_table("per event (seconds)", EVENT_COLUMNS, ev_rows)
    common.print_table("CPU used (cores)", CPU_COLUMNS, c_rows)
    for line in hit["stderr_etcd_lines"]:
        print(f"  stderr: {line}")
    png = plot(hit, base, args)
    doc = {"parameters": {k: v for k, v in vars(args).items()}, "result": res, "wall_s": walls,
           "stderr_etcd_lines": hit["stderr_etcd_lines"], "history": hit["history"],
           "baseline_history_kinds": None if base is None else sorted({h["kind"] for h in base["history"]}),
           "events_wall": [{k: v for k, v in e.items()} for e in hit["events"]],
           "total_s": round(time.time() - t_start, 1)}
    path = common.save(NAME, doc)
    saved = {**doc, "command": common.command_line(), "machine": common.machine()}
    md = common.RESULTS / f"{NAME}.md"
    md.write_text(markdown(saved, columns, rows, ev_rows, c_rows))
    print(f"results: {path.relative_to(common.REPO)}, {md.relative_to(common.REPO)}, plot: "
          f"{png.relative_to(common.REPO)}; total {doc['total_s']:.0f} s")
    ok = (res["exit_code"] == 0 and res["lost"] == 0
          and (base is None or (base["exit_code"] == 0 and res.get("identical_weights"))))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
