"""Train the GPT of ``examples/gpt_model.py`` with torchft: one process per replica group.

Each process is a whole replica group of world size 1. Fault tolerance across the groups is
torchft's (https://github.com/pytorch/torchft, PyPI ``torchft`` 0.2.0): a ``torchft.Manager``
talks to a torchft Lighthouse (started elsewhere, e.g. by ``torchft_job.py``), the model is
wrapped in ``torchft.DistributedDataParallel`` whose gradient all-reduce goes through
``Manager.allreduce`` over a reconfigurable ``torchft.ProcessGroupGloo`` (with one fix: see
:class:`DistributedDataParallel` below; unpatched, torchft 0.2.0 kills the *survivor* with an
``AssertionError`` when a peer dies mid all-reduce), and the optimizer is
wrapped in ``torchft.Optimizer`` (``zero_grad`` starts the quorum, ``step`` applies the update
only when ``Manager.should_commit()`` says so). Nothing is written to disk: a replica that
(re)joins behind the others is healed by torchft from a live peer (the peer serves its
``{"model", "optim"}`` state dict and the manager's step over HTTP, torchft's default
``HTTPTransport``), which is torchft's whole recovery model.

Run (after starting a lighthouse, ``torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510``)::

    python bench/competitors/torchft_gpt.py --params 1M --steps 50 --replicas 2 --replica-id 0 \\
        --lighthouse http://127.0.0.1:29510 --threads 1 --step-log /tmp/steps.jsonl

Each process hosts its own replica-group ``TCPStore`` on a free loopback port (port 0), so no
MASTER_ADDR/MASTER_PORT is needed; the manager advertises ``127.0.0.1`` and the checkpoint server
does too.

Data: the batch of a step is ``gpt_model.batch(data, step, rank=replica_id,
world_size=replicas, ...)`` where ``step`` is the manager's committed step count before the step
(0-based) and ``replicas`` is the *configured* number of replica groups (``--replicas``). The
replica's rank among the live replicas changes with failures, so it is not used; with
``--replica-id`` and ``--replicas`` a replica always reads the same slice of the same global
batch for a given step, and a step that does not commit is redone on the same data. While a
replica is down its slice of each step is simply not trained on (torchft averages the gradients
over the replicas that take part).

Step log (``--step-log``): after each committed optimizer step one JSON line, appended with a
single ``write`` on an ``O_APPEND`` descriptor::

    {"v": 1, "t": <time.time()>, "step": <Manager.current_step(), 1-based>, "replica": <id>,
     "pid": <pid>, "participants": <Manager.num_participants()>, "loss": <local batch loss>}

``participants`` counts the replicas whose gradients were averaged in that step. With torchft's
default asynchronous quorum a replica that heals in a step does not contribute to that step (its
gradient is zeroed and it loads the peer's state before the optimizer step), so the step in which
a restarted replica heals still has ``participants == replicas - 1`` and the job is back at full
size on the next one. On the healing replica itself ``loss`` of that step was computed with the
weights it had before healing.

At the end each replica prints ``done steps=N replica=I sha256=<hex of the model state>`` (equal
on all replicas when the run is consistent).

Timeouts (``--timeout``, default 60 s): the manager's timeout (collectives, should_commit,
checkpoint transfer) and the Gloo group's timeout; ``--quorum-timeout`` (default 60 s) bounds the
wait for a quorum. The time to notice a dead replica is set by the lighthouse
(``--heartbeat_timeout_ms``, torchft default 5000) and by Gloo seeing the peer's socket close.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpt_model import (BETAS, EPS, GPT, VOCAB, WEIGHT_DECAY, add_training_args, batch, config_for_params,  # noqa: E402
                       count_params, load_corpus, positive_int, state_sha256)

try:
    import torchft
    from torchft.checkpointing.http_transport import HTTPTransport
except ImportError as exc:  # a clear one-liner instead of a traceback
    sys.exit(f"torchft_gpt: torchft is not usable here: {exc}")


class DistributedDataParallel(torchft.DistributedDataParallel):
    """torchft's DDP wrapper with a comm hook that survives a failed all-reduce.

    In torchft 0.2.0 ``torchft.DistributedDataParallel._comm_hook`` does ``assert fut._fut`` after
    ``work.wait()``; when a peer dies during the all-reduce (Gloo: "Connection closed by peer")
    ``_ManagedWork.wait`` reports the error to the manager and returns False without building its
    future chain, so ``_fut`` is None and the assertion kills the *surviving* replica (and after
    an error ``Manager.allreduce`` returns a ``_DummyWork`` whose plain future has no ``_fut``).
    Here the bucket is handed back unchanged instead; the manager already marked the step as
    failed, so ``should_commit()`` is False and the step is redone after a new quorum.
    """

    @staticmethod
    def _comm_hook(manager, bucket):
        work = manager.allreduce(bucket.buffer())
        work.wait()  # False on failure; the manager has recorded the error
        fut = work.get_future()
        fut = getattr(fut, "_fut", fut)  # a torchft _ManagedFuture wraps the real future
        if fut is None:
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
        return fut


class LoopbackHTTPTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, advertised on 127.0.0.1 instead of the hostname."""

    def address(self) -> str:
        return f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(p)
    p.add_argument("--replica-id", type=int, required=True, help="this replica group's id, 0..replicas-1")
    p.add_argument("--replicas", type=positive_int, default=2,
                   help="configured number of replica groups; slices the global batch (default 2)")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="lighthouse URL, e.g. http://127.0.0.1:29510 (default $TORCHFT_LIGHTHOUSE)")
    p.add_argument("--min-replicas", type=positive_int, default=1,
                   help="Manager min_replica_size: commit only with at least this many participants (default 1)")
    p.add_argument("--step-log", type=Path, default=None, help="append one JSON line per committed step")
    p.add_argument("--timeout", type=float, default=60.0, help="manager and Gloo timeout, seconds (default 60)")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="quorum timeout, seconds (default 60)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.lighthouse:
        sys.exit("torchft_gpt: --lighthouse URL (or $TORCHFT_LIGHTHOUSE) is required")
    if not 0 <= args.replica_id < args.replicas:
        sys.exit(f"torchft_gpt: --replica-id must be in 0..{args.replicas - 1}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)

    data = load_corpus(args.data)
    cfg = config_for_params(args.params, block_size=args.block_size)
    torch.manual_seed(args.seed)  # same init on every replica
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.optim_groups(WEIGHT_DECAY), lr=args.lr, betas=BETAS, eps=EPS)

    timeout = timedelta(seconds=args.timeout)
    # This process is the whole replica group: it hosts the group's store itself, on a free port.
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
            state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
            min_replica_size=args.min_replicas,
            replica_id=str(args.replica_id),  # torchft appends a fresh uuid per process
            lighthouse_addr=args.lighthouse,
            store_addr="127.0.0.1",
            store_port=store.port,
            rank=0,
            world_size=1,
            hostname="127.0.0.1",
            timeout=timeout,
            quorum_timeout=timedelta(seconds=args.quorum_timeout),
            connect_timeout=timeout,
            checkpoint_transport=LoopbackHTTPTransport(timeout=timeout, num_chunks=0),
            init_sync=False,  # every replica seeds the same initial weights
        )
    except Exception as exc:  # e.g. lighthouse unreachable
        sys.exit(f"torchft_gpt: replica {args.replica_id} could not start the torchft manager: {exc}")
    ddp = DistributedDataParallel(manager, model)
    ft_opt = torchft.Optimizer(manager, opt)

    log_fd = None
    if args.step_log is not None:
        args.step_log.parent.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(args.step_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    print(f"model n_layer={cfg.n_layer} n_embd={cfg.n_embd} params={count_params(model)} "
          f"replica={args.replica_id}/{args.replicas} pid={os.getpid()}", flush=True)

    ddp.train()
    while manager.current_step() < args.steps:
        step = manager.current_step()  # committed steps so far; the data of this step
        x, y = batch(data, step, args.replica_id, args.replicas, args.batch_size, cfg.block_size, seed=args.seed)
        ft_opt.zero_grad(set_to_none=True)  # starts the (async) quorum for this step
        loss = F.cross_entropy(ddp(x).view(-1, VOCAB), y.view(-1))
        loss.backward()  # gradient all-reduce across the participating replicas
        participants = manager.num_participants()
        ft_opt.step()  # Manager.should_commit(); steps AdamW only if the step commits
        if manager.current_step() == step or log_fd is None:
            continue  # not committed: redo the same step (same data)
        line = json.dumps({"v": 1, "t": time.time(), "step": manager.current_step(), "replica": args.replica_id,
                           "pid": os.getpid(), "participants": participants, "loss": loss.item()})
        os.write(log_fd, (line + "\n").encode())

    print(f"done steps={manager.current_step()} replica={args.replica_id} "
          f"sha256={state_sha256(model.state_dict())}", flush=True)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
