"""End to end on a real SLURM cluster: 4 slurmd nodes, each its own host name and address.

``sbatch -N 4`` with ``srun tmrun --nnodes 3 --standby 1``: the embedded etcd runs as a 3-member
cluster on node1..node3, node4 waits as a warm standby. Each test injects one kind of trouble and
checks what matters: the final weights equal an uninterrupted run's, every step is committed
exactly once per rank, the workers of the nodes that were not replaced kept their process ids,
and (the ``slurm`` fixture) nothing the job started is alive on any node afterwards.

- a worker SIGKILLed on one node; SLURM's drain plus the health check of ``docs/slurm.md``
  (``examples/slurm/train.sbatch`` and ``health-check.sh``, as written); ``scancel``;
- the control plane: one etcd member SIGKILLed (node 0's), the drain of a node hosting a member,
  then a second member lost after the cluster healed; two of three members stopped for 60 s (no
  quorum); a node cut off from etcd while the others replace it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.etcd_cluster import layout_for
from agent.slurm import SlurmAllocation
from tests.chaos import check_commits
from tests.harness import FAST, assert_same_weights, fast_gate, job_store, run_tmrun, wait_events, wait_status
from tests.slurm_cluster import SlurmCluster, wait_for
from tests.test_e2e_hot_swap import JOB, _events, _reference
from tmrun.jobs import JobRef

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
GPT_STEPS = 60  # a swap after step 10: 50 steps of 3 ranks and a standby on the lab's 2 shared cores
GPT = ["--params", "1M", "--steps", str(GPT_STEPS), "--log-every", "10", "--threads", "1"]
STEPS = 700  # runtime_job.py steps for the control-plane tests (0.1 s each)


def layout(slurm: SlurmCluster, job_id: int):
    alloc = SlurmAllocation(str(job_id), len(slurm.nodes), 0, tuple(slurm.nodes), slurm.nodes[0])
    return layout_for(alloc, tls=True)


def ref_of(slurm: SlurmCluster, job_id: int) -> JobRef:
    return JobRef(f"slurm-{job_id}", layout(slurm, job_id).endpoint)


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory) -> Path:
    """train_gpt.py uninterrupted on 3 ranks (torchrun), the weights every run here must end with."""
    out = tmp_path_factory.mktemp("gpt") / "ref.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TMRUN_", "SLURM_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(EXAMPLES / "train_gpt.py"), *GPT, "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runtime_reference(tmp_path_factory) -> Path:
    return _reference(tmp_path_factory, 3, STEPS)


PROBE = """
import asyncio, sys
from agent.credentials import credentials_dir
from agent.errors import ConfigError, StoreError
from agent.etcd_store import EtcdStore, client_tls, parse_endpoint
endpoint = sys.argv[1]
async def put(tls):
    store = EtcdStore(parse_endpoint(endpoint), tls=tls, retry_deadline=3, max_attempts=3)
    try:
        await store.put("/tmrun/intruder", {"v": 1})
    finally:
        await store.close()
try:
    asyncio.run(put(None))
    print("plain: got in")
except StoreError:
    print("plain: refused")
try:
    asyncio.run(put(client_tls(endpoint, None, None, None, credentials_dir({"TMRUN_CREDENTIALS": "/nonexistent"}))))
    print("https: got in")
except ConfigError:
    print("https: no credentials")
"""


def submit_gpt(slurm: SlurmCluster, workdir: Path) -> int:
    """examples/slurm/train.sbatch as a user submits it (tmrun flags from the environment)."""
    return slurm.sbatch(script_path=EXAMPLES / "slurm" / "train.sbatch", nodes=4, workdir=workdir,
                        script_args=[*GPT, "--out", str(workdir / "final.pt"), "--step-log",
                                     str(workdir / "steps.jsonl")],
                        env={"TMRUN_EXAMPLES": str(EXAMPLES), "PET_RDZV_CONF": FAST, "HEALTH_INTERVAL": "1",
                             "PYTHONUNBUFFERED": "1"})


def submit_runtime_job(slurm: SlurmCluster, workdir: Path, steps: int = STEPS, step_time: float = 0.1,
                       conf: str = FAST) -> int:
    """runtime_job.py on 3 nodes and a standby, its steps paced until ``fast_gate(workdir)`` exists."""
    script = (f"srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 tmrun --nnodes 3 --standby 1 "
              f"--rdzv-conf {conf} {JOB} {workdir / 'final.pt'} --steps {steps} --step-time {step_time} "
              f"--fast-when {fast_gate(workdir)}\n")
    return slurm.sbatch(script, nodes=4, workdir=workdir, args=["--no-kill"], env={"PYTHONUNBUFFERED": "1"})


def steps_logged(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"step"' in line]


def committed(output: str) -> dict[int, list[tuple[int, int]]]:
    """rank -> [(step, pid)] of every committed step, from runtime_job.py's JSON lines."""
    found: dict[int, list[tuple[int, int]]] = {}
    for event in _events(output):
        if event.get("role") == "active" and event.get("committed"):
            found.setdefault(event["rank"], []).append((event["step"], event["pid"]))
    return found


def last_step(output: str) -> int:
    steps = [s for rows in committed(output).values() for s, _ in rows]
    return max(steps, default=-1)


def wait_steps(slurm: SlurmCluster, job_id: int, step: int, timeout: float) -> None:
    wait_for(lambda: last_step(slurm.output(job_id)) >= step, timeout, f"step {step} committed")


def start_runtime_job(slurm: SlurmCluster, prefix: str, steps: int = STEPS,
                      conf: str = FAST) -> tuple[Path, int, JobRef, dict]:
    """runtime_job.py submitted, training warm (a standby shadow-trains, 30 steps done): the status."""
    workdir = slurm.workdir(prefix)
    job_id = submit_runtime_job(slurm, workdir, steps, conf=conf)
    ref, _ = wait_hot(slurm, job_id)
    wait_steps(slurm, job_id, 30, 120)
    return workdir, job_id, ref, wait_status(ref, lambda d: True, 10)


def wait_hot(slurm: SlurmCluster, job_id: int) -> tuple[JobRef, dict]:
    """Once the job's etcd serves (a leader was elected), until a standby shadow-trains."""
    wait_for(lambda: f"leads job slurm-{job_id}" in slurm.output(job_id), 150, "the job's leader")
    ref = ref_of(slurm, job_id)
    return ref, wait_status(ref, lambda d: d["hot_swap"] and any(n["state"] == "shadow" for n in d["nodes"]), 150)


def workers(doc: dict) -> dict[str, list[int]]:
    return {n["node"]: n["worker_pids"] for n in doc["nodes"] if n["role"] == "active"}


def wait_completed(slurm: SlurmCluster, job_id: int, timeout: float) -> str:
    """The job's final state; when it does not end in time, a post-mortem: each tmrun still running
    dumps its agent's tasks (SIGUSR1) and its threads' stacks (py-spy, when installed)."""
    try:
        return slurm.wait_job(job_id, timeout)
    except TimeoutError:
        stacks = []
        for proc in slurm.node_processes():
            if proc.comm != "tmrun":
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            if os.path.exists(spy):
                dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True,
                                      timeout=30)
                stacks.append(f"--- {proc}\n{dump.stdout[-3000:]}{dump.stderr[-500:]}")
        raise AssertionError(f"job {job_id} did not end within {timeout:g} s:\n" + slurm.output(job_id)[-6000:]
                             + "\n" + "\n".join(stacks)) from None


def check_runtime_job(slurm: SlurmCluster, job_id: int, workdir: Path, reference: Path,
                      replaced: set[int] = frozenset(), steps: int = STEPS) -> None:
    """The job completed with the weights of an uninterrupted run; each step once per rank; ranks
    other than ``replaced`` kept one process for the whole run. The test has acted: the steps left
    run unpaced (they only have to reach the end)."""
    fast_gate(workdir).touch()
    state = wait_completed(slurm, job_id, 300)
    assert state == "COMPLETED", slurm.output(job_id)[-4000:]
    assert_same_weights(workdir / "final.pt", reference)
    rows = committed(slurm.output(job_id))
    assert set(rows) == {0, 1, 2}, sorted(rows)
    for rank, got in rows.items():  # a replaced rank's worker may die between committing a step and printing it
        check_commits(f"job {job_id}", rank, got, rank in replaced, steps)
    for rank, got in rows.items():
        if rank not in replaced:
            assert len({pid for _, pid in got}) == 1, f"rank {rank} was restarted"


def etcd_pid(slurm: SlurmCluster, node: str) -> int:
    """The etcd member running in ``node``'s namespace."""
    for proc in slurm.node_processes(node):
        if proc.comm == "etcd":
            return proc.pid
    raise AssertionError(f"no etcd member on {node}")


def members(slurm: SlurmCluster, job_id: int) -> list[tuple[str, bool]]:
    """(host, started) of each member of the job's etcd cluster, by asking it."""
    from agent.etcd_cluster import host_of

    async def ask():
        store = job_store(layout(slurm, job_id).endpoint, retry_deadline=10)
        try:
            return sorted((host_of(m.peer_urls), bool(m.name)) for m in await store.members())
        finally:
            await store.close()

    return asyncio.run(ask())


# ----------------------------------------------------------------------------- the workers


def start_gpt(slurm: SlurmCluster, prefix: str) -> tuple[Path, int, JobRef, dict]:
    """train.sbatch submitted, training warm (a standby shadow-trains, 10 steps done): the status."""
    workdir = slurm.workdir(prefix)
    job_id = submit_gpt(slurm, workdir)
    ref, _ = wait_hot(slurm, job_id)
    wait_for(lambda: len(steps_logged(workdir / "steps.jsonl")) >= 10, 120, "10 steps")
    return workdir, job_id, ref, wait_status(ref, lambda d: True, 10)


def check_gpt_job(slurm: SlurmCluster, job_id: int, workdir: Path, reference: Path, before: dict[str, list[int]],
                  after: dict, replaced: str) -> None:
    """The other nodes kept their workers through the swap; the job completed with the weights of
    an uninterrupted run, every step committed once."""
    for node, pids in before.items():
        if node != replaced:
            assert workers(after)[node] == pids, f"{node}'s workers were restarted"
    assert wait_completed(slurm, job_id, 300) == "COMPLETED", slurm.output(job_id)[-4000:]
    assert_same_weights(workdir / "final.pt", reference)
    assert sorted(steps_logged(workdir / "steps.jsonl")) == list(range(1, GPT_STEPS + 1))
    assert "started generation 2" not in slurm.output(job_id)  # nobody restarted: the swap was hot


@pytest.mark.timeout(420)
def test_kill_9_of_a_worker_swaps_in_the_standby(slurm, gpt_reference):
    workdir, job_id, ref, doc = start_gpt(slurm, "gpt-kill-")
    victim = next(n for n in doc["nodes"] if n["ranks"] == [1])
    standby = next(n["node"] for n in doc["nodes"] if n["role"] == "standby")
    before = workers(doc)
    os.kill(victim["worker_pids"][0], signal.SIGKILL)

    after = wait_status(ref, lambda d: d["generation"] >= 2 and d["state"] == "running"
                        and all(n["state"] == "running" for n in d["nodes"] if n["role"] == "active"), 120)
    assert {n["node"] for n in after["nodes"] if n["role"] == "active"} == set(before) - {victim["node"]} | {standby}
    assert after["mode"] == "swap-now" and after["restarts"] == 0 and after["hot_swaps"] == 1, after
    check_gpt_job(slurm, job_id, workdir, gpt_reference, before, after, victim["node"])


@pytest.mark.timeout(420)
def test_slurm_drain_and_the_health_check_swap_the_node_out(slurm, gpt_reference):
    workdir, job_id, ref, doc = start_gpt(slurm, "gpt-drain-")
    victim = next(n["node"] for n in doc["nodes"] if n["ranks"] == [2])
    slurm.drain(victim, "gpu check failed")  # what an administrator or a site check does
    after = wait_status(ref, lambda d: d["generation"] >= 2 and any(n["node"] == victim and n["role"] == "drained"
                                                                     for n in d["nodes"]), 120)
    assert after["mode"] == "swap-agreed" and after["restarts"] == 0 and after["hot_swaps"] == 1, after
    wait_for(lambda: f"{victim}: unwell, draining" in slurm.output(job_id), 30, "the health check's line")
    assert f"drain {victim}" in slurm.output(job_id)
    check_gpt_job(slurm, job_id, workdir, gpt_reference, workers(doc), after, victim)


@pytest.mark.timeout(240)
def test_scancel_stops_every_process_on_every_node(slurm):
    workdir = slurm.workdir("cancel-")
    job_id = submit_runtime_job(slurm, workdir)
    ref, _ = wait_hot(slurm, job_id)
    assert {n for n in slurm.nodes if slurm.node_pids(n)} == set(slurm.nodes)
    # the job's etcd is closed: from another host, a client without the user's credentials is refused
    probe = subprocess.run(["ip", "netns", "exec", "node4", sys.executable, "-c", PROBE, ref.endpoint],
                           capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env={**os.environ, "TMRUN_CREDENTIALS": str(workdir / "none")})
    assert probe.stdout.splitlines() == ["plain: refused", "https: no credentials"], probe.stdout + probe.stderr
    slurm.scancel(job_id)
    assert slurm.wait_job(job_id, 120) == "CANCELLED"
    assert slurm.wait_no_leftovers(30) == []


# ----------------------------------------------------------------------------- the control plane


@pytest.mark.timeout(420)
def test_etcd_member_losses_cost_no_step(slurm, runtime_reference):
    workdir, job_id, ref, doc = start_runtime_job(slurm, "etcd-loss-")
    ranks = ranks_of(doc)

    # 1. node 0's member is SIGKILLed: its agent starts it again from its data directory
    first = etcd_pid(slurm, "node1")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: "tmrun-node1 is back" in slurm.output(job_id), 60, "node1's member back")
    assert etcd_pid(slurm, "node1") != first

    # 2. the node hosting another member is drained: the standby takes its place, and the
    #    leader's agent replaces its member on the node that has none
    drained = run_tmrun(["drain", "node2", "--rdzv-endpoint", ref.endpoint, "--job", ref.job], cwd=workdir,
                        timeout=120)
    assert drained.returncode == 0 and "hot swap" in drained.stderr, drained.stderr
    wait_events(ref, lambda rows: any(r["kind"] == "etcd" and "add" in r["text"] for r in rows), 90)
    wait_for(lambda: members(slurm, job_id) == [("node1", True), ("node3", True), ("node4", True)], 60,
             "three members again, node2's on node4")

    # 3. a second member is lost for good: the healed cluster still has a quorum
    mark = last_step(slurm.output(job_id))
    lost = etcd_pid(slurm, "node3")
    os.kill(lost, signal.SIGSTOP)
    try:
        wait_steps(slurm, job_id, mark + 50, 60)
        status = run_tmrun(["status", "--json", "--rdzv-endpoint", ref.endpoint, "--job", ref.job], cwd=workdir,
                           timeout=60)
        assert status.returncode == 0 and json.loads(status.stdout)["state"] == "running", status.stderr
    finally:
        os.kill(lost, signal.SIGCONT)
    check_runtime_job(slurm, job_id, workdir, runtime_reference, replaced={ranks["node2"]})


@pytest.mark.timeout(600)
def test_no_quorum_for_60_s_training_goes_on(slurm, tmp_path_factory):
    # 30 steps, 60 s without etcd (at most 600 steps: each sleeps 0.1 s), then a drain; 1000 leave
    # the drain 300 steps (30 s or more) before the end
    steps = 1000
    reference = _reference(tmp_path_factory, 3, steps)
    workdir, job_id, ref, doc = start_runtime_job(slurm, "etcd-quorum-", steps)
    ranks = ranks_of(doc)

    stopped = [etcd_pid(slurm, "node1"), etcd_pid(slurm, "node2")]  # two of three: no quorum
    mark = last_step(slurm.output(job_id))
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        outage_end = time.monotonic() + 60
        wait_for(lambda: time.monotonic() >= outage_end and last_step(slurm.output(job_id)), 90,
                 "60 s without a quorum")
        during = last_step(slurm.output(job_id)) - mark
        assert during >= 300, f"only {during} steps in 60 s without etcd: training stalled"
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    same = wait_status(ref, lambda d: d["state"] == "running", 60)
    assert same["generation"] == doc["generation"] and same["restarts"] == 0, same  # nobody was replaced

    victim = next(node for node, rank in ranks.items() if rank == 1)  # and a drain right after works
    drained = run_tmrun(["drain", victim, "--rdzv-endpoint", ref.endpoint, "--job", ref.job], cwd=workdir,
                        timeout=120)
    assert drained.returncode == 0 and "hot swap" in drained.stderr, drained.stderr
    check_runtime_job(slurm, job_id, workdir, reference, replaced={1}, steps=steps)


@pytest.mark.timeout(420)
def test_a_node_cut_off_from_etcd_is_fenced_out(slurm, runtime_reference):
    workdir, job_id, ref, doc = start_runtime_job(slurm, "etcd-cut-")
    victim = next(n for n in doc["nodes"] if n["role"] == "active" and n["node"] != doc["leader"])
    rank = victim["ranks"][0]
    port = layout(slurm, job_id).client_port

    slurm.block_port(victim["node"], port)  # its agent reaches no etcd member (its own neither)
    try:
        after = wait_status(ref, lambda d: d["generation"] >= 2 and d["state"] == "running"
                            and all(n["state"] == "running" for n in d["nodes"] if n["role"] == "active"), 120)
        assert any(n["node"] == victim["node"] and n["role"] == "lost" for n in after["nodes"]), after
        mark = last_step(slurm.output(job_id))
        wait_steps(slurm, job_id, mark + 30, 60)  # the new generation trains beside the cut-off node
    finally:
        slurm.unblock_port(victim["node"], port)
    # back in touch, its agent learns it was replaced and stops its workers
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in victim["worker_pids"]), 90,
             "the cut-off node's workers to stop")
    check_runtime_job(slurm, job_id, workdir, runtime_reference, replaced={rank})
    # the old generation never committed a step that the new one committed too: each once per rank
    rows = committed(slurm.output(job_id))[rank]
    old = [s for s, pid in rows if pid in victim["worker_pids"]]
    new = [s for s, pid in rows if pid not in victim["worker_pids"]]
    assert old and new and max(old) < min(new), (max(old), min(new))


def ranks_of(doc: dict) -> dict[str, int]:
    return {n["node"]: n["ranks"][0] for n in doc["nodes"] if n["role"] == "active"}




# ----------------------------------------------------------------------------- the links


@pytest.mark.timeout(600)
def test_a_cut_link_takes_one_end_out_and_the_node_is_used_again_once_it_is_back(slurm, runtime_reference):
    """The link between two members is cut (tc, both ways; both keep every other link): the agents'
    link checks miss, the leader takes the higher rank's node out like a failure and the standby
    takes its place; nobody else restarts. With the link back, that node is a standby again, and a
    drain swaps it in."""
    workdir, job_id, ref, doc = start_runtime_job(slurm, "link-cut-", conf=FAST + ",collective_timeout=5")
    ranks = ranks_of(doc)
    by_rank = {rank: node for node, rank in ranks.items()}
    # the leader hosts the next generation's store and never leaves for a cut link (the other end
    # does): cut a link between the two highest ranks that do not lead, so that the higher one leaves
    keep, victim = [by_rank[r] for r in sorted(by_rank) if by_rank[r] != doc["leader"]][-2:]
    standby = next(n["node"] for n in doc["nodes"] if n["role"] == "standby")

    slurm.cut_link(keep, victim)
    try:
        after = wait_status(ref, lambda d: d["generation"] >= 2 and d["state"] == "running"
                            and all(n["state"] == "running" for n in d["nodes"] if n["role"] == "active"), 90)
        rows = wait_events(ref, lambda rows: any(r["kind"] == "link" for r in rows), 30)
        cut = [r for r in rows if r["kind"] == "link"]
        decider = cut[0]["data"]["leader"]
        if decider != doc["leader"]:  # leadership moved meanwhile; if to an end, that end stays, the other leaves
            print(f"{decider} decided on the cut link; {doc['leader']} led at the start")
            if decider == victim:
                keep, victim = victim, keep
        roles = {n["node"]: n["role"] for n in after["nodes"]}
        assert roles[victim] == "cut-off" and roles[standby] == "active", (
            f"cut {keep} <-> {victim}; roles {roles}; the job's events: "
            f"{[(r['kind'], r.get('text'), r['data'].get('leader')) for r in rows][-6:]}; who led: "
            f"{[line for line in slurm.output(job_id).splitlines() if 'leads job' in line or 'leader' in line]}")
        assert after["mode"] == "swap-now" and after["restarts"] == 0 and after["hot_swaps"] == 1, after
        assert f"{victim}'s link to {keep} is down" in cut[0]["text"], cut
        print(f"link event: decision {cut[0].get('data', {}).get('decision_ms')} ms")
        mark = last_step(slurm.output(job_id))
        wait_steps(slurm, job_id, mark + 30, 60)  # the new generation trains while the link is still down
        assert any(n["node"] == victim and keep in n["unreachable"] for n in wait_status(ref, lambda d: True, 10)
                   ["nodes"]), "the cut-off node's agent still misses the link"
    finally:
        slurm.restore_link(keep, victim)
    back = wait_status(ref, lambda d: any(n["node"] == victim and n["role"] == "standby" and n["state"] == "shadow"
                                          for n in d["nodes"]), 120)
    assert all(not n["unreachable"] for n in back["nodes"] if n["role"] in ("active", "standby")), back

    # used again: a drain of rank 0's node swaps the node that was cut off back in
    first = next(n["node"] for n in back["nodes"] if n["role"] == "active" and n["ranks"] == [0])
    drained = run_tmrun(["drain", first, "--rdzv-endpoint", ref.endpoint, "--job", ref.job], cwd=workdir,
                        timeout=120)
    assert drained.returncode == 0 and f"{victim} takes its place" in drained.stderr, drained.stderr
    check_runtime_job(slurm, job_id, workdir, runtime_reference, replaced={0, ranks[victim]})

