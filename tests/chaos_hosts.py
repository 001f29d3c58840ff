"""Chaos schedules on separate hosts: tests/chaos.py's faults on the SLURM lab's four hosts.

One ``sbatch -N 4`` job per schedule: ``srun tmrun --nnodes 3 --standby 1`` of runtime_job.py on
node1..node4, each its own network namespace, host name and address, the embedded etcd a
3-member cluster on node1..node3. The schedule is the first fault of ``chaos.generate(seed)``:
the lab has four hosts, so one standby, and a second fault that takes a rank would leave nobody
to take its place (the job would restart, which is not what a schedule here checks).

The faults are the local cluster's, found by pid from ``tmrun status`` (the lab's nodes share
this machine's process list): a worker SIGKILLed or SIGSTOPped, a node's agent (its ``tmrun``)
or the leader's SIGKILLed, ``tmrun drain`` with and without ``--rejoin`` from outside the
allocation, and the etcd member on the struck rank's node SIGKILLed (node1's when that node
hosts none). The checks are the local ones (``chaos.check_end``, ``check_drains``,
``check_work``), and the job's end within ``END_BOUND`` seconds of its last committed step,
as seen from its output and SLURM's state. One difference: srun counts a SIGKILLed task
against its step, so a job whose agent (its ``tmrun``) was killed ends FAILED in SLURM's eyes
however well it went on; there the agents' own word on the outcome is checked instead. Leftover processes on any node are the ``slurm``
fixture's check (or ``SlurmCluster.finish`` for the benchmark).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests import chaos
from tests.harness import TMRUN, wait_status
from tests.slurm_cluster import TERMINAL, SlurmCluster, wait_for
from tests.test_e2e_slurm import etcd_pid, ref_of, submit_runtime_job, wait_steps

STEP_TIME = 0.2  # seconds a step: 120 steps outlast the job's start on four hosts
# Seconds from the last committed step to SLURM's end of the job. Longer than the local cluster's
# chaos.END_BOUND: here the end also holds the job's etcd cluster stopping member by member (each
# waits for the others to have seen the outcome, or for a lost quorum) and SLURM ending the step
# on four hosts; measured 10-18 s on this machine alone (docs/reliability.md), and once 33.5 s
# while the whole suite ran beside it (a drain racing the last step, seed 3). The bound is there
# for the 48-140 s waits that a real fault caused (issue 9), which it still catches.
END_BOUND = 45.0
ETCD_HOSTS = ("node1", "node2", "node3")


def schedule(seed: int) -> chaos.Schedule:
    """The separate-hosts schedule of ``seed``: the local schedule's first fault."""
    return chaos.Schedule(seed, chaos.generate(seed).faults[:1])


def run(plan: chaos.Schedule, slurm: SlurmCluster, reference: Path) -> chaos.Outcome:
    """Run one schedule on the lab; raises AssertionError naming the seed when a check fails."""
    fault = plan.faults[0]
    where = f"{plan.describe()} (separate hosts)"
    workdir = slurm.workdir(f"chaos-{plan.seed}-")
    job_id = submit_runtime_job(slurm, workdir, chaos.STEPS, STEP_TIME, chaos.CONF)
    drains: list[subprocess.Popen] = []
    try:
        wait_for(lambda: f"leads job slurm-{job_id}" in slurm.output(job_id), 150, "the job's leader")
        ref = ref_of(slurm, job_id)
        if fault.step >= 10:  # a fault in the first steps may come before the standby is warm
            wait_status(ref, lambda d: d["hot_swap"] and any(n["state"] == "shadow" for n in d["nodes"]), 150)
        wait_steps(slurm, job_id, fault.step, 150)
        doc = wait_status(ref, lambda d: True, 10)
        hot = doc["hot_swap"] and any(n["state"] == "shadow" for n in doc["nodes"])
        time.sleep(fault.delay)  # fault placement inside the step, not a synchronisation
        drain = [*TMRUN, "drain", "--rdzv-endpoint", ref.endpoint, "--job", ref.job]
        replaced = chaos.inject(fault, doc, lambda node: _kill_member(slurm, node),
                                lambda name, rejoin: drains.append(chaos.start_drain([*drain, name], rejoin, workdir)))
        struck = [chaos.struck_pids(fault, doc)]
        try:
            state, end_s = _follow(slurm, job_id, 150)
        except TimeoutError as exc:  # what every node still runs, and what the job said: for the replay
            running = "\n".join(map(str, slurm.leftovers()))
            raise AssertionError(f"{where}: {exc}; still running:\n{running}\n{slurm.output(job_id)[-8000:]}") from None
    finally:
        chaos.reap_drains(drains)
    output = slurm.output(job_id)
    # srun counts a SIGKILLed task (a killed agent's tmrun) against the step, and SLURM calls the job
    # FAILED however it went on: then the job's own outcome, as every agent printed it, is what counts
    killed_agent = fault.kind in ("kill-agent", "kill-leader-agent") and state == "FAILED"
    succeeded = state == "COMPLETED" or (killed_agent and "the job has ended (succeeded" in output
                                         and "the job has ended (failed" not in output)
    if chaos.check_end(where, succeeded, output, output, struck, failed=f"the SLURM job ended {state}"):
        return chaos.Outcome(plan, hot, replaced, 0.0, epilogue=True)
    chaos.check_drains(where, drains, etcd_ends_with_the_job=True)
    chaos.check_work(where, workdir / "final.pt", reference, output, replaced, hot)
    assert end_s <= END_BOUND, f"{where}: the job ended {end_s:.1f} s after its last step"
    return chaos.Outcome(plan, hot, replaced, end_s)


def _kill_member(slurm: SlurmCluster, node: str | None) -> None:
    """SIGKILL the etcd member on ``node`` (node1's when ``node`` hosts none); its agent restarts it."""
    os.kill(etcd_pid(slurm, node if node in ETCD_HOSTS else ETCD_HOSTS[0]), signal.SIGKILL)


def _follow(slurm: SlurmCluster, job_id: int, timeout: float) -> tuple[str, float]:
    """Until the SLURM job is over: its final state, and the seconds from its last step (every
    rank's, as printed) to SLURM's end of it (``inf`` when the last step never showed)."""
    last_at: list[float] = []
    last = f'"step": {chaos.STEPS - 1}, "committed": true'

    def over() -> str | None:
        if not last_at and slurm.output(job_id).count(last) >= chaos.NODES:
            last_at.append(time.monotonic())
        state = slurm.job_state(job_id)
        return state if state in TERMINAL else None

    state = wait_for(over, timeout, f"job {job_id} to end")
    return state, (time.monotonic() - last_at[0]) if last_at else float("inf")
