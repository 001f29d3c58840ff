"""End to end, the other ways to run: node mode against an etcd endpoint, SLURM (simulated on
loopback addresses 127.0.0.x), several local jobs at once, and bad input against a running job.
"""

from __future__ import annotations

import json
import random
import signal

import pytest

from tests.harness import EXAMPLE, FAST, assert_same_weights, job_ref, run_tmrun
from tests.test_e2e_launch import PACED, STEPS, reference  # noqa: F401  (module fixture)

pytestmark = pytest.mark.e2e


def _one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tmrun: error:"), stderr
    return lines[0]


@pytest.mark.timeout(150)
def test_node_mode_with_endpoint(jobs, tmp_path, etcd_server, reference):
    job_id = f"ep-{random.randrange(1 << 30)}"
    common = ["--rdzv-endpoint", f"etcd://{etcd_server.endpoint}", "--rdzv-id", job_id, "--nnodes", "2",
              "--local-addr", "127.0.0.1", "--rdzv-conf", FAST]
    script = [str(EXAMPLE), "--steps", str(STEPS), "--out", str(tmp_path / "final.pt")]
    a = jobs([*common, "--node-name", "alpha", *script])
    b = jobs([*common, "--node-name", "beta", *script])
    assert a.wait(120) == 0, a.err.text()[-3000:]
    assert b.wait(60) == 0, b.err.text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", reference)
    done = run_tmrun(["status", "--json", "--rdzv-endpoint", etcd_server.endpoint, "--job", job_id], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["state"] == "succeeded" and doc["generation"] == 1


@pytest.mark.timeout(150)
def test_slurm_allocation_with_standby(jobs, tmp_path, reference):
    job_id = str(random.randrange(100000, 999999))
    outs = []
    for node_id in range(3):
        env = {"SLURM_JOB_ID": job_id, "SLURM_NNODES": "3", "SLURM_NODEID": str(node_id),
               "SLURM_JOB_NODELIST": "127.0.0.[1-3]", "SLURMD_NODENAME": f"127.0.0.{node_id + 1}"}
        outs.append(jobs(["--nnodes", "2", "--standby", "1", "--rdzv-conf", FAST, str(EXAMPLE), "--steps", str(STEPS),
                          "--out", str(tmp_path / "final.pt")], env=env))
    codes = [job.wait(120) for job in outs]
    assert codes == [0, 0, 0], "\n\n".join(job.err.text()[-2000:] for job in outs)
    assert_same_weights(tmp_path / "final.pt", reference)
    # the third node of the allocation was the standby: it never ran a worker
    assert "started generation" not in outs[2].err.text()
    assert "started generation 1" in outs[0].err.text() and "started generation 1" in outs[1].err.text()


@pytest.mark.timeout(150)
def test_bad_input_leaves_running_job_untouched(jobs, tmp_path, reference):
    job = jobs(["--nnodes", "2", "--standby", "1", "--rdzv-conf", FAST, str(EXAMPLE), "--steps", str(STEPS),
                "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "final.pt"), *PACED])
    ref = job_ref(job)
    job.out.wait_for(r"step 3 ", 60)
    job.track()

    unknown = run_tmrun(["drain", "node-9"], cwd=tmp_path)
    assert unknown.returncode == 4
    assert "unknown node 'node-9'" in _one_line_error(unknown.stderr)

    unreachable = run_tmrun(["status", "--rdzv-endpoint", "127.0.0.1:1", "--store-timeout", "1"], cwd=tmp_path)
    assert unreachable.returncode == 3
    assert "127.0.0.1:1" in _one_line_error(unreachable.stderr)

    missing = run_tmrun(["--nnodes", "2", str(tmp_path / "nope.py")], cwd=tmp_path)
    assert missing.returncode == 2 and "not found" in _one_line_error(missing.stderr)

    status = run_tmrun(["status", "--json"], cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["job"] == ref.job and doc["generation"] == 1 and doc["restarts"] == 0
    assert job.wait(120) == 0, job.err.text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", reference)


@pytest.mark.timeout(150)
def test_two_jobs_need_job_flag(jobs, tmp_path):
    first = jobs(["--rdzv-id", "first", "--rdzv-conf", FAST, str(EXAMPLE), "--steps", "400", *PACED])
    second = jobs(["--rdzv-id", "second", "--rdzv-conf", FAST, str(EXAMPLE), "--steps", "400", *PACED])
    for job in (first, second):
        job_ref(job)
        job.out.wait_for(r"step 1 ", 60)
        job.track()
    ambiguous = run_tmrun(["status"], cwd=tmp_path)
    assert ambiguous.returncode == 5
    assert "choose one with --job" in _one_line_error(ambiguous.stderr)
    chosen = run_tmrun(["status", "--json", "--job", "second"], cwd=tmp_path)
    assert chosen.returncode == 0 and json.loads(chosen.stdout)["job"] == "second"
    table = run_tmrun(["status", "--job", "first"], cwd=tmp_path)
    assert table.returncode == 0 and "node-0" in table.stdout and "active" in table.stdout
    events = run_tmrun(["events", "--json", "--job", "first"], cwd=tmp_path)
    assert events.returncode == 0 and json.loads(events.stdout)[0]["kind"] == "start"
    for job in (first, second):
        job.proc.send_signal(signal.SIGINT)
    assert [first.wait(60), second.wait(60)] == [130, 130]


@pytest.mark.timeout(120)
def test_log_dir_redirects_and_tee(jobs, tmp_path):
    logs = tmp_path / "logs"
    job = jobs(["--standalone", "--nproc-per-node", "2", "--rdzv-id", "logs", "--log-dir", str(logs),
                "--redirects", "1", "--tee", "1:1", str(EXAMPLE), "--steps", "3"])
    assert job.wait(100) == 0, job.err.text()[-3000:]
    rank0 = logs / "logs" / "node-0" / "gen1" / "0" / "stdout.log"
    assert "done steps=3" in rank0.read_text()
    assert (logs / "logs" / "node-0" / "gen1" / "1" / "stdout.log").exists()
    # local rank 0's stdout is redirected: in its file, not on the console
    assert "done steps=3" not in job.out.text()
    assert "started generation 1" in job.err.text()
