"""The GPT of ``examples/train_gpt.py`` as a plain torchrun script: the torchrun competitor.

No tmrun here: ``torch.distributed.init_process_group("gloo")`` from the launcher's environment,
``torch.nn.parallel.DistributedDataParallel``, and the only recovery torchrun offers, a
checkpoint that every (re)started worker reloads. Everything that decides the weights is taken
from ``train_gpt.py``: the model config (``config_for_params``), the seeding, AdamW with the same
hyperparameters and ``optim_groups``, and the batch of a step, a pure function of
``(step, rank, world_size)`` (``gpt_model.batch``). An uninterrupted run therefore ends with the
same ``sha256`` as ``train_gpt.py`` under the same world size, and so does a run that was killed
and resumed from a checkpoint (model, optimizer and step are all that the rest depends on)::

    torchrun --standalone --nproc-per-node 2 bench/competitors/torchrun_gpt.py --params 1M --steps 20

Extra flags:

- ``--ckpt-dir DIR --ckpt-every N``: rank 0 writes ``DIR/checkpoint.pt`` = {model, optimizer,
  step} after every N-th committed step and after the last one (temp file, fsync, os.replace);
  on start every rank loads it with ``torch.load(..., weights_only=True)`` if it exists and
  resumes at its step.
- ``--step-log PATH``: rank 0 appends one JSON line per committed step (one ``write`` on an
  ``O_APPEND`` descriptor, so lines from successive workers never interleave)::

      {"v": 1, "t": <time.time()>, "step": <committed steps, 1-based>, "pid": <pid>,
       "world": <world size>, "loss": <mean loss over ranks>, "restart": <TORCHELASTIC_RESTART_COUNT>}

  plus ``{"v": 1, "t": ..., "event": "started", ...}`` right after ``init_process_group`` and
  ``{"v": 1, "t": ..., "event": "loaded", "step": N, ...}`` after loading a checkpoint.
  ``restart`` is this agent's restart count: an agent that restarts its workers because another
  node rejoined (not because its own worker failed) does not count it, so tell generations
  apart by ``pid`` or by the ``started`` events.

Output (rank 0, flushed) is that of ``train_gpt.py``: a ``model ...`` line, ``step N loss L
step_time T`` every ``--log-every`` steps, and ``done steps=N params=P sha256=H``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from gpt_model import (GPT, VOCAB, add_training_args, batch, config_for_params, count_params,  # noqa: E402
                       load_corpus, positive_int, state_sha256)

BETAS = (0.9, 0.95)  # as in examples/train_gpt.py
EPS = 1e-8
WEIGHT_DECAY = 0.1
CKPT_NAME = "checkpoint.pt"

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(p)
    p.add_argument("--out", type=Path, default=None, help="rank 0 saves the final model state_dict here")
    p.add_argument("--log-every", type=positive_int, default=10, help="log every N steps (default 10)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint directory (default: none)")
    p.add_argument("--ckpt-every", type=positive_int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument("--step-log", type=Path, default=None, help="rank 0 appends a JSON line per committed step")
    return p


def atomic_save(obj, path: Path) -> None:
    """``torch.save`` to a temp file next to ``path``, fsync, ``os.replace``: readers see old or new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sum_then_divide(world, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP communication hook: all-reduce the gradient bucket (sum), then divide by the world size.

    torch's built-in hook divides first and sums after; tmrun's DDP sums first. The two agree to
    the bit only when the world size is a power of two, so this hook (the same gloo all-reduce,
    the same buckets) keeps the results identical to ``train_gpt.py`` for any world size.
    """
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


class StepLog:
    """Appends whole JSON lines to a file shared by every generation of workers (rank 0 only)."""

    def __init__(self, path: Path | None) -> None:
        self.fd = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **fields) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps({"v": 1, "t": time.time(), **fields}) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)

    data = load_corpus(args.data)
    cfg = config_for_params(args.params, block_size=args.block_size)

    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    main_rank = rank == 0
    log = print if main_rank else (lambda *a, **k: None)
    steplog = StepLog(args.step_log if main_rank else None)
    steplog.write(event="started", pid=os.getpid(), world=world, restart=restart)

    torch.manual_seed(args.seed)  # same init on every rank
    model = GPT(cfg)
    n_params = count_params(model)
    opt = torch.optim.AdamW(model.optim_groups(WEIGHT_DECAY), lr=args.lr, betas=BETAS, eps=EPS)

    start = 0
    ckpt_path = args.ckpt_dir / CKPT_NAME if args.ckpt_dir is not None else None
    if ckpt_path is not None and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start = int(ckpt["step"])
        del ckpt
    starts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(starts, torch.tensor([start]))  # every rank resumes at the same step
    if len({int(s) for s in starts}) != 1:
        raise RuntimeError(f"ranks loaded checkpoints at different steps: {[int(s) for s in starts]}")
    if start:
        steplog.write(event="loaded", step=start, pid=os.getpid(), world=world, restart=restart)
        log(f"resumed from step {start}", flush=True)

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(world, sum_then_divide)
    log(f"model n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"params={n_params} world_size={world}", flush=True)

    ddp.train()
    since, t_last = 0, time.perf_counter()
    for step in range(start, args.steps):
        x, y = batch(data, step, rank, world, args.batch_size, cfg.block_size, seed=args.seed)
        logits = ddp(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        since += 1
        log_now = done % args.log_every == 0 or done == args.steps
        if log_now or args.step_log is not None:  # the same decision on every rank
            mean_loss = loss.detach().float().reshape(1).clone()
            dist.all_reduce(mean_loss)
            mean_loss = mean_loss.div_(world).item()
            steplog.write(step=done, pid=os.getpid(), world=world, loss=mean_loss, restart=restart)
        if log_now:
            now = time.perf_counter()
            log(f"step {done} loss {mean_loss:.4f} step_time {(now - t_last) / since:.3f}", flush=True)
            since, t_last = 0, now
        if main_rank and ckpt_path is not None and (done % args.ckpt_every == 0 or done == args.steps):
            atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done}, ckpt_path)

    final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if main_rank:
        if args.out is not None:
            atomic_save(final, args.out)
        log(f"done steps={args.steps} params={n_params} sha256={state_sha256(final)}", flush=True)
    steplog.close()
    dist.barrier()  # rank 0 may host the store: nobody leaves while a peer still needs it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
