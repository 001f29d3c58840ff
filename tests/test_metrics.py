"""Each agent's Prometheus metrics (``--metrics-port``): served, named in ``tmrun status --json``,
true to what the job did (a swap counted on the nodes that switched), and bad ports refused in one line."""

from __future__ import annotations

import os
import signal
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.metrics import MetricsServer, Snapshot
from tests.harness import FAST, assert_same_weights, job_ref, run_tmrun, wait_status
from tests.test_e2e_hot_swap import JOB, PACE, STEPS

pytestmark = pytest.mark.timeout(30)


def scrape(url: str) -> dict[str, float | dict[str, str]]:
    """Every sample of ``url`` by name (an info metric: its labels)."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain"), reply.headers["Content-Type"]
        text = reply.read().decode()
    samples: dict[str, float | dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = sample.labels if sample.name.endswith("_info") else sample.value
    return samples


def link_rates(url: str) -> dict[str, float]:
    """``tmrun_link_rate_bytes_per_second`` of ``url``, by source node."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {sample.labels["source"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "tmrun_link_rate_bytes_per_second"}


def test_link_rates_are_one_sample_per_source_node() -> None:
    server = MetricsServer("127.0.0.1", 0, lambda: Snapshot(job="j", node="n2", role="member",
                                                            links={"n0": 1.5e8, "n1": 7.5e7}))
    try:
        assert link_rates(f"http://{server.address}/metrics") == {"n0": 1.5e8, "n1": 7.5e7}
    finally:
        server.close()


def test_a_scrape_reads_the_agent_at_that_moment_and_close_stops_the_server() -> None:
    now = {"snapshot": Snapshot(job="j1", node="gpu-3", role="member", generation=2, step=41, step_time=0.25,
                                workers=8, swaps=1, last_stall=1.5, bytes_received=4096, leader=True)}
    server = MetricsServer("127.0.0.1", 0, lambda: now["snapshot"])
    url = f"http://{server.address}/metrics"
    try:
        first = scrape(url)
        assert first["tmrun_node_info"] == {"job": "j1", "node": "gpu-3", "role": "member", "leader": "true"}
        assert (first["tmrun_generation"], first["tmrun_step"], first["tmrun_step_seconds"]) == (2, 41, 0.25)
        assert (first["tmrun_workers"], first["tmrun_swaps_total"], first["tmrun_last_swap_stall_seconds"]) == (8, 1, 1.5)
        assert first["tmrun_state_received_bytes_total"] == 4096 and first["tmrun_state_sent_bytes_total"] == 0
        now["snapshot"] = Snapshot(job="j1", node="gpu-3", role="leaving", step=42)
        second = scrape(url)
        assert second["tmrun_step"] == 42 and second["tmrun_node_info"]["role"] == "leaving"
    finally:
        server.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


@pytest.mark.parametrize(("value", "says"), [
    ("70000", "70000: expected 0 to 65535"),
    ("9x", "'9x': expected an integer"),
    ("65535", "a local cluster of 3 nodes needs ports 65535 to 65537; pick a lower one"),
])
def test_a_bad_metrics_port_is_one_line_and_exit_2(tmp_path: Path, value: str, says: str) -> None:
    done = run_tmrun(["--nnodes", "2", "--standby", "1", "--metrics-port", value, str(JOB), str(tmp_path / "f.pt")],
                     cwd=tmp_path)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_metrics_port_in_use_is_one_line_and_exit_2_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_tmrun(["--nnodes", "2", "--metrics-port", str(port), str(JOB), str(tmp_path / "f.pt")], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"tmrun: error: cannot serve metrics on 127.0.0.1:{port} (--metrics-port): " \
                                  "Address already in use", done.stderr


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_every_agent_serves_its_metrics_and_a_swap_shows_in_them(jobs, tmp_path, references) -> None:
    job = jobs(["--nnodes", "2", "--standby", "1", "--metrics-port", "0", "--rdzv-conf", FAST, str(JOB),
                str(tmp_path / "final.pt"), "--steps", str(STEPS), *PACE])
    ref = job_ref(job)
    doc = wait_status(ref, lambda d: d["hot_swap"] and any(n["state"] == "shadow" for n in d["nodes"])
                      and all(n["step"] for n in d["nodes"] if n["role"] == "active"), 90)
    urls = {n["node"]: n["metrics"] for n in doc["nodes"]}
    assert all(url and url.startswith("http://127.0.0.1:") for url in urls.values()), urls
    assert len(set(urls.values())) == 3, urls  # one port per agent
    seen = {node: scrape(url) for node, url in urls.items()}
    roles = {node: s["tmrun_node_info"]["role"] for node, s in seen.items()}
    assert roles == {"node-0": "member", "node-1": "member", "node-2": "shadow"}, roles
    assert [s["tmrun_node_info"]["leader"] for s in seen.values()].count("true") == 1
    for node in ("node-0", "node-1"):
        assert seen[node]["tmrun_generation"] == 1 and seen[node]["tmrun_step"] > 0, seen[node]
        assert seen[node]["tmrun_workers"] == 1 and seen[node]["tmrun_swaps_total"] == 0, seen[node]

    job.track()
    victim = next(n for n in doc["nodes"] if n["node"] == "node-1")
    os.kill(victim["worker_pids"][0], signal.SIGKILL)
    wait_status(ref, lambda d: d["generation"] == 2 and all(  # each member trained a step in generation 2
        n["last_swap"].get("gen") == 2 and "first_step_at" in n["last_swap"] for n in d["nodes"] if n["role"] == "active"),
        90)
    survivor, joiner = scrape(urls["node-0"]), scrape(urls["node-2"])
    assert joiner["tmrun_node_info"]["role"] == "member" and joiner["tmrun_generation"] == 2, joiner
    assert joiner["tmrun_swaps_total"] == 1 and joiner["tmrun_state_received_bytes_total"] > 0, joiner
    assert survivor["tmrun_swaps_total"] == 1 and survivor["tmrun_state_received_bytes_total"] == 0, survivor
    assert survivor["tmrun_step"] > seen["node-0"]["tmrun_step"], (survivor, seen["node-0"])
    assert link_rates(urls["node-2"]).keys() == {"node-0"} and link_rates(urls["node-2"])["node-0"] > 0  # measured
    assert link_rates(urls["node-0"]) == {}  # the survivor received nothing
    assert job.wait(150) == 0, job.err.text()[-4000:]
    assert_same_weights(tmp_path / "final.pt", references[2])


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, Path]:
    from tests.test_e2e_hot_swap import _reference

    return {2: _reference(tmp_path_factory, 2)}


def test_two_servers_in_one_process_each_show_their_own_agent() -> None:
    """Each server has its own registry: nothing goes to prometheus_client's process-wide one."""
    a = MetricsServer("127.0.0.1", 0, lambda: Snapshot(job="j", node="a", role="idle"))
    b = MetricsServer("127.0.0.1", 0, lambda: Snapshot(job="j", node="b", role="idle"))
    try:
        assert scrape(f"http://{a.address}/metrics")["tmrun_node_info"]["node"] == "a"
        assert scrape(f"http://{b.address}/metrics")["tmrun_node_info"]["node"] == "b"
    finally:
        a.close()
        b.close()
    assert sys.modules["prometheus_client"].REGISTRY.get_sample_value("tmrun_step") is None
