"""Tests for examples/train_ddp.py, the plain torchrun workload used by the e2e tests.

They run the script under stock torchrun (``python -m torch.distributed.run``)
and as a plain ``python`` world of one; no tmrun involved.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_ddp.py"

DONE_RE = re.compile(r"^done steps=(\d+) sha256=([0-9a-f]{64})$", re.M)
STEP_RE = re.compile(r"^step (\d+) loss (\d+\.\d{6})$", re.M)

# Launcher/rank variables that must not leak in from the environment pytest runs in.
_LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
          "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LEAKY and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores; also silences torchrun's banner
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args: list[str], cwd: Path, torchrun: bool = True, timeout: float = 50) -> str:
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(SCRIPT), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc.stdout


def _done(out: str) -> tuple[int, str]:
    m = DONE_RE.findall(out)
    assert len(m) == 1, f"expected exactly one done line:\n{out}"
    return int(m[0][0]), m[0][1]


def _steps(out: str) -> dict[int, str]:
    return {int(s): loss for s, loss in STEP_RE.findall(out)}


def _assert_bit_identical(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"tensor {k} differs"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted 20-step, 2-rank torchrun run: (workdir, stdout)."""
    d = tmp_path_factory.mktemp("uninterrupted")
    out = _run(["--steps", "20", "--out", "A.pt"], cwd=d)
    return d, out


@pytest.mark.timeout(60)
def test_torchrun_two_ranks_completes(uninterrupted):
    d, out = uninterrupted
    steps, digest = _done(out)
    assert steps == 20
    assert sorted(_steps(out)) == list(range(1, 21))  # rank 0 only: one line per step
    assert "resumed" not in out
    state = torch.load(d / "A.pt", weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert all(torch.isfinite(t).all() for t in state.values())


@pytest.mark.timeout(90)
def test_resume_is_bit_identical(uninterrupted, tmp_path):
    ref_dir, ref_out = uninterrupted
    ckpt = tmp_path / "ckpt"

    first = _run(["--steps", "10", "--ckpt-dir", str(ckpt)], cwd=tmp_path)
    assert _done(first)[0] == 10
    assert sorted(os.listdir(ckpt)) == ["checkpoint.pt"]  # no temp files left behind
    saved = torch.load(ckpt / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 10
    assert set(saved) == {"model", "optimizer", "step"}

    second = _run(["--steps", "20", "--ckpt-dir", str(ckpt), "--out", "B.pt"], cwd=tmp_path)
    assert "resumed from step 10" in second.splitlines()
    assert sorted(_steps(second)) == list(range(11, 21))
    assert torch.load(ckpt / "checkpoint.pt", weights_only=True)["step"] == 20

    # Same weights, bit for bit, and the same reported hash and losses.
    _assert_bit_identical(torch.load(ref_dir / "A.pt", weights_only=True),
                          torch.load(tmp_path / "B.pt", weights_only=True))
    assert _done(second) == _done(ref_out)
    ref_losses = _steps(ref_out)
    assert _steps(second) == {s: ref_losses[s] for s in range(11, 21)}


@pytest.mark.timeout(60)
def test_plain_python_world_of_one(tmp_path):
    out = _run(["--steps", "5", "--out", "C.pt"], cwd=tmp_path, torchrun=False)
    steps, digest = _done(out)
    assert steps == 5
    assert sorted(_steps(out)) == [1, 2, 3, 4, 5]
    state = torch.load(tmp_path / "C.pt", weights_only=True)
    h = hashlib.sha256()
    for t in state.values():
        h.update(bytes(t.contiguous().view(-1).view(torch.uint8).tolist()))
    assert h.hexdigest() == digest  # the done line hashes the saved state_dict
