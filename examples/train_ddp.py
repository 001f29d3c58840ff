"""Deterministic, resumable DDP training example (a plain torchrun script).

This is an ordinary PyTorch training script written for ``torchrun``: it does
not import tmrun and knows nothing about it.  The project's tests run it under
both ``torchrun`` and ``tmrun`` and compare the results bit-for-bit, so every
source of nondeterminism is pinned down:

* the model is initialised after ``torch.manual_seed(0)``;
* ``torch.use_deterministic_algorithms(True)`` and one intra-op thread per
  process, so results do not depend on the launcher's OMP_NUM_THREADS;
* the synthetic regression data set is generated from a fixed seed;
* the batch a step uses is a pure function of the step index: epoch =
  step // steps_per_epoch, the sampler is re-seeded with
  ``sampler.set_epoch(epoch)`` and the step takes batch number
  step % steps_per_epoch of that epoch's shuffled order.

With ``--ckpt-dir`` rank 0 writes ``checkpoint.pt`` ({model, optimizer, step})
atomically (temp file in the same directory, fsync, os.replace) after every
K-th optimizer step and at the last step; on start every rank loads it if it
exists and resumes at the saved step.  A job killed at any instant and resumed
therefore ends with weights bit-identical to an uninterrupted run with the same
world size.

Run it with::

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 60

or as a world of one, without any process group::

    python examples/train_ddp.py --steps 60

Output (rank 0 only, flushed): ``step {step} loss {loss:.6f}`` per logged step
(``step`` counts completed optimizer steps, 1-based; the loss is the batch loss
averaged over ranks), ``resumed from step {k}`` after resuming, and finally
``done steps={N} sha256={hex}`` where the hash covers the bytes of every tensor
of the final model state_dict, in state_dict order.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

NUM_SAMPLES = 4096
IN_FEATURES = 32
HIDDEN = 64
DATA_SEED = 1234
CKPT_NAME = "checkpoint.pt"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="total optimizer steps (default 60)")
    p.add_argument("--batch-size", type=int, default=16, help="per-rank batch size (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: no checkpointing)")
    p.add_argument("--ckpt-every", type=int, default=1, help="checkpoint every K steps (default 1)")
    p.add_argument("--out", default=None, help="rank 0 saves the final model state_dict here")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra simulated compute per step, in seconds (default 0)")
    p.add_argument("--log-every", type=int, default=1, help="log every N steps (default 1)")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")
    if args.batch_size < 1 or args.ckpt_every < 1 or args.log_every < 1:
        p.error("--batch-size, --ckpt-every and --log-every must be >= 1")
    if args.step_time < 0:
        p.error("--step-time must be >= 0")
    return args


def make_dataset() -> TensorDataset:
    """A fixed synthetic regression problem: y = f(x) + noise."""
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, 1, generator=g) / IN_FEATURES ** 0.5
    y = torch.tanh(x @ w) + 0.1 * torch.sin(3.0 * x[:, :1]) + 0.01 * torch.randn(NUM_SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    )


def atomic_save(obj, path: str) -> None:
    """torch.save to a temp file in the same directory, fsync, os.replace."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; keep it readable like a plain torch.save
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # Make the rename itself durable.
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def state_sha256(state_dict) -> str:
    h = hashlib.sha256()
    for t in state_dict.values():
        t = t.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


class StepBatches:
    """Maps a global step index to its batch; caches one epoch's order."""

    def __init__(self, dataset: TensorDataset, sampler: DistributedSampler, batch_size: int):
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.steps_per_epoch = len(sampler) // batch_size
        if self.steps_per_epoch < 1:
            raise SystemExit(
                f"--batch-size {batch_size} is larger than the {len(sampler)} samples per rank")
        self._epoch = None
        self._order: list[int] = []

    def batch(self, step: int):
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order = list(iter(self.sampler))
            self._epoch = epoch
        idx = torch.tensor(self._order[pos * self.batch_size:(pos + 1) * self.batch_size])
        x, y = self.dataset.tensors
        return x[idx], y[idx]


def main(argv=None) -> int:
    args = parse_args(argv)

    distributed = "RANK" in os.environ
    if distributed:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method="env://")
    else:
        rank, world_size = 0, 1

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    # One intra-op thread: results must not depend on the launcher's OMP settings.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    batches = StepBatches(dataset, sampler, args.batch_size)

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    start_step = 0
    ckpt_path = None
    if args.ckpt_dir:
        ckpt_path = os.path.join(args.ckpt_dir, CKPT_NAME)
        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
        # Only the atomically renamed file is ever read; temp files are ignored.
        if os.path.exists(ckpt_path):
            ckpt = torch.load(ckpt_path, weights_only=True)
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            start_step = int(ckpt["step"])
            del ckpt
    if distributed:
        # Every rank must resume from the same step.  This collective also
        # guarantees that no rank is still reading the checkpoint when rank 0
        # starts overwriting it.
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(gathered, torch.tensor([start_step], dtype=torch.int64))
        steps = [int(t.item()) for t in gathered]
        if len(set(steps)) != 1:
            raise RuntimeError(f"ranks loaded checkpoints at different steps: {steps}")
    if start_step > args.steps:
        if distributed:
            dist.destroy_process_group()
        print(f"checkpoint {ckpt_path} is at step {start_step}, past --steps {args.steps}",
              file=sys.stderr, flush=True)
        return 2
    if start_step:
        log(f"resumed from step {start_step}")

    raw_model = model
    if distributed:
        model = DistributedDataParallel(model)
    loss_fn = nn.MSELoss()

    model.train()
    for step in range(start_step, args.steps):
        x, y = batches.batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if args.step_time:
            time.sleep(args.step_time)  # simulated extra compute (workload pacing)
        optimizer.step()
        done = step + 1

        if done % args.log_every == 0 or done == args.steps:
            report = loss.detach().clone()
            if distributed:
                dist.all_reduce(report)
                report /= world_size
            log(f"step {done} loss {report.item():.6f}")

        if ckpt_path and (done % args.ckpt_every == 0 or done == args.steps):
            if rank == 0:
                atomic_save({"model": raw_model.state_dict(),
                             "optimizer": optimizer.state_dict(),
                             "step": done}, ckpt_path)
            if distributed:
                dist.barrier()  # the checkpoint is complete before any rank moves on

    final = raw_model.state_dict()
    if rank == 0 and args.out:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(out_dir, exist_ok=True)
        atomic_save(final, args.out)
    log(f"done steps={args.steps} sha256={state_sha256(final)}")

    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """End the process without Python's finalization.

    DDP keeps the default gloo group alive after ``destroy_process_group`` (its threads keep
    running), and the group's final barrier may still hold the work of the last ``all_reduce``:
    when a gloo thread drops that work it takes the GIL to release the reduced tensor, and a
    thread that takes the GIL while the interpreter is finalizing is ended mid-destructor, which
    aborts the process ("terminate called without an active exception", signal 6) after training
    has finished. Seen under torchrun and tmrun alike, more often on a busy machine. The output
    is complete at this point; only the streams need flushing.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
