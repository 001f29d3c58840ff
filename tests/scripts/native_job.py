"""Torch-native parallelism on the runtime's groups, for tests/test_native.py and the e2e tests.

Usage: python native_job.py OUT.pt --mode ddp|fsdp|hsdp [--steps N] [--torch] [--step-time S] [--exit-at S:R]
       [--exit-once MARKER] [--hold-from N --gate FILE] (steps from N on are slower until FILE exists: gate.py)

- ``--mode ddp``: ``DistributedDataParallel(model, process_group=...)``;
- ``--mode fsdp``: ``fully_shard`` on a 1-D mesh (each rank holds its own shard of everything);
- ``--mode hsdp``: ``fully_shard`` on a (2, world/2) mesh, replicate × shard.

With ``--torch`` the script is plain torch (``init_process_group("gloo")``, ``init_device_mesh``)
and must run under torchrun: the reference. Without it the groups come from tmrun's runtime
(``run.process_group``, ``run.device_mesh``) and the loop is ``run.steps``/``run.commit``; nothing
else differs. Prints one JSON line per step ({"step", "committed", "rank", "pid", "gen"}); rank
0 saves the full weights (FSDP's shards gathered) to OUT.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import gate
import tmrun


def emit(event: dict) -> None:
    os.write(1, (json.dumps(event) + "\n").encode())


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :4].sin()


def build(mode: str, group, mesh_of) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, list]:
    """The model (identical on every rank), the module to call, the optimizer, and the groups it uses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, process_group=group)
        return model, wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2), [group]
    from torch.distributed.fsdp import fully_shard

    world = group.size()
    mesh = mesh_of((world,), ("shard",)) if mode == "fsdp" else mesh_of((2, world // 2), ("replicate", "shard"))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    return model, model, torch.optim.AdamW(model.parameters(), lr=1e-2), groups


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def first_time(marker: str) -> bool:
    """True unless ``marker`` names a file that exists; creates it (a fault that happens once per job)."""
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=("ddp", "fsdp", "hsdp"), required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--torch", action="store_true", help="plain torch under torchrun: the reference")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step (pacing)")
    parser.add_argument("--exit-at", default="", help="STEP:RANK: SIGKILL itself in that step, before backward")
    parser.add_argument("--exit-once", default="", help="with --exit-at: only if this file does not exist (it is created)")
    gate.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.torch:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model, call, opt, _ = build(args.mode, dist.group.WORLD,
                                 lambda shape, names: init_device_mesh("cpu", shape, mesh_dim_names=names))
        for step in range(args.steps):
            x, y = batch(step, rank)
            F.mse_loss(call(x), y).backward()
            opt.step()
            opt.zero_grad()
        weights = full_weights(model)
        if rank == 0:
            torch.save(weights, args.out)
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)  # see runtime_job.py: torch 2.13's teardown at exit hangs now and then

    run = tmrun.init()
    model, call, opt, groups = build(args.mode, run.process_group, run.device_mesh)
    run.track(model=model, optimizer=opt)
    for step in run.steps(total=args.steps):
        x, y = batch(step, run.rank)
        pace = gate.pause(args, step)
        if pace:
            time.sleep(pace)  # pacing: a step's compute, so that faults land inside the run
        loss = F.mse_loss(call(x), y)
        if args.exit_at == f"{step}:{run.rank}" and first_time(args.exit_once):
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        committed = run.commit()
        if committed:
            opt.step()
        opt.zero_grad()
        emit({"step": step, "committed": committed, "rank": run.rank, "pid": os.getpid(), "gen": run.generation,
              "role": run.role})
    if run.role == "standby":  # no agent promoted it: what its shadow iterations did
        emit({"standby": True, "sandboxed": all(g.sandboxed for g in groups), "answered": [g.answered for g in groups]})
        return
    weights = full_weights(model)
    if run.rank == 0:
        torch.save(weights, args.out)
    emit({"done": True, "rank": run.rank, "pid": os.getpid(), "swaps": run.swaps})
    run.finish()


if __name__ == "__main__":
    main()
