"""A batch-invariant training job on the tmrun runtime, for elastic tests (tests/test_e2e_elastic.py).

Usage: python elastic_job.py OUT.pt [--steps N] [--shares K] [--step-time S] [--hold-from N --gate FILE]

Every step trains on the same K shares whatever the number of ranks (``run.shares``). Each rank
prints one JSON line per committed step: the step, its generation and world size, the shares it
took, the sum of their losses and its pid; rank 0 saves the weights at the end. With
``--hold-from N --gate FILE`` the steps from N on are slower until FILE exists (gate.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

import gate
import tmrun


def emit(event: dict) -> None:
    """One JSON line in one write(2), so that lines of ranks sharing a pipe never interleave."""
    os.write(1, (json.dumps(event) + "\n").encode())


def batch(step: int, share: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one share of one step: fixed by the two numbers, not by the rank."""
    g = torch.Generator().manual_seed(7919 * step + share)
    x = torch.randn(4, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--shares", type=int, default=12)
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step (pacing)")
    gate.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = tmrun.init()
    run.track(model=model, optimizer=opt)
    ddp = run.data_parallel(model)
    for step in run.steps(total=args.steps):
        taken, loss_sum = [], 0.0
        for share in run.shares(args.shares, ddp=ddp):
            x, y = batch(step, share.index)
            loss = F.mse_loss(ddp(x), y)
            (loss * share.weight).backward()
            taken.append(share.index)
            loss_sum += loss.item()
        pause = gate.pause(args, step)
        if pause:
            time.sleep(pause)  # workload, so that a test can act while the job runs
        if run.commit():
            opt.step()
            if run.role == "active":
                emit({"step": step, "gen": run.generation, "world": run.world_size, "rank": run.rank,
                      "shares": taken, "loss_sum": loss_sum, "pid": os.getpid()})
        opt.zero_grad()
    if run.is_main:
        torch.save(model.state_dict(), args.out)
    run.finish()


if __name__ == "__main__":
    main()
