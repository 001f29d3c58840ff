"""Table tests of the embedded etcd cluster's layout and the keeper's decision (agent/etcd_cluster.py),
and of how a node finds its own address (agent/address.py)."""

from __future__ import annotations

import pytest

from agent.address import node_address
from agent.errors import ConfigError
from agent.etcd_cluster import MemberView, Repair, host_of, layout_for, next_repair
from agent.slurm import SlurmAllocation

HOSTS = ("node1", "node2", "node3", "node4", "node5")


def alloc(n: int) -> SlurmAllocation:
    return SlurmAllocation("812345", n, 0, HOSTS[:n], "node1")


def test_layout_three_members_on_the_first_hosts_and_every_host_an_endpoint():
    layout = layout_for(alloc(4))
    assert layout.initial_hosts == ("node1", "node2", "node3")
    assert (layout.client_port, layout.peer_port) == (22345, 12345)
    assert layout.initial_cluster() == {f"tmrun-node{i}": f"http://node{i}:12345" for i in (1, 2, 3)}
    assert layout.endpoint == "node1:22345,node2:22345,node3:22345,node4:22345"


@pytest.mark.parametrize("nodes, size", [(1, 1), (2, 1), (3, 3), (5, 3)])
def test_layout_size(nodes, size):
    # two members would need both for a quorum: worse than one
    assert layout_for(alloc(nodes)).size == size


def m(id: int, node: str, started: bool = True) -> MemberView:
    return MemberView(id, node, started)


THREE = [m(1, "node1"), m(2, "node2"), m(3, "node3")]
ALL = {"node1", "node2", "node3", "node4"}

REPAIRS = [
    ("whole", THREE, ALL, set(), set(), Repair("none", "every member's node is in the job")),
    ("node left: remove first", THREE, ALL - {"node1"}, set(), set(),
     Repair("remove", "node1 left the job (its agent is gone)", 1, "node1")),
    ("drained: remove", THREE, ALL, {"node2"}, set(), Repair("remove", "node2 was drained from the job", 2, "node2")),
    ("two left: add on the first free live node", THREE[1:], ALL - {"node1"}, set(), set(),
     Repair("add", "2 of 3 members: a new one on node4", node="node4")),
    ("no free node", THREE[1:], {"node2", "node3"}, set(), set(),
     Repair("none", "2 of 3 members and no node left to host another")),
    ("a drained node is not a candidate", THREE[1:], ALL, {"node1", "node4"}, set(),
     Repair("none", "2 of 3 members and no node left to host another")),
    ("added but never started: removed, not tried again", [*THREE[1:], m(4, "node4", started=False)], ALL - {"node1"},
     set(), {"node4"}, Repair("remove", "the member added on node4 did not start in time", 4, "node4")),
    ("a stale node is skipped", THREE[1:], ALL - {"node1"} | {"node5"}, set(), {"node4"},
     Repair("add", "2 of 3 members: a new one on node5", node="node5")),
    ("added and starting: wait", [*THREE[1:], m(4, "node4", started=False)], ALL, set(), set(),
     Repair("none", "every member's node is in the job")),
]


@pytest.mark.parametrize("members, live, leaving, stale, expected", [r[1:] for r in REPAIRS], ids=[r[0] for r in REPAIRS])
def test_next_repair(members, live, leaving, stale, expected):
    assert next_repair(members, live, leaving, HOSTS, stale) == expected


def test_host_of_peer_url():
    assert host_of(["http://node4:12345"]) == "node4"
    assert host_of([]) == ""


def resolver(table):
    return lambda host: table.get(host, [])


ADDRESSES = [
    ("own name", "node1", {"node1": ["10.77.0.11"]}, None, "10.77.0.11"),
    ("debian 127.0.1.1: route to a peer", "node1", {"node1": ["127.0.1.1"], "node2": ["10.77.0.12"]}, None,
     "10.77.0.11"),
    ("override ip", "node1", {"node1": ["10.77.0.11"]}, "192.0.2.7", "192.0.2.7"),
    ("override name", "node1", {"node1": ["10.77.0.11"], "ib-node1": ["10.1.0.11"]}, "ib-node1", "10.1.0.11"),
    ("ip as host name", "127.0.0.2", {}, None, "127.0.0.2"),
]


@pytest.mark.parametrize("host, table, override, expected", [a[1:] for a in ADDRESSES], ids=[a[0] for a in ADDRESSES])
def test_node_address(host, table, override, expected):
    towards = {"10.77.0.12": "10.77.0.11"}.get
    assert node_address(host, ["node1", "node2"], override, resolver=resolver(table), towards=towards) == expected


def test_node_address_nothing_found_says_what_to_do():
    with pytest.raises(ConfigError, match="pass --local-addr"):
        node_address("node1", ["node1", "node2"], resolver=resolver({"node1": ["127.0.1.1"]}), towards=lambda _: None)
    with pytest.raises(ConfigError, match="does not resolve"):
        node_address("node1", [], "nowhere", resolver=resolver({}))


def test_docs_show_the_slurm_examples_as_they_are_tested():
    """docs/slurm.md shows examples/slurm/*, which tests/test_e2e_slurm.py runs as written."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "slurm.md").read_text()
    for name in ("train.sbatch", "health-check.sh"):
        assert f"```bash\n{(root / 'examples' / 'slurm' / name).read_text()}```" in doc, name


@pytest.mark.timeout(60)
def test_etcd_start_error_is_one_line_with_what_etcd_said(tmp_path):
    """etcd refuses a host name as a listen address; the user reads etcd's own words, in one line."""
    from agent.errors import StoreError
    from agent.etcd_server import EmbeddedEtcd

    server = EmbeddedEtcd(tmp_path / "etcd", host="node1.invalid", client_port=23790, peer_port=23791)
    with pytest.raises(StoreError) as failed:
        server.start(timeout=20)
    text = str(failed.value)
    assert "\n" not in text and "expected IP in URL for binding" in text, text
    assert not server.running()


def _entries(keys, **values):
    from agent.store import Entry

    return {keys.root + rel: Entry(keys.root + rel, value, 1, 1) for rel, value in values.items()}


def test_a_member_host_waits_for_every_node_that_did_not_see_the_outcome():
    from agent.etcd_member import awaiting_ack
    from agent.keys import JobKeys
    from agent.records import Plan

    keys = JobKeys("812345")
    plan = Plan(gen=2, members=("node1", "node4"), slots={"node1": 1, "node4": 1}, store_host="node1",
                store_port=1, leader="node1", out={"node2": "drained"}).to_dict()
    hosts = ("node1", "node2", "node3", "node4")
    # node3's key is gone (its lease expired in an outage) but it never said it saw the outcome
    entries = _entries(keys, plan=plan, **{"nodes/node4": {}, "done/node4": {}})
    assert awaiting_ack(entries, keys, hosts, "node1") == {"node3"}
    entries = _entries(keys, plan=plan, **{"done/node3": {}, "done/node4": {}})
    assert awaiting_ack(entries, keys, hosts, "node1") == set()
    # a node outside the allocation (an external standby) counts while it is registered
    entries = _entries(keys, plan=plan, **{"nodes/extra": {}, "done/node3": {}, "done/node4": {}})
    assert awaiting_ack(entries, keys, hosts, "node1") == {"extra"}


@pytest.mark.timeout(60)
def test_the_last_member_up_stops_waiting_once_etcd_has_had_no_quorum_for_a_while(tmp_path):
    """The job ended, the other members stopped: reads fail (no quorum). The member stops after
    NO_QUORUM_WAIT seconds of failed reads, not after release's whole limit, and says why."""
    import asyncio
    import time

    from agent.errors import StoreUnavailable
    from agent.etcd_member import NO_QUORUM_WAIT, MemberHost
    from agent.keys import JobKeys

    class Running:
        def running(self) -> bool:
            return True

    class NoQuorum:
        reads = 0

        async def get_prefix(self, prefix):
            self.reads += 1
            raise StoreUnavailable("etcd cluster has no quorum")

    said: list[str] = []
    host = MemberHost(layout_for(alloc(4)), "node3", "10.0.0.3", tmp_path, report=said.append)
    host.server = Running()
    store = NoQuorum()
    started = time.monotonic()
    asyncio.run(host.release(store, JobKeys("812345"), job_ended=True, limit=30.0))
    took = time.monotonic() - started
    assert NO_QUORUM_WAIT <= took < NO_QUORUM_WAIT + 2, took
    assert store.reads >= 2
    assert len(said) == 1 and "etcd has had no quorum" in said[0] and said[0].startswith("node3: stopping")


@pytest.mark.timeout(60)
def test_a_host_whose_key_is_gone_is_waited_for_a_while_a_registered_node_for_the_whole_limit(tmp_path, monkeypatch):
    """Chaos seed 14 on separate hosts: the standby's agent (the leader) was SIGKILLed, its key
    expired, and every member waited release's whole 30 s for it to say it saw the job's end."""
    import asyncio
    import time

    from agent import etcd_member
    from agent.keys import JobKeys
    from agent.records import Plan

    monkeypatch.setattr(etcd_member, "KEYLESS_WAIT", 1.0)
    keys = JobKeys("812345")
    plan = Plan(gen=1, members=("node1", "node2", "node3"), slots={"node1": 1, "node2": 1, "node3": 1},
                store_host="node1", store_port=1, leader="node3").to_dict()

    class Running:
        def running(self) -> bool:
            return True

    class Store:
        def __init__(self, entries):
            self.entries = entries

        async def get_prefix(self, prefix):
            return self.entries, 1

    def release(entries, limit: float) -> tuple[float, list[str]]:
        said: list[str] = []
        host = etcd_member.MemberHost(layout_for(alloc(4)), "node3", "10.0.0.3", tmp_path, report=said.append)
        host.server = Running()
        started = time.monotonic()
        asyncio.run(host.release(Store(entries), keys, job_ended=True, limit=limit))
        return time.monotonic() - started, said

    acked = {"done/node1": {}, "done/node2": {}}
    took, said = release(_entries(keys, plan=plan, **acked), limit=20.0)  # node4: no key, no word
    assert 1.0 <= took < 3.0, took
    assert said == ["node3: stopping the etcd member; node4 did not say they saw the job's end within 1 s and their "
                    "keys are gone (an agent killed, or cut off from etcd)"], said
    took, said = release(_entries(keys, plan=plan, **acked, **{"nodes/node4": {}}), limit=4.0)  # node4 registered
    assert 3.0 <= took < 6.0, took  # tenacity stops before a wait would pass the limit
    assert said == ["node3: stopping the etcd member after 4 s; node4 did not say they saw the job's end"], said
