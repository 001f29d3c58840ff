"""The SLURM lab (tests/slurm_cluster.py) gives what the project's SLURM tests rely on: four nodes
that look like separate hosts, jobs that run the venv's python with torch and tmrun, TCP between
nodes, port cuts that really cut, and no process of a job left after it ends or is cancelled."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster, wait_for

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parent.parent
NODES = ["node1", "node2", "node3", "node4"]
# Test servers listen below Linux's ephemeral range (32768-60999): a port in it can be held by any
# outgoing connection in the node's namespace (one was, in CI: EADDRINUSE at 47200).
PORT, PORT_B = 31200, 31201

# Accept connections on the given ports (IPv4 and IPv6) and answer each with the host name.
SERVER = r"""
import selectors, socket, sys
sel = selectors.DefaultSelector()
for port in map(int, sys.argv[1:]):
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::", port))
    s.listen(64)
    sel.register(s, selectors.EVENT_READ)
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept()
        conn.sendall(socket.gethostname().encode())
        conn.close()
"""

# probe TIMEOUT HOST:PORT...: connect to all at once; print "HOST:PORT ok REPLY" or an error name.
PROBE = r"""
import socket, sys, threading
timeout, targets = float(sys.argv[1]), sys.argv[2:]
results = {}
def probe(target):
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout) as s:
            s.settimeout(timeout)
            results[target] = "ok " + s.recv(100).decode()
    except TimeoutError:
        results[target] = "timeout"
    except OSError as e:
        results[target] = type(e).__name__
threads = [threading.Thread(target=probe, args=(t,)) for t in targets]
for t in threads: t.start()
for t in threads: t.join()
for t in targets: print(socket.gethostname(), t, results[t])
"""


def start_server(cluster: SlurmCluster, node: str, *ports: int) -> subprocess.Popen:
    proc = cluster.popen_on_node(node, [sys.executable, "-c", SERVER, *map(str, ports)],
                                 stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


def probe(cluster: SlurmCluster, node: str, *targets: str, timeout: float = 1.0) -> dict[str, str]:
    """{target: "ok <host>" | "timeout" | error name} seen from ``node``."""
    out = cluster.on_node(node, [sys.executable, "-c", PROBE, str(timeout), *targets],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    lines = [line.split(" ", 2) for line in out.splitlines()]
    assert {host for host, _, _ in lines} == {node}
    return {target: result for _, target, result in lines}


@pytest.mark.timeout(60)
def test_four_idle_nodes_with_their_own_names_and_addresses(slurm: SlurmCluster):
    assert slurm.nodes == NODES
    assert slurm.node_states() == dict.fromkeys(NODES, "idle")
    assert [slurm.ip(n) for n in NODES] == ["10.77.0.11", "10.77.0.12", "10.77.0.13", "10.77.0.14"]
    for node in NODES:
        out = slurm.on_node(node, ["sh", "-c", "hostname; hostname -I"], capture_output=True,
                            text=True, check=True, timeout=10).stdout.split()
        assert out == [node, slurm.ip(node)]
    slurmds = slurm.daemon_pids()
    for node in NODES:  # a node's namespace holds its own slurmd and nothing else
        assert slurm.node_pids(node) == [slurmds[node]]
    assert slurm.leftovers() == []


@pytest.mark.timeout(60)
def test_srun_in_a_four_node_job_runs_on_node1_to_node4(slurm: SlurmCluster):
    step = "echo $(hostname) $SLURM_NODEID $SLURM_JOB_NODELIST $(hostname -I)"
    job = slurm.sbatch(wrap=f"srun bash -c {shlex.quote(step)}", nodes=4)
    assert slurm.wait_job(job, 30) == "COMPLETED", slurm.output(job)
    rows = sorted(line.split() for line in slurm.output(job).splitlines())
    assert [r[0] for r in rows] == NODES
    assert sorted(r[1] for r in rows) == ["0", "1", "2", "3"]
    assert {r[2] for r in rows} == {"node[1-4]"}
    assert [r[3] for r in rows] == [slurm.ip(n) for n in NODES]
    assert len({r[3] for r in rows}) == 4


@pytest.mark.timeout(90)
def test_job_steps_run_the_venv_python_with_torch_and_tmrun(slurm: SlurmCluster):
    code = ("import os, socket, sys, torch, tmrun; print(socket.gethostname(), sys.executable, "
            "torch.__version__, tmrun.__file__, os.environ['LAB_PROBE'])")
    script = f"command -v python\nsrun {sys.executable} -c {shlex.quote(code)}\n"
    job = slurm.sbatch(script, nodes=4, env={"LAB_PROBE": "reached"})
    assert slurm.wait_job(job, 60) == "COMPLETED", slurm.output(job)
    first, *rows = slurm.output(job).splitlines()
    assert first == str(Path(sys.executable).parent / "python")  # the venv is first on PATH
    rows = sorted(line.split() for line in rows)
    assert [r[0] for r in rows] == NODES
    for _, exe, torch_version, tmrun_file, probe_env in rows:
        assert exe == sys.executable
        assert torch_version.startswith("2.")
        assert Path(tmrun_file).is_relative_to(ROOT / "tmrun")  # the editable install
        assert probe_env == "reached"


# The reverse lookups torch's TCPStore makes of each peer (an IPv4-mapped address), and one of
# /etc/hosts' own names: "HOST SECONDS ANSWER" per lookup.
LOOKUPS = r"""
import socket, time
for address in ("::ffff:10.77.0.12", "::1", "10.77.0.12"):
    start = time.monotonic()
    try:
        answer = socket.getnameinfo((address, 80, 0, 0) if ":" in address else (address, 80), 0)[0]
    except socket.gaierror as exc:
        answer = f"error{exc.errno}"
    print(socket.gethostname(), address, round(time.monotonic() - start, 3), answer)
"""


@pytest.mark.timeout(90)
def test_a_name_that_etc_hosts_does_not_answer_fails_at_once_on_a_node(slurm: SlurmCluster):
    """The host's name server cannot be reached from a node: the lab's resolv.conf fails at once
    instead of waiting 10 s per lookup (which every TCPStore connection paid; up.sh)."""
    job = slurm.sbatch(f"srun {sys.executable} -c {shlex.quote(LOOKUPS)}\n", nodes=4)
    assert slurm.wait_job(job, 60) == "COMPLETED", slurm.output(job)
    rows = [line.split() for line in slurm.output(job).splitlines()]
    assert len(rows) == 12, rows
    for node, address, seconds, answer in rows:
        assert float(seconds) < 2, (node, address, seconds)  # glibc's default wait for a silent server: 10 s
        if address == "10.77.0.12":  # /etc/hosts still answers what it holds
            assert answer == "node2", (node, address, answer)


@pytest.mark.timeout(60)
def test_job_steps_reach_a_server_on_another_node_over_tcp(slurm: SlurmCluster):
    server = start_server(slurm, "node1", PORT)
    try:
        script = f"srun {sys.executable} -c {shlex.quote(PROBE)} 5 node1:{PORT} 10.77.0.11:{PORT}"
        job = slurm.sbatch(script, nodes=3, args=["--nodelist=node[2-4]"])
        assert slurm.wait_job(job, 30) == "COMPLETED", slurm.output(job)
    finally:
        stop(server)
    rows = sorted(line.split(" ", 2) for line in slurm.output(job).splitlines())
    assert rows == [[n, t, "ok node1"] for n in NODES[1:] for t in (f"10.77.0.11:{PORT}",
                                                                     f"node1:{PORT}")]


@pytest.mark.timeout(60)
def test_block_port_cuts_only_that_port_until_unblocked(slurm: SlurmCluster):
    p, q = PORT, PORT_B
    servers = []
    try:
        servers.append(start_server(slurm, "node1", p, q))
        servers.append(start_server(slurm, "node2", p))
        targets = [f"node1:{p}", f"node1:{q}", f"127.0.0.1:{p}", f"[::1]:{p}"]
        ok = {t: "ok node1" for t in targets[:2]} | {t: "ok node2" for t in targets[2:]}
        assert probe(slurm, "node2", *targets) == ok

        # outbound: node2 reaches nothing at port p, not even itself; others are not affected
        slurm.block_port("node2", p)
        assert probe(slurm, "node2", *targets) == ok | dict.fromkeys(
            [f"node1:{p}", f"127.0.0.1:{p}", f"[::1]:{p}"], "timeout")
        assert probe(slurm, "node3", f"node1:{p}", f"node2:{p}") == {
            f"node1:{p}": "ok node1", f"node2:{p}": "ok node2"}
        slurm.unblock_port("node2", p)
        assert probe(slurm, "node2", *targets) == ok

        # inbound: no one reaches node1's server at port p; its other port and node2's still work
        slurm.block_port("node1", p, inbound=True)
        assert probe(slurm, "node3", f"node1:{p}", f"node1:{q}", f"node2:{p}") == {
            f"node1:{p}": "timeout", f"node1:{q}": "ok node1", f"node2:{p}": "ok node2"}
        assert probe(slurm, "node1", f"127.0.0.1:{p}", f"node1:{q}") == {
            f"127.0.0.1:{p}": "timeout", f"node1:{q}": "ok node1"}
        slurm.unblock_port("node1", p, inbound=True)
        assert probe(slurm, "node3", f"node1:{p}") == {f"node1:{p}": "ok node1"}
        assert probe(slurm, "node1", f"127.0.0.1:{p}") == {f"127.0.0.1:{p}": "ok node1"}
    finally:
        for server in servers:
            stop(server)


@pytest.mark.timeout(60)
def test_drained_node_holds_a_job_back_until_resumed(slurm: SlurmCluster):
    slurm.drain("node2", "lab test")
    assert slurm.node_state("node2") == "drain"
    job = slurm.sbatch(wrap="srun hostname", nodes=4)
    reason = wait_for(lambda: (r := slurm.job_field(job, "Reason")) != "None" and r, 10,
                      "the scheduler to look at the job")
    assert slurm.job_state(job) == "PENDING", reason
    slurm.resume("node2")
    assert slurm.wait_job(job, 30) == "COMPLETED"
    assert sorted(slurm.output(job).split()) == NODES


@pytest.mark.timeout(60)
def test_scancel_leaves_no_process_in_any_node(slurm: SlurmCluster):
    job = slurm.sbatch("sleep 600 &\nsrun sleep 600\n", nodes=4)
    sleeps = wait_for(lambda: (s := [p for p in slurm.leftovers() if p.comm == "sleep"])
                      and len(s) == 5 and s, 30, "5 sleeps: one per node, one in the batch step")
    assert {p.node for p in sleeps} == set(NODES)
    slurm.scancel(job)
    assert slurm.wait_job(job, 30) == "CANCELLED"
    assert slurm.wait_no_leftovers(15) == []


@pytest.mark.timeout(60)
def test_leftovers_finds_a_process_that_escaped_its_job(slurm: SlurmCluster):
    # (with the step's stdout still open, the step would wait up to 60 s for its output to end)
    job = slurm.sbatch(wrap="srun sh -c 'setsid -f sleep 600 </dev/null >/dev/null 2>&1'",
                       nodes=1, args=["--nodelist=node3"])
    assert slurm.wait_job(job, 30) == "COMPLETED"
    escaped = wait_for(lambda: [p for p in slurm.leftovers() if p.comm == "sleep"], 10,
                       "the escaped sleep")
    assert [(p.node, p.cmdline) for p in escaped] == [("node3", "sleep 600")]
    assert slurm.escaped() == escaped  # under no slurmstepd: SLURM will never clean it up
    assert slurm.finish(timeout=1) == escaped  # what the `slurm` fixture reports, killed
    assert slurm.leftovers() == []
