"""End to end elastic resizes without a restart: real etcd, agents, gloo workers, a real SIGKILL.

A 4-node elastic job (``--nnodes 2:4``, no standby) loses a node to ``kill -9`` and goes on with
3, a drain takes it to 2, a new agent joins and it grows to 3. Nobody restarts: the workers that
stay keep their process from the first step to the last. Every step is committed exactly once,
on the same 12 shares as a run that never changed size, and its loss matches that run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import FAST, job_ref, run_tmrun, wait_status
from tmrun.shares import share_range

pytestmark = pytest.mark.e2e

JOB = Path(__file__).parent / "scripts" / "elastic_job.py"
STEPS = 150
SHARES = 12
PACE = ["--step-time", "0.06"]
# the rendezvous waits up to 10 s past the second node for the other two: on a busy machine one
# agent can register more than FAST's 0.5 s after the others, and the job would start with 3
CONF = FAST + ",last_call_timeout=10"
# Loss per step against the fixed-size run: the same samples and the same mean gradient, summed
# in another order (the ranks' partial sums differ with the size), so equal to rounding, which
# SGD carries forward: over 150 steps of this model the gap stayed below 1e-6 (relative).
LOSS_RTOL = 1e-5


def _reached(job, step: int, timeout: float = 90) -> None:
    """Wait until some rank committed ``step``; on failure, say what the agents said."""
    try:
        job.out.wait_for(rf'"step": {step}, ', timeout)
    except AssertionError:
        raise AssertionError(f"step {step} was not committed within {timeout:g} s; tmrun said:\n"
                             f"{job.err.text()[-6000:]}") from None


def _records(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        if '"loss_sum"' in line:
            rows.append(json.loads(line[line.index("{"):]))
    return rows


def _per_step(rows: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for row in rows:
        steps.setdefault(row["step"], []).append(row)
    return steps


@pytest.fixture(scope="module")
def fixed_size(tmp_path_factory) -> tuple[dict[int, float], Path]:
    """The same job on 4 ranks that never change: the loss of every step, and the final weights."""
    out = tmp_path_factory.mktemp("fixed") / "fixed.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TMRUN_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(JOB), str(out), "--steps", str(STEPS), "--shares", str(SHARES)],
                          capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = {step: sum(r["loss_sum"] for r in rows) / SHARES for step, rows in _per_step(_records(done.stdout)).items()}
    assert sorted(losses) == list(range(STEPS))
    return losses, out


@pytest.mark.timeout(300)
def test_an_elastic_job_shrinks_and_grows_without_restarting_anyone(jobs, tmp_path, fixed_size):
    # the steps from 100 on wait for the grow (slower until the gate opens): it must land before the last
    gate = tmp_path / "grown"
    script = [str(JOB), str(tmp_path / "final.pt"), "--steps", str(STEPS), "--shares", str(SHARES), *PACE,
              "--hold-from", "100", "--gate", str(gate)]
    job = jobs(["--nnodes", "2:4", "--rdzv-conf", CONF, *script])
    ref = job_ref(job)
    start = wait_status(ref, lambda d: d["hot_swap"] and len([n for n in d["nodes"] if n["ranks"]]) == 4, 90)
    assert start["generation"] == 1, start  # all four from the first step
    job.track()
    pids = {n["node"]: n["worker_pids"][0] for n in start["nodes"]}
    agents = {n["node"]: n["agent_pid"] for n in start["nodes"]}

    # 1. a node dies (its agent and its worker, kill -9): the job goes on with 3
    _reached(job, 20)
    os.kill(agents["node-1"], signal.SIGKILL)
    os.kill(pids["node-1"], signal.SIGKILL)
    three = wait_status(ref, lambda d: d["generation"] >= 2 and d["state"] == "running", 60)
    assert [n["node"] for n in three["nodes"] if n["ranks"]] == ["node-0", "node-2", "node-3"], three

    # 2. a drain of rank 0's node: the job goes on with 2
    _reached(job, 50)
    drained = run_tmrun(["drain", "node-0"], cwd=tmp_path, timeout=120)
    assert drained.returncode == 0, drained.stderr
    assert "shrinks to 2 nodes (no restart)" in drained.stderr, drained.stderr

    # 3. a new agent is pointed at the job: it grows to 3
    _reached(job, 80)
    newcomer = jobs(["--rdzv-endpoint", ref.endpoint, "--rdzv-id", ref.job, "--nnodes", "2:4", "--node-name",
                     "node-9", "--local-addr", "127.0.0.1", "--rdzv-conf", CONF, *script])
    grown = wait_status(ref, lambda d: d["generation"] >= 4 or d["state"] != "running", 90)
    assert grown["state"] == "running", grown
    job.track()
    newcomer.track()
    newcomer.out.wait_for(r'"world": 3, ', 60)  # the newcomer's first step as a member of the grown job
    gate.touch()
    assert job.wait(150) == 0, job.err.text()[-4000:]
    assert newcomer.wait(60) == 0, newcomer.err.text()[-4000:]
    assert grown["restarts"] == 0 and grown["hot_swaps"] == 3, grown  # three resizes, no restart

    rows = _records(job.out.text()) + _records(newcomer.out.text())
    steps = _per_step(rows)
    assert sorted(steps) == list(range(STEPS)), "a step was never committed"
    # The last step of generation 1 may lack some ranks' lines: the killed worker's (killed between
    # its vote and its line), and a survivor's whose vote failed after the others' had completed (it
    # did not commit the step itself; it receives the state of the ranks that did, at the switch).
    last_of_first = max(r["step"] for r in rows if r["gen"] == 1)
    worlds, partial = [], set()
    for step, done in sorted(steps.items()):
        gens = {r["gen"] for r in done}
        assert len(gens) == 1, f"step {step} committed in generations {gens}: more than once"
        world = done[0]["world"]
        ranks = sorted(r["rank"] for r in done)
        taken = sorted(i for r in done for i in r["shares"])
        if ranks != list(range(world)) and step == last_of_first:
            partial.add(step)
            missing = sorted(set(range(world)) - set(ranks))
            ranks = sorted(ranks + missing)
            taken = sorted(taken + [i for rank in missing for i in share_range(rank, world, SHARES)])
        assert ranks == list(range(world)), f"step {step}: ranks {done}"
        assert taken == list(range(SHARES)), f"step {step}: shares {taken}, not each of the {SHARES} once"
        worlds.append(world)
    sizes = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    assert sizes == [4, 3, 2, 3], sizes

    losses, fixed_weights = fixed_size
    for step, done in steps.items():
        if step in partial:
            continue  # a rank's share of the loss is not in the lines
        loss = sum(r["loss_sum"] for r in done) / SHARES
        assert loss == pytest.approx(losses[step], rel=LOSS_RTOL), f"step {step}: {loss} against {losses[step]}"
    gap = max(abs(sum(r["loss_sum"] for r in done) / SHARES - losses[s]) / abs(losses[s])
              for s, done in steps.items() if s not in partial)
    print(f"largest relative loss gap to the fixed-size run: {gap:.2e}")
    final_weights = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, tensor in torch.load(fixed_weights, weights_only=True).items():
        torch.testing.assert_close(final_weights[name], tensor, rtol=1e-4, atol=1e-6)

    for node in ("node-2", "node-3"):  # trained from the first step to the last in one process
        printed = sorted(r["step"] for r in rows if r["pid"] == pids[node])
        assert len(printed) == len(set(printed)), f"{node} committed a step twice: {printed}"
        # the one step it may lack is the partial last step of generation 1 (see above)
        assert set(range(STEPS)) - set(printed) <= partial, f"{node} lacks steps: {printed}"
    for row in rows:  # every committed step came from a first-generation process or the newcomer's
        assert row["pid"] in pids.values() or row["gen"] >= 4, row
    assert "started generation 2" not in job.err.text() and "started generation 3" not in job.err.text()
