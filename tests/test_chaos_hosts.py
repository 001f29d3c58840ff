"""A fixed handful of chaos schedules on separate hosts (tests/chaos_hosts.py: the SLURM lab's
four hosts). ``python -m bench.chaos --hosts`` runs many and adds them to docs/reliability.md."""

from __future__ import annotations

import pytest

from tests import chaos, chaos_hosts
from tests.test_e2e_hot_swap import _reference

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

SEEDS = {
    3: "a drain racing the last step (issue 9 saw 140 s there)",
    9: "an agent SIGKILLed mid-run",
    14: "the leader's agent, a standby's, SIGKILLed: its key goes, the members waited 30 s for its word",
    21: "a worker SIGSTOPped in its epilogue: the job must end failed, not wait for it",
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory, chaos.NODES, chaos.STEPS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", list(SEEDS), ids=[f"{s}-{why.split(':')[0]}" for s, why in SEEDS.items()])
def test_chaos_schedule_on_separate_hosts(seed, slurm, reference):
    chaos_hosts.run(chaos_hosts.schedule(seed), slurm, reference)
