"""A real multi-host SLURM cluster on this machine, for tests.

``tests/slurmlab/up.sh`` (root only) starts Debian's slurm-wlm 22.05: ``slurmctld`` in the host's
network namespace (as ``slurmctl``, 10.77.0.1 on bridge ``slurmbr0``) and one ``slurmd`` per node
``nodeK`` in its own network + UTS namespace (host name ``nodeK``, address 10.77.0.1K). Every job
step runs inside its node's namespaces, so host names, ``SLURM_JOB_NODELIST`` and addresses look
like separate machines; ``/tmp``, ``/dev/shm``, the process list, CPUs and memory are shared.
``tests/slurmlab/down.sh`` removes all of it again.

Fixtures (imported into ``tests/conftest.py``; mark the tests ``@pytest.mark.slurm``):

- ``slurm_cluster`` (session): brings the cluster up (4 nodes x 2 CPUs), yields a
  :class:`SlurmCluster`, and at the end of the session tears it down and asserts that nothing is
  left (namespaces, bridge, ``/etc/hosts`` block, daemons, processes of the nodes). Skipped only
  when not root or network namespaces are unusable. Two pytest sessions never share it: the second
  one waits for ``/tmp/slurmlab.lock``.
- ``slurm`` (function): the same cluster, with every node idle and reachable before the test;
  after the test it cancels the jobs that are left and fails the test if any process is still
  alive in a node's namespace (other than ``slurmd``), after killing it.

Job work dirs are made under ``/tmp/slurmlab/jobs`` (every node sees /tmp) and removed at the end
of the session unless ``SLURMLAB_KEEP`` is set; daemon logs stay in ``/tmp/slurmlab/log``.

Waiting is done by polling the daemons (``scontrol``, ``sinfo``, ``squeue``) or ``/proc`` in a
short loop until a condition holds, never by a fixed sleep.

Traffic cuts use ``tc``: this kernel has neither the ``prio`` qdisc nor the ``gact`` (``action
drop``) module, nor iptables; what it has is ``clsact``, the ``u32`` classifier and ``mirred``.
So :meth:`SlurmCluster.block_port` redirects matching packets to a veth inside the node that is
kept down, which drops them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import pytest

SCRIPTS = Path(__file__).resolve().parent / "slurmlab"
LAB = Path(os.environ.get("SLURMLAB_DIR", "/tmp/slurmlab"))
LOCK = Path("/tmp/slurmlab.lock")
NET = "10.77.0"
BRIDGE = "slurmbr0"
BLACKHOLE = "sldrop0"  # a veth inside each node, kept down: packets redirected to it are dropped

# JobState values after which a job does nothing any more (COMPLETING is not one of them).
TERMINAL = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT",
})
SLURM_COMMS = frozenset({"slurmctld", "slurmd", "slurmstepd", "slurmscriptd"})
CMD_TIMEOUT = 30.0

T = TypeVar("T")


class SlurmError(RuntimeError):
    """A SLURM command or one of the lab scripts failed."""


@dataclasses.dataclass(frozen=True)
class NodeProcess:
    """A process living in a node's network namespace."""

    node: str
    pid: int
    comm: str
    cmdline: str

    def __str__(self) -> str:
        return f"{self.node}: pid {self.pid} ({self.comm}) {self.cmdline}"


def wait_for(condition: Callable[[], T], timeout: float, what: str) -> T:
    """Poll ``condition`` (a few ms apart, growing to 0.2 s) until it returns a true value."""
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(pause)
        pause = min(0.2, pause * 1.5)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _pidfile(path: Path, comm: str) -> int | None:
    """The pid in ``path`` if that process is alive and is ``comm``."""
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) and _read(f"/proc/{pid}/comm") == comm else None


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = CMD_TIMEOUT,
         **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} exited with {proc.returncode}: "
                         f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why this machine cannot host the lab (None when it can)."""
    if os.geteuid() != 0:
        return "the SLURM lab needs root (network namespaces, daemons as root)"
    if shutil.which("ip") is None:
        # up.sh would install iproute2; probe namespaces with unshare meanwhile.
        probe = ["unshare", "--net", "--uts", "true"]
    else:
        name = f"slurmlab-probe-{os.getpid()}"
        probe = ["sh", "-c", f"ip netns add {name} && ip netns del {name}"]
    try:
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces are unusable here: {exc}"
    if proc.returncode != 0:
        return f"network namespaces are unusable here: {proc.stderr.strip()}"
    return None


class SlurmCluster:
    """The lab cluster: start/stop it, run things on its nodes, submit and watch jobs, cut ports."""

    def __init__(self, nodes: int = 4, cpus: int = 2, mem_mb: int = 4096, lab: Path = LAB) -> None:
        self.lab = Path(lab)
        self.nodes: list[str] = [f"node{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.mem_mb = mem_mb
        self.jobs_dir = self.lab / "jobs"
        self.up_seconds: float | None = None
        self.up_log = ""
        self._workdirs: list[Path] = []
        self._job_outputs: dict[int, Path] = {}
        self._blocks: dict[tuple[str, int | str, bool], list[tuple[str, str, int]]] = {}
        self._prefs = itertools.count(100)
        self._started: set[int] = set()  # daemons up.sh started, for the final check

    def __repr__(self) -> str:
        return f"SlurmCluster(nodes={self.nodes}, lab={str(self.lab)!r})"

    # ------------------------------------------------------------------ life cycle
    def _script_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SLURMLAB_DIR=str(self.lab), SLURMLAB_NODES=str(len(self.nodes)),
                   SLURMLAB_CPUS=str(self.cpus), SLURMLAB_MEM=str(self.mem_mb), SLURMLAB_NET=NET)
        return env

    def up(self, timeout: float = 900) -> float:
        """Run up.sh (idempotent: installs packages, rewrites config, starts what is missing)."""
        t0 = time.monotonic()
        proc = subprocess.run(["bash", str(SCRIPTS / "up.sh")], env=self._script_env(),
                              capture_output=True, text=True, timeout=timeout)
        self.up_log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise SlurmError(f"up.sh failed ({proc.returncode}):\n{self.up_log}")
        self.up_seconds = time.monotonic() - t0
        self._started |= set(self.daemon_pids().values())
        munged = _pidfile(self.lab / "run" / "munged.pid", "munged")
        if munged:
            self._started.add(munged)
        return self.up_seconds

    def daemons_alive(self) -> bool:
        pids = self.daemon_pids()
        return "slurmctld" in pids and all(n in pids for n in self.nodes)

    def daemon_pids(self) -> dict[str, int]:
        """{"slurmctld": pid, "node1": slurmd pid, ...} for the daemons that are alive."""
        run = self.lab / "run"
        found = {"slurmctld": _pidfile(run / "slurmctld.pid", "slurmctld")}
        for node in self.nodes:
            found[node] = _pidfile(run / f"slurmd.{node}.pid", "slurmd")
        return {k: v for k, v in found.items() if v}

    def down(self, timeout: float = 120) -> None:
        """Run down.sh, then raise if anything of the cluster is left."""
        tracked = set(self._started) | set(self.daemon_pids().values())
        for node in self.nodes:
            tracked |= {p.pid for p in self._node_processes(node)}
        proc = subprocess.run(["bash", str(SCRIPTS / "down.sh")], env=self._script_env(),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise SlurmError(f"down.sh failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        if not os.environ.get("SLURMLAB_KEEP"):
            for d in self._workdirs:
                shutil.rmtree(d, ignore_errors=True)
        try:
            wait_for(lambda: not self.residue(tracked), 10, "the lab to be gone")
        except TimeoutError:
            problems = self.residue(tracked)
            raise SlurmError("down.sh left things behind:\n  " + "\n  ".join(problems)) from None

        def reaped() -> bool:  # pid 1 here takes up to a second to reap the daemons' zombies
            return not any(int(e) in tracked or _read(f"/proc/{e}/comm") in SLURM_COMMS
                           for e in os.listdir("/proc") if e.isdigit())
        with contextlib.suppress(TimeoutError):
            wait_for(reaped, 5, "the daemons' zombies to be reaped")

    def residue(self, pids: set[int] = frozenset()) -> list[str]:
        """What is left of a cluster: namespaces, bridge, hosts block, slurm daemons, ``pids``."""
        problems = []
        netns = _run(["ip", "netns", "list"], check=False).stdout.split()
        problems += [f"netns {n}" for n in netns if re.fullmatch(r"node\d+", n)]
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            problems.append(f"bridge {BRIDGE}")
        if "# BEGIN slurmlab" in Path("/etc/hosts").read_text():
            problems.append("slurmlab block in /etc/hosts")
        for entry in os.listdir("/proc"):
            if entry.isdigit() and alive(int(entry)):
                comm = _read(f"/proc/{entry}/comm")
                if comm in SLURM_COMMS or int(entry) in pids:
                    problems.append(f"pid {entry} ({comm}) {_read(f'/proc/{entry}/cmdline')}")
        return problems

    # ------------------------------------------------------------------ nodes
    def _check(self, node: str) -> str:
        if node not in self.nodes:
            raise ValueError(f"no node {node!r} (nodes: {self.nodes})")
        return node

    def ip(self, node: str) -> str:
        """The node's address on the cluster network (node3 -> 10.77.0.13)."""
        return f"{NET}.{10 + self.nodes.index(self._check(node)) + 1}"

    def node_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs on ``node`` (its network, UTS and /sys)."""
        return [str(self.lab / f"on-{self._check(node)}"), *map(str, argv)]

    def on_node(self, node: str, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(argv, **kwargs)`` on ``node``, outside SLURM."""
        return subprocess.run(self.node_argv(node, argv), **kwargs)

    def popen_on_node(self, node: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(argv, **kwargs)`` on ``node``; the caller must stop it."""
        return subprocess.Popen(self.node_argv(node, argv), **kwargs)

    def node_state(self, node: str) -> str:
        """sinfo's short state: idle, mix, alloc, drain, drng, down*, ..."""
        out = _run(["sinfo", "-h", "-N", "-n", self._check(node), "-o", "%t"]).stdout.split()
        return out[0] if out else "unknown"

    def node_states(self) -> dict[str, str]:
        out = _run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def drain(self, node: str, reason: str = "test") -> None:
        _run(["scontrol", "update", f"NodeName={self._check(node)}", "State=DRAIN",
              f"Reason={reason}"])

    def resume(self, node: str) -> None:
        _run(["scontrol", "update", f"NodeName={self._check(node)}", "State=RESUME"])

    def wait_nodes_idle(self, timeout: float = 30) -> None:
        def idle():
            states = self.node_states()
            return all(states.get(n) == "idle" for n in self.nodes)
        try:
            wait_for(idle, timeout, "every node to be idle")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {self.node_states()}") from None

    def link_down(self, node: str) -> None:
        """Cut the node off the network (its veth on the bridge goes down)."""
        _run(["ip", "link", "set", f"slv-{self._check(node)}", "down"])

    def link_up(self, node: str) -> None:
        _run(["ip", "link", "set", f"slv-{self._check(node)}", "up"])

    # ------------------------------------------------------------------ processes
    def _netns_id(self, node: str) -> tuple[int, int]:
        st = os.stat(f"/run/netns/{self._check(node)}")
        return st.st_dev, st.st_ino

    def _node_processes(self, node: str) -> list[NodeProcess]:
        try:
            ns = self._netns_id(node)
        except FileNotFoundError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
            except OSError:  # gone, or a zombie (no namespaces any more)
                continue
            if (st.st_dev, st.st_ino) == ns and alive(int(entry)):
                found.append(NodeProcess(node, int(entry), _read(f"/proc/{entry}/comm"),
                                         _read(f"/proc/{entry}/cmdline")))
        return found

    def node_pids(self, node: str) -> list[int]:
        """Pids of the live processes whose network namespace is ``node``'s (slurmd included)."""
        return [p.pid for p in self._node_processes(node)]

    def node_processes(self, node: str | None = None) -> list[NodeProcess]:
        """Like :meth:`node_pids`, with names and command lines; all nodes when ``node`` is None."""
        return [p for n in ([node] if node else self.nodes) for p in self._node_processes(n)]

    def leftovers(self, exclude_daemons: bool = True) -> list[NodeProcess]:
        """Processes alive in any node's namespace, other than the nodes' ``slurmd``s."""
        daemons = set(self.daemon_pids().values()) if exclude_daemons else set()
        return [p for p in self.node_processes() if p.pid not in daemons]

    def escaped(self) -> list[NodeProcess]:
        """:meth:`leftovers` that SLURM will never clean up: not under any slurmstepd (processes
        that left their job, or were started on a node outside SLURM)."""
        parent: dict[int, int] = {}
        stepds = set()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if _read(f"/proc/{entry}/comm") == "slurmstepd":
                    stepds.add(int(entry))

        def managed(pid: int) -> bool:
            seen = set()
            while pid > 1 and pid not in seen:
                if pid in stepds:
                    return True
                seen.add(pid)
                pid = parent.get(pid, 0)
            return False

        return [p for p in self.leftovers() if not managed(p.pid)]

    def wait_no_leftovers(self, timeout: float = 15) -> list[NodeProcess]:
        """Wait until :meth:`leftovers` is empty; return what is still there after ``timeout``."""
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not self.leftovers(), timeout, "node processes to exit")
        return self.leftovers()

    def kill(self, procs: Sequence[NodeProcess], timeout: float = 10) -> None:
        """SIGKILL ``procs`` and wait until they are gone."""
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        wait_for(lambda: not any(alive(p.pid) for p in procs), timeout, "killed processes to go")

    # ------------------------------------------------------------------ jobs
    def workdir(self, prefix: str = "job-") -> Path:
        """A fresh directory under ``$LAB/jobs`` (seen by every node: /tmp is shared)."""
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.jobs_dir, 0o1777)
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.jobs_dir))
        os.chmod(path, 0o1777)
        self._workdirs.append(path)
        return path

    @staticmethod
    def job_env(env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment sbatch gets (and exports to the job): ours without SLURM_*/SBATCH_*/
        SRUN_*, the venv's bin first on PATH, then ``env``."""
        out = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        bindir = os.path.dirname(sys.executable)
        out["PATH"] = os.pathsep.join([bindir, *(p for p in out.get("PATH", "").split(os.pathsep)
                                                 if p and p != bindir)])
        out.update(env or {})
        return out

    def sbatch(self, script: str | None = None, *, wrap: str | None = None, nodes: int = 1,
               workdir: Path | None = None, env: dict[str, str] | None = None,
               args: Sequence[str] = (), job_name: str | None = None, script_path: Path | None = None,
               script_args: Sequence[str] = ()) -> int:
        """Submit a batch job (a script's text, a script file with ``script_args``, or a ``wrap``
        command line) on ``nodes`` nodes; its output (stdout + stderr) goes to
        ``workdir/slurm-<id>.out`` (see :meth:`output`). The job runs in ``workdir`` (a fresh one
        by default) with ``--export=ALL`` of :meth:`job_env`. Returns the job id."""
        if sum(x is not None for x in (script, wrap, script_path)) != 1:
            raise ValueError("give exactly one of script, script_path and wrap")
        workdir = Path(workdir) if workdir is not None else self.workdir()
        argv = ["sbatch", "--parsable", f"--nodes={nodes}", f"--chdir={workdir}",
                f"--output={workdir}/slurm-%j.out", "--export=ALL"]
        if job_name:
            argv.append(f"--job-name={job_name}")
        argv += list(args)
        if wrap is not None:
            argv += ["--wrap", wrap]
        elif script_path is not None:
            argv += [str(script_path), *script_args]
        elif not script.startswith("#!"):
            script = "#!/bin/bash\n" + script
        proc = _run(argv, input=script, env=self.job_env(env))
        job_id = int(proc.stdout.strip().split(";")[0])
        self._job_outputs[job_id] = workdir / f"slurm-{job_id}.out"
        return job_id

    def output_path(self, job_id: int) -> Path:
        return self._job_outputs[job_id]

    def output(self, job_id: int) -> str:
        """What the job wrote so far ("" before it started)."""
        try:
            return self._job_outputs[job_id].read_text()
        except FileNotFoundError:
            return ""

    def job_info(self, job_id: int) -> str:
        """``scontrol show job -o`` of the job: one line of Key=Value pairs."""
        return _run(["scontrol", "show", "job", "-o", str(job_id)]).stdout.strip()

    def job_field(self, job_id: int, key: str) -> str:
        m = re.search(rf"(?:^| ){key}=(\S*)", self.job_info(job_id))
        if not m:
            raise SlurmError(f"job {job_id} has no {key}")
        return m.group(1)

    def job_state(self, job_id: int) -> str:
        """PENDING, RUNNING, COMPLETING, COMPLETED, CANCELLED, FAILED, ..."""
        return self.job_field(job_id, "JobState")

    def wait_state(self, job_id: int, states: set[str] | frozenset[str],
                   timeout: float = 60) -> str:
        """Wait until the job's state is one of ``states``; return it."""
        try:
            return wait_for(lambda: (s := self.job_state(job_id)) in states and s,
                            timeout, f"job {job_id} to reach {sorted(states)}")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; now {self.job_info(job_id)}\n--- output:\n"
                               f"{self.output(job_id)[-3000:]}") from None

    def wait_job(self, job_id: int, timeout: float = 60) -> str:
        """Wait until the job is over (and no longer COMPLETING); return its final state."""
        return self.wait_state(job_id, TERMINAL, timeout)

    def jobs(self) -> list[int]:
        """Ids of the jobs the controller has that are not over."""
        return [int(j) for j in _run(["squeue", "-h", "-o", "%A"]).stdout.split()]

    def scancel(self, job_id: int, signal: str | None = None) -> None:
        """Cancel the job (or, with ``signal``, only send that signal to its steps)."""
        argv = ["scancel"] + ([f"--signal={signal}"] if signal else []) + [str(job_id)]
        _run(argv)

    def cancel_all(self, timeout: float = 30) -> list[int]:
        """Cancel every job and wait until the queue is empty; return the ids cancelled."""
        ids = self.jobs()
        if ids:
            _run(["scancel", *map(str, ids)], check=False)
            wait_for(lambda: not self.jobs(), timeout, f"jobs {ids} to end")
        return ids

    # ------------------------------------------------------------------ traffic
    def _tc(self, node: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["tc", "-n", node, *args], check=check)

    def _prepare_blocking(self, node: str) -> None:
        if _run(["ip", "-n", node, "link", "show", BLACKHOLE], check=False).returncode != 0:
            _run(["ip", "-n", node, "link", "add", BLACKHOLE, "type", "veth",
                  "peer", "name", "sldrop1"])
        for dev in ("eth0", "lo"):
            if "clsact" not in self._tc(node, "qdisc", "show", "dev", dev).stdout:
                self._tc(node, "qdisc", "add", "dev", dev, "clsact")

    def block_port(self, node: str, port: int, *, inbound: bool = False) -> None:
        """Drop TCP packets with destination ``port`` (IPv4 and IPv6) that ``node`` sends
        (default: it can reach no server at that port, on any node, itself included) or, with
        ``inbound``, that reach ``node`` (no one reaches a server on ``node`` at that port).
        Traffic of the node to itself goes over ``lo`` and is cut in both cases."""
        key = (self._check(node), int(port), inbound)
        if key in self._blocks:
            return
        self._prepare_blocking(node)
        hooks = [("eth0", "ingress" if inbound else "egress"), ("lo", "egress")]
        added = []
        for dev, hook in hooks:
            for proto, sel in (("ip", "ip"), ("ipv6", "ip6")):
                pref = next(self._prefs)
                self._tc(node, "filter", "add", "dev", dev, hook, "protocol", proto, "pref",
                         str(pref), "u32", "match", sel, "protocol", "6", "0xff",
                         "match", sel, "dport", str(port), "0xffff",
                         "action", "mirred", "egress", "redirect", "dev", BLACKHOLE)
                added.append((dev, hook, pref))
        self._blocks[key] = added

    def cut_link(self, a: str, b: str) -> None:
        """Drop every IPv4 packet between nodes ``a`` and ``b`` (each end's ``eth0`` egress to the
        other's address); their links to everyone else stay up."""
        for node, peer in ((a, b), (b, a)):
            key = (self._check(node), f"to {self.ip(peer)}", False)
            if key in self._blocks:
                continue
            self._prepare_blocking(node)
            pref = next(self._prefs)
            self._tc(node, "filter", "add", "dev", "eth0", "egress", "protocol", "ip", "pref", str(pref), "u32",
                     "match", "ip", "dst", f"{self.ip(peer)}/32", "action", "mirred", "egress", "redirect",
                     "dev", BLACKHOLE)
            self._blocks[key] = [("eth0", "egress", pref)]

    def restore_link(self, a: str, b: str) -> None:
        """Undo :meth:`cut_link`."""
        for node, peer in ((a, b), (b, a)):
            for dev, hook, pref in self._blocks.pop((self._check(node), f"to {self.ip(peer)}", False), []):
                self._tc(node, "filter", "del", "dev", dev, hook, "pref", str(pref))

    def unblock_port(self, node: str, port: int, *, inbound: bool = False) -> None:
        """Undo :meth:`block_port` with the same arguments."""
        for dev, hook, pref in self._blocks.pop((self._check(node), int(port), inbound), []):
            self._tc(node, "filter", "del", "dev", dev, hook, "pref", str(pref))

    def unblock_all(self) -> None:
        """Remove every traffic filter from every node."""
        self._blocks.clear()
        for node in self.nodes:
            for dev in ("eth0", "lo"):
                if "clsact" in self._tc(node, "qdisc", "show", "dev", dev).stdout:
                    self._tc(node, "qdisc", "del", "dev", dev, "clsact")

    # ------------------------------------------------------------------ between tests
    def _clear(self, timeout: float, grace: float = 2.0) -> list[NodeProcess]:
        """Lift filters, bring links up, cancel every job. Processes in the nodes that SLURM does
        not manage (:meth:`escaped`) still there after ``grace`` seconds are killed at once; those
        under a slurmstepd get ``timeout`` seconds to be cleaned up by SLURM before they are
        killed too. Returns what had to be killed."""
        self.unblock_all()
        for node in self.nodes:
            self.link_up(node)
        ids = self.jobs()
        if ids:
            _run(["scancel", *map(str, ids)], check=False)

        def settled() -> bool:
            return not self.jobs() and not self.leftovers()

        with contextlib.suppress(TimeoutError):
            wait_for(settled, grace, "jobs and the nodes' processes to end")
            return []
        killed = self.escaped()
        self.kill(killed)
        try:
            wait_for(settled, timeout, "jobs and their steps to end")
        except TimeoutError:
            rest = self.leftovers()
            killed += rest
            self.kill([p for p in rest if p.comm != "slurmstepd"])
            with contextlib.suppress(TimeoutError):
                wait_for(settled, timeout, "jobs to end once their processes were killed")
            self.kill(self.leftovers())
            wait_for(lambda: not self.jobs(), timeout, "the job queue to empty")
        return killed

    def reset(self, timeout: float = 30) -> None:
        """Daemons running, no job, no process in a node, no filter, links up, nodes idle."""
        if not self.daemons_alive():
            self.up()
        self._clear(timeout)
        for node, state in self.node_states().items():
            if node in self.nodes and state != "idle":
                _run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
        self.wait_nodes_idle(timeout)

    def finish(self, timeout: float = 15) -> list[NodeProcess]:
        """After a test: cancel its jobs, lift its filters; return the processes of the nodes
        that outlived it and had to be killed (see :meth:`_clear`): none if all went well."""
        return self._clear(timeout)


@contextlib.contextmanager
def _session_lock(timeout: float = 60) -> Iterator[None]:
    """One pytest session at a time uses the lab."""
    with open(LOCK, "a") as f:
        def take():
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
        try:
            wait_for(take, timeout, f"the SLURM lab lock {LOCK}")
        except TimeoutError:
            pytest.fail(f"another pytest session is using the SLURM lab (holds {LOCK})")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The lab cluster for the whole session (4 nodes); torn down and checked at the end."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster()
    with _session_lock():
        try:
            cluster.up()
            yield cluster
        finally:
            cluster.down()  # raises if anything is left


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's cluster, idle; afterwards no job and no process of a job may be left."""
    slurm_cluster.reset()
    yield slurm_cluster
    left = slurm_cluster.finish()
    if left:
        pytest.fail("processes outlived the test in node namespaces (killed):\n  "
                    + "\n  ".join(map(str, left)))
