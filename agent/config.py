"""Frozen configuration handed from the CLI to an agent: who it is, where etcd is, what to run.

The CLI layer reads flags and environment variables and builds one :class:`AgentConfig`; the agent
never reads the environment for its own settings. A config travels to a local-cluster agent
process as JSON (``to_json``/``from_json``), never as pickle.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from agent.errors import ConfigError

SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Deadlines per phase, in seconds, validated on construction.

    - ``join``: how long the first rendezvous waits for the minimum number of nodes.
    - ``last_call``: with ``--nnodes MIN:MAX``, how long to wait for more nodes once MIN joined.
    - ``lease_ttl``: an agent whose keepalives stop is declared lost after this long.
    - ``failure_window``: how long an ambiguous worker failure (a plain non-zero exit, which may be
      the echo of a peer's death) waits for a clearer culprit (a lost lease or a killed worker).
    - ``stop_grace``: SIGTERM to SIGKILL for workers being stopped.
    - ``store_retry``: how long etcd errors are retried before the agent gives up.
    - ``standby_fill``: at the first rendezvous, how long nodes started as standbys wait before
      they fill in for regular nodes that did not come.
    - ``collective``: how long a runtime worker's collective (gloo) waits for its peers before it
      fails the step; passed to workers as ``TMRUN_COLLECTIVE_TIMEOUT``.
    - ``progress``: the hang watchdog. A node whose runtime workers committed no step for this
      long (and did not report a broken group) is hung: its workers are killed and the failure
      path takes over. 0 turns it off. It must exceed twice ``collective`` (a step's collective and
      its vote may each time out), so that the peers of a hung rank report a broken group (and are
      spared) before the hung rank's watchdog fires.
    - ``outage``: the control-plane outage bound. An agent that cannot reach etcd keeps its
      workers training and keeps trying; after this long without a successful lease refresh it
      stops them cleanly (SIGTERM, ``stop_grace``, SIGKILL) and exits 3. 0: never.
    """

    join: float = 600.0
    last_call: float = 1.0
    lease_ttl: int = 5
    failure_window: float = 6.0
    stop_grace: float = 5.0
    store_retry: float = 20.0
    standby_fill: float = 10.0
    collective: float = 120.0
    progress: float = 300.0
    outage: float = 900.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"timeout {field.name} must be a non-negative number, got {value!r}")
        if self.lease_ttl < 2:
            raise ConfigError(f"lease_ttl must be at least 2 seconds, got {self.lease_ttl}")
        if self.collective <= 0:
            raise ConfigError(f"collective_timeout must be positive, got {self.collective}")
        if self.outage and self.outage <= self.lease_ttl:
            raise ConfigError(f"etcd_outage_timeout ({self.outage:g} s) must exceed lease_ttl ({self.lease_ttl} s), "
                              "or be 0 for no bound")
        if self.progress and self.progress <= 2 * self.collective:
            raise ConfigError(f"progress_timeout ({self.progress:g} s) must exceed twice collective_timeout "
                              f"({self.collective:g} s), or be 0 to turn the hang watchdog off")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What each worker process runs and where its output goes (torchrun's flags)."""

    argv: tuple[str, ...]
    nproc_per_node: int = 1
    role: str = "default"
    log_dir: str | None = None
    redirects: str = "0"  # torchrun's Std spec: "3" or "0:3,1:0"
    tee: str = "0"
    local_ranks_filter: tuple[int, ...] = ()
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if not self.argv:
            raise ConfigError("nothing to run: no script given")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Everything one node agent needs; built by the CLI, immutable afterwards."""

    job_id: str
    node: str
    host: str
    endpoint: str
    worker: WorkerSpec
    min_nodes: int = 1
    max_nodes: int = 1
    standby_hint: bool = False
    timeouts: Timeouts = Timeouts()
    monitor_interval: float = 0.1
    tls_cacert: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    etcd_user: str | None = None  # etcd's own authentication (an external etcd); the password is in a file
    etcd_password_file: str | None = None
    # Under SLURM, the node that hosts the embedded etcd keeps it up until the others have left.
    hosts_store: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"--nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX")
        if not self.node or "/" in self.node:
            raise ConfigError(f"bad node name {self.node!r}: must be non-empty and contain no '/'")

    def to_json(self) -> str:
        return json.dumps({"v": SCHEMA, **dataclasses.asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "AgentConfig":
        data: dict[str, Any] = json.loads(text)
        if data.pop("v", None) != SCHEMA:
            raise ConfigError("agent config has an unknown schema version")
        worker = data.pop("worker")
        worker["argv"] = tuple(worker["argv"])
        worker["local_ranks_filter"] = tuple(worker["local_ranks_filter"])
        timeouts = Timeouts(**data.pop("timeouts"))
        return cls(worker=WorkerSpec(**worker), timeouts=timeouts, **data)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:4"`` → (1, 4). Raises ConfigError on anything else."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError(text)
    except ValueError:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise ConfigError(f"--nnodes {text}: need 1 <= MIN <= MAX")
    return low, high


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """torchrun's ``--rdzv-conf key1=value1,key2=value2`` into a dict."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf item {item!r}: expected key=value")
        conf[key.strip()] = value.strip()
    return conf


_TIMEOUT_KEYS = {
    "join_timeout": "join",
    "last_call_timeout": "last_call",
    "lease_ttl": "lease_ttl",
    "failure_window": "failure_window",
    "close_timeout": "stop_grace",
    "store_timeout": "store_retry",
    "standby_fill_timeout": "standby_fill",
    "collective_timeout": "collective",
    "progress_timeout": "progress",
    "etcd_outage_timeout": "outage",
}
KNOWN_RDZV_CONF = frozenset(_TIMEOUT_KEYS) | {"timeout", "read_timeout", "is_host"}


def timeouts_from_conf(conf: dict[str, str], stop_grace: float | None = None) -> Timeouts:
    """Timeouts from ``--rdzv-conf`` keys (torchrun's names where they exist)."""
    values: dict[str, float] = {}
    for key, field in _TIMEOUT_KEYS.items():
        if key in conf:
            try:
                values[field] = int(conf[key]) if field == "lease_ttl" else float(conf[key])
            except ValueError:
                kind = "an integer" if field == "lease_ttl" else "a number"
                raise ConfigError(f"--rdzv-conf {key}={conf[key]!r}: expected {kind}") from None
    if "join_timeout" not in conf and "timeout" in conf:
        try:
            values["join"] = float(conf["timeout"])
        except ValueError:
            raise ConfigError(f"--rdzv-conf timeout={conf['timeout']!r}: expected a number") from None
    if stop_grace is not None and "stop_grace" not in values:
        values["stop_grace"] = stop_grace
    if "collective" in values and "progress" not in values:
        values["progress"] = max(Timeouts.progress, 3 * values["collective"])
    if "lease_ttl" in values and "failure_window" not in values:
        values["failure_window"] = values["lease_ttl"] + 1.0
    return Timeouts(**values)
