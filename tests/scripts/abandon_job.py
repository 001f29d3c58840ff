"""A worker for tests/test_abandon.py: a deep model under ``run.data_parallel`` whose backward a test stops.

``--die-at STEP:LAYER``: this rank SIGKILLs itself in the backward of step STEP, when the
gradient of layer LAYER (counted from the output) is computed. ``--wait-at STEP:LAYER``: there it
prints ``IN_BACKWARD`` and waits until the step is doomed (the test's fake agent sends a failure's
``prepare``), then lets the backward go on; ``--wait-in-forward STEP:LAYER`` the same in the
forward, before layer LAYER (counted from the input). Each try of a step prints one JSON line: how many
layers' gradients this rank computed, whether it committed. ``--stop-after-failure``: exit after
the first step that did not commit (a job without an agent has no next group to go to). The
final weights go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import torch
import torch.nn.functional as F

import tmrun


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--die-at", default="")
    parser.add_argument("--wait-at", default="")
    parser.add_argument("--wait-in-forward", default="")
    parser.add_argument("--stop-after-failure", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = tmrun.init()
    run.track(model=model, optimizer=opt)
    ddp = run.data_parallel(model, bucket_cap_mb=0.5)
    die = tuple(map(int, args.die_at.split(":"))) if args.die_at else None
    wait = tuple(map(int, args.wait_at.split(":"))) if args.wait_at else None
    wait_forward = tuple(map(int, args.wait_in_forward.split(":"))) if args.wait_in_forward else None
    computed = [0]
    first_try = {"open": False}

    def wait_for_doom(where: str) -> None:
        first_try["open"] = False
        print(where, flush=True)
        deadline = time.monotonic() + 60
        while not run._doomed() and time.monotonic() < deadline:
            threading.Event().wait(0.005)  # until the reader thread has seen the prepare

    def counter(depth: int):
        def hook(grad: torch.Tensor) -> None:
            computed[0] += 1
            here = (run.step, depth)
            if die == here and run.generation <= 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if wait == here and first_try["open"]:
                wait_for_doom("IN_BACKWARD")
        return hook

    def in_forward(position: int):
        def hook(module: torch.nn.Module, inputs: tuple) -> None:
            if wait_forward == (run.step, position) and first_try["open"]:
                wait_for_doom("IN_FORWARD")
        return hook

    for position, layer in enumerate(layers, start=1):
        layer.register_forward_pre_hook(in_forward(position))

    for depth, layer in enumerate(reversed(layers), start=1):
        layer.weight.register_hook(counter(depth))
    tried: dict[int, int] = {}
    for step in run.steps(total=args.steps):
        tried[step] = tried.get(step, 0) + 1
        first_try["open"] = tried[step] == 1
        generator = torch.Generator().manual_seed(1000 + step * 10 + run.rank)
        x = torch.randn(args.batch, args.width, generator=generator)
        computed[0] = 0
        started = time.monotonic()
        out = ddp(x)
        hollow = bool((out == 0).all())  # the forward after the doom answered zeros
        run.backward(F.mse_loss(out, torch.zeros_like(x)))
        backward_s = time.monotonic() - started
        committed = run.commit()
        if committed:
            opt.step()
        opt.zero_grad()
        print(json.dumps({"step": step, "try": tried[step], "rank": run.rank, "gen": run.generation,
                          "layers": computed[0], "hollow": hollow, "committed": committed, "backward_s": round(backward_s, 4),
                          "abandoned": run._guard.abandoned, "error": str(run.step_error or "")[:200]}), flush=True)
        if not committed and args.stop_after_failure:
            os._exit(0)  # no agent, no next generation: the old group cannot be used again
    if run.rank == 0:
        torch.save(model.state_dict(), args.out)
    run.finish()


if __name__ == "__main__":
    main()
