"""A small, deterministic, byte-level GPT for the tmrun examples.

The model is a plain pre-LayerNorm decoder-only transformer over bytes (vocabulary 256):

    token embedding + learned position embedding
    -> n_layer x [x + attn(ln_1(x)); x + mlp(ln_2(x))]
    -> final LayerNorm -> linear head (untied by default; ``tie_weights=True`` shares the
       token embedding)

Attention is ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``; the MLP
is 4x wide with GELU. Weights are initialised GPT-2 style (normal(0, 0.02), residual projections
scaled by 1/sqrt(2 * n_layer), zero biases, unit LayerNorms). Nothing here draws randomness
outside a seeded generator: the model is always initialised on the CPU (from the global
generator, which the caller seeds with ``torch.manual_seed``, or from ``GPT(cfg, seed=...)``)
and then moved to ``device``, so the initial weights are the same on every rank and every
device; dropout is 0 by default, and :func:`batch` draws its offsets from a generator seeded by
the step alone.

Model sizes
-----------
:func:`config_for_params` picks ``(n_layer, n_embd)`` for a target parameter count:
``n_embd`` is a multiple of 32, heads are 64 wide when ``n_embd`` is a multiple of 64 and 32 wide
otherwise, and the choice minimises ``|log(count / target)| + 0.1 * |log(n_layer / L*)|`` with
the preferred depth ``L* = 4 + log2(target / 1M)`` (at least 1). With the defaults
(``block_size=128``, untied head, vocab 256) it produces:

    ========== ======= ====== ======= ============ =========
    target     n_layer n_head n_embd  parameters   vs target
    ========== ======= ====== ======= ============ =========
     1,000,000       3      5     160    1,030,560     +3.1%
     5,000,000       6      4     256    4,902,912     -1.9%
    20,000,000       8      7     448   19,601,792     -2.0%
    50,000,000      10     10     640   49,646,080     -0.7%
    ========== ======= ====== ======= ============ =========

The count is ``(vocab + block_size) * d + n_layer * (12 d^2 + 13 d) + 2 d (+ vocab * d untied)``
(:meth:`GPTConfig.num_params`), so a different ``block_size`` shifts it slightly.

Data
----
:func:`batch` is a pure function of ``(step, rank, world_size)`` (plus the sizes and an optional
data seed): a CPU ``torch.Generator`` seeded from a SHA-256 of ``(seed, step)`` draws the offsets
of the whole global batch (``world_size * batch_size`` windows) and each rank takes its own slice.
A retried step therefore sees exactly the same data, and the global batch of a step does not
depend on how it is split among ranks.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import math
import os
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


@dataclasses.dataclass
class GPTConfig:
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 128
    vocab: int = VOCAB
    dropout: float = 0.0
    tie_weights: bool = False

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if min(self.n_layer, self.n_head, self.n_embd, self.block_size, self.vocab) < 1:
            raise ValueError(f"every size must be positive: {self}")

    def num_params(self) -> int:
        """The model's parameter count (shared weights counted once), without building it."""
        d = self.n_embd
        per_block = 12 * d * d + 13 * d  # ln_1 2d, qkv 3d^2+3d, proj d^2+d, ln_2 2d, mlp 8d^2+5d
        head = 0 if self.tie_weights else self.vocab * d
        return (self.vocab + self.block_size) * d + self.n_layer * per_block + 2 * d + head


def _heads(n_embd: int) -> int:
    return n_embd // 64 if n_embd % 64 == 0 else n_embd // 32


def config_for_params(target_params: int, *, block_size: int = 128, tie_weights: bool = False,
                      dropout: float = 0.0) -> GPTConfig:
    """A config whose parameter count is close to ``target_params`` (see the module docstring)."""
    target = int(target_params)
    if target < 1:
        raise ValueError(f"target_params must be positive, got {target_params!r}")
    preferred_depth = max(1.0, 4.0 + math.log2(target / 1e6))
    best: tuple[float, int, int] | None = None
    for n_layer in range(1, 49):
        for n_embd in range(32, 8193, 32):
            cfg = GPTConfig(n_layer, _heads(n_embd), n_embd, block_size, VOCAB, dropout, tie_weights)
            cost = abs(math.log(cfg.num_params() / target)) + 0.1 * abs(math.log(n_layer / preferred_depth))
            if best is None or cost < best[0]:
                best = (cost, n_layer, n_embd)
    assert best is not None
    _, n_layer, n_embd = best
    return GPTConfig(n_layer, _heads(n_embd), n_embd, block_size, VOCAB, dropout, tie_weights)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level GPT; ``forward(idx[B, T] of int64) -> logits[B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig, device: torch.device | str | None = None,
                 seed: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters(None if seed is None else torch.Generator().manual_seed(seed))
        if device is not None:
            self.to(device)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 initialisation, drawn on the CPU from ``generator`` (default: the global one)."""
        std = 0.02
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.head and self.cfg.tie_weights:
                    continue
                s = resid_std if name.endswith(".proj") else std
                _normal_(module.weight, s, generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                _normal_(module.weight, std, generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        return count_params(self)

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """AdamW parameter groups: decay matrices and embeddings, not biases or LayerNorm gains."""
        decay, no_decay = [], []
        for p in self.parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]


def _normal_(tensor: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    if tensor.device.type == "cpu":
        tensor.normal_(0.0, std, generator=generator)
    else:  # only reached when reset_parameters() is called again after .to(device)
        tensor.copy_(torch.empty(tensor.shape, dtype=tensor.dtype).normal_(0.0, std, generator=generator))


def count_params(model: nn.Module) -> int:
    """Parameters of ``model``, shared ones counted once."""
    return sum(p.numel() for p in model.parameters())


def append_record(path: Path | None, record: dict) -> None:
    """One JSON line (``{"v": 1, "t": unix time, **record}``) appended to ``path`` in one write(2)
    with O_APPEND, so that lines of several processes never interleave (the scripts' step logs)."""
    if path is None:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({"v": 1, "t": time.time(), **record}) + "\n").encode())
    finally:
        os.close(fd)


def load_corpus(path: str | Path) -> torch.Tensor:
    """The bytes of ``path`` as a 1-D uint8 CPU tensor (the token stream)."""
    raw = Path(path).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def step_seed(step: int, seed: int = 0) -> int:
    """A 63-bit generator seed derived from ``(seed, step)`` only (stable across processes)."""
    digest = hashlib.sha256(f"tmrun-gpt-batch:{int(seed)}:{int(step)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def batch(data: torch.Tensor, step: int, rank: int, world_size: int, batch_size: int, block_size: int,
          *, seed: int = 0, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(x, y)`` int64 pair ``[batch_size, block_size]`` that ``rank`` trains on at ``step``.

    A pure function of its arguments: the offsets of all ``world_size * batch_size`` windows of
    the step come from a CPU generator seeded with :func:`step_seed`, and the rank takes rows
    ``rank * batch_size : (rank + 1) * batch_size``. ``y`` is ``x`` shifted by one byte.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    if data.dim() != 1 or data.numel() <= block_size:
        raise ValueError(f"need a 1-D token tensor longer than block_size={block_size}, got {tuple(data.shape)}")
    gen = torch.Generator().manual_seed(step_seed(step, seed))
    offsets = torch.randint(0, data.numel() - block_size, (world_size * batch_size,), generator=gen)
    offsets = offsets[rank * batch_size:(rank + 1) * batch_size]
    windows = data.cpu()[offsets[:, None] + torch.arange(block_size + 1)].long()
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def state_sha256(state_dict) -> str:
    """SHA-256 over the raw bytes of every tensor of ``state_dict``, in order.

    The bytes are read straight from each tensor's memory (no numpy: the base install has none).
    """
    h = hashlib.sha256()
    for t in state_dict.values():
        t = t.detach().cpu().contiguous()
        if t.numel():
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


# ---------------------------------------------------------------------------- training flags
# What every GPT training script of this repository shares (the tmrun example and the
# benchmarks' competitors), so that they train the same model the same way.

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
_COUNT_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([kmgb]?)$")


def parse_count(text: str) -> int:
    """``5M``, ``50m``, ``1e6``, ``5_000_000``, ``500k``, ``1.5M`` -> an int (> 0)."""
    s = str(text).strip().lower().replace("_", "").replace(",", "")
    m = _COUNT_RE.match(s)
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 5M, 50M, 1e6, 5000000)")
    value = round(float(m.group(1)) * _SUFFIX[m.group(2)])
    if value < 1:
        raise argparse.ArgumentTypeError(f"parameter count must be positive: {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The model, data and optimizer flags every GPT training script takes."""
    p.add_argument("--params", type=parse_count, default=5_000_000,
                   help="target parameter count, e.g. 1M, 5M, 50M, 1e6 (default 5M)")
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--block-size", type=positive_int, default=128, help="context length in bytes (default 128)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate, constant (default 3e-4)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="training text (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default 0: leave torch's choice)")


__all__ = ["append_record", "parse_count", "positive_int", "add_training_args", "BETAS", "EPS", "WEIGHT_DECAY", "DEFAULT_DATA", "GPTConfig", "GPT", "config_for_params", "count_params", "batch", "load_corpus",
           "step_seed", "state_sha256", "VOCAB"]
