"""Link events on real hosts: a link between two members cut, the job reconfigured, the link back.

On the SLURM lab (4 hosts in network namespaces, real slurmctld/slurmd; ``tests/slurm_cluster.py``,
root) one job, ``srun tmrun --nnodes 3 --standby 1`` of ``tests/scripts/runtime_job.py`` (0.1 s
steps; rdzv-conf ``collective_timeout=5``), sees ``--cuts`` cycles of: the link between the nodes
of ranks 1 and 2 cut both ways (``tc``, every other link up); the job reconfigures (one end
leaves, the standby takes its place); the link restored; the node that left is a standby again
(the next cycle's swaps it back in). Per cycle, from the job's events and status:

- *noticed and planned* (s): from the cut to the plan event (the agents' link checks, 1 s apart,
  two misses; the report; the leader's decision);
- *leader decision* (ms): the plan event's ``decision_ms``, from the report reaching the leader's
  copy of the keys to the plan written (goal ≤ 20 ms);
- *survivors' stall* (s): the swap event's ``stall_s``, bounded by ``collective_timeout`` for a
  survivor whose collective waited on the cut link;
- *back as a standby* (s): from the link restored to the node shadow-training in the pool.

There is no torchrun column: torchrun has no notion of a link, and a cut link leaves its
collectives waiting for the process group timeout (30 minutes by default) before it restarts
every worker into a rendezvous across the same cut.

Output: a table, ``bench/results/link_event.json`` and ``bench/results/link_event.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import common  # noqa: E402

from tests.harness import FAST, wait_events, wait_status  # noqa: E402

NAME = "link_event"
GOAL_DECISION_MS = 20.0


def cycle(slurm, job_id: int, ref, index: int) -> dict:
    from tests.test_e2e_slurm import members, ranks_of

    doc = wait_status(ref, lambda d: d["state"] == "running" and any(n["role"] == "standby" and n["state"] == "shadow"
                                                                       for n in d["nodes"]), 120)
    by_rank = {rank: node for node, rank in ranks_of(doc).items()}
    keep, victim, gen = by_rank[1], by_rank[2], doc["generation"]
    etcd = [host for host, started in members(slurm, job_id) if started]
    cut_at = time.time()
    slurm.cut_link(keep, victim)
    try:
        rows = wait_events(ref, lambda rs: any(r["kind"] == "link" and r["gen"] > gen for r in rs)
                           and any(r["kind"] == "swap" and r["gen"] > gen for r in rs), 120)
    finally:
        slurm.restore_link(keep, victim)
        restored_at = time.time()
    plan = next(r for r in rows if r["kind"] == "link" and r["gen"] > gen)
    swap = next(r for r in rows if r["kind"] == "swap" and r["gen"] > gen)["data"]
    # which end left: the rank-2 end as a rule, the other one when the rank-2 end leads (the leader
    # hosts the next generation's store, so it never leaves for a cut link)
    after = wait_status(ref, lambda d: d["generation"] > gen, 60)
    active = {n["node"] for n in after["nodes"] if n["role"] == "active"}
    left = victim if victim not in active else keep
    wait_status(ref, lambda d: any(n["node"] == left and n["role"] == "standby" and n["state"] == "shadow"
                                   for n in d["nodes"]), 180)
    back_s = time.time() - restored_at
    return {"cycle": index + 1, "cut": f"{keep} ↔ {victim}", "left": left, "text": plan["text"], "etcd_members": etcd,
            "etcd_link_cut": keep in etcd and victim in etcd,
            "noticed_s": round(plan["at"] - cut_at, 3), "decision_ms": plan["data"].get("decision_ms"),
            "stall_s": swap.get("stall_s"), "back_s": round(back_s, 2)}


def main() -> None:
    from tests.slurm_cluster import SlurmCluster, unavailable_reason
    from tests.test_e2e_slurm import submit_runtime_job, wait_hot, wait_steps

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", type=int, default=3)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"link_event: the SLURM lab cannot run here: {reason}")
    slurm = SlurmCluster()
    slurm.up()
    rows = []
    try:
        workdir = slurm.workdir("bench-link-")
        job_id = submit_runtime_job(slurm, workdir, steps=600 * (args.cuts + 1), conf=FAST + ",collective_timeout=5")
        ref, _ = wait_hot(slurm, job_id)
        wait_steps(slurm, job_id, 30, 120)
        try:
            for index in range(args.cuts):
                rows.append(cycle(slurm, job_id, ref, index))
                print(rows[-1], flush=True)
        finally:
            log = common.RESULTS / f"{NAME}-job.out"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(slurm.output(job_id))
            print(f"the job's output: {log}", flush=True)
        slurm.scancel(job_id)
        slurm.wait_job(job_id, 120)
    finally:
        slurm.down()
    columns = ["cycle", "link cut", "left", "etcd members", "noticed and planned (s)", "leader decision (ms)",
               "survivors' stall (s)", "back as a standby (s)"]
    table = [[r["cycle"], r["cut"], r["left"], " ".join(r["etcd_members"]) + (" (a raft link cut)" if r["etcd_link_cut"] else ""),
              r["noticed_s"], r["decision_ms"], r["stall_s"], r["back_s"]] for r in rows]
    common.print_table("Link events on the SLURM lab", columns, table)
    decisions = [r["decision_ms"] for r in rows if r["decision_ms"] is not None]
    worst = max(decisions) if decisions else None
    targets = [{"target": f"leader decision for a link event ≤ {GOAL_DECISION_MS:g} ms (report at the leader → "
                          "plan written)",
                "measured": f"median {statistics.median(decisions):.1f} ms, worst {worst:.1f} ms" if decisions else "-",
                "met": worst is not None and worst <= GOAL_DECISION_MS}]
    common.save(NAME, {"rows": rows, "targets": targets})
    intro = ("One `srun tmrun --nnodes 3 --standby 1` job on the SLURM lab (`runtime_job.py`, 0.1 s steps, "
             "`collective_timeout=5`); each cycle cuts the link between the nodes of ranks 1 and 2 both ways "
             "with `tc`, waits for the job to reconfigure, restores the link and waits for the node that left "
             "to be a standby again.")
    common.write_markdown(NAME, "Link events: a cut link, one end out, the node back", intro, [("", columns, table)],
                   targets, [])


if __name__ == "__main__":
    main()
