"""Run many chaos schedules (tests/chaos.py) and write docs/reliability.md.

    python -m bench.chaos --seeds 200            # seeds 0..199
    python -m bench.chaos --from 91 --seeds 200  # seeds 91..199: go on with a run that stopped
    python -m bench.chaos --seed 17 --seed 42    # replay chosen seeds
    python -m bench.chaos --report-only          # the report from the rows saved so far

Each finished seed's row is appended at once to ``bench/results/chaos-rows.jsonl`` (a run of two
hours can be read, and reported, before it ends); ``--report-only`` writes the report from it.

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
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import REPO, command_line, machine, save
from tests import chaos
from tests.harness import Job

REPORT = REPO / "docs" / "reliability.md"
ROWS = REPO / "bench" / "results" / "chaos-rows.jsonl"


def reference(directory: Path) -> Path:
    out = directory / "reference.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(chaos.NODES), str(chaos.JOB), str(out), "--steps", str(chaos.STEPS)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"the uninterrupted reference run failed:\n{done.stderr[-2000:]}")
    return out


def run_seed(seed: int, root: Path, ref: Path) -> dict:
    workdir = root / f"seed-{seed}"
    workdir.mkdir()
    schedule = chaos.generate(seed)
    started: list[Job] = []

    def start(args: list[str]) -> Job:
        started.append(Job(args, cwd=workdir))
        return started[-1]

    t0 = time.monotonic()
    row = {"seed": seed, "schedule": schedule.describe(), "kinds": list(schedule.kinds)}
    try:
        outcome = chaos.run(schedule, workdir, ref, start)
        row.update(ok=True, hot=outcome.hot, epilogue=outcome.epilogue,
                   end_s=None if outcome.epilogue else round(outcome.end_s, 2))
    except AssertionError as exc:
        row.update(ok=False, error=str(exc).splitlines()[0][:300], detail=str(exc)[-3000:])  # the job's stderr
    except Exception as exc:  # the harness itself failed: a failure of this seed, said as such
        row.update(ok=False, error=f"harness: {exc!r}"[:300], trace=traceback.format_exc()[-2000:])
    for job in started:
        job.track()
        left = chaos.leftovers(job) if job.proc.poll() is not None else [job.proc.pid]
        job.kill()
        if left and row["ok"]:
            row.update(ok=False, error=f"processes left running: {left}")
        row["left"] = left
    row["wall_s"] = round(time.monotonic() - t0, 1)
    print(("ok   " if row["ok"] else "FAIL ") + row["schedule"] + ("" if row["ok"] else f": {row['error']}"),
          flush=True)
    return row


def report(rows: list[dict], command: str, info: dict) -> str:
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows:
        for kind in set(row["kinds"]):
            by_kind[kind]["ok" if row["ok"] else "failed"] += 1
    doubles = [r for r in rows if len(r["kinds"]) == 2]
    failed = [r for r in rows if not r["ok"]]
    ends = sorted(r["end_s"] for r in rows if r.get("end_s") is not None)
    epilogues = [r for r in rows if r.get("epilogue")]
    lines = [
        "# Reliability: random fault schedules",
        "",
        "Written by `bench/chaos.py` (schedules from `tests/chaos.py`; a fixed handful also runs in CI,",
        "`tests/test_chaos.py`). Each schedule is a hot-swap job on the local cluster, 3 nodes and 2",
        f"standbys, {chaos.STEPS} steps, with one or two faults drawn from its seed. Every schedule must end",
        "with weights bit-identical to an uninterrupted run, each step committed once per rank, the",
        "untouched ranks' workers unchanged (one fault, standbys warm), the job's exit within",
        f"{chaos.END_BOUND:g} s of its last step, and nothing left running.",
        "",
        f"Command: `{command}`  ",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; torch {info['torch']}; "
        f"{_commits(rows, info)}.",
        "",
        f"**{len(rows)} schedules: {len(rows) - len(failed)} passed, {len(failed)} failed.** "
        f"{len(doubles)} had two faults close together. {len(epilogues)} struck a worker after its last step (in",
        "the script's epilogue): those must end failed, saying so, and did.",
        "",
        "| fault kind | schedules | passed | failed |",
        "|---|---|---|---|",
    ]
    for kind in chaos.KINDS:
        counts = by_kind.get(kind, collections.Counter())
        lines.append(f"| {kind} | {counts['ok'] + counts['failed']} | {counts['ok']} | {counts['failed']} |")
    if ends:
        lines += ["", f"Last committed step → job exit: median {ends[len(ends) // 2]:.1f} s, "
                  f"max {ends[-1]:.1f} s."]
    lines += ["", "## Failures", ""]
    if not failed:
        lines.append("None.")
    for row in failed:
        lines.append(f"- seed {row['seed']} ({row['schedule']}): {row['error']}. "
                     f"Replay: `python -m bench.chaos --seed {row['seed']}`")
    return "\n".join(lines) + "\n"


def _commits(rows: list[dict], info: dict) -> str:
    """Which commit ran which seeds (a long run may be continued on a later commit)."""
    seeds: dict[str, list[int]] = collections.defaultdict(list)
    for row in rows:
        seeds[row.get("machine", info)["tmrun_commit"]].append(row["seed"])
    if len(seeds) == 1:
        return f"commit {next(iter(seeds))}"
    return "; ".join(f"commit {commit}: seeds {min(s)}-{max(s)} ({len(s)})" for commit, s in seeds.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=200, help="run seeds 0..N-1")
    parser.add_argument("--from", dest="first", type=int, default=0, help="start at this seed (with --seeds)")
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite docs/reliability.md")
    parser.add_argument("--report-only", action="store_true",
                        help=f"write the report from the rows saved in {ROWS.relative_to(REPO)}; run nothing")
    args = parser.parse_args(argv)
    if args.report_only:
        saved = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
        rows = list({row["seed"]: row for row in saved}.values())  # a replayed seed: its latest row
        REPORT.write_text(report(rows, saved[-1].get("command", command_line()), saved[-1].get("machine", machine())))
        return summary(rows)
    seeds = args.seed or list(range(args.first, args.seeds))
    info, command = machine(), command_line()
    ROWS.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tmrun-chaos-") as tmp, ROWS.open("a") as saved:
        root = Path(tmp)
        ref = reference(root)
        for seed in seeds:
            rows.append(run_seed(seed, root, ref))
            saved.write(json.dumps({**rows[-1], "command": command, "machine": info}) + "\n")
            saved.flush()
    save("chaos", {"rows": rows})
    if not args.no_report:
        REPORT.write_text(report(rows, command, info))
    return summary(rows)


def summary(rows: list[dict]) -> int:
    failed = [r["seed"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} schedules passed" + (f"; failed seeds {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
