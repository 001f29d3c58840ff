"""A plain torchrun DDP script (no tmrun runtime) in which rank 1 can block forever in a collective.

Usage: python hang_job.py OUT.pt [--steps N] [--hang-at STEP --hang-once MARKER] [--busy S] [--heartbeat]

- ``--hang-at K``: in step K rank 1 waits in ``dist.recv`` for a message nobody sends (gloo's
  timeout is torch's default, 30 minutes), once per job (``--hang-once``: only while MARKER does
  not exist; it is created). Rank 0 first works ``--busy`` seconds on its own (CPU, printing,
  like an evaluation on rank 0), then waits for rank 1 in the step's gradient all-reduce.
- ``--heartbeat``: ``tmrun.heartbeat()`` once per step and during rank 0's work.

No checkpoint: a restarted job trains from step 0 again, so it ends with the weights of an
uninterrupted run. Rank 0 saves them to OUT.pt. Each rank prints ``rank R step K`` per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tmrun


def busy(seconds: float, beat: bool) -> None:
    """Compute (CPU) for ``seconds``, printing now and then: a rank doing work of its own."""
    end = time.monotonic() + seconds
    x = torch.randn(64, 64)
    while time.monotonic() < end:
        for _ in range(50):
            x = torch.tanh(x @ x.T / 64)
        print(f"rank 0 working, {end - time.monotonic():.0f} s left", flush=True)
        if beat:
            tmrun.heartbeat()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--hang-once", default="")
    p.add_argument("--busy", type=float, default=0.0)
    p.add_argument("--heartbeat", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                                        torch.nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    hang = args.hang_at >= 0 and not os.path.exists(args.hang_once)  # every rank reads it before anyone writes it
    dist.barrier()
    if hang and rank == 1:
        open(args.hang_once, "w").close()
    for step in range(args.steps):
        if hang and step == args.hang_at:
            if rank == 1:
                print(f"rank 1 hangs in step {step}", flush=True)
                dist.recv(torch.zeros(1), src=0, tag=777)  # nobody sends: blocks
            else:
                busy(args.busy, args.heartbeat)
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(8, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :4].cos())
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step}", flush=True)
        if args.heartbeat:
            tmrun.heartbeat()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, args.out)
    dist.barrier()
    dist.destroy_process_group()
    # DDP keeps the gloo group alive past destroy_process_group, and a gloo thread that releases
    # a tensor while the interpreter finalizes aborts the process (examples/train_ddp.py, exit_now).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
