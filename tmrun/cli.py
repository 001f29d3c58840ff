"""The ``tmrun`` command: a thin typer layer that reads flags and environment, builds frozen
configs and hands them to the launcher or the admin functions.

``tmrun [torchrun flags] script.py [args]`` launches (the default command); ``tmrun status``,
``tmrun drain NODE`` and ``tmrun events`` talk to a running job. The first word picks the
subcommand only when it is exactly a subcommand's name, so ``tmrun ./status`` still launches a
script called ``status``. Environment variables are read here and nowhere else. Exit codes are
listed in docs/cli.md and in :data:`EXIT_CODES`.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from agent.config import (KNOWN_RDZV_CONF, MAX_NODES, MAX_NPROC, MAX_RESTARTS, AgentConfig, WorkerSpec, parse_int,
                          parse_nnodes, parse_rdzv_conf, parse_seconds, timeouts_from_conf)
from agent.errors import ConfigError, JobNotFound, StoreError, TmrunError
from agent.output import parse_std_spec
from agent.slurm import detect_slurm
from tmrun import console
from tmrun.jobs import JobRef, find_job, running_jobs, runtime_dir

EXIT_CODES = {
    0: "success (the job succeeded; a drain completed)",
    1: "the job failed (a worker failed beyond the standby pool and --max-restarts, a worker failed after the "
       "job's last step, or rendezvous timed out)",
    2: "usage error: unknown or malformed flag, missing script, inconsistent values; a runtime, credential or "
       "etcd data directory that is not the user's own or is open to others",
    3: "etcd is unreachable (after bounded retries), or stayed unreachable for longer than the outage bound "
       "while the job ran (the workers were stopped cleanly)",
    4: "unknown node",
    5: "no running job found, or several and none chosen with --job (events: and no history file either)",
    6: "the leader rejected the request (for example: nobody can take the drained node's place)",
    130: "interrupted (SIGINT)",
    143: "terminated (SIGTERM)",
}
SUBCOMMANDS = ("status", "drain", "events", "top")
MAX_LOCAL_NODES = 256  # a local cluster runs one agent process per node on this machine

LAUNCH = "Launch"
RDZV = "Rendezvous (etcd)"
LOGS = "Logs"
TORCHRUN = "Accepted for torchrun compatibility"

launch_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                         context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]})
admin_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                        context_settings={"help_option_names": ["-h", "--help"]})

# flag -> why it does nothing (yet); warned about when set to a non-default value.
NO_EFFECT = {
    "start_method": "workers are always started as new processes",
    "event_log_handler": "events go to etcd and `tmrun events`",
    "run_path": "the script runs in a new interpreter as with a plain launch",
    "logs_specs": "use --log-dir, --redirects and --tee",
    "numa_binding": "NUMA binding is not implemented",
    "signals_to_handle": "SIGTERM, SIGINT, SIGHUP and SIGQUIT always stop the job cleanly",
    "duplicate_stdout_filters": "not implemented",
    "duplicate_stderr_filters": "not implemented",
    "virtual_local_rank": "not implemented",
    "node_rank": "node ranks follow the node names in the first generation (node-0 rank 0)",
    "master_addr": "the leader agent hosts the store; MASTER_ADDR is set for workers",
    "master_port": "the leader agent hosts the store; MASTER_PORT is set for workers",
    "monitor_interval": "worker exits are seen at once",
}


class Backend(str, enum.Enum):
    etcd = "etcd"
    etcd_v2 = "etcd-v2"
    c10d = "c10d"
    static = "static"


def _opt(*names: str, env: str | None = None, panel: str = LAUNCH, help: str = "", **kw):
    return typer.Option(*names, envvar=env, rich_help_panel=panel, help=help, show_envvar=bool(env), **kw)


def _integer(low: int, high: int):
    """A typer parser: an integer in [low, high], in ASCII digits (a usage error, exit 2, otherwise)."""
    def parse(text) -> int:
        try:
            return parse_int(str(text), "", low, high)
        except ConfigError as exc:
            raise typer.BadParameter(str(exc).strip()) from None
    return parse


def _seconds(text) -> float:
    """A typer parser: a finite, non-negative number of seconds (no NaN, no infinity)."""
    try:
        return parse_seconds(str(text), "")
    except ConfigError as exc:
        raise typer.BadParameter(str(exc).strip()) from None


@launch_app.command(help="Launch SCRIPT on every node, with standby nodes ready to take over. "
                    "Subcommands: tmrun status | drain NODE | events | top (see tmrun status --help).")
def launch(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(help="Training script, module (-m) or executable (--no-python).")],
    script_args: Annotated[Optional[list[str]], typer.Argument(help="Arguments for the script.")] = None,
    nnodes: Annotated[str, _opt("--nnodes", env="PET_NNODES", help="Nodes: N or MIN:MAX.")] = "1:1",
    nproc_per_node: Annotated[str, _opt("--nproc-per-node", "--nproc_per_node", env="PET_NPROC_PER_NODE",
                                        help="Workers per node: an integer, auto, cpu or gpu.")] = "1",
    standby: Annotated[int, _opt("--standby", env="TMRUN_STANDBY", help="Standby nodes kept ready (local cluster: "
                                 "started on this machine).", parser=_integer(0, MAX_NODES))] = 0,
    grow: Annotated[bool, _opt("--grow", env="TMRUN_GROW", help="Elastic jobs (--nnodes MIN:MAX): standbys and "
                               "nodes back from drain --rejoin grow the job while it is below MAX, instead of "
                               "waiting for a failure or drain.")] = False,
    redundancy: Annotated[int, _opt("--redundancy", env="TMRUN_REDUNDANCY", help="1: each rank of a tmrun-runtime "
                                    "script keeps its neighbour's shards (FSDP2) in host memory, so that a failure "
                                    "rolls back to the last complete copy instead of restarting. 0: off.",
                                    parser=_integer(0, 1))] = 0,
    redundancy_every: Annotated[int, _opt("--redundancy-every", env="TMRUN_REDUNDANCY_EVERY", help="Steps between "
                                          "two redundant copies (--redundancy 1).", parser=_integer(1, 1_000_000))] = 10,
    warm_start: Annotated[bool, _opt("--warm-start", env="TMRUN_WARM_START", help="Keep one Python with torch "
                                     "imported waiting per local rank, so that a restart skips starting Python and "
                                     "importing torch (about 290 MB each on CPU).")] = False,
    node_name: Annotated[Optional[str], _opt("--node-name", env="TMRUN_NODE_NAME",
                                             help="This node's name in the job (default: hostname).")] = None,
    max_restarts: Annotated[int, _opt("--max-restarts", "--max_restarts", env="PET_MAX_RESTARTS",
                                      help="In-place restarts allowed for the whole job once no standby is left.",
                                      parser=_integer(0, MAX_RESTARTS))] = 0,
    role: Annotated[str, _opt("--role", env="PET_ROLE", help="Worker role name (ROLE_NAME).")] = "default",
    module: Annotated[bool, _opt("-m", "--module", env="PET_MODULE", help="Run SCRIPT as a module (python -m).")] = False,
    no_python: Annotated[bool, _opt("--no-python", "--no_python", env="PET_NO_PYTHON",
                                    help="Run SCRIPT directly, not with python.")] = False,
    standalone: Annotated[bool, _opt("--standalone", env="PET_STANDALONE", panel=RDZV,
                                     help="Single-machine job: local cluster with an embedded etcd.")] = False,
    rdzv_backend: Annotated[Backend, _opt("--rdzv-backend", "--rdzv_backend", env="PET_RDZV_BACKEND", panel=RDZV,
                                          help="tmrun always uses etcd.")] = Backend.etcd,
    rdzv_endpoint: Annotated[str, _opt("--rdzv-endpoint", "--rdzv_endpoint", env="PET_RDZV_ENDPOINT", panel=RDZV,
                                       help="etcd://host:port[,host:port]; none: local cluster or SLURM.")] = "",
    rdzv_id: Annotated[str, _opt("--rdzv-id", "--rdzv_id", env="PET_RDZV_ID", panel=RDZV,
                                 help="Job id (default: slurm-<job id> under SLURM, local-<time>-<pid> in a local cluster, "
                                 "'default' with an endpoint).")] = "none",
    rdzv_conf: Annotated[str, _opt("--rdzv-conf", "--rdzv_conf", env="PET_RDZV_CONF", panel=RDZV,
                                   help="key=value,...: join_timeout, last_call_timeout, lease_ttl, "
                                   "failure_window, close_timeout, store_timeout, standby_fill_timeout, "
                                   "collective_timeout, progress_timeout.")] = "",
    local_addr: Annotated[Optional[str], _opt("--local-addr", "--local_addr", env="PET_LOCAL_ADDR", panel=RDZV,
                                              help="Address other nodes use to reach this one.")] = None,
    metrics_port: Annotated[Optional[int], _opt("--metrics-port", env="TMRUN_METRICS_PORT", panel=LOGS,
                                                help="Serve Prometheus metrics at http://<node>:PORT/metrics "
                                                "(0: a free port; a local cluster's node i: PORT+i). Off when "
                                                "not given.", parser=_integer(0, 65535))] = None,
    etcd_cacert: Annotated[Optional[str], _opt("--etcd-cacert", env="TMRUN_ETCD_CACERT", panel=RDZV)] = None,
    etcd_cert: Annotated[Optional[str], _opt("--etcd-cert", env="TMRUN_ETCD_CERT", panel=RDZV)] = None,
    etcd_key: Annotated[Optional[str], _opt("--etcd-key", env="TMRUN_ETCD_KEY", panel=RDZV)] = None,
    etcd_user: Annotated[Optional[str], _opt("--etcd-user", env="TMRUN_ETCD_USER", panel=RDZV,
                                             help="etcd user name (etcd's own authentication).")] = None,
    etcd_password_file: Annotated[Optional[str], _opt("--etcd-password-file", env="TMRUN_ETCD_PASSWORD_FILE",
                                                      panel=RDZV, help="File with the etcd user's password "
                                                      "(yours, mode 0600).")] = None,
    log_dir: Annotated[Optional[str], _opt("--log-dir", "--log_dir", env="PET_LOG_DIR", panel=LOGS,
                                           help="Directory for worker logs and error files.")] = None,
    redirects: Annotated[str, _opt("-r", "--redirects", env="PET_REDIRECTS", panel=LOGS,
                                   help="Send std streams to files only: 1 out, 2 err, 3 both; or 0:3,1:1.")] = "0",
    tee: Annotated[str, _opt("-t", "--tee", env="PET_TEE", panel=LOGS, help="Files and console (as --redirects).")] = "0",
    local_ranks_filter: Annotated[str, _opt("--local-ranks-filter", "--local_ranks_filter",
                                            env="PET_LOCAL_RANKS_FILTER", panel=LOGS,
                                            help="Only these local ranks reach the console, e.g. 0,1.")] = "",
    shutdown_timeout: Annotated[Optional[float], _opt("--shutdown-timeout", "--shutdown_timeout",
                                                      env="PET_SHUTDOWN_TIMEOUT", parser=_seconds,
                                                      help="Seconds from SIGTERM to SIGKILL for workers.")] = None,
    monitor_interval: Annotated[float, _opt("--monitor-interval", "--monitor_interval", env="PET_MONITOR_INTERVAL",
                                            panel=TORCHRUN, parser=_seconds)] = 0.1,
    start_method: Annotated[str, _opt("--start-method", "--start_method", env="PET_START_METHOD",
                                      panel=TORCHRUN)] = "spawn",
    event_log_handler: Annotated[str, _opt("--event-log-handler", "--event_log_handler",
                                           env="PET_EVENT_LOG_HANDLER", panel=TORCHRUN)] = "null",
    run_path: Annotated[bool, _opt("--run-path", "--run_path", env="PET_RUN_PATH", panel=TORCHRUN)] = False,
    logs_specs: Annotated[Optional[str], _opt("--logs-specs", "--logs_specs", env="PET_LOGS_SPECS",
                                              panel=TORCHRUN)] = None,
    numa_binding: Annotated[Optional[str], _opt("--numa-binding", "--numa_binding", env="PET_NUMA_BINDING",
                                                panel=TORCHRUN)] = None,
    signals_to_handle: Annotated[str, _opt("--signals-to-handle", "--signals_to_handle",
                                           env="PET_SIGNALS_TO_HANDLE", panel=TORCHRUN)] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    duplicate_stdout_filters: Annotated[str, _opt("--duplicate-stdout-filters", "--duplicate_stdout_filters",
                                                  env="PET_DUPLICATE_STDOUT_FILTERS", panel=TORCHRUN)] = "",
    duplicate_stderr_filters: Annotated[str, _opt("--duplicate-stderr-filters", "--duplicate_stderr_filters",
                                                  env="PET_DUPLICATE_STDERR_FILTERS", panel=TORCHRUN)] = "",
    virtual_local_rank: Annotated[bool, _opt("--virtual-local-rank", "--virtual_local_rank",
                                             env="PET_VIRTUAL_LOCAL_RANK", panel=TORCHRUN)] = False,
    node_rank: Annotated[int, _opt("--node-rank", "--node_rank", env="PET_NODE_RANK", panel=TORCHRUN,
                                   parser=_integer(0, MAX_NODES))] = 0,
    master_addr: Annotated[str, _opt("--master-addr", "--master_addr", env="PET_MASTER_ADDR",
                                     panel=TORCHRUN)] = "127.0.0.1",
    master_port: Annotated[int, _opt("--master-port", "--master_port", env="PET_MASTER_PORT", panel=TORCHRUN,
                                     parser=_integer(0, 65535))] = 29500,
) -> int:
    for name, why in NO_EFFECT.items():
        if _set_by_user(ctx, name):
            console.warning(f"--{name.replace('_', '-')} has no effect in tmrun: {why}")
    if _set_by_user(ctx, "rdzv_backend") and rdzv_backend is not Backend.etcd:
        console.warning(f"--rdzv-backend {rdzv_backend.value}: tmrun always uses etcd for rendezvous")
    if module and no_python:
        raise ConfigError("--module and --no-python cannot be used together")
    min_nodes, max_nodes = parse_nnodes(nnodes)
    if grow and min_nodes == max_nodes:
        console.warning(f"--grow has no effect with a fixed --nnodes {max_nodes}: the job never grows")
    nproc = _nproc(nproc_per_node)
    conf = parse_rdzv_conf(rdzv_conf)
    for key in sorted(set(conf) - KNOWN_RDZV_CONF):
        console.warning(f"--rdzv-conf {key}: unknown key, ignored")
    timeouts = timeouts_from_conf(conf, shutdown_timeout)
    parse_std_spec(redirects, "--redirects")
    parse_std_spec(tee, "--tee")
    worker = WorkerSpec(_worker_argv(script, script_args or [], module, no_python), nproc, role, log_dir,
                        redirects, tee, _ranks_filter(local_ranks_filter), max_restarts,
                        redundancy_every=redundancy_every if redundancy else 0, warm_start=warm_start)
    slurm = None if standalone else detect_slurm(os.environ)
    common = dict(min_nodes=min_nodes, max_nodes=max_nodes, timeouts=timeouts, worker=worker,
                  monitor_interval=monitor_interval, tls_cacert=etcd_cacert, tls_cert=etcd_cert, tls_key=etcd_key,
                  metrics_port=metrics_port, grow=grow, **_etcd_login(etcd_user, etcd_password_file))
    if standalone and rdzv_endpoint:
        console.warning("--standalone: ignoring --rdzv-endpoint, starting a local cluster")
    if standalone or (not rdzv_endpoint and slurm is None):
        return _launch_local(rdzv_id, standby, common)
    return _launch_node(rdzv_id, rdzv_endpoint, node_name, local_addr, standby, slurm, common)


def _set_by_user(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave ``name`` (flag or environment) a value other than its default."""
    source = ctx.get_parameter_source(name)
    if source is None or source.name == "DEFAULT":
        return False
    default = next((p.default for p in ctx.command.params if p.name == name), None)
    value = ctx.params.get(name)
    return str(getattr(value, "value", value)) != str(getattr(default, "value", default))


def _with_log_dir(common: dict) -> dict:
    """Redirected output needs a directory that outlives the job: make one when none was given."""
    worker: WorkerSpec = common["worker"]
    if worker.log_dir is None and (worker.redirects.strip() not in ("", "0") or worker.tee.strip() not in ("", "0")):
        worker = dataclasses.replace(worker, log_dir=tempfile.mkdtemp(prefix="tmrun-logs-"))
        console.info(f"worker logs go to {worker.log_dir}")
    return {**common, "worker": worker}


def _log_root(worker: WorkerSpec) -> Path:
    """Where the job's history file goes: ``--log-dir``, else the default log root (agent/history.py)."""
    from agent.history import default_log_root

    return Path(worker.log_dir) if worker.log_dir else default_log_root(os.environ)


def _launch_local(rdzv_id: str, standby: int, common: dict) -> int:
    from tmrun.launch import run_local_cluster

    job = rdzv_id if rdzv_id != "none" else f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    _check_job_id(job)
    common = _with_log_dir(common)
    creds = _user_credentials()
    common = {**common, **_client_files(creds)}
    total = common["max_nodes"] + standby
    if total > MAX_LOCAL_NODES:
        raise ConfigError(f"a local cluster of {total} nodes (--nnodes plus --standby) would run {total} agents on "
                          f"this machine; at most {MAX_LOCAL_NODES}")
    port = common.pop("metrics_port")
    if port and port + total - 1 > 65535:
        raise ConfigError(f"--metrics-port {port}: a local cluster of {total} nodes needs ports {port} to "
                          f"{port + total - 1}; pick a lower one")
    configs = [AgentConfig(job_id=job, node=f"node-{i}", host="127.0.0.1", endpoint="",
                           standby_hint=i >= common["max_nodes"], metrics_port=None if port is None else port and port + i,
                           **common) for i in range(total)]
    for cfg in configs:  # an agent that cannot open its port would leave the others waiting for it
        _check_port_free(cfg.host, cfg.metrics_port)
    return run_local_cluster(configs, runtime_dir(os.environ), console.info, _log_root(common["worker"]), creds)


def _check_port_free(host: str, port: int | None) -> None:
    """ConfigError (one line, exit 2) when ``host:port`` cannot be listened on now."""
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port} (--metrics-port): {exc.strerror or exc}") from None


def _etcd_login(user: str | None, password_file: str | None) -> dict[str, str | None]:
    """``--etcd-user`` and ``--etcd-password-file`` go together; the file is checked now (one line)."""
    if bool(user) != bool(password_file):
        raise ConfigError("--etcd-user and --etcd-password-file go together: give both or neither")
    if password_file:
        from agent.etcd_store import Login

        Login(user, password_file).password()
    return {"etcd_user": user, "etcd_password_file": password_file}


def _user_credentials():
    """The user's tmrun CA and client certificate (made on first use; agent/credentials.py)."""
    from agent.credentials import credentials_dir, user_credentials

    return user_credentials(credentials_dir(os.environ))


def _client_files(creds) -> dict[str, str | None]:
    """What agents present to the job's own etcd: the user's client certificate (no user name there)."""
    return {"tls_cacert": str(creds.ca), "tls_cert": str(creds.client), "tls_key": str(creds.client_key),
            "etcd_user": None, "etcd_password_file": None}


def _endpoint_tls(endpoint: str, cacert: str | None, cert: str | None, key: str | None) -> dict[str, str | None]:
    """The TLS files for ``endpoint``: those given, else the user's for an ``https://`` one."""
    from agent.credentials import credentials_dir
    from agent.etcd_store import client_tls

    tls = client_tls(endpoint, cacert, cert, key, credentials_dir(os.environ))
    return {"tls_cacert": tls.cacert if tls else None, "tls_cert": tls.cert if tls else None,
            "tls_key": tls.key if tls else None}


def _launch_node(rdzv_id: str, endpoint: str, node_name: str | None, local_addr: str | None, standby: int,
                 slurm, common: dict) -> int:
    from tmrun.launch import run_node

    hosting = None
    if slurm is not None:
        from agent.address import node_address

        job = rdzv_id if rdzv_id != "none" else f"slurm-{slurm.job_id}"
        _check_job_id(job)  # before anything is started
        name = node_name or slurm.this_host
        host = node_address(slurm.this_host, peers=slurm.hosts, override=local_addr)
        hint = slurm.node_id >= common["max_nodes"]
        if not endpoint:
            creds = _user_credentials()
            hosting = _etcd_member_host(slurm, job, name, host, common["timeouts"].lease_ttl, creds)
            endpoint = hosting.layout.endpoint
            common = {**common, **_client_files(creds)}
    else:
        job = rdzv_id if rdzv_id != "none" else "default"
        name = node_name or socket.gethostname()
        host = local_addr or socket.getfqdn()
        hint = False
    if standby and slurm is None:
        console.warning("--standby counts nodes only in a local cluster or under SLURM; "
                        "with an endpoint, every node beyond --nnodes is a standby")
    _check_job_id(job)
    if hosting is None:
        common = {**common, **_endpoint_tls(endpoint, common["tls_cacert"], common["tls_cert"], common["tls_key"])}
    common = _with_log_dir(common)
    cfg = AgentConfig(job_id=job, node=name, host=host, endpoint=endpoint, standby_hint=hint,
                      hosts_store=hosting is not None, **common)
    from agent.__main__ import setup_logging

    setup_logging(name)
    if hosting is not None:
        hosting.boot()  # the job's etcd cluster is up (this node's member too, if it has one)
    return run_node(cfg, hosting, console.info, _log_root(cfg.worker))


def _etcd_member_host(slurm, job: str, name: str, address: str, lease_ttl: int, creds):
    """This node's part in the job's embedded etcd cluster (agent/etcd_cluster.py), closed by TLS."""
    from agent.etcd_cluster import layout_for
    from agent.etcd_member import MemberHost
    from agent.shared_dirs import private_dir

    data_root = Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / f"tmrun-{job}"
    private_dir(data_root, "remove it, or set TMPDIR to a directory of your own")  # its name is easy to guess
    return MemberHost(layout_for(slurm, tls=True), name, address, data_root, report=console.warning,
                      grace=2.0 * lease_ttl + 2, credentials=creds)


def _check_job_id(job: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", job):
        raise ConfigError(f"--rdzv-id {job!r}: use letters, digits, '.', '_' and '-'")


def _nproc(text: str) -> int:
    text = text.strip()
    if re.fullmatch(r"[0-9]+", text):
        return parse_int(text, "--nproc-per-node", 0, MAX_NPROC)
    if text in ("auto", "gpu", "cpu"):
        if text == "cpu":
            return os.cpu_count() or 1
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if text == "gpu":
            raise ConfigError("--nproc-per-node gpu: no CUDA device is available")
        return os.cpu_count() or 1
    raise ConfigError(f"--nproc-per-node {text!r}: expected an integer, auto, cpu or gpu")


def _ranks_filter(text: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        return tuple(parse_int(part, "", 0, MAX_NPROC - 1) for part in text.split(","))
    except ConfigError:
        raise ConfigError(f"--local-ranks-filter {text!r}: expected a comma-separated list of local ranks "
                          f"(0 to {MAX_NPROC - 1})") from None


def _worker_argv(script: str, args: list[str], module: bool, no_python: bool) -> tuple[str, ...]:
    if module:
        top = script.split(".")[0]
        if not top or importlib.util.find_spec(top) is None:
            raise ConfigError(f"module {script!r} not found")
        return (sys.executable, "-u", "-m", script, *args)
    if no_python:
        if shutil.which(script) is None:
            raise ConfigError(f"executable {script!r} not found")
        return (script, *args)
    if not Path(script).is_file():
        raise ConfigError(f"script {script!r} not found")
    return (sys.executable, "-u", script, *args)


# ----------------------------------------------------------------------------- admin commands

JobOpt = Annotated[Optional[str], typer.Option("--job", "--rdzv-id", envvar="TMRUN_JOB",
                                               help="Job id, when several run or with --rdzv-endpoint.")]
EndpointOpt = Annotated[Optional[str], typer.Option("--rdzv-endpoint", envvar="TMRUN_ENDPOINT",
                                                    help="etcd endpoint of the job (default: local runtime file, "
                                                    "or the SLURM allocation's).")]
TimeoutOpt = Annotated[float, typer.Option("--store-timeout", help="Seconds to retry etcd before giving up.",
                                           parser=_seconds)]


def _job_ref(job: str | None, endpoint: str | None) -> JobRef:
    slurm = detect_slurm(os.environ)
    if endpoint:
        return JobRef(job or (f"slurm-{slurm.job_id}" if slurm else "default"), endpoint)
    if slurm is not None and job is None:
        from agent.etcd_cluster import layout_for

        return JobRef(f"slurm-{slurm.job_id}", layout_for(slurm, tls=True).endpoint)
    return find_job(runtime_dir(os.environ), job)


def _admin(ref: JobRef, store_timeout: float, work):
    from agent.credentials import credentials_dir
    from agent.etcd_store import EtcdStore, Login, client_tls, parse_endpoint
    from tmrun.admin import run

    env = os.environ
    tls = client_tls(ref.endpoint, env.get("TMRUN_ETCD_CACERT"), env.get("TMRUN_ETCD_CERT"), env.get("TMRUN_ETCD_KEY"),
                     credentials_dir(env))
    login = _etcd_login(env.get("TMRUN_ETCD_USER"), env.get("TMRUN_ETCD_PASSWORD_FILE"))

    async def go():
        store = EtcdStore(parse_endpoint(ref.endpoint), tls=tls, retry_deadline=store_timeout,
                          login=Login(login["etcd_user"], login["etcd_password_file"]) if login["etcd_user"] else None)
        try:
            return await work(store)
        finally:
            await store.close()

    return run(go())


@admin_app.command("status", help="Show the job's nodes, roles, generation and restarts.")
def status_cmd(job: JobOpt = None, endpoint: EndpointOpt = None,
               as_json: Annotated[bool, typer.Option("--json", help="Stable JSON for scripts.")] = False,
               store_timeout: TimeoutOpt = 10.0) -> int:
    from tmrun import admin

    ref = _job_ref(job, endpoint)
    doc = _admin(ref, store_timeout, lambda store: admin.status(store, ref.job))
    console.print_json(doc) if as_json else console.print_status(doc)
    return 0


@admin_app.command("drain", help="Take NODE out of the job: a standby takes its place. Waits until it has left.")
def drain_cmd(node: Annotated[str, typer.Argument(help="Node name, as in tmrun status.")],
              job: JobOpt = None, endpoint: EndpointOpt = None,
              no_wait: Annotated[bool, typer.Option("--no-wait", help="Return once the leader accepted.")] = False,
              rejoin: Annotated[bool, typer.Option("--rejoin", help="The node comes back to the pool as a standby "
                                                   "instead of leaving the job.")] = False,
              timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the node to leave.",
                                                     parser=_seconds)] = 600.0,
              store_timeout: TimeoutOpt = 10.0) -> int:
    from tmrun import admin

    ref = _job_ref(job, endpoint)
    _admin(ref, store_timeout, lambda store: admin.drain(store, ref.job, node, wait=not no_wait, timeout=timeout,
                                                         progress=console.info, rejoin=rejoin))
    return 0


@admin_app.command("top", help="The job live: nodes, roles, step rates, links and recent events, refreshed "
                   "in place until the job ends (Ctrl-C leaves).")
def top_cmd(job: JobOpt = None, endpoint: EndpointOpt = None,
            as_json: Annotated[bool, typer.Option("--json", help="One JSON frame per line, for scripts.")] = False,
            interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.",
                                                    parser=_seconds)] = 1.0,
            count: Annotated[Optional[int], typer.Option("--count", help="Stop after this many frames.",
                                                         parser=_integer(1, 10**9))] = None,
            store_timeout: TimeoutOpt = 10.0) -> int:
    from rich.live import Live

    from tmrun import top

    if interval < 0.1:
        raise ConfigError(f"--interval {interval:g}: at least 0.1 seconds")
    ref = _job_ref(job, endpoint)
    shown: list[str] = []  # each frame's job state

    def follow(show) -> bool:
        """Frames until the job ends; True when its etcd went first (a local job's stops with it)."""
        def emit(frame: dict) -> None:
            shown.append(frame["state"])
            show(frame)
        try:
            _admin(ref, store_timeout, lambda store: top.follow(store, ref.job, interval, count, emit))
        except StoreError:
            if not (shown and endpoint is None and not _still_running(job, ref)):
                raise
            return True
        return False

    def gone() -> None:  # said after the live view has stopped drawing, or it would draw over the line
        console.info(f"job {ref.job} has ended and its etcd with it; tmrun events --job {ref.job} shows how")

    if as_json:
        def line(frame: dict) -> None:
            sys.stdout.write(json.dumps(frame, sort_keys=True) + "\n")
            sys.stdout.flush()

        if follow(line):
            gone()
        return 0
    ended_unseen = False
    try:
        with Live(console=console.screen(), auto_refresh=False, redirect_stderr=False) as live:
            ended_unseen = follow(lambda frame: live.update(top.render(frame), refresh=True))
    except KeyboardInterrupt:  # the way out of a live view: not an error
        pass
    if ended_unseen:
        gone()
    return 0


def _still_running(job: str | None, ref: JobRef) -> bool:
    """Whether the local job ``ref`` still has its runtime file (a SLURM job: assumed running)."""
    if job is None and detect_slurm(os.environ) is not None:
        return True
    try:
        find_job(runtime_dir(os.environ), ref.job)
    except JobNotFound:
        return False
    return True


@admin_app.command("events", help="Show the job's history: generations, failures, drains. "
                   "A job that has ended is read from its history file.")
def events_cmd(job: JobOpt = None, endpoint: EndpointOpt = None,
               as_json: Annotated[bool, typer.Option("--json", help="JSON for scripts.")] = False,
               store_timeout: TimeoutOpt = 10.0,
               log_dir: Annotated[Optional[str], typer.Option(
                   "--log-dir", envvar="TMRUN_LOG_DIR", show_envvar=True,
                   help="Log root of finished jobs' history files (default: $XDG_STATE_HOME/tmrun/logs, "
                   "else ~/.local/state/tmrun/logs).")] = None) -> int:
    from tmrun import admin

    try:
        ref = _job_ref(job, endpoint)
    except JobNotFound:
        runtime = runtime_dir(os.environ)
        if job is None and running_jobs(runtime):
            raise  # several jobs run: choosing one is the answer, not a history
        rows = _history_rows(job, log_dir, runtime, quiet=as_json)
    else:
        rows = _admin(ref, store_timeout, lambda store: admin.events(store, ref.job))
    console.print_json(rows) if as_json else console.print_events(rows)
    return 0


def _history_rows(job: str | None, log_dir: str | None, runtime: Path, quiet: bool) -> list[dict]:
    """A finished job's events from ``<log root>/<job>/events.jsonl``; with no ``job``, the only history."""
    from agent.history import default_log_root, history_path, list_histories, load_history

    root = Path(log_dir) if log_dir else default_log_root(os.environ)
    if job is None:
        found = list_histories(root)
        if not found:
            raise JobNotFound(f"no running tmrun job found in {runtime} and no job history in {root}; "
                              "give --job, --log-dir or --rdzv-endpoint")
        if len(found) > 1:
            names = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
            raise JobNotFound(f"no running tmrun job found in {runtime}, and {len(found)} job histories in "
                              f"{root} ({names}); choose one with --job")
        job = found[0]
    path = history_path(root, job)
    try:
        header, rows = load_history(path)
    except JobNotFound:
        raise JobNotFound(f"no job {job!r}: not running (looked in {runtime}) and no history file {path}") from None
    if not quiet:
        outcome = header["outcome"]
        ended = f"{outcome['state']}: {outcome['reason']}" if outcome else "no outcome"
        console.info(f"job {job} has ended ({ended}); its history from {path}")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tmrun`` console script; returns (and exits with) the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    is_admin = bool(args) and args[0] in SUBCOMMANDS
    app = admin_app if is_admin else launch_app
    command = typer.main.get_command(app)
    try:
        code = command.main(args=args, prog_name="tmrun", standalone_mode=False)
    except typer.Abort:
        code = 130
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.TyperException as exc:  # typer's (vendored click) usage errors
        if type(exc).__name__ == "NoArgsIsHelpError" and getattr(exc, "ctx", None) is not None:
            print(exc.ctx.get_help(), file=sys.stderr)
        else:
            console.error(exc.format_message().replace("\n", " "))
        code = 2
    except TmrunError as exc:
        console.error(str(exc))
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    code = 0 if code is None else int(code)
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
