"""A fixed handful of chaos schedules on separate hosts (tests/chaos_hosts.py: the SLURM lab's
four hosts). ``python -m bench.chaos --hosts`` runs many and adds them to docs/reliability.md."""

from __future__ import annotations

import pytest

from tests import chaos, chaos_hosts
from tests.test_e2e_hot_swap import _reference

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

SEEDS = [3, 9]  # a drain racing the last step (issue 9 saw 140 s there); an agent SIGKILLed mid-run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory, chaos.NODES, chaos.STEPS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_schedule_on_separate_hosts(seed, slurm, reference):
    chaos_hosts.run(chaos_hosts.schedule(seed), slurm, reference)
