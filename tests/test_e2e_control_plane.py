"""End to end: the control plane fails and the job trains on (local cluster and node mode).

The embedded etcd of a local cluster is SIGKILLed mid-run: the launcher starts it again from its
data directory, no worker stops or restarts, every step commits exactly once, a drain right after
is a hot swap, and the weights equal an uninterrupted run's. An etcd that stays away longer than
the outage bound ends a node-mode job cleanly: exit 3, one clear line, the workers stopped with
SIGTERM (their last words reach the output), nothing left running. Junk written under the job's
prefix while it runs (a value that is not JSON, a node record of the wrong shape) is skipped with
a warning: status and drain answer, the job ends as it should, and no traceback is printed.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal

import pytest

from agent.etcd_server import EmbeddedEtcd
from agent.keys import JobKeys
from agent.procfs import descendants
from tests.harness import FAST, alive, assert_same_weights, fast_gate, job_ref, job_store, run_tmrun, wait_status
from tests.test_e2e_hot_swap import JOB, PACE, _events, _reference

pytestmark = pytest.mark.e2e

STEPS = 220


def _etcd_pid(job) -> int:
    """The job's embedded etcd: the launcher's child running the etcd binary."""
    for pid in descendants(job.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"/etcd"):
            return pid
    raise AssertionError("no etcd process under the launcher")


@pytest.mark.timeout(240)
def test_local_etcd_killed_mid_run_is_restarted_and_training_never_stops(jobs, tmp_path, tmp_path_factory):
    reference = _reference(tmp_path_factory, 2, STEPS)
    acted = fast_gate(tmp_path)  # the steps left after the drain run unpaced (gate.py)
    job = jobs(["--nnodes", "2", "--standby", "1", "--rdzv-conf", FAST, str(JOB), str(tmp_path / "final.pt"),
                "--steps", str(STEPS), *PACE, "--fast-when", str(acted)])
    ref = job_ref(job)
    ready = wait_status(ref, lambda d: d["hot_swap"] and any(n["state"] == "shadow" for n in d["nodes"]), 90)
    job.track()
    pids = {n["node"]: n["worker_pids"] for n in ready["nodes"]}
    job.out.wait_for(r'"step": 30, "committed"', 90)

    first = _etcd_pid(job)
    os.kill(first, signal.SIGKILL)
    job.err.wait_for(r"etcd member \S+ \(pid \d+\) exited with code -9: restarting it", 30)
    job.err.wait_for(r"etcd member \S+ is back at", 30)
    assert _etcd_pid(job) != first
    doc = wait_status(ref, lambda d: d["state"] == "running", 30)  # the same job, keys and leases kept
    assert doc["generation"] == ready["generation"] and doc["restarts"] == 0, doc
    assert {n["node"]: n["worker_pids"] for n in doc["nodes"]} == pids  # nobody was restarted

    drained = run_tmrun(["drain", "node-1"], cwd=tmp_path, timeout=120)  # and the job still obeys
    assert drained.returncode == 0 and "hot swap" in drained.stderr, drained.stderr
    acted.touch()
    assert job.wait(150) == 0, job.err.text()[-4000:]
    assert_same_weights(tmp_path / "final.pt", reference)
    committed: dict[int, list[int]] = {}
    for event in _events(job.out.text()):
        if event.get("role") == "active" and event.get("committed"):
            committed.setdefault(event["rank"], []).append(event["step"])
    assert {r: sorted(s) for r, s in committed.items()} == {0: list(range(STEPS)), 1: list(range(STEPS))}
    assert "started generation 2" not in job.err.text()


@pytest.mark.timeout(180)
def test_etcd_away_past_the_outage_bound_ends_the_job_cleanly(jobs, tmp_path):
    server = EmbeddedEtcd(tmp_path / "etcd").start()
    try:
        job_id = f"outage-{random.randrange(1 << 30)}"
        common = ["--rdzv-endpoint", server.endpoint, "--rdzv-id", job_id, "--nnodes", "1", "--local-addr",
                  "127.0.0.1", "--rdzv-conf", FAST + ",etcd_outage_timeout=8,store_timeout=3"]
        job = jobs([*common, "--node-name", "solo", str(JOB), str(tmp_path / "final.pt"), "--steps", "100000",
                    *PACE])
        job.out.wait_for(r'"step": 5, "committed"', 90)
        job.track()
        workers = descendants(job.proc.pid)
        server.stop(grace=0.5)  # etcd is gone, for good
        line = job.err.wait_for(r"etcd at \S+ unreachable for \d+ s \(outage bound 8 s", 60)
        assert job.wait(60) == 3, job.err.text()[-3000:]
        assert "workers keep running" in job.err.text()
        steps = [e["step"] for e in _events(job.out.text()) if e.get("committed")]
        assert max(steps) > 5 + 10, "the workers stopped training when etcd went away"  # 8 s of 0.08 s steps
        assert not [pid for pid in workers if alive(pid)]
        assert re.search(r"stopping the workers", line.string)
    finally:
        server.stop()


async def _plant_junk(ref) -> None:
    """What a stray ``etcdctl put`` could leave under the job's prefix."""
    keys = JobKeys(ref.job)
    store = job_store(ref.endpoint, retry_deadline=5)  # with the user's credentials: the job's etcd is closed
    try:
        await store.put_raw(keys.root + "junk", b"not json")
        await store.put(keys.node("intruder"), {"v": 1})  # a node record of the wrong shape
        await store.put(keys.request("bogus"), {"v": 1, "id": "bogus", "kind": "drain", "node": 3, "created": 0})
        await store.put_raw(keys.event(1), b'{"v": 1, "at": NaN}')
    finally:
        await store.close()


@pytest.mark.timeout(240)
def test_junk_under_the_job_prefix_does_not_stop_the_job(jobs, tmp_path):
    job = jobs(["--nnodes", "2", "--standby", "1", "--rdzv-conf", FAST, str(JOB), str(tmp_path / "final.pt"),
                "--steps", "160", *PACE])
    ref = job_ref(job)
    wait_status(ref, lambda d: d["hot_swap"] and any(n["state"] == "shadow" for n in d["nodes"]), 90)
    job.track()
    asyncio.run(_plant_junk(ref))

    status = run_tmrun(["status"], cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "node-0" in status.stdout and "intruder" not in status.stdout
    assert f"ignoring /tmrun/{ref.job}/junk" in status.stderr and "Traceback" not in status.stderr
    refused = run_tmrun(["drain", "intruder"], cwd=tmp_path)
    assert refused.returncode == 4 and "unknown node 'intruder'" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    drained = run_tmrun(["drain", "node-1"], cwd=tmp_path, timeout=120)
    assert drained.returncode == 0 and "hot swap" in drained.stderr, drained.stderr
    assert "Traceback" not in drained.stderr

    assert job.wait(150) == 0, job.err.text()[-4000:]
    out, err = job.out.text(), job.err.text()
    assert "Traceback" not in out + err, err[-4000:]
    assert "succeeded" in err
    warned = [line for line in err.splitlines() if f"ignoring /tmrun/{ref.job}/junk" in line]
    assert 1 <= len(warned) <= 4, warned  # once per process that read it (agents, launcher), not a flood
