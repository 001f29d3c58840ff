"""Hosts in network namespaces on one switch, with links whose rate ``tc`` sets: for link tests.

``NetLab(n)`` makes namespaces ``<prefix>-h1`` .. ``-hn`` with address ``10.79.0.(10+k)/24`` on
``eth0``, each a veth into a bridge that lives in a namespace of its own (``<prefix>-sw``), so
nothing is added to the host's own network. :meth:`NetLab.shape` puts a token bucket (``tbf``)
on a host's ``eth0``: everything that host sends leaves at that rate. Needs root and iproute2;
:func:`unavailable_reason` says why not when it cannot run. :meth:`NetLab.down` removes every
namespace (their veths go with them).

:func:`pull_over` runs tests/scripts/pull_node.py on the hosts: sources behind links of given
rates, and a receiver that pulls from them. Used by tests/test_pull_links.py and bench/pull.py. (The SLURM lab, tests/slurmlab, brings up
namespaced hosts too, with slurmd in them; this one is for tests that need only the network.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

NET = "10.79.0"


def unavailable_reason() -> str | None:
    """Why namespaced hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


class NetLab:
    def __init__(self, hosts: int, prefix: str = "tmnet") -> None:
        self.hosts = [f"{prefix}-h{k}" for k in range(1, hosts + 1)]
        self.switch = f"{prefix}-sw"
        self._prefix = prefix

    def ip(self, host: str) -> str:
        return f"{NET}.{10 + self.hosts.index(host) + 1}"

    def up(self) -> "NetLab":
        self.down()
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for k, host in enumerate(self.hosts, start=1):
            _run(["ip", "netns", "add", host])
            _run(["ip", "-n", self.switch, "link", "add", f"p{k}", "type", "veth", "peer", "name", "eth0",
                  "netns", host])
            _run(["ip", "-n", self.switch, "link", "set", f"p{k}", "master", "br0", "up"])
            _run(["ip", "-n", host, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0"])
            _run(["ip", "-n", host, "link", "set", "eth0", "up"])
            _run(["ip", "-n", host, "link", "set", "lo", "up"])
        return self

    def shape(self, host: str, mbit: float | None) -> None:
        """Everything ``host`` sends leaves at ``mbit`` Mbit/s (None: at the veth's own speed)."""
        if mbit is None:
            _run(["tc", "-n", host, "qdisc", "del", "dev", "eth0", "root"], check=False)
            return
        _run(["tc", "-n", host, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit",
              "burst", "8kb", "latency", "500ms"])

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``argv`` run in ``host``'s network namespace."""
        return subprocess.Popen(["ip", "netns", "exec", host, *argv], **kwargs)

    def down(self) -> None:
        listed = _run(["ip", "netns", "list"], check=False).stdout.split()
        for name in listed:
            if name == self.switch or name.startswith(f"{self._prefix}-h"):
                _run(["ip", "netns", "del", name], check=False)


def python() -> list[str]:
    """This interpreter, with the repository on its path (for scripts run in a namespace)."""
    return ["env", f"PYTHONPATH={Path(__file__).resolve().parents[1]}", "GLOO_SOCKET_IFNAME=eth0", sys.executable]


SCRIPT = Path(__file__).resolve().parent / "scripts" / "pull_node.py"


def pull_over(lab: NetLab, mbits: Sequence[float | None], *, mib: float, pulls: str = "planned,striped,single",
              repeat: int = 1, timeout: float = 300) -> tuple[list[dict[str, Any]], list[str]]:
    """Sources on ``lab.hosts[k]`` sending at ``mbits[k]`` (None: unshaped), the receiver on the
    next host: the receiver's lines (one per pull and repetition) and the sources' digests."""
    sources = len(mbits)
    hosts = lab.hosts[:sources + 1]
    for host, mbit in zip(hosts, [*mbits, None]):
        lab.shape(host, mbit)
    store = f"{lab.ip(hosts[0])}:29611"
    procs = [lab.popen(host, [*python(), str(SCRIPT), "--rank", str(rank), "--world", str(sources + 1), "--store",
                              store, "--mib", str(mib), "--pulls", pulls, "--repeat", str(repeat)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, host in enumerate(hosts)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"pull_node.py exited {proc.returncode}: {err[-2000:]}")
            outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    digests = [lines[0]["digest"] for lines in outputs[:-1]]
    return outputs[-1], digests
