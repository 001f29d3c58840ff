"""Hot swaps of torch-native parallelism: torch's DDP, FSDP2 and HSDP on the runtime's groups.

Real etcd, agents and gloo workers running tests/scripts/native_job.py, which builds torch's own
``DistributedDataParallel(process_group=run.process_group)`` or ``fully_shard`` on
``run.device_mesh(...)``. A drain or a SIGKILL swaps the standby in; the final weights must equal,
bit for bit, the same script's under torchrun with plain torch (``--torch``: torch's own gloo
groups and ``init_device_mesh``), every step must be committed once per rank, and the survivors'
process ids must not change.

Which state moves: DDP's replicas after a failure; under FSDP2 the leaver's own shard, handed over
in a drain; under HSDP the lost rank's shard from the rank of its replicate group. A SIGKILL
under FSDP2 leaves a shard that nobody else holds: the runtime refuses to train on the standby's
shadow state (``StateLost``) and the job restarts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import FAST, assert_same_weights, fast_gate, job_ref, run_tmrun, wait_status
from tests.test_e2e_hot_swap import _assert_each_step_committed_once, _events

pytestmark = pytest.mark.e2e

JOB = Path(__file__).parent / "scripts" / "native_job.py"
STEPS = 120  # as tests/test_e2e_hot_swap.py: _assert_each_step_committed_once counts these
PACE = ["--step-time", "0.05"]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mode: str
    nodes: int
    action: str  # drain | kill
    rank: int  # whose node is drained / whose worker is killed
    step: int = 20


CASES = [
    Case("ddp-drain-rank1", "ddp", 2, "drain", 1),
    Case("ddp-kill-9-rank0", "ddp", 2, "kill", 0),  # the standby's shadow ran as rank 1: it is rebound to 0
    Case("fsdp-drain-rank1", "fsdp", 4, "drain", 1),
    Case("hsdp-kill-9-rank0", "hsdp", 4, "kill", 0),  # rank 0's shard comes from rank 2, its replica
    Case("hsdp-kill-9-rank3", "hsdp", 4, "kill", 3),
]


class References(dict):
    """The same script with plain torch under torchrun, per (mode, world size), trained the first
    time a test of this worker asks for it (the tests of a mode may all run on the other one)."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__()
        self._tmp = tmp_path_factory

    def __missing__(self, key: tuple[str, int]) -> Path:
        mode, world = key
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TMRUN_"))}
        out = self._tmp.mktemp(f"native-{mode}{world}") / "ref.pt"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(world), str(JOB), str(out), "--mode", mode, "--steps", str(STEPS), "--torch"],
                              capture_output=True, text=True, timeout=150, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        self[key] = out
        return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> References:
    return References(tmp_path_factory)


def _start_warm(jobs, tmp_path: Path, flags: list[str], mode: str, nodes: int, step: int):
    """A job of the native script on ``nodes`` nodes and one standby: once the standby is warm and
    ``step`` was committed, the job, its ref and its status (the nodes' ranks and worker pids).
    The steps from ``step`` on are slower until the test calls :func:`_acted` (gate.py), so that on
    a loaded machine the job cannot end before its standby is warm or before the test acted; they
    go unpaced once the test saw the next generation and opened ``fast_gate`` (gate.py)."""
    job = jobs(["--nnodes", str(nodes), "--standby", "1", *flags, "--rdzv-conf", FAST,
                str(JOB), str(tmp_path / "final.pt"), "--mode", mode, "--steps", str(STEPS), *PACE,
                "--hold-from", str(step), "--gate", str(tmp_path / "acted"), "--fast-when", str(fast_gate(tmp_path))])
    ref = job_ref(job)
    wait_status(ref, lambda d: d["hot_swap"] and any(n["state"] == "shadow" for n in d["nodes"]), 120)
    job.out.wait_for(rf'"step": {step}, "committed"', 120)
    doc = wait_status(ref, lambda d: True, 10)
    job.track()
    return job, ref, doc


def _acted(tmp_path: Path) -> None:
    """The test did what it started the job for: the job's steps go at their pace again."""
    (tmp_path / "acted").touch()


def _kill(doc: dict, rank: int) -> dict:
    """SIGKILL the worker of ``rank``; its node's status row."""
    target = next(n for n in doc["nodes"] if n["ranks"] == [rank])
    os.kill(target["worker_pids"][0], signal.SIGKILL)
    return target


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_native_parallelism_hot_swap(case: Case, jobs, tmp_path, references):
    job, ref, doc = _start_warm(jobs, tmp_path, [], case.mode, case.nodes, case.step)
    if case.action == "drain":
        target = next(n for n in doc["nodes"] if n["ranks"] == [case.rank])
        drained = run_tmrun(["drain", target["node"]], cwd=tmp_path, timeout=120)
        assert drained.returncode == 0 and "hot swap" in drained.stderr, drained.stderr
    else:
        target = _kill(doc, case.rank)
    _acted(tmp_path)
    final = wait_status(ref, lambda d: d["generation"] >= 2 or d["state"] != "running", 150)
    fast_gate(tmp_path).touch()  # the next generation was seen
    job.track()
    assert job.wait(180) == 0, job.err.text()[-4000:]
    assert final["restarts"] == 0 and final["hot_swaps"] == 1, final  # a swap, not a restart
    assert_same_weights(tmp_path / "final.pt", references[case.mode, case.nodes])

    events = [e for e in _events(job.out.text()) if e.get("role") == "active" and "step" in e]
    killed = {target["worker_pids"][0]} if case.action == "kill" else set()
    pids: dict[int, set[int]] = {}
    for event in events:
        pids.setdefault(event["rank"], set()).add(event["pid"])
    before = {n["ranks"][0]: n["worker_pids"][0] for n in doc["nodes"] if n["ranks"]}
    for rank in range(case.nodes):
        _assert_each_step_committed_once(events, rank, killed)
        if rank != case.rank:  # the same process from the first step to the last
            assert pids[rank] == {before[rank]}, f"rank {rank} was restarted: {pids[rank]}, before {before[rank]}"
    assert len(pids[case.rank]) == 2, pids  # the leaver's process, then the joiner's
    assert "started generation 2" not in job.err.text() and "Traceback" not in job.err.text()
    # a survivor blocked in a collective with the dead rank failed at once, not at the collective timeout
    assert "Timed out waiting" not in job.err.text()


@pytest.mark.timeout(240)
def test_fsdp_kill_9_without_a_replica_restarts_and_says_why(jobs, tmp_path, references):
    """FSDP2's shards have no replica: after a SIGKILL the survivors refuse to train on the standby's
    shadow shard (``StateLost``), the leader's decision says so, and the job restarts (the script has
    no checkpoint: it trains again from step 0 and ends with the uninterrupted run's weights)."""
    job, ref, doc = _start_warm(jobs, tmp_path, ["--max-restarts", "1"], "fsdp", 4, 20)
    _kill(doc, 2)
    _acted(tmp_path)
    wait_status(ref, lambda d: d["generation"] >= 2 or d["state"] != "running", 150)
    fast_gate(tmp_path).touch()  # the next generation was seen
    assert job.wait(200) == 0, job.err.text()[-4000:]
    err = job.err.text()
    assert "StateLost: no surviving rank holds rank 2's copy of /model/" in err, err[-4000:]
    # no survivor sat in a collective with the dead rank until the collective timeout (120 s): the
    # others let go of the old group's connections (FSDP2 keeps its works between calls)
    assert "Timed out waiting" not in err
    assert "restart" in next(line for line in err.splitlines() if "decision" in line and "StateLost" in line)
    assert_same_weights(tmp_path / "final.pt", references["fsdp", 4])


@pytest.mark.timeout(240)
def test_fsdp_kill_9_with_redundancy_rolls_back_and_swaps_without_a_restart(jobs, tmp_path, references):
    """``--redundancy 1``: each rank keeps its right neighbour's shards. After a SIGKILL the joiner's
    shards come from the dead rank's left neighbour's copy, every rank goes back to that copy's step,
    and the job goes on without a restart; deterministic steps make the end bit-identical to the
    uninterrupted run, though the steps since the copy were trained twice."""
    job, ref, doc = _start_warm(jobs, tmp_path, ["--redundancy", "1", "--redundancy-every", "5"], "fsdp", 4, 22)
    _kill(doc, 2)
    _acted(tmp_path)
    final = wait_status(ref, lambda d: d["generation"] >= 2 or d["state"] != "running", 150)
    fast_gate(tmp_path).touch()  # the next generation was seen
    job.track()
    assert job.wait(180) == 0, job.err.text()[-4000:]
    assert final["restarts"] == 0 and final["hot_swaps"] == 1, final
    assert_same_weights(tmp_path / "final.pt", references["fsdp", 4])
    err = job.err.text()
    assert "rolled back to step" in err and "StateLost" not in err and "Timed out waiting" not in err, err[-3000:]

    events = [e for e in _events(job.out.text()) if e.get("role") == "active" and "step" in e]
    before = {n["ranks"][0]: n["worker_pids"][0] for n in doc["nodes"] if n["ranks"]}
    for rank in (0, 1, 3):  # the survivors: the same process throughout, every step committed at least once
        mine = [e for e in events if e["rank"] == rank]
        assert {e["pid"] for e in mine} == {before[rank]}, mine[:3]
        committed = [e["step"] for e in mine if e["committed"]]
        assert set(committed) == set(range(STEPS)), rank
        again = sorted({s for s in committed if committed.count(s) == 2})
        # the steps since the last agreed copy (a multiple of 5) were trained twice, and only those
        assert again and again[0] % 5 == 0 and again == list(range(again[0], again[-1] + 1)), again
        assert all(committed.count(s) <= 2 for s in committed)
