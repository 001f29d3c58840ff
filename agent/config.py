"""Frozen configuration handed from the CLI to an agent: who it is, where etcd is, what to run.

The CLI layer reads flags and environment variables and builds one :class:`AgentConfig`; the agent
never reads the environment for its own settings. A config travels to a local-cluster agent
process as JSON (``to_json``/``from_json``), never as pickle.

Numbers from the command line go through :func:`parse_int` and :func:`parse_seconds`: ASCII digits
only (Python's ``int`` takes ``"٣"`` for 3 and fails late on ``"²"``), finite (``float`` takes
``nan`` and ``inf``) and within bounds (:data:`MAX_NODES`, :data:`MAX_NPROC`, :data:`MAX_SECONDS`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from agent.errors import ConfigError

SCHEMA = 1
MAX_NODES = 100_000  # nodes in a job (--nnodes, --standby)
MAX_NPROC = 1024  # workers per node
MAX_RESTARTS = 10_000
MAX_SECONDS = 10_000_000.0  # any timeout: about 115 days

_INT = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def parse_int(text: str, what: str, low: int, high: int) -> int:
    """``text`` as an integer in [low, high], written in ASCII digits; ConfigError otherwise."""
    text = text.strip()
    if not _INT.fullmatch(text):
        raise ConfigError(f"{what} {text!r}: expected an integer")
    if len(text) > 20 or not low <= int(text) <= high:
        raise ConfigError(f"{what} {text[:24]}: expected {low} to {high}")
    value = int(text)
    return value


def parse_seconds(text: str, what: str, high: float = MAX_SECONDS) -> float:
    """``text`` as a finite number of seconds in [0, high]; ConfigError otherwise (NaN, inf, "٣")."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        raise ConfigError(f"{what} {text!r}: expected a number of seconds")
    value = float(text)
    if not 0 <= value <= high:
        raise ConfigError(f"{what} {text}: expected a non-negative number of seconds, at most {high:g}")
    return value


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
    - ``link_check``: every this many seconds an agent checks its link to every member (a TCP
      handshake with each member's agent, agent/links.py); two misses in a row mark the link
      down, and the leader takes one end out of the job. 0 turns the checks off.
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
    link_check: float = 1.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECONDS:
                raise ConfigError(f"timeout {field.name} must be a number from 0 to {MAX_SECONDS:g}, got {value!r}")
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
    redundancy_every: int = 0  # --redundancy: snapshot every N steps (0: off), TMRUN_REDUNDANCY* for the runtime
    warm_start: bool = False  # --warm-start: an interpreter with torch imported waits per local rank (agent/warm.py)

    def __post_init__(self) -> None:
        if not self.argv:
            raise ConfigError("nothing to run: no script given")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nproc_per_node > MAX_NPROC:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node}: at most {MAX_NPROC}")
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ConfigError(f"--max-restarts must be from 0 to {MAX_RESTARTS}, got {self.max_restarts}")


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
    metrics_port: int | None = None  # --metrics-port: None off, 0 a free port (agent/metrics.py)
    grow: bool = False  # --grow: standbys and rejoined nodes grow an elastic job below MAX

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"--nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX")
        if self.max_nodes > MAX_NODES:
            raise ConfigError(f"--nnodes {self.max_nodes}: at most {MAX_NODES}")
        if not (isinstance(self.monitor_interval, (int, float)) and 0 <= self.monitor_interval <= MAX_SECONDS):
            raise ConfigError(f"--monitor-interval {self.monitor_interval!r}: expected 0 to {MAX_SECONDS:g} seconds")
        if self.metrics_port is not None and not (isinstance(self.metrics_port, int) and 0 <= self.metrics_port <= 65535):
            raise ConfigError(f"--metrics-port {self.metrics_port!r}: expected a port from 0 to 65535")
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
    if len(parts) > 2 or not all(_INT.fullmatch(part.strip()) and len(part.strip()) <= 20 for part in parts):
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX")
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high:
        raise ConfigError(f"--nnodes {text}: need 1 <= MIN <= MAX")
    if high > MAX_NODES:
        raise ConfigError(f"--nnodes {text}: at most {MAX_NODES} nodes")
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
    "link_check": "link_check",
}
KNOWN_RDZV_CONF = frozenset(_TIMEOUT_KEYS) | {"timeout", "read_timeout", "is_host"}


def _conf_value(key: str, text: str, integer: bool = False) -> float:
    pattern = _INT if integer else _NUMBER
    if not pattern.fullmatch(text) or len(text) > 40:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"--rdzv-conf {key}={text!r}: expected {kind}")
    value = int(text) if integer else float(text)
    if not 0 <= value <= MAX_SECONDS:
        raise ConfigError(f"--rdzv-conf {key}={text}: expected a non-negative number, at most {MAX_SECONDS:g}")
    return value


def timeouts_from_conf(conf: dict[str, str], stop_grace: float | None = None) -> Timeouts:
    """Timeouts from ``--rdzv-conf`` keys (torchrun's names where they exist)."""
    values: dict[str, float] = {}
    for key, field in _TIMEOUT_KEYS.items():
        if key in conf:
            values[field] = _conf_value(key, conf[key], integer=field == "lease_ttl")
    if "join_timeout" not in conf and "timeout" in conf:
        values["join"] = _conf_value("timeout", conf["timeout"])
    if stop_grace is not None and "stop_grace" not in values:
        values["stop_grace"] = stop_grace
    if "collective" in values and "progress" not in values:
        values["progress"] = max(Timeouts.progress, 3 * values["collective"])
    if "lease_ttl" in values and "failure_window" not in values:
        values["failure_window"] = values["lease_ttl"] + 1.0
    return Timeouts(**values)
