"""Train the byte-level GPT of ``gpt_model.py`` with torch's FSDP2 (``fully_shard``), or HSDP with ``--hsdp``.

Written the torch way: each transformer block and then the whole model go through torch's own
``fully_shard`` on a ``DeviceMesh``, and torch's own collectives shard the parameters, gradients
and optimizer state. What tmrun adds, against a torchrun FSDP2 script (docs/native.md):

- ``run = tmrun.init()`` instead of ``init_process_group``;
- the mesh from ``run.device_mesh(...)`` instead of ``init_device_mesh(...)``: its groups survive
  a hot swap (their transport is replaced at a switch, torch's FSDP2 does not notice);
- ``run.track(model=..., optimizer=...)``: tmrun reads off the DTensors which state is
  replicated where (FSDP2: nowhere; HSDP: over the replicate dimension);
- the loop over ``run.steps(total)``, with ``opt.step()`` only when ``run.commit()`` says every
  rank's step counts.

The model code is unchanged. ``--hsdp``: a (2, world/2) mesh, ("replicate", "shard"); after a
SIGKILL a joiner takes the lost rank's shard from its replica, without a restart. Plain FSDP2
shards have no replica: a drain hands the leaver's shard over, a SIGKILL restarts the job.

Run it under torchrun (``torchrun --nproc-per-node 4 examples/train_gpt_fsdp.py --hsdp``) or
tmrun (``tmrun --nnodes 4 --standby 1 examples/train_gpt_fsdp.py --hsdp``). The sharded dimensions
(256 bytes of vocabulary, the block size, multiples of ``n_embd``) must divide by the shard
group's size for a standby to take any rank. Output (rank 0)::

    model n_layer=... params=... world_size=4 mesh=(2, 2)
    step {step} loss {loss:.4f} step_time {seconds:.3f}
    done steps={N} params={count} sha256={hex}
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # so that ``gpt_model`` imports when this file is loaded by path
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import tmrun  # noqa: E402
from gpt_model import (BETAS, EPS, GPT, VOCAB, WEIGHT_DECAY, add_training_args, append_record, batch,  # noqa: E402
                       config_for_params, count_params, load_corpus, positive_int, state_sha256)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(p)
    p.add_argument("--hsdp", action="store_true", help="HSDP: a (2, world/2) mesh, replicate x shard")
    p.add_argument("--out", type=Path, default=None, help="rank 0 saves the final (gathered) state_dict here")
    p.add_argument("--log-every", type=positive_int, default=10, help="log every N steps (default 10)")
    p.add_argument("--ckpt-dir", type=Path, default=None,
                   help="each rank saves its shards to DIR/rank<R>.pt every --ckpt-every steps and resumes from them "
                   "(what a torchrun job needs to survive a restart; tmrun's hot swap does not)")
    p.add_argument("--ckpt-every", type=positive_int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument("--step-log", type=Path, default=None,
                   help="rank 0 appends one JSON line per committed step (bench/), every rank one at the end")
    return p


def _local(state):
    """A state_dict with every DTensor replaced by this rank's shard (what this rank saves)."""
    if hasattr(state, "to_local"):
        return state.to_local()
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_local(v) for v in state]
    return state


def save_shards(model, opt, step: int, path: Path) -> None:
    """This rank's shards of the model and optimizer, and the step (loaded with weights_only=True)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({"model": _local(model.state_dict()), "optimizer": _local(opt.state_dict()), "step": step}, tmp)
    os.replace(tmp, path)


def load_shards(model, opt, path: Path) -> int:
    """The reverse of :func:`save_shards`: shards back into the model, the optimizer's state as
    DTensors placed like their parameters; the step to resume from."""
    from torch.distributed.tensor import DTensor

    saved = torch.load(path, map_location="cpu", weights_only=True)
    with torch.no_grad():
        for name, value in model.state_dict().items():
            value.to_local().copy_(saved["model"][name])
    params = [p for group in opt.param_groups for p in group["params"]]
    state = saved["optimizer"]
    for index, entries in state["state"].items():
        param = params[int(index)]
        for key, value in entries.items():
            if value.dim() and isinstance(param, DTensor):
                entries[key] = DTensor.from_local(value, param.device_mesh, param.placements,
                                                  shape=param.shape, stride=param.stride())
    opt.load_state_dict(state)
    return int(saved["step"])




def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    data = load_corpus(args.data)
    cfg = config_for_params(args.params, block_size=args.block_size)

    run = tmrun.init()
    world = run.world_size
    if args.hsdp and world % 2:
        raise SystemExit(f"--hsdp needs an even number of ranks, not {world}")
    shape, names = ((2, world // 2), ("replicate", "shard")) if args.hsdp else ((world,), ("shard",))
    mesh = run.device_mesh(shape, names)
    log = print if run.is_main else (lambda *a, **k: None)

    torch.manual_seed(args.seed)  # same init on every rank: each keeps its shard of it
    model = GPT(cfg)
    n_params = count_params(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.optim_groups(WEIGHT_DECAY), lr=args.lr, betas=BETAS, eps=EPS)
    run.track(model=model, optimizer=opt)
    ckpt = args.ckpt_dir / f"rank{run.rank}.pt" if args.ckpt_dir is not None and run.role != "standby" else None
    if ckpt is not None and ckpt.exists():
        run.step = load_shards(model, opt, ckpt)
        log(f"resumed from step {run.step}", flush=True)
    log(f"model n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"params={n_params} world_size={world} mesh={shape}", flush=True)

    since, t_last = 0, time.perf_counter()
    for step in run.steps(total=args.steps):
        x, y = batch(data, step, run.rank, world, args.batch_size, cfg.block_size, seed=args.seed)
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        loss.backward()
        log_now = (step + 1) % args.log_every == 0 or step + 1 == args.steps
        mean_loss = run.all_reduce(loss.detach().reshape(1).clone(), op="mean") if log_now else None
        committed = run.commit()
        if committed:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if not committed:
            continue
        since += 1
        if run.is_main:
            append_record(args.step_log, {"step": step + 1, "rank": run.rank, "pid": os.getpid(), "world": world,
                                          "gen": run.generation})
        if ckpt is not None and ((step + 1) % args.ckpt_every == 0 or step + 1 == args.steps):
            save_shards(model, opt, step + 1, ckpt)
        if log_now:
            now = time.perf_counter()
            log(f"step {step + 1} loss {mean_loss.item():.4f} step_time {(now - t_last) / since:.3f}", flush=True)
            since, t_last = 0, now

    if run.role == "standby":  # shadow iterations only: nobody promoted this standby
        return 0
    append_record(args.step_log, {"event": "done", "rank": run.rank, "pid": os.getpid(),
                                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    final = {k: v.full_tensor().detach() for k, v in model.state_dict().items()}  # a collective: every rank
    if run.is_main:
        if args.out is not None:
            torch.save(final, args.out)
        log(f"done steps={args.steps} params={n_params} sha256={state_sha256(final)}", flush=True)
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
