"""Tests for the byte-level GPT example (examples/gpt_model.py) and its training script's helpers.

Fast (CPU, a few seconds in all): sizing, the data function, the model's shapes and causality,
bit-for-bit determinism of a seeded model, and that the loss goes down on the shipped corpus.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CORPUS = EXAMPLES / "data" / "corpus.txt"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from gpt_model import (GPT, GPTConfig, batch, config_for_params, count_params,  # noqa: E402
                       load_corpus, state_sha256)

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)

# The table in gpt_model's docstring: target -> (n_layer, n_head, n_embd, parameters).
TABLE = {
    1_000_000: (3, 5, 160, 1_030_560),
    5_000_000: (6, 4, 256, 4_902_912),
    20_000_000: (8, 7, 448, 19_601_792),
    50_000_000: (10, 10, 640, 49_646_080),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: steady timings on a busy 2-core machine, and no cross-test drift."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return load_corpus(CORPUS)


def _train(model: GPT, data: torch.Tensor, steps: int, *, batch_size: int, block_size: int,
           lr: float = 3e-4) -> list[float]:
    opt = torch.optim.AdamW(model.optim_groups(0.1), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 0, 1, batch_size, block_size)
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------------- sizing
@pytest.mark.timeout(30)
@pytest.mark.parametrize("target", sorted(TABLE))
def test_config_for_params_hits_target(target):
    cfg = config_for_params(target)
    assert abs(cfg.num_params() - target) <= 0.15 * target
    assert cfg.n_embd % cfg.n_head == 0 and cfg.n_embd // cfg.n_head in (32, 64)
    assert (cfg.block_size, cfg.vocab, cfg.dropout) == (128, 256, 0.0)
    # the documented table is what the function produces
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.num_params()) == TABLE[target]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("target", [1_000_000, 5_000_000])
@pytest.mark.parametrize("tie", [False, True])
def test_num_params_matches_the_built_model(target, tie):
    cfg = config_for_params(target, tie_weights=tie, block_size=64)
    assert count_params(GPT(cfg)) == cfg.num_params()
    assert abs(cfg.num_params() - target) <= 0.15 * target


@pytest.mark.timeout(10)
def test_config_for_params_accepts_float_and_rejects_nonpositive():
    assert config_for_params(5e6) == config_for_params(5_000_000)
    with pytest.raises(ValueError):
        config_for_params(0)


# ------------------------------------------------------------------------------------------ data
@pytest.mark.timeout(10)
def test_batch_is_a_pure_function(corpus):
    a = batch(corpus, 7, 1, 2, 4, 32)
    torch.manual_seed(123)  # the global generator plays no part
    torch.rand(10)
    b = batch(corpus, 7, 1, 2, 4, 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    assert not torch.equal(batch(corpus, 8, 1, 2, 4, 32)[0], a[0])  # another step
    assert not torch.equal(batch(corpus, 7, 0, 2, 4, 32)[0], a[0])  # another rank
    assert not torch.equal(batch(corpus, 7, 1, 2, 4, 32, seed=1)[0], a[0])  # another data seed


@pytest.mark.timeout(10)
def test_batch_shapes_targets_and_global_batch(corpus):
    x, y = batch(corpus, 3, 0, 1, 8, 128)
    assert x.shape == y.shape == (8, 128)
    assert x.dtype == y.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
    # the step's global batch does not depend on how it is split among ranks
    parts = [batch(corpus, 3, r, 4, 2, 128) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError):
        batch(corpus, 3, 2, 2, 8, 128)


# ----------------------------------------------------------------------------------------- model
@pytest.mark.timeout(10)
def test_forward_shape_and_causality():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, 256, (3, 32))
    assert model(idx).shape == (3, 32, 256)
    assert model(idx[:, :10]).shape == (3, 10, 256)  # shorter than block_size
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256  # the future must not leak into the past
    with torch.no_grad():
        assert torch.allclose(model(idx)[:, :20], model(changed)[:, :20], atol=1e-6)
        assert not torch.allclose(model(idx)[:, 20:], model(changed)[:, 20:])
    with pytest.raises(ValueError):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.timeout(20)
def test_seeded_models_train_bit_identically(corpus):
    def trained() -> dict:
        torch.manual_seed(0)
        model = GPT(TINY)
        _train(model, corpus, 3, batch_size=4, block_size=TINY.block_size)
        return model.state_dict()

    a, b = trained(), trained()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert state_sha256(a) == state_sha256(b)
    torch.manual_seed(0)
    assert state_sha256(GPT(TINY).state_dict()) != state_sha256(a)  # training did change them
    # an explicit seed gives the same weights whatever the global generator's state
    torch.manual_seed(5)
    c = GPT(TINY, seed=3).state_dict()
    torch.manual_seed(6)
    d = GPT(TINY, seed=3).state_dict()
    assert state_sha256(c) == state_sha256(d)


@pytest.mark.timeout(30)
def test_loss_decreases_on_the_corpus(corpus):
    torch.manual_seed(0)
    model = GPT(config_for_params(1_000_000, block_size=64))
    losses = _train(model, corpus, 30, batch_size=8, block_size=64, lr=1e-3)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 5.0  # about ln(256) = 5.55 at initialisation
    assert last < first - 1.0, losses


# -------------------------------------------------------------------------------- training script
def _load_train_script():
    spec = importlib.util.spec_from_file_location("train_gpt_under_test", EXAMPLES / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(20)
def test_train_script_imports_quietly_and_parses_counts():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        train = _load_train_script()
    assert out.getvalue() == ""
    assert [train.parse_count(s) for s in ("5M", "50m", "1e6", "5_000_000", "500k", "1.5M", "2.5e7")] == \
        [5_000_000, 50_000_000, 1_000_000, 5_000_000, 500_000, 1_500_000, 25_000_000]
    args = train.build_parser().parse_args([])
    assert (args.params, args.steps, args.batch_size, args.block_size, args.lr, args.seed, args.log_every) == \
        (5_000_000, 200, 8, 128, 3e-4, 0, 10)
    assert args.data == EXAMPLES / "data" / "corpus.txt"
    for bad in ("", "abc", "0", "-1M", "5X"):
        with pytest.raises(Exception):
            train.parse_count(bad)


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("tmrun.runtime") is None, reason="tmrun.runtime not written yet")
def test_train_script_world_of_one(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONUNBUFFERED"] = "1"
    out = tmp_path / "model.pt"
    cmd = [sys.executable, str(EXAMPLES / "train_gpt.py"), "--params", "1M", "--steps", "4",
           "--log-every", "2", "--block-size", "32", "--batch-size", "2", "--out", str(out), "--threads", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(r"^step (\d+) loss (\d+\.\d{4}) step_time (\d+\.\d{3})$", proc.stdout, re.M)
    assert [int(s[0]) for s in steps] == [2, 4]
    done = re.search(r"^done steps=(\d+) params=(\d+) sha256=([0-9a-f]{64})$", proc.stdout, re.M)
    assert done, proc.stdout
    cfg = config_for_params(1_000_000, block_size=32)
    assert int(done[1]) == 4 and int(done[2]) == cfg.num_params()
    saved = torch.load(out)
    assert state_sha256(saved) == done[3]


@pytest.mark.timeout(90)
def test_train_script_shares_train_on_the_same_samples_as_one_large_batch(tmp_path):
    """``--shares 4`` of 2 sequences takes the 8 windows a single rank of ``--batch-size 8`` takes:
    the same losses, to the rounding of summing 4 partial gradients."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    common = [sys.executable, str(EXAMPLES / "train_gpt.py"), "--params", "1M", "--steps", "4", "--log-every", "1",
              "--block-size", "32", "--threads", "1"]
    losses = []
    for extra in (["--batch-size", "2", "--shares", "4"], ["--batch-size", "8"]):
        proc = subprocess.run(common + extra, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        losses.append([float(x) for x in re.findall(r"^step \d+ loss (\d+\.\d{4})", proc.stdout, re.M)])
    assert len(losses[0]) == 4
    assert losses[0] == pytest.approx(losses[1], abs=2e-4)
