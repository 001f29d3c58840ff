"""A joiner's pull from 1, 2 and 4 sources over equal and unequal links, three ways.

Hosts in network namespaces (tests/netlab.py): K sources, each sending through a token bucket
(``tc tbf``) of a set rate, and one receiver, unshaped. They build a group as a swap does (phase
1 probes the receiver's links), then the receiver pulls ``--mib`` MiB of float32 tensors (12
tensors of 0.3 to 19 % of the state) from zeros, ``--repeat`` times per way (median reported):

- ``planned``: shards by the probed rates (tmrun's pull since this benchmark);
- ``striped``: tensor ``i`` whole from source ``i mod K`` (tmrun's pull before it);
- ``single``: everything from the fastest source.

Links: equal, every source at ``--equal`` Mbit/s; unequal, rates 1:2:4:8 from ``--slowest``
Mbit/s. Reported: seconds per way, the planned pull's ratio to its plan's prediction and to the
fluid bound (the bytes over the sum of the probed rates: no split of the state does better), the
speed-up of K equal sources over one, and the planned pull's speed-up over striping and over the
single source. The same bytes arrive every time (digests compared). There is no torchrun or
torchft column: neither moves a running job's state between nodes (torchrun restarts every
worker from a checkpoint; torchft's recovery sends from one peer).

Output: a table, ``bench/results/pull.json``, ``bench/results/pull.md`` and ``docs/bench/pull.png``.
Needs root (network namespaces).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import common  # noqa: E402

from tests.netlab import NetLab, pull_over, unavailable_reason  # noqa: E402

NAME = "pull"
PULLS = ("planned", "striped", "single")


def configs(equal: float, slowest: float) -> list[tuple[str, tuple[float, ...]]]:
    return [("1 source", (equal,)),
            ("2 equal", (equal,) * 2), ("2 unequal 1:4", (slowest * 2, slowest * 8)),
            ("4 equal", (equal,) * 4), ("4 unequal 1:2:4:8", tuple(slowest * f for f in (1, 2, 4, 8)))]


def run(mbits: tuple[float, ...], mib: float, repeat: int, lab: NetLab) -> dict:
    pulls = "planned" if len(mbits) == 1 else ",".join(PULLS)
    lines, digests = pull_over(lab, mbits, mib=mib, pulls=pulls, repeat=repeat, timeout=900)
    if len(set(digests)) != 1 or any(line["digest"] != digests[0] for line in lines):
        raise SystemExit(f"pull: the receiver's bytes differ from the sources' ({digests}, {lines})")
    out = {"mbits": list(mbits), "probed": lines[0]["probed"], "runs": lines}
    for pull in pulls.split(","):
        mine = [line for line in lines if line["pull"] == pull]
        out[pull] = statistics.median(line["seconds"] for line in mine)
        out[f"{pull}_predicted"] = statistics.median(line["predicted"] for line in mine)
    return out


def plot(results: dict[str, dict]) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.27
    for i, pull in enumerate(PULLS):  # one source: the three ways are one
        done = [k for k, n in enumerate(names) if pull in results[n]]
        ax.bar([k + (i - 1) * width for k in done], [results[names[k]][pull] for k in done], width, label=pull)
    ax.scatter([k - width for k in range(len(names))], [results[n]["planned_predicted"] for n in names],
               marker="_", s=300, color="black", zorder=3, label="planned: predicted")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("seconds to pull the state")
    ax.set_title("A joiner's pull: planned by probed rates, striped, single source")
    ax.legend()
    fig.tight_layout()
    path = common.REPO / "docs" / "bench" / "pull.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = common.Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--equal", type=float, default=80.0, help="Mbit/s of every source, equal links")
    parser.add_argument("--slowest", type=float, default=20.0, help="Mbit/s of the slowest source, unequal links")
    parser.add_argument("--report-only", action="store_true", help="the table, plot and markdown of the last run")
    args = parser.parse_args()
    if args.report_only:
        last = json.loads((common.RESULTS / f"{NAME}.json").read_text())
        report(last["results"], last["mib"], last["repeat"], last["command"])
        return
    why = unavailable_reason()
    if why:
        raise SystemExit(f"pull: cannot run here: {why}")
    lab = NetLab(5, prefix="tmbench").up()
    try:
        results = {name: run(mbits, args.mib, args.repeat, lab) for name, mbits in configs(args.equal, args.slowest)}
    finally:
        lab.down()
    report(results, args.mib, args.repeat, common.command_line())


def report(results: dict[str, dict], mib: float, repeat: int, command: str) -> None:
    one = results["1 source"]["planned"]
    rows, targets = [], []
    for name, r in results.items():
        k = len(r["mbits"])
        fluid = r["runs"][0]["bytes"] / sum(r["probed"].values())  # any split of the bytes: a lower bound
        r["fluid"] = fluid
        rows.append([name, "/".join(f"{m:g}" for m in r["mbits"]), r["planned"], r["planned_predicted"],
                     r["planned"] / r["planned_predicted"], fluid, r["planned"] / fluid, r.get("striped"), r.get("single"),
                     r["striped"] / r["planned"] if k > 1 else None, r["single"] / r["planned"] if k > 1 else None])
        if k > 1 and "unequal" not in name:
            speedup = one / r["planned"]
            targets.append({"target": f"{k} equal sources: speed-up ≥ {0.8 * k:g}× one source",
                            "measured": f"{speedup:.2f}×", "met": speedup >= 0.8 * k})
        if "unequal" in name:
            ratio = r["planned"] / r["planned_predicted"]
            targets.append({"target": f"{name}: within 5% of the plan's predicted finish",
                            "measured": f"{(ratio - 1) * 100:+.1f}%", "met": ratio <= 1.05})
    columns = ["links", "Mbit/s", "planned s", "predicted s", "planned/predicted", "fluid s", "planned/fluid",
               "striped s", "single s",
               "striped/planned", "single/planned"]
    common.print_table(f"A joiner's pull of {mib:g} MiB", columns, rows)
    png = plot(results)
    if command == common.command_line():  # a fresh run (not --report-only)
        common.save(NAME, {"mib": mib, "repeat": repeat, "results": results, "targets": targets})
    intro = (f"A receiver pulls {mib:g} MiB from K sources on namespaced hosts whose links `tc tbf` "
             f"shapes; median of {repeat}. Predicted: the plan's finish from phase 1's probed rates; "
             "fluid: the bytes over the sum of the probed rates, which no split of the state beats.")
    md = common.write_markdown(NAME, "A joiner's pull by measured link rate", intro, [("", columns, rows)], targets,
                        [("pull times", png.name)])
    md.write_text(md.read_text().replace(common.command_line(), command))  # --report-only: the run's command
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
