"""Table tests of :mod:`agent.slurm`: environments as plain dicts, never ``os.environ``."""

from __future__ import annotations

import dataclasses

import pytest

from agent.errors import ConfigError
from agent.slurm import SlurmAllocation, default_endpoint, detect_slurm, etcd_port_for_job

SIX = "gpu[01-06]"
SIX_HOSTS = ("gpu01", "gpu02", "gpu03", "gpu04", "gpu05", "gpu06")


def srun_env(node_id: int, **extra: str) -> dict[str, str]:
    """What srun gives the task on node ``node_id`` of a 6-node step that spans the job."""
    env = {
        "SLURM_JOB_ID": "812345",
        "SLURM_JOB_NUM_NODES": "6",
        "SLURM_NNODES": "6",
        "SLURM_JOB_NODELIST": SIX,
        "SLURM_NODELIST": SIX,
        "SLURM_STEP_NODELIST": SIX,
        "SLURM_STEP_NUM_NODES": "6",
        "SLURM_NODEID": str(node_id),
        "SLURMD_NODENAME": SIX_HOSTS[node_id],
    }
    env.update(extra)
    return env


def job(**values: str) -> dict[str, str]:
    """An environment of job 9 with ``values`` added."""
    return {"SLURM_JOB_ID": "9", **values}


NOT_SLURM = [
    {},
    {"HOME": "/root", "SLURM_NODEID": "0"},
    {"SLURM_JOB_ID": ""},
    {"SLURM_JOB_ID": "   ", "SLURM_JOB_NODELIST": SIX},
]


@pytest.mark.parametrize("env", NOT_SLURM)
def test_not_under_slurm(env: dict[str, str]) -> None:
    assert detect_slurm(env) is None


DETECTED = [
    # (id, env, job_id, nnodes, node_id, hosts, this_host)
    ("srun-node0", srun_env(0), "812345", 6, 0, SIX_HOSTS, "gpu01"),
    ("srun-node4", srun_env(4), "812345", 6, 4, SIX_HOSTS, "gpu05"),
    (
        "sbatch-batch-script",
        {
            "SLURM_JOB_ID": "77",
            "SLURM_NNODES": "3",
            "SLURM_JOB_NODELIST": "n[1-2],login",
            "SLURM_NODEID": "0",
            "SLURMD_NODENAME": "n1",
        },
        "77",
        3,
        0,
        ("n1", "n2", "login"),
        "n1",
    ),
    (
        "fallback-job-num-nodes-and-nodelist",
        {
            "SLURM_JOB_ID": "9",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NODELIST": "a,b",
            "SLURM_NODEID": "1",
        },
        "9",
        2,
        1,
        ("a", "b"),
        "b",
    ),
    (
        "no-node-count-uses-list-length",
        job(SLURM_JOB_NODELIST="x[09-11]", SLURM_NODEID="2"),
        "9",
        3,
        2,
        ("x09", "x10", "x11"),
        "x11",
    ),
    (
        "job-nodelist-wins-over-nodelist",
        {
            "SLURM_JOB_ID": "9",
            "SLURM_JOB_NODELIST": "a,b",
            "SLURM_NODELIST": "c,d,e",
            "SLURM_NNODES": "2",
            "SLURM_NODEID": "0",
        },
        "9",
        2,
        0,
        ("a", "b"),
        "a",
    ),
    (
        "nnodes-wins-over-job-num-nodes",
        {
            "SLURM_JOB_ID": "9",
            "SLURM_JOB_NODELIST": "a,b",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NUM_NODES": "7",
            "SLURM_NODEID": "0",
        },
        "9",
        2,
        0,
        ("a", "b"),
        "a",
    ),
    (
        "srun-step-smaller-than-job",
        {
            "SLURM_JOB_ID": "500",
            "SLURM_JOB_NUM_NODES": "6",
            "SLURM_JOB_NODELIST": SIX,
            "SLURM_NNODES": "4",
            "SLURM_NODELIST": "gpu[03-06]",
            "SLURM_STEP_NODELIST": "gpu[03-06]",
            "SLURM_STEP_NUM_NODES": "4",
            "SLURM_NODEID": "1",
            "SLURMD_NODENAME": "gpu04",
        },
        "500",
        4,
        1,
        ("gpu03", "gpu04", "gpu05", "gpu06"),
        "gpu04",
    ),
    (
        "slurmd-nodename-wins-when-it-disagrees",
        srun_env(2, SLURMD_NODENAME="gpu03-eth0"),
        "812345",
        6,
        2,
        SIX_HOSTS,
        "gpu03-eth0",
    ),
    (
        "no-nodeid-found-by-slurmd-nodename",
        job(SLURM_JOB_NODELIST="a,b,c", SLURMD_NODENAME="c"),
        "9",
        3,
        2,
        ("a", "b", "c"),
        "c",
    ),
    (
        "whitespace-around-values",
        {
            "SLURM_JOB_ID": " 42 ",
            "SLURM_NNODES": " 2\n",
            "SLURM_JOB_NODELIST": " n[1-2] ",
            "SLURM_NODEID": " 1 ",
            "SLURMD_NODENAME": "   ",
        },
        "42",
        2,
        1,
        ("n1", "n2"),
        "n2",
    ),
    (
        "single-node",
        job(SLURM_NNODES="1", SLURM_JOB_NODELIST="solo", SLURM_NODEID="0"),
        "9",
        1,
        0,
        ("solo",),
        "solo",
    ),
]


@pytest.mark.parametrize(
    ("env", "job_id", "nnodes", "node_id", "hosts", "this_host"),
    [row[1:] for row in DETECTED],
    ids=[row[0] for row in DETECTED],
)
def test_detect(
    env: dict[str, str],
    job_id: str,
    nnodes: int,
    node_id: int,
    hosts: tuple[str, ...],
    this_host: str,
) -> None:
    assert detect_slurm(env) == SlurmAllocation(
        job_id=job_id, nnodes=nnodes, node_id=node_id, hosts=hosts, this_host=this_host
    )


MALFORMED = [
    # (id, env, a part the message must name)
    ("no-nodelist", job(SLURM_NNODES="2", SLURM_NODEID="0"), "no node list"),
    (
        "blank-nodelist",
        job(SLURM_JOB_NODELIST="  ", SLURM_NODEID="0"),
        "no node list",
    ),
    (
        "bad-nodelist",
        job(SLURM_JOB_NODELIST="gpu[01-03", SLURM_NODEID="0"),
        "SLURM_JOB_NODELIST",
    ),
    (
        "reversed-range",
        job(SLURM_JOB_NODELIST="gpu[5-3]", SLURM_NODEID="0"),
        "5-3",
    ),
    (
        "count-mismatch",
        job(SLURM_NNODES="4", SLURM_JOB_NODELIST="a,b", SLURM_NODEID="0"),
        "SLURM_NNODES=4",
    ),
    (
        "job-count-mismatch",
        {
            "SLURM_JOB_ID": "9",
            "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_NODELIST": "a,b",
            "SLURM_NODEID": "0",
        },
        "SLURM_JOB_NUM_NODES=1",
    ),
    (
        "nnodes-not-a-number",
        job(SLURM_NNODES="two", SLURM_JOB_NODELIST="a,b", SLURM_NODEID="0"),
        "SLURM_NNODES='two'",
    ),
    (
        "nnodes-zero",
        job(SLURM_NNODES="0", SLURM_JOB_NODELIST="a,b", SLURM_NODEID="0"),
        "SLURM_NNODES='0'",
    ),
    (
        "nnodes-negative",
        job(SLURM_NNODES="-2", SLURM_JOB_NODELIST="a,b", SLURM_NODEID="0"),
        "SLURM_NNODES='-2'",
    ),
    (
        "nnodes-float",
        job(SLURM_NNODES="2.0", SLURM_JOB_NODELIST="a,b", SLURM_NODEID="0"),
        "SLURM_NNODES='2.0'",
    ),
    (
        "nodeid-not-a-number",
        job(SLURM_NNODES="2", SLURM_JOB_NODELIST="a,b", SLURM_NODEID="x"),
        "SLURM_NODEID='x'",
    ),
    (
        "nodeid-negative",
        job(SLURM_NNODES="2", SLURM_JOB_NODELIST="a,b", SLURM_NODEID="-1"),
        "SLURM_NODEID='-1'",
    ),
    (
        "nodeid-too-large",
        job(SLURM_NNODES="2", SLURM_JOB_NODELIST="a,b", SLURM_NODEID="2"),
        "SLURM_NODEID=2",
    ),
    (
        "nodeid-missing-outside-srun",
        job(SLURM_NNODES="2", SLURM_JOB_NODELIST="a,b"),
        "SLURM_NODEID is not set",
    ),
    (
        "nodeid-missing-and-slurmd-nodename-not-in-list",
        job(SLURM_JOB_NODELIST="a,b", SLURMD_NODENAME="login1"),
        "SLURM_NODEID is not set",
    ),
    (
        "step-list-and-job-count-disagree",
        {
            "SLURM_JOB_ID": "9",
            "SLURM_JOB_NUM_NODES": "6",
            "SLURM_JOB_NODELIST": SIX,
            "SLURM_STEP_NODELIST": "gpu[01-04]",
            "SLURM_NODEID": "0",
        },
        "SLURM_JOB_NUM_NODES=6",
    ),
]


@pytest.mark.parametrize(
    ("env", "named"), [row[1:] for row in MALFORMED], ids=[row[0] for row in MALFORMED]
)
def test_malformed(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        detect_slurm(env)
    message = str(info.value)
    assert named in message
    assert "\n" not in message


def test_every_node_agrees_on_everything_but_its_place() -> None:
    allocations = [detect_slurm(srun_env(node)) for node in range(6)]
    assert [a.node_id for a in allocations] == list(range(6))
    assert [a.this_host for a in allocations] == list(SIX_HOSTS)
    assert {(a.job_id, a.nnodes, a.hosts, a.first_host) for a in allocations} == {
        ("812345", 6, SIX_HOSTS, "gpu01")
    }
    assert {default_endpoint(a) for a in allocations} == {"gpu01:22345"}


def test_allocation_is_frozen_and_stores_a_tuple() -> None:
    allocation = SlurmAllocation(
        job_id="1", nnodes=2, node_id=0, hosts=["a", "b"], this_host="a"  # type: ignore[arg-type]
    )
    assert allocation.hosts == ("a", "b")
    assert allocation.first_host == "a"
    with pytest.raises(dataclasses.FrozenInstanceError):
        allocation.node_id = 1  # type: ignore[misc]


INVALID_ALLOCATIONS = [
    (dict(job_id="", nnodes=1, node_id=0, hosts=("a",), this_host="a"), "job id"),
    (dict(job_id="1", nnodes=0, node_id=0, hosts=(), this_host="a"), "node list is empty"),
    (dict(job_id="1", nnodes=3, node_id=0, hosts=("a", "b"), this_host="a"), "node count 3"),
    (dict(job_id="1", nnodes=2, node_id=2, hosts=("a", "b"), this_host="a"), "node id 2"),
    (dict(job_id="1", nnodes=2, node_id=-1, hosts=("a", "b"), this_host="a"), "node id -1"),
    (dict(job_id="1", nnodes=2, node_id=0, hosts=("a", "b"), this_host=""), "host name is empty"),
]


@pytest.mark.parametrize(("fields", "named"), INVALID_ALLOCATIONS)
def test_allocation_checks_itself(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        SlurmAllocation(**fields)


PORTS = [
    ("0", 20000),
    ("1", 20001),
    ("9999", 29999),
    ("10000", 20000),
    ("812345", 22345),
    (" 812345 ", 22345),
    ("0000123", 20123),
]


@pytest.mark.parametrize(("job_id", "port"), PORTS)
def test_port_of_numeric_job_id(job_id: str, port: int) -> None:
    assert etcd_port_for_job(job_id) == port


@pytest.mark.parametrize("job_id", ["my-job", "1234_5", "x", "ジョブ", "9" * 40 + "a"])
def test_port_of_other_job_id_is_stable_and_in_range(job_id: str) -> None:
    port = etcd_port_for_job(job_id)
    assert 20000 <= port <= 29999
    assert etcd_port_for_job(job_id) == port


def test_consecutive_job_ids_get_distinct_ports() -> None:
    ports = {etcd_port_for_job(str(number)) for number in range(812000, 822000)}
    assert len(ports) == 10000


def test_hashed_ids_spread_over_the_range() -> None:
    ports = {etcd_port_for_job(f"job-{n}") for n in range(2000)}
    assert len(ports) > 1500
    assert min(ports) >= 20000 and max(ports) <= 29999


@pytest.mark.parametrize("job_id", ["", "   "])
def test_port_needs_a_job_id(job_id: str) -> None:
    with pytest.raises(ConfigError, match="job id"):
        etcd_port_for_job(job_id)


def test_default_endpoint() -> None:
    allocation = SlurmAllocation(
        job_id="77", nnodes=3, node_id=2, hosts=("n1", "n2", "login"), this_host="login"
    )
    assert default_endpoint(allocation) == "n1:20077"
