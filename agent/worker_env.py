"""The environment a worker process gets: exactly torchrun's, plus a few ``TMRUN_*`` variables.

An unmodified torchrun script reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` … and calls
``init_process_group(init_method="env://")``; with ``TORCHELASTIC_USE_AGENT_STORE=True`` every
rank connects as a client to the TCPStore that the leader agent hosts for the generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from agent.config import AgentConfig
from agent.records import Plan


def worker_env(base: Mapping[str, str], cfg: AgentConfig, plan: Plan, local_rank: int,
               error_file: str, rank_offset: int | None = None) -> dict[str, str]:
    """The full environment of local rank ``local_rank`` of this node in ``plan``.

    ``rank_offset`` overrides the node's place in ``plan`` (a standby's shadow workers, which are
    not members yet, get the last ranks of the world as placeholders).
    """
    nproc = cfg.worker.nproc_per_node
    rank = (plan.rank_offset(cfg.node) if rank_offset is None else rank_offset) + local_rank
    env = dict(base)
    env.update({
        "LOCAL_RANK": str(local_rank),
        "RANK": str(rank),
        "GROUP_RANK": str(plan.members.index(cfg.node) if cfg.node in plan.members else len(plan.members)),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": cfg.worker.role,
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(plan.world_size),
        "GROUP_WORLD_SIZE": str(len(plan.members)),
        "ROLE_WORLD_SIZE": str(plan.world_size),
        "MASTER_ADDR": plan.store_host,
        "MASTER_PORT": str(plan.store_port),
        "TORCHELASTIC_RESTART_COUNT": str(plan.restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.worker.max_restarts),
        "TORCHELASTIC_RUN_ID": cfg.job_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TMRUN_JOB_ID": cfg.job_id,
        "TMRUN_NODE": cfg.node,
        "TMRUN_GENERATION": str(plan.gen),
        "TMRUN_COLLECTIVE_TIMEOUT": f"{cfg.timeouts.collective:g}",
        "TMRUN_HEARTBEAT_FILE": str(Path(error_file).with_name("heartbeat")),  # tmrun.heartbeat() touches it
    })
    if cfg.worker.redundancy_every:  # --redundancy 1 (tmrun/redundancy.py)
        env.update({"TMRUN_REDUNDANCY": "1", "TMRUN_REDUNDANCY_EVERY": str(cfg.worker.redundancy_every)})
    if "OMP_NUM_THREADS" not in base and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default, so that results match it
    return env
