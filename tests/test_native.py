"""Torch-native groups without agents: static worlds under torchrun, a standby's sandbox, replicas.

- Under torchrun, tests/scripts/native_job.py on ``run.process_group``/``run.device_mesh`` ends
  bit-identical to the same script on torch's own gloo groups and ``init_device_mesh`` (DDP,
  FSDP2, HSDP on 4 ranks).
- A rank SIGKILLed inside a step: the other ranks' collectives fail inside torch's DDP or FSDP2,
  which never raise into the script (latched, voted down, retried), and after the retries the
  runtime says so (``StepFailed``), as with ``run.data_parallel``.
- A standby's shadow iterations on the native groups never leave the process.
- Which ranks hold which copy (:mod:`tmrun.replicas`): pure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agent.etcd_server import free_port
from bench.competitors import torchrun_job
from tests.harness import assert_same_weights
from tests.test_runtime import _clean_env
from tmrun.pull import pull_plans
from tmrun.replicas import NoReplica, key_of, local, replica_pulls

JOB = Path(__file__).parent / "scripts" / "native_job.py"


def _torchrun(cwd: Path, out: str, *args: str, world: int = 4) -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(JOB), out, *args], capture_output=True, text=True, timeout=150,
                          env=_clean_env(), cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ddp", "fsdp", "hsdp"])
def test_native_groups_train_bit_identical_to_torchs_own(tmp_path, mode):
    _torchrun(tmp_path, "torch.pt", "--mode", mode, "--torch")
    _torchrun(tmp_path, "ours.pt", "--mode", mode)
    assert_same_weights(tmp_path / "ours.pt", tmp_path / "torch.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_failed_native_collective_is_latched_and_voted_not_raised(tmp_path, mode):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(JOB), str(tmp_path / "x.pt"), "--mode", mode, "--exit-at", "2:1"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                             MASTER_PORT=str(port), TMRUN_COLLECTIVE_TIMEOUT="20"))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9
    stdout, stderr = outs[0]
    steps = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [(e["step"], e["committed"]) for e in steps] == [(0, True), (1, True)] + [(2, False)] * 3, steps
    # the failure surfaced where the runtime says it does: not from inside backward() or the optimizer
    assert "tmrun.runtime.StepFailed: step 2 did not commit after 3 tries" in stderr, stderr[-3000:]
    assert "backward" not in stderr and "step()" not in stderr, stderr[-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_torchrun_restart_agrees_on_its_round_though_the_agents_counts_differ(tmp_path):
    """Two torchrun agents (nodes), torch's default shared store; rank 1 SIGKILLed once at step 2.

    Its agent counts a restart; the other agent's worker is still inside its paced step when the
    new rendezvous round starts, so that agent restarts it without counting one. The restarted
    ranks see different ``TORCHELASTIC_RESTART_COUNT`` values, and the job must still finish,
    bit-identical to an uninterrupted run (it starts over: no checkpoint).
    """
    _torchrun(tmp_path, "torch.pt", "--mode", "ddp", "--torch", world=2)
    marker = tmp_path / "killed-once"
    job = torchrun_job.start_job([str(tmp_path / "ours.pt"), "--mode", "ddp", "--step-time", "2", "--exit-at", "2:1",
                                  "--exit-once", str(marker)], script=JOB, log_dir=tmp_path / "logs", max_restarts=1,
                                 env={**_clean_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    try:
        codes = job.wait(timeout=240)
    finally:
        job.kill()
    logs = {n.name: n.log.read_text() for n in job.nodes}
    assert codes == [0, 0], logs
    assert marker.exists()
    finals = [json.loads(line) for text in logs.values() for line in text.splitlines()
              if line.startswith('{"done"')]
    gens = {e["rank"]: e["gen"] for text in logs.values() for line in text.splitlines()
            if line.startswith('{"step"') and (e := json.loads(line))["pid"] in {f["pid"] for f in finals}}
    assert gens[0] != gens[1], (gens, logs)  # the case that hung: counts that differ between the nodes
    assert_same_weights(tmp_path / "ours.pt", tmp_path / "torch.pt")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["ddp", "hsdp"])
def test_a_standbys_native_groups_answer_inside_the_process(tmp_path, mode):
    env = _clean_env(RANK="3", WORLD_SIZE="4", LOCAL_RANK="0", TMRUN_ROLE="standby",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # nothing listens there: nothing may connect
    done = subprocess.run([sys.executable, str(JOB), str(tmp_path / "x.pt"), "--mode", mode], capture_output=True,
                          text=True, timeout=50, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.splitlines()[-1])
    assert last["standby"] and last["sandboxed"] and all(count > 0 for count in last["answered"]), last
    assert not (tmp_path / "x.pt").exists()


# -- which ranks hold which copy (pure) ---------------------------------------------------------

class Placement:
    def __init__(self, replicate: bool) -> None:
        self.replicate = replicate

    def is_replicate(self) -> bool:
        return self.replicate


def fake_dtensor(layout: torch.Tensor, *replicate: bool) -> SimpleNamespace:
    """What :func:`tmrun.replicas.key_of` reads of a DTensor: its mesh's ranks and its placements."""
    return SimpleNamespace(device_mesh=SimpleNamespace(mesh=layout), placements=[Placement(r) for r in replicate])


def test_replica_keys_follow_the_placements():
    hsdp = fake_dtensor(torch.arange(4).view(2, 2), True, False)  # (Replicate(), Shard(0)) on (2, 2)
    key = key_of(hsdp)
    assert [key(r) for r in range(4)] == [(0,), (1,), (0,), (1,)]  # rank 0's shard is rank 2's too
    fsdp = key_of(fake_dtensor(torch.arange(4), False))
    assert [fsdp(r) for r in range(4)] == [(0,), (1,), (2,), (3,)] and fsdp(7) is None
    assert key_of(fake_dtensor(torch.arange(4), True)) is None  # replicated everywhere
    plain = torch.zeros(3)
    assert key_of(plain) is None and local(plain) is plain


def test_a_receiver_pulls_each_tensor_from_its_own_replicas_only():
    tensors = [torch.zeros(1024), torch.zeros(1024), torch.zeros(8)]
    shard = key_of(fake_dtensor(torch.arange(4).view(2, 2), True, False))
    keys = [shard, shard, None]  # two HSDP shards, and a scalar every rank holds
    rates = [[10**8] * 4 for _ in range(4)]
    (plan,) = replica_pulls(tensors, keys, ["a", "b", "step"], (1, 2, 3), (0,), rates)
    by_tensor = {}
    for piece in plan.pieces:
        by_tensor.setdefault(piece.tensor, set()).add(piece.source)
    assert by_tensor[0] == {2} and by_tensor[1] == {2}  # rank 0's shard: only rank 2 holds it
    assert by_tensor[2] <= {1, 2, 3}
    assert sum(p.stop - p.start for p in plan.pieces) == 2 * 4096 + 32
    tags = [(p.source, i) for i, p in enumerate(plan.pieces)]
    assert len(tags) == len(set(tags))  # one tag per piece: the pieces of all classes travel at once
    # no key at all: exactly the plain pull
    assert replica_pulls(tensors, [None] * 3, ["a", "b", "c"], (1, 2), (0,), rates) == \
        pull_plans(tensors, (1, 2), (0,), rates)


def test_a_shard_nobody_else_holds_is_no_replica():
    fsdp = key_of(fake_dtensor(torch.arange(4), False))
    with pytest.raises(NoReplica, match=r"no surviving rank holds rank 2's copy of /model/w"):
        replica_pulls([torch.zeros(4)], [fsdp], ["/model/w"], (0, 1, 3), (2,), [[1] * 4] * 4)
