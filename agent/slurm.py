"""What a SLURM allocation tells tmrun: job id, node count, this node's index, the node list.

Under ``srun tmrun --nnodes 4 --standby 2 train.py`` every node runs one tmrun; each reads the
``SLURM_*`` variables of its own task and gets the same :class:`SlurmAllocation` up to
``node_id`` and ``this_host``. The node with ``node_id == 0`` (the allocation's first host) starts
the embedded etcd, at a port every node computes alike from the job id
(:func:`etcd_port_for_job`), so that no address has to be passed around.

Variables read, first present wins (an empty value counts as absent)::

    job id      SLURM_JOB_ID                  absent: not under SLURM, detect_slurm → None
    node list   SLURM_STEP_NODELIST           set by srun for its step's tasks
                SLURM_JOB_NODELIST            the whole allocation (sbatch, salloc, srun)
                SLURM_NODELIST                the older name of either
    node count  SLURM_STEP_NUM_NODES          beside SLURM_STEP_NODELIST
                SLURM_NNODES                  srun sets it to the step's count
                SLURM_JOB_NUM_NODES           the allocation's count
                (none: the length of the node list)
    node index  SLURM_NODEID                  srun: this task's node within the step;
                                              sbatch: 0 in the batch script, which runs on
                                              the first node
                (none: SLURMD_NODENAME's position in the node list)
    this host   SLURMD_NODENAME               preferred when it disagrees with the list

The step variables come first because ``SLURM_NODEID`` counts nodes within the step: with
``srun -N 4`` inside a 6-node allocation the step's list is the one the index refers to.

A pure module: the environment is passed in as a mapping (the CLI hands over ``os.environ``),
nothing is read or written behind the caller's back. Malformed or inconsistent values raise
:class:`agent.errors.ConfigError` with one line naming the variable.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Mapping

from agent.errors import ConfigError
from agent.hostlist import expand_hostlist

__all__ = [
    "ETCD_PORT_BASE",
    "ETCD_PORT_SPAN",
    "SlurmAllocation",
    "default_endpoint",
    "detect_slurm",
    "etcd_port_for_job",
]

ETCD_PORT_BASE = 20000
"""The lowest client port :func:`etcd_port_for_job` returns."""

ETCD_PORT_SPAN = 10000
"""How many ports it chooses among: ``ETCD_PORT_BASE`` to ``ETCD_PORT_BASE + 9999``."""

_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")


@dataclasses.dataclass(frozen=True)
class SlurmAllocation:
    """The nodes of one SLURM job step as this node sees them.

    ``hosts`` are in SLURM's order; ``node_id`` indexes them; ``this_host`` is normally
    ``hosts[node_id]`` (``SLURMD_NODENAME`` wins where the two disagree). Construction checks
    that the fields agree and raises :class:`ConfigError` otherwise.
    """

    job_id: str
    nnodes: int
    node_id: int
    hosts: tuple[str, ...]
    this_host: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        if not self.job_id:
            raise ConfigError("SLURM job id is empty")
        if not self.hosts:
            raise ConfigError(f"SLURM job {self.job_id}: the node list is empty")
        if self.nnodes != len(self.hosts):
            raise ConfigError(
                f"SLURM job {self.job_id}: node count {self.nnodes} does not match the "
                f"{len(self.hosts)} hosts in the node list"
            )
        if not 0 <= self.node_id < self.nnodes:
            raise ConfigError(
                f"SLURM job {self.job_id}: node id {self.node_id} is outside 0..{self.nnodes - 1}"
            )
        if not self.this_host:
            raise ConfigError(f"SLURM job {self.job_id}: this node's host name is empty")

    @property
    def first_host(self) -> str:
        """The allocation's first host (node id 0): where the embedded etcd runs."""
        return self.hosts[0]


def detect_slurm(environ: Mapping[str, str]) -> SlurmAllocation | None:
    """The allocation described by ``environ``, or None when ``SLURM_JOB_ID`` is absent or empty.

    Raises :class:`ConfigError` when the job id is set but the rest is missing, malformed or
    inconsistent.
    """
    job_id = _get(environ, "SLURM_JOB_ID")
    if job_id is None:
        return None
    nodelist_var, nodelist = _first(environ, _NODELIST_VARS)
    if nodelist is None:
        raise ConfigError(
            f"SLURM job {job_id}: no node list (none of {', '.join(_NODELIST_VARS)} is set)"
        )
    try:
        hosts = tuple(expand_hostlist(nodelist))
    except ConfigError as exc:
        raise ConfigError(f"{nodelist_var}: {exc}") from None
    if not hosts:
        raise ConfigError(f"SLURM job {job_id}: {nodelist_var} is empty")

    nnodes_var, nnodes_text = _first(environ, _NNODES_VARS)
    if nnodes_text is None:
        nnodes = len(hosts)
    else:
        nnodes = _integer(nnodes_var, nnodes_text, minimum=1)
        if nnodes != len(hosts):
            raise ConfigError(
                f"SLURM job {job_id}: {nnodes_var}={nnodes} but {nodelist_var}={nodelist!r} "
                f"has {len(hosts)} hosts"
            )

    slurmd_name = _get(environ, "SLURMD_NODENAME")
    node_id_text = _get(environ, "SLURM_NODEID")
    if node_id_text is not None:
        node_id = _integer("SLURM_NODEID", node_id_text, minimum=0)
        if node_id >= nnodes:
            raise ConfigError(
                f"SLURM job {job_id}: SLURM_NODEID={node_id} but the job has {nnodes} nodes "
                f"(0..{nnodes - 1})"
            )
    elif slurmd_name is not None and slurmd_name in hosts:
        node_id = hosts.index(slurmd_name)
    else:
        raise ConfigError(
            f"SLURM job {job_id}: SLURM_NODEID is not set; start tmrun with srun, one task per node"
        )

    this_host = slurmd_name if slurmd_name is not None else hosts[node_id]
    return SlurmAllocation(
        job_id=job_id, nnodes=nnodes, node_id=node_id, hosts=hosts, this_host=this_host
    )


def etcd_port_for_job(job_id: str) -> int:
    """A client port for the job's embedded etcd, in 20000–29999, that every node computes alike.

    A numeric job id (SLURM's are) maps to ``20000 + id % 10000``, so that jobs whose ids are
    less than 10000 apart never share a port; any other id is hashed (SHA-256).

    Caveat: this is a convention, not a reservation. Two jobs whose ids are congruent modulo
    10000 and whose first nodes coincide (shared nodes, ``--oversubscribe``) want the same port,
    and an unrelated process may already hold it; the embedded etcd then fails to bind and the
    job stops with that error. Pass ``--rdzv-endpoint`` to choose the address yourself.
    """
    text = job_id.strip() if isinstance(job_id, str) else ""
    if not text:
        raise ConfigError(f"cannot derive an etcd port from job id {job_id!r}")
    if text.isascii() and text.isdigit():
        offset = int(text) % ETCD_PORT_SPAN
    else:
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        offset = int.from_bytes(digest[:8], "big") % ETCD_PORT_SPAN
    return ETCD_PORT_BASE + offset


def default_endpoint(alloc: SlurmAllocation) -> str:
    """``host:port`` of the embedded etcd on the allocation's first node."""
    return f"{alloc.first_host}:{etcd_port_for_job(alloc.job_id)}"


def _get(environ: Mapping[str, str], name: str) -> str | None:
    """``environ[name]`` stripped, or None when absent or blank."""
    value = environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str | None]:
    """The first of ``names`` that is set (name and value); the last name and None if none is."""
    for name in names:
        value = _get(environ, name)
        if value is not None:
            return name, value
    return names[-1], None


def _integer(name: str, text: str, *, minimum: int) -> int:
    """``text`` as a decimal integer no less than ``minimum``, or ConfigError naming ``name``."""
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"{name}={text!r} is not a non-negative integer")
    value = int(text)
    if value < minimum:
        raise ConfigError(f"{name}={text!r} must be at least {minimum}")
    return value
