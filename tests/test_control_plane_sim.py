"""The control-plane simulation (tests/control_plane_sim.py) on a small job: real agents' control
loops against a real etcd, stand-in workers. It must rendezvous, hot-swap a drained node, end
succeeded, and keep the traffic shape the 1,000-node design relies on: in steady state no agent
reads the job's prefix (followers follow their watch, the leader its copy), and no record grows
with the number of ranks. The numbers for N = 10 to 1000 are in docs/benchmarks.md
(``python -m bench.control_plane_scale``)."""

from __future__ import annotations

import asyncio

import pytest

from tests.control_plane_sim import simulate

pytestmark = pytest.mark.timeout(180)


def test_twelve_simulated_nodes_rendezvous_swap_a_drained_node_and_end(etcd_server) -> None:
    """Two processes, six agents each (the bench's way past one process's limit)."""
    endpoint = f"http://{etcd_server.endpoint}"
    result = asyncio.run(simulate(endpoint, f"{endpoint}/metrics", 12, standbys=2, drains=1, window=3.0, processes=2))
    assert result["outcome"] == "succeeded"
    assert result["exit_codes"] == {0: 12}  # the drained node left earlier, with 0 too
    assert result["drain_ms"]["samples"] == 11  # the 10 members of the new plan and the leaver saw it
    for window in (result["steady"], result["steady_later"]):
        assert "get_prefix" not in window["by_kind"] and "keys" not in window["by_kind"], window
        assert window["by_kind"].get("put", 0) <= 12, window  # progress: at most one report a second a node
    assert result["prefix_keys"] <= 12 + 8  # nodes, plan, leader, the request, a few events
    assert result["largest_record_bytes"] < 4096  # the plan; a node's record does not grow with its 8 ranks
