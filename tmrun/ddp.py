"""Data parallelism for the runtime: torch DDP whose gradients travel over the run's group.

DDP is given a process group of one rank that never communicates (so it neither broadcasts at
construction nor syncs buffers on its own); its bucketed gradients reach the other ranks through
a communication hook that all-reduces over ``run.group``, whichever group is current (a real
gloo group, or the standby's sandbox). A failed all-reduce is latched on the run as a failed
group (the step's later buckets and its vote are not sent on it) and the bucket is returned
unreduced, so ``backward()`` never raises into the user's code; ``commit()`` then votes the
step down. A step doomed by a failure's generation sends no more buckets either, and
``run.backward`` stops its backward (:mod:`tmrun.abandon`).
"""

import inspect
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from tmrun.groups import completed, local_process_group


def data_parallel(run, module: torch.nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        ddp_kwargs.setdefault("forward_sync_buffers", False)
    else:
        ddp_kwargs.setdefault("broadcast_buffers", False)
    ddp = DistributedDataParallel(module, process_group=local_process_group(), **ddp_kwargs)
    ddp.register_comm_hook(run, _allreduce_hook)
    return ddp


def _allreduce_hook(run, bucket) -> torch.futures.Future[torch.Tensor]:  # DDP checks this annotation
    buffer = bucket.buffer()
    if run._doomed():
        return completed(buffer)  # this step is already lost: don't touch its group again
    try:
        future = run.group.all_reduce(buffer, "mean")
    except RuntimeError as exc:
        run.latch(exc, group_failed=True)
        return completed(buffer)

    def settle(fut: torch.futures.Future) -> torch.Tensor:
        try:
            return fut.value()
        except RuntimeError as exc:
            run.latch(exc, group_failed=True)
            return buffer

    return future.then(settle)
