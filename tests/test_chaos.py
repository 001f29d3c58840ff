"""A fixed handful of chaos schedules (tests/chaos.py) on the local cluster, run in every CI.

Each seed is one schedule: the leader's agent killed, a worker killed and a drain in the same step,
two drains in the last step, an agent killed in the last step, a worker stopped while it waits for
the next generation (tests/test_e2e_hot_swap.py has a worker killed mid-step and a hang). The benchmark (``python -m bench.chaos``) runs every kind
(the job's etcd killed among them) over many seeds; every seed that ever failed is added here once
fixed.
"""

from __future__ import annotations

import pytest

from tests import chaos
from tests.test_e2e_hot_swap import _reference

pytestmark = pytest.mark.e2e

SEEDS = {
    0: "the leader's agent SIGKILLed",
    7: "a worker killed and a drain in the same step",
    13: "two drains with --rejoin in the job's last step (the drains may meet the job's end)",
    18: "an agent SIGKILLed in the job's last step (its loss may be seen before the others finish)",
    116: "a worker killed, and another SIGSTOPped just after it reported its group broken",
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory, chaos.NODES, chaos.STEPS)


def test_the_schedules_are_reproducible():
    assert chaos.generate(7) == chaos.generate(7)
    kinds = {kind for seed in range(200) for kind in chaos.generate(seed).kinds}
    assert kinds == set(chaos.KINDS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", list(SEEDS), ids=[f"{s}-{why}" for s, why in SEEDS.items()])
def test_chaos_schedule(seed, jobs, tmp_path, reference):
    schedule = chaos.generate(seed)
    print(schedule.describe())
    outcome = chaos.run(schedule, tmp_path, reference, jobs)
    print(f"hot={outcome.hot} replaced={sorted(outcome.replaced)} ended {outcome.end_s:.1f} s after the last step")
