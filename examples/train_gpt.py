"""Train the byte-level GPT of ``gpt_model.py`` on ``examples/data/corpus.txt`` with the tmrun runtime.

Unlike ``train_ddp.py`` this script is written *for* tmrun: it calls ``tmrun.init()``, registers
the model and optimizer with ``run.track`` (the state that moves with a rank when a standby takes
over), trains through ``run.data_parallel`` (DDP whose gradient all-reduce goes over tmrun's
group) and lets ``run.steps`` drive the loop, applying the optimizer step only when
``run.commit()`` says every rank agrees the step counts. A step that does not commit is yielded
again with the same index and therefore the same data: the batch is a pure function of
``(step, rank, world_size)`` (see ``gpt_model.batch``).

With ``--shares K`` every step trains on the same ``K`` batches whatever the number of ranks
(``run.shares``: an elastic job that shrinks and grows sees the same samples per step as one that
never changed size; ``K`` at least the largest world size).

Run it as a world of one::

    python examples/train_gpt.py --params 1M --steps 50

or under the launcher, e.g. ``tmrun ... examples/train_gpt.py --params 5M``.

Output (rank 0 only, flushed)::

    model n_layer=6 n_head=4 n_embd=256 block_size=128 params=4902912 world_size=2
    step {step} loss {loss:.4f} step_time {seconds:.3f}
    ...
    done steps={N} params={count} sha256={hex}

With ``--step-log PATH`` the main rank also appends one JSON line per committed step to PATH
(``{"v": 1, "t": unix_time, "step": committed_steps, "rank", "pid", "world", "gen"}``) and every
rank a final ``{"v": 1, "t", "event": "done", "rank", "pid", "maxrss_kb"}``; the benchmarks in
``bench/`` read these.

``step`` counts committed optimizer steps (1-based), printed every ``--log-every`` steps and at the
last one; ``loss`` is that step's batch loss averaged over ranks; ``step_time`` is the mean wall
time per committed step since the previous line (failed tries included). ``sha256`` covers the
bytes of every tensor of the final model state_dict, in order. With ``--out`` rank 0 saves that
state_dict with ``torch.save``.

Determinism: every rank seeds ``torch.manual_seed(--seed)`` before building the model (the
initial weights are drawn on the CPU, so they do not depend on the device),
``torch.use_deterministic_algorithms(True, warn_only=True)`` is on, AdamW has fixed
hyperparameters and a constant learning rate, and dropout is 0. Results on the CPU can depend on
the number of intra-op threads; ``--threads N`` pins it.
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

import tmrun  # noqa: E402
from gpt_model import (BETAS, EPS, GPT, VOCAB, WEIGHT_DECAY, add_training_args, append_record, batch,  # noqa: E402
                       config_for_params, count_params, load_corpus, parse_count, positive_int, state_sha256)

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(p)
    p.add_argument("--out", type=Path, default=None, help="rank 0 saves the final model state_dict here")
    p.add_argument("--log-every", type=positive_int, default=10, help="log every N steps (default 10)")
    p.add_argument("--shares", type=int, default=0,
                   help="batch-invariant steps for elastic jobs: each step trains on SHARES batches of "
                   "--batch-size sequences, split over whatever ranks there are (run.shares); at least the "
                   "largest world size. Default 0: --batch-size sequences per rank, drawn per rank")
    p.add_argument("--step-log", type=Path, default=None,
                   help="append one JSON line per committed step here (main rank), and one per rank at the end")
    return p




def _save(state: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, if on a GPU
    torch.use_deterministic_algorithms(True, warn_only=True)

    data = load_corpus(args.data)
    cfg = config_for_params(args.params, block_size=args.block_size)

    run = tmrun.init()
    device = torch.device(getattr(run, "device", None) or "cpu")
    log = print if run.is_main else (lambda *a, **k: None)

    torch.manual_seed(args.seed)  # same init on every rank
    model = GPT(cfg, device=device)
    n_params = count_params(model)
    opt = torch.optim.AdamW(model.optim_groups(WEIGHT_DECAY), lr=args.lr, betas=BETAS, eps=EPS)
    run.track(model=model, optimizer=opt)
    ddp = run.data_parallel(model)
    log(f"model n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"params={n_params} world_size={run.world_size}", flush=True)

    ddp.train()
    since, t_last = 0, time.perf_counter()
    for step in run.steps(total=args.steps):
        if args.shares:  # the same samples at any world size: a fixed global batch of shares
            loss = torch.zeros((), device=device)
            for share in run.shares(args.shares, ddp=ddp):
                x, y = batch(data, step, share.index, share.count, args.batch_size, cfg.block_size,
                             seed=args.seed, device=device)
                part = F.cross_entropy(ddp(x).view(-1, VOCAB), y.view(-1)) * share.weight
                run.backward(part)  # loss.backward(), stopped at once if the step can no longer commit
                loss += part.detach()  # averaged over the ranks below: the step's mean loss
        else:
            x, y = batch(data, step, run.rank, run.world_size, args.batch_size, cfg.block_size,
                         seed=args.seed, device=device)
            logits = ddp(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
            run.backward(loss)
        log_now = (step + 1) % args.log_every == 0 or step + 1 == args.steps
        mean_loss = None
        if log_now:  # a collective of the step itself: it precedes the vote like the gradient all-reduce
            mean_loss = run.all_reduce(loss.detach().float().reshape(1).cpu().clone(), op="mean")
        if run.commit():  # all ranks agree the step counts; False: it is yielded again
            opt.step()
            committed = True
        else:
            committed = False
        opt.zero_grad(set_to_none=True)
        if not committed:
            continue
        since += 1
        if run.is_main:
            append_record(args.step_log, {"step": step + 1, "rank": run.rank, "pid": os.getpid(),
                                          "world": run.world_size, "gen": run.generation})
        if log_now:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            log(f"step {step + 1} loss {mean_loss.item():.4f} step_time {(now - t_last) / since:.3f}", flush=True)
            since, t_last = 0, now

    final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if run.is_main:
        if args.out is not None:
            _save(final, args.out)
        log(f"done steps={args.steps} params={n_params} sha256={state_sha256(final)}", flush=True)
    append_record(args.step_log, {"event": "done", "rank": run.rank, "pid": os.getpid(),
                                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    run.finish()
    return 0


__all__ = ["main", "build_parser", "parse_count"]


if __name__ == "__main__":
    sys.exit(main())
