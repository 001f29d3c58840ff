"""Run many chaos schedules (tests/chaos.py) and write docs/reliability.md.

    python -m bench.chaos --seeds 200            # seeds 0..199
    python -m bench.chaos --from 91 --seeds 200  # seeds 91..199: go on with a run that stopped
    python -m bench.chaos --seed 17 --seed 42    # replay chosen seeds
    python -m bench.chaos --report-only          # the report from the rows saved so far
    python -m bench.chaos --hosts --seeds 10     # on separate hosts: the SLURM lab (root)

Each finished seed's row is appended at once to ``bench/results/chaos-rows.jsonl`` (a run of two
hours can be read, and reported, before it ends); ``--report-only`` writes the report from it.
With ``--hosts`` a seed's first fault runs on the SLURM lab's four hosts (``tests/chaos_hosts.py``;
the lab is brought up and torn down here), its rows go to ``chaos-hosts-rows.jsonl``, and the
report gains their table. The report keeps the "## Notes" section of the one it replaces.

Each seed is one hot-swap job on the local cluster (3 nodes, 2 standbys) with one or two faults;
each must end with weights bit-identical to an uninterrupted run, every step committed once per
rank, the untouched ranks' workers unchanged where promised, the job's exit within
``chaos.END_BOUND`` seconds of its last step, and no process left. The report counts schedules by
fault kind and lists every failure with its seed, to replay with ``--seed``. Results also go to
``bench/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import common  # noqa: E402
from tests import chaos  # noqa: E402
from tests.harness import Job  # noqa: E402

REPORT = common.REPO / "docs" / "reliability.md"
ROWS = common.REPO / "bench" / "results" / "chaos-rows.jsonl"
HOST_ROWS = common.REPO / "bench" / "results" / "chaos-hosts-rows.jsonl"


def reference(directory: Path) -> Path:
    out = directory / "reference.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(chaos.NODES), str(chaos.JOB), str(out), "--steps", str(chaos.STEPS)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"the uninterrupted reference run failed:\n{done.stderr[-2000:]}")
    return out


def run_seed(seed: int, root: Path, ref: Path) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"seed-{seed}-", dir=root))  # a seed may be replayed in one run
    schedule = chaos.generate(seed)
    started: list[Job] = []

    def start(args: list[str]) -> Job:
        started.append(Job(args, cwd=workdir))
        return started[-1]

    def leftovers() -> list:
        left = []
        for job in started:
            job.track()
            left += chaos.leftovers(job) if job.proc.poll() is not None else [job.proc.pid]
            job.kill()
        return left

    return _attempt(schedule, lambda: chaos.run(schedule, workdir, ref, start), leftovers)


def run_seed_on_hosts(seed: int, slurm, ref: Path) -> dict:
    from tests import chaos_hosts

    schedule = chaos_hosts.schedule(seed)
    slurm.reset()
    return _attempt(schedule, lambda: chaos_hosts.run(schedule, slurm, ref), lambda: list(map(str, slurm.finish())))


def _attempt(schedule: chaos.Schedule, go: Callable[[], chaos.Outcome], leftovers: Callable[[], list]) -> dict:
    """Run one schedule; its row: passed or why not, and what it left running (killed since)."""
    t0 = time.monotonic()
    row = {"seed": schedule.seed, "schedule": schedule.describe(), "kinds": list(schedule.kinds)}
    try:
        outcome = go()
        row.update(ok=True, hot=outcome.hot, epilogue=outcome.epilogue,
                   end_s=None if outcome.epilogue else round(outcome.end_s, 2))
    except AssertionError as exc:
        row.update(ok=False, error=str(exc).splitlines()[0][:300], detail=str(exc)[-3000:])  # the job's stderr
    except Exception as exc:  # the harness itself failed: a failure of this seed, said as such
        row.update(ok=False, error=f"harness: {exc!r}"[:300], trace=traceback.format_exc()[-2000:])
    left = leftovers()
    if left and row["ok"]:
        row.update(ok=False, error=f"processes left running: {left}")
    row["left"] = left
    row["wall_s"] = round(time.monotonic() - t0, 1)
    print(("ok   " if row["ok"] else "FAIL ") + row["schedule"] + ("" if row["ok"] else f": {row['error']}"),
          flush=True)
    return row


def report(rows: list[dict], command: str, info: dict, host_rows: list[dict] = (), host_command: str = "",
           notes: str = "") -> str:
    """docs/reliability.md: the local cluster's schedules, then those on separate hosts, then ``notes``."""
    failed = [r for r in rows if not r["ok"]]
    lines = [
        "# Reliability: random fault schedules",
        "",
        "Written by `bench/chaos.py` (schedules from `tests/chaos.py`; a fixed handful also runs in CI,",
        "`tests/test_chaos.py` and `tests/test_chaos_hosts.py`). Each schedule is a hot-swap job with one",
        "or two faults drawn from its seed. Every schedule must end with weights bit-identical to an",
        "uninterrupted run, each step committed once per rank, the untouched ranks' workers unchanged",
        f"(one fault, standbys warm), the job's exit within {chaos.END_BOUND:g} s of its last step, no move refused",
        "by a worker's phase table or an agent's role table, and nothing left running.",
        "",
        f"## On the local cluster: 3 nodes, 2 standbys, {chaos.STEPS} steps",
        "",
        f"Command: `{command}`  ",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; torch {info['torch']}; "
        f"{_commits(rows, info)}.",
        "",
        f"**{len(rows)} schedules: {len(rows) - len(failed)} passed, {len(failed)} failed.** "
        f"{sum(len(r['kinds']) == 2 for r in rows)} had two faults close together. "
        f"{sum(bool(r.get('epilogue')) for r in rows)} struck a worker after its last step (in",
        "the script's epilogue): those must end failed, saying so.",
        "",
        *_table(rows, ""),
    ]
    if host_rows:
        host_failed = [r for r in host_rows if not r["ok"]]
        lines += [
            "",
            f"## On separate hosts: the SLURM lab, 3 nodes and 1 standby on 4 hosts, {chaos.STEPS} steps",
            "",
            "`tests/chaos_hosts.py`: `sbatch -N 4` with `srun tmrun --nnodes 3 --standby 1`; each host its own",
            "network namespace, host name and address, the job's etcd three members on three of them. A",
            "schedule is its seed's first fault (one standby: a second fault taking a rank would restart).",
            "",
            f"Command: `{host_command}`  ",
            f"Same machine; {_commits(host_rows, info)}.",
            "",
            f"**{len(host_rows)} schedules: {len(host_rows) - len(host_failed)} passed, {len(host_failed)} failed.**",
            "",
            *_table(host_rows, " --hosts"),
        ]
    if notes:
        lines += ["", notes.strip()]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict], replay: str) -> list[str]:
    """Counts by fault kind, the end times, and each failure with the command that replays it."""
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows:
        for kind in set(row["kinds"]):
            by_kind[kind]["ok" if row["ok"] else "failed"] += 1
    lines = ["| fault kind | schedules | passed | failed |", "|---|---|---|---|"]
    for kind in chaos.KINDS:
        counts = by_kind.get(kind, collections.Counter())
        lines.append(f"| {kind} | {counts['ok'] + counts['failed']} | {counts['ok']} | {counts['failed']} |")
    ends = sorted(r["end_s"] for r in rows if r.get("end_s") is not None)
    if ends:
        lines += ["", f"Last committed step → job exit: median {ends[len(ends) // 2]:.1f} s, max {ends[-1]:.1f} s."]
    lines += ["", "Failures:" if any(not r["ok"] for r in rows) else "Failures: none."]
    for row in rows:
        if not row["ok"]:
            said = row["error"] if row["error"].startswith(row["schedule"]) else f"{row['schedule']}: {row['error']}"
            lines.append(f"- {said}. Replay: `python -m bench.chaos{replay} --seed {row['seed']}`")
    return lines


def _commits(rows: list[dict], info: dict) -> str:
    """Which commit ran which seeds (a long run may be continued on a later commit)."""
    seeds: dict[str, list[int]] = collections.defaultdict(list)
    for row in rows:
        seeds[row.get("machine", info)["tmrun_commit"]].append(row["seed"])
    if len(seeds) == 1:
        return f"commit {next(iter(seeds))}"
    return "; ".join(f"commit {commit}: seeds {min(s)}-{max(s)} ({len(s)})" for commit, s in seeds.items())


def _saved(path: Path) -> list[dict]:
    """The rows saved in ``path``, the latest per seed (a replayed seed replaces its earlier row)."""
    if not path.exists():
        return []
    saved = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted({row["seed"]: row for row in saved}.values(), key=lambda r: r["seed"])


def _notes() -> str:
    """The "## Notes" section of the report in place (written by people, kept across rewrites)."""
    text = REPORT.read_text() if REPORT.exists() else ""
    start = text.find("\n## Notes")
    return text[start:] if start >= 0 else ""


def write_report() -> None:
    rows, host_rows = _saved(ROWS), _saved(HOST_ROWS)
    last = rows[-1] if rows else {}
    REPORT.write_text(report(rows, last.get("command", common.command_line()), last.get("machine", common.machine()), host_rows,
                             host_rows[-1].get("command", "") if host_rows else "", _notes()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=200, help="run seeds 0..N-1")
    parser.add_argument("--from", dest="first", type=int, default=0, help="start at this seed (with --seeds)")
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    parser.add_argument("--hosts", action="store_true", help="on separate hosts: the SLURM lab (needs root)")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite docs/reliability.md")
    parser.add_argument("--report-only", action="store_true",
                        help=f"write the report from the rows saved in {ROWS.parent.relative_to(common.REPO)}; run nothing")
    args = parser.parse_args(argv)
    if args.report_only:
        write_report()
        return summary(_saved(HOST_ROWS if args.hosts else ROWS))
    seeds = args.seed or list(range(args.first, args.seeds))
    info, command = common.machine(), common.command_line()
    rows_file = HOST_ROWS if args.hosts else ROWS
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tmrun-chaos-") as tmp, rows_file.open("a") as saved, \
            _hosts(args.hosts) as slurm:
        root = Path(tmp)
        ref = reference(root)
        for seed in seeds:
            rows.append(run_seed_on_hosts(seed, slurm, ref) if slurm else run_seed(seed, root, ref))
            saved.write(json.dumps({**rows[-1], "command": command, "machine": info}) + "\n")
            saved.flush()
    common.save("chaos-hosts" if args.hosts else "chaos", {"rows": rows})
    if not args.no_report:
        write_report()
    return summary(rows)


@contextlib.contextmanager
def _hosts(wanted: bool) -> Iterator:
    """The SLURM lab, up for the run and torn down after (None when not ``wanted``)."""
    if not wanted:
        yield None
        return
    from tests.slurm_cluster import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bench.chaos --hosts: the SLURM lab cannot run here: {reason}")
    cluster = SlurmCluster()
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


def summary(rows: list[dict]) -> int:
    failed = [r["seed"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} schedules passed" + (f"; failed seeds {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
