"""The control plane at scale: N simulated nodes' real control loops against one real etcd.

    python -m bench.control_plane_scale                    # N = 10, 100, 500, 1000
    python -m bench.control_plane_scale --nodes 100 --nodes 1000 --lease-ttl 20

Each N is one job of ``tests/control_plane_sim.py``: N real node agents (follower, leader,
keepalive, watchdog) split over ``--processes`` processes (2: this machine's cores), 8 stand-in
workers each, 2 of the N standbys, against an embedded etcd (plain HTTP: what is measured is the control plane, not TLS). It reports the time
from start to the first plan (written, and acted on by every agent), drain request -> the new plan
delivered to and acted on by every member (p50, p99), etcd requests and bytes a second in steady
state (early, and again later in the job's life), and the job prefix's size. Results go to
``bench/results/control_plane_scale.json`` and a table for docs/benchmarks.md
(``bench/results/control_plane_scale.md``).

All N agents share two Python processes and this machine's cores: their work, which on a cluster
runs on N machines at once, is serialized here (the "acted on" times include it; "delivered" is
when each agent's watch brought the plan). A run whose agents fall behind their own lease
keepalives (the process, not etcd, is then the limit) is reported as such, not as a number.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from agent.etcd_server import EmbeddedEtcd  # noqa: E402
from bench import common  # noqa: E402
from tests.control_plane_sim import simulate  # noqa: E402

GOALS = "rendezvous of 1,000 nodes <= 5 s; drain -> every member <= 200 ms at p99; traffic linear in N, not in age"


def run_one(nodes: int, lease_ttl: int, window: float, timeout: float, processes: int, ramp: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tmrun-scale-") as tmp:
        server = EmbeddedEtcd(Path(tmp))
        server.start()
        endpoint = f"http://{server.endpoint}"
        started = time.monotonic()
        try:
            row = asyncio.run(simulate(endpoint, f"{endpoint}/metrics", nodes, window=window, lease_ttl=lease_ttl,
                                       timeout=timeout, processes=processes, ramp=ramp))
            row["ok"] = True
        except (TimeoutError, asyncio.TimeoutError) as exc:
            row = {"nodes": nodes, "lease_ttl": lease_ttl, "ok": False, "error": str(exc)}
        finally:
            server.stop()
        row["wall_s"] = round(time.monotonic() - started, 1)
        return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| N (8 slots each) | first plan written | acted on by all | drain → delivered to all, p50 / p99 | "
             "drain → acted on by all, p50 / p99 | etcd requests/s (early → later) | etcd bytes/s out | "
             "per node: requests/s | prefix: keys, KiB | largest record |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['nodes']} | — | — | — | — | — | — | — | — | not measured: {r['error']} |")
            continue
        d, early, later = r["drain_ms"], r["steady"], r["steady_later"]
        lines.append(
            f"| {r['nodes']} | {r['rendezvous_plan_s']:.2f} s | {r['rendezvous_all_s']:.2f} s | "
            f"{d['delivered_p50']:.0f} / {d['delivered_p99']:.0f} ms | {d['p50']:.0f} / {d['p99']:.0f} ms | "
            f"{early['requests']:.0f} → {later['requests']:.0f} | {later['bytes_out'] / 1024:.0f} KiB | "
            f"{later['requests'] / r['nodes']:.2f} | {r['prefix_keys']}, {r['prefix_bytes'] / 1024:.0f} | "
            f"{r['largest_record_bytes'] / 1024:.1f} KiB (plan) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.control_plane_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, action="append", help="simulate N nodes (repeatable)")
    parser.add_argument("--lease-ttl", type=int, default=5, help="the agents' lease TTL, seconds (tmrun's default 5)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of each steady-state measurement")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds any phase of one run may take")
    parser.add_argument("--processes", type=int, default=2, help="processes the agents are split over")
    parser.add_argument("--ramp", type=float, default=0.0, help="seconds over which the agents start")
    args = parser.parse_args(argv)
    rows = []
    for nodes in args.nodes or [10, 100, 500, 1000]:
        rows.append(run_one(nodes, args.lease_ttl, args.window, args.timeout, min(args.processes, nodes), args.ramp))
        print(rows[-1], flush=True)
    common.save("control_plane_scale", {"rows": rows, "goals": GOALS})
    info = common.machine()
    text = (f"Machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, commit {info['tmrun_commit']}.\n\n"
            + table(rows) + "\n")
    (common.RESULTS / "control_plane_scale.md").write_text(text)
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
