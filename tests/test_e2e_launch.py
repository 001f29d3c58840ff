"""End to end: the real ``tmrun`` command, real etcd, real agents and gloo workers, real signals.

The job is ``examples/train_ddp.py``, an unmodified torchrun script that checkpoints every step
and resumes; every interrupted run must end with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agent.procfs import descendants, running
from agent.warm import MARKER as WARM_MARKER
from tests.harness import EXAMPLE, FAST, assert_same_weights, job_ref, node_row, roles, run_tmrun, wait_status

pytestmark = pytest.mark.e2e

STEPS = 40
PACED = ["--step-time", "0.15"]  # simulated compute, so an interruption lands mid-run


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> "os.PathLike":
    """Final weights of an uninterrupted 2-rank run under torchrun."""
    out = tmp_path_factory.mktemp("ref") / "ref.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLE), "--steps", str(STEPS), "--out", str(out)],
                          capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _two_plus_one(jobs, tmp_path, extra=()):
    return jobs(["--nnodes", "2", "--standby", "1", "--rdzv-conf", FAST, *extra, str(EXAMPLE), "--steps", str(STEPS),
                 "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "final.pt"), *PACED])


@pytest.mark.timeout(120)
def test_same_flags_same_weights_as_torchrun(jobs, tmp_path, reference):
    job = jobs(["--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--steps", str(STEPS),
                "--out", str(tmp_path / "final.pt")])
    assert job.wait(100) == 0, job.err.text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", reference)
    assert "succeeded" in job.err.text()


@pytest.mark.timeout(120)
def test_link_checks_turned_off_the_job_runs_to_its_end(jobs, tmp_path, reference):
    """``link_check=0`` (documented: no link checks) once made every agent's finished check task
    stop its agent with a traceback."""
    job = jobs(["--nnodes", "2", "--rdzv-conf", f"{FAST},link_check=0", str(EXAMPLE), "--steps", str(STEPS),
                "--out", str(tmp_path / "final.pt")])
    assert job.wait(100) == 0, job.err.text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", reference)
    assert "Traceback" not in job.err.text()


@pytest.mark.timeout(150)
def test_kill_worker_standby_takes_over(jobs, tmp_path, reference):
    job = _two_plus_one(jobs, tmp_path)
    ref = job_ref(job)
    job.out.wait_for(r"step 5 ", 60)
    before = wait_status(ref, lambda d: d["generation"] == 1 and len(node_row(d, "active")) == 2
                         and all(r["worker_pids"] for r in node_row(d, "active")), 30)
    assert sorted(roles(before).values()) == ["active", "active", "standby"]
    job.track()
    victim = next(r for r in before["nodes"] if r["ranks"] == [1])
    survivor = next(r for r in before["nodes"] if r["ranks"] == [0])
    standby = node_row(before, "standby")[0]["node"]
    os.kill(victim["worker_pids"][0], signal.SIGKILL)

    after = wait_status(ref, lambda d: d["generation"] == 2, 60)
    assert roles(after)[victim["node"]] == "failed"
    assert roles(after)[standby] == "active"
    assert next(r for r in after["nodes"] if r["node"] == standby)["ranks"] == [1]  # it took rank 1's place
    assert after["restarts"] == 1 and after["hot_swaps"] == 0  # a restart, not a hot swap
    assert next(r for r in after["nodes"] if r["node"] == survivor["node"])["agent_pid"] == survivor["agent_pid"]
    job.track()

    assert job.wait(120) == 0, job.err.text()[-3000:]
    assert "resumed from step" in job.out.text()
    assert_same_weights(tmp_path / "final.pt", reference)


@pytest.mark.timeout(150)
def test_drain_node(jobs, tmp_path, reference):
    job = _two_plus_one(jobs, tmp_path)
    ref = job_ref(job)
    job.out.wait_for(r"step 5 ", 60)
    before = wait_status(ref, lambda d: d["generation"] == 1, 30)
    job.track()
    leaving = next(r for r in before["nodes"] if r["ranks"] == [1])["node"]
    standby = node_row(before, "standby")[0]["node"]

    drained = run_tmrun(["drain", leaving], cwd=tmp_path, timeout=60)
    assert drained.returncode == 0, drained.stderr
    assert f"{standby} takes its place" in drained.stderr
    assert f"{leaving} has left the job" in drained.stderr

    after = wait_status(ref, lambda d: d["generation"] == 2, 30)
    assert roles(after)[leaving] == "drained"
    assert roles(after)[standby] == "active"
    assert after["restarts"] == 0  # a planned departure is not a failure
    assert job.wait(120) == 0, job.err.text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", reference)


@pytest.mark.timeout(150)
def test_kill_leader_agent(jobs, tmp_path, reference):
    job = _two_plus_one(jobs, tmp_path)
    ref = job_ref(job)
    job.out.wait_for(r"step 5 ", 60)
    before = wait_status(ref, lambda d: d["generation"] == 1 and d["leader"], 30)
    job.track()
    old_leader = before["leader"]
    agent_pid = next(r for r in before["nodes"] if r["node"] == old_leader)["agent_pid"]
    # the leader and the plan's deputy (its first member other than the leader) host TCPStores;
    # the standby never imports torch
    members = [r for r in before["nodes"] if r["ranks"] and r["node"] != old_leader]
    deputy = min(members, key=lambda r: r["ranks"])["node"]
    hosting = {r["node"] for r in before["nodes"] if running(descendants(r["agent_pid"]), "agent.store_host")}
    assert hosting == {old_leader, deputy}, (hosting, before["nodes"])
    os.kill(agent_pid, signal.SIGKILL)

    after = wait_status(ref, lambda d: d["leader"] not in (None, old_leader) and d["generation"] >= 2
                        or d["state"] == "succeeded", 60)
    assert after["leader"] != old_leader
    if after["state"] == "running":  # the deputy campaigned first (the standby DEPUTY_HEAD_START later)
        assert after["leader"] == deputy, (after["leader"], deputy)
    job.track()
    assert job.wait(120) == 0, job.err.text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", reference)


@pytest.mark.timeout(150)
def test_no_standby_restarts_in_place_then_fails_past_max_restarts(jobs, tmp_path, reference):
    job = jobs(["--nnodes", "2", "--max-restarts", "1", "--rdzv-conf", FAST, str(EXAMPLE), "--steps", str(STEPS),
                "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "final.pt"), *PACED])
    ref = job_ref(job)
    job.out.wait_for(r"step 5 ", 60)
    first = wait_status(ref, lambda d: d["generation"] == 1 and all(r["worker_pids"] for r in node_row(d, "active")), 30)
    job.track()
    os.kill(node_row(first, "active")[1]["worker_pids"][0], signal.SIGKILL)
    second = wait_status(ref, lambda d: d["generation"] == 2 and all(
        r["worker_pids"] and r["generation"] == 2 for r in node_row(d, "active")), 60)
    assert second["in_place_restarts"] == 1 and second["standby_pool"] == 0
    assert sorted(r["node"] for r in node_row(second, "active")) == sorted(r["node"] for r in node_row(first, "active"))
    job.track()
    os.kill(node_row(second, "active")[0]["worker_pids"][0], signal.SIGKILL)

    assert job.wait(60) == 1
    assert "--max-restarts 1 is used up" in job.err.text()


def _warm_interpreters(job) -> set[int]:
    """The job's warm interpreters (--warm-start): its processes that run agent/warm.py's program."""
    return set(running(descendants(job.proc.pid), WARM_MARKER))


@pytest.mark.timeout(150)
def test_warm_start_restarts_into_interpreters_started_before_the_failure(jobs, tmp_path, reference):
    job = jobs(["--nnodes", "2", "--max-restarts", "1", "--warm-start", "--rdzv-conf", FAST, str(EXAMPLE),
                "--steps", str(STEPS), "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "final.pt"),
                "--step-time", "0.4"])  # 16 s of steps: the warm interpreters start 5 s in
    ref = job_ref(job)
    first = wait_status(ref, lambda d: d["generation"] == 1 and all(r["worker_pids"] for r in node_row(d, "active")), 60)
    deadline = time.monotonic() + 60
    while len(warm := _warm_interpreters(job)) < 2:  # one per node, started WARM_DELAY after its workers
        assert time.monotonic() < deadline, f"no warm interpreters: {warm}"
        time.sleep(0.2)  # a poll of /proc with a deadline, not a synchronisation
    # step 2 logged: step 1's checkpoint is complete (its barrier came first), so the restart resumes;
    # on a loaded machine the interpreters can be warm before the first step
    job.out.wait_for(r"step 2 ", 60)
    job.track()
    os.kill(node_row(first, "active")[1]["worker_pids"][0], signal.SIGKILL)
    second = wait_status(ref, lambda d: d["generation"] == 2 and all(
        r["worker_pids"] and r["generation"] == 2 for r in node_row(d, "active")), 60)
    restarted = {pid for r in node_row(second, "active") for pid in r["worker_pids"]}
    assert restarted == warm  # the restarted workers are the interpreters that waited, torch imported
    assert second["in_place_restarts"] == 1
    job.track()
    assert job.wait(100) == 0, job.err.text()[-3000:]
    assert "resumed from step" in job.out.text()
    assert_same_weights(tmp_path / "final.pt", reference)


@pytest.mark.timeout(150)
def test_sigterm_stops_everything(jobs, tmp_path):
    job = _two_plus_one(jobs, tmp_path)
    job.out.wait_for(r"step 3 ", 60)
    job.track()
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 143
    assert "stopped by SIGTERM" in job.err.text()


@pytest.mark.timeout(150)
def test_drain_the_leaders_node(jobs, tmp_path, reference):
    """The leader hosts each generation's store: draining its node hands leadership over first."""
    job = _two_plus_one(jobs, tmp_path)
    ref = job_ref(job)
    job.out.wait_for(r"step 5 ", 60)
    before = wait_status(ref, lambda d: d["generation"] == 1 and d["leader"], 30)
    job.track()
    leader = before["leader"]
    drained = run_tmrun(["drain", leader], cwd=tmp_path, timeout=90)
    assert drained.returncode == 0, drained.stderr
    assert f"{leader} has left the job" in drained.stderr
    after = wait_status(ref, lambda d: d["leader"] not in (None, leader), 30)
    assert roles(after).get(leader) in ("drained", None)
    assert job.wait(120) == 0, job.err.text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", reference)
