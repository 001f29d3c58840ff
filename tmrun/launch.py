"""Running a job: a local cluster on this machine, or this node's agent in a multi-node job.

- Local cluster (no endpoint, not under SLURM): start an embedded etcd on a free loopback port,
  write the runtime file, start ``max_nodes + standby`` agent processes ``node-0`` … and wait for
  them. Ctrl-C or SIGTERM stops everything; agents, workers and etcd never outlive this process.
- Node mode (an endpoint, or SLURM): run this node's agent in this process. Under SLURM with no
  endpoint, the allocation's first three nodes host the job's embedded etcd cluster
  (:mod:`agent.etcd_cluster`); the agents keep it whole while the job runs.

In both, once the agents are done and before etcd stops, the job's events and outcome are copied
to its history file ``<log root>/<job>/events.jsonl`` (:mod:`agent.history`) for ``tmrun events``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from agent.config import AgentConfig
from agent.errors import StoreError
from agent.credentials import UserCredentials, server_certificate
from agent.etcd_member import MemberHost, keep_alive
from agent.etcd_server import EmbeddedEtcd
from agent.history import save_history
from agent.keys import JobKeys
from agent.node import HANDLED_SIGNALS, make_store, run_agent
from agent.records import Outcome, parse
from agent.workers import die_with_parent
from tmrun.jobs import write_runtime_file

log = logging.getLogger("tmrun.launch")

EXIT_FAILED = 1


async def _read_outcome(cfg: AgentConfig) -> Outcome | None:
    store = make_store(dataclasses.replace(cfg, timeouts=dataclasses.replace(cfg.timeouts, store_retry=2.0)))
    try:
        entry = await store.get(JobKeys(cfg.job_id).outcome)
        return parse(Outcome, entry)
    except StoreError:
        return None
    finally:
        await store.close()


async def _supervise_agents(configs: list[AgentConfig], grace: float,
                            etcd: EmbeddedEtcd | None = None,
                            report: Callable[[str], None] = log.warning) -> tuple[list[int], int]:
    """Start one agent process per config; wait for all. Returns their exit codes and the signal.

    Meanwhile the job's embedded etcd is kept alive: restarted from its data directory if it dies.
    """
    keeper = asyncio.ensure_future(keep_alive(etcd, report)) if etcd else None
    procs = []
    for cfg in configs:
        argv = die_with_parent([sys.executable, "-m", "agent", "--config", cfg.to_json()], signal.SIGTERM)
        procs.append(await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL))
    received: list[int] = []
    loop = asyncio.get_running_loop()

    def forward(sig: int) -> None:
        received.append(sig)
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)

    for sig in HANDLED_SIGNALS:
        loop.add_signal_handler(sig, forward, sig)
    try:
        waits = [asyncio.ensure_future(p.wait()) for p in procs]
        while pending := [w for w in waits if not w.done()]:
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)  # the ones still running only
            if received:
                try:
                    await asyncio.wait_for(asyncio.gather(*waits), grace + 5)
                except asyncio.TimeoutError:
                    for proc in procs:
                        if proc.returncode is None:
                            proc.kill()
                    await asyncio.gather(*waits)
        return [p.returncode for p in procs], (received[0] if received else 0)
    finally:
        for sig in HANDLED_SIGNALS:
            loop.remove_signal_handler(sig)
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)


def run_local_cluster(configs: list[AgentConfig], runtime: Path, report: Callable[[str], None],
                      log_root: Path | None = None, credentials: UserCredentials | None = None) -> int:
    """Run a whole job on this machine; returns the job's exit code.

    With ``credentials`` the job's etcd admits only holders of a certificate of the user's CA
    (the configs carry the client files); the runtime file then names an ``https://`` endpoint.
    """
    job = configs[0].job_id
    with tempfile.TemporaryDirectory(prefix=f"tmrun-{job}-etcd-") as data_dir:
        tls = server_certificate(credentials, Path(data_dir) / "tls", ["localhost", "127.0.0.1"]) if credentials else None
        etcd = EmbeddedEtcd(Path(data_dir), tls=tls)
        etcd.start()
        try:
            configs = [dataclasses.replace(c, endpoint=etcd.endpoint) for c in configs]
            runtime_file = write_runtime_file(runtime, job, etcd.url, os.getpid(), time.time())
            report(f"job {job}: {len(configs)} agents, etcd at {etcd.url}")
            try:
                codes, sig = asyncio.run(_supervise_agents(configs, configs[0].timeouts.stop_grace, etcd, report))
                outcome = asyncio.run(_read_outcome(configs[0]))
                _save_history(configs[0], log_root, report)
            finally:
                runtime_file.unlink(missing_ok=True)
        finally:
            etcd.stop()
    return _exit_code(job, outcome, sig, codes, report)


def _save_history(cfg: AgentConfig, log_root: Path | None, report: Callable[[str], None]) -> None:
    """Copy the job's events and outcome to ``<log_root>/<job>/events.jsonl`` while etcd is still up,
    for ``tmrun events`` after the job (agent/history.py). A store that is gone costs one warning."""
    if log_root is None:
        return

    async def save() -> Path | None:
        # briefly: under SLURM the last agents may find the job's etcd without a quorum already
        store = make_store(dataclasses.replace(cfg, timeouts=dataclasses.replace(cfg.timeouts, store_retry=1.0)))
        try:
            return await save_history(store, cfg.job_id, log_root)
        finally:
            await store.close()

    path = asyncio.run(save())
    if path is not None:
        report(f"job {cfg.job_id}: history in {path}")


def _exit_code(job: str, outcome: Outcome | None, sig: int, codes: list[int],
               report: Callable[[str], None]) -> int:
    if outcome is not None and outcome.state == "succeeded":
        report(f"job {job} succeeded: {outcome.reason}")
        return 0
    if outcome is not None:
        report(f"job {job} failed: {outcome.reason}")
        return EXIT_FAILED
    if sig:
        report(f"job {job} stopped by {signal.Signals(sig).name}")
        return 128 + sig
    report(f"job {job} ended without an outcome (agent exit codes {codes})")
    return EXIT_FAILED


def run_node(cfg: AgentConfig, hosting: MemberHost | None, report: Callable[[str], None],
             log_root: Path | None = None) -> int:
    """Run this node's agent in-process (multi-node jobs), and its etcd member when it hosts one."""
    try:
        code = asyncio.run(run_agent(cfg, hosting))
        if code >= 128:  # stopped by a signal (scancel: the whole job goes, etcd too, and soon SIGKILL)
            return code
        _save_history(cfg, log_root, report)
        if hosting is not None:
            asyncio.run(_release(cfg, hosting))
        return code
    finally:
        if hosting is not None:
            hosting.close()


async def _release(cfg: AgentConfig, hosting: MemberHost) -> None:
    """Keep this node's etcd member while the others still need it (bounded)."""
    store = make_store(dataclasses.replace(cfg, timeouts=dataclasses.replace(cfg.timeouts, store_retry=2.0)))
    try:
        try:
            ended = await store.get(JobKeys(cfg.job_id).outcome) is not None
        except StoreError:
            ended = True
        await hosting.release(store, JobKeys(cfg.job_id), ended)
    finally:
        await store.close()
