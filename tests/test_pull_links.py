"""A joiner's pull over links of unequal rates (1:2:4), on namespaced hosts (tests/netlab.py).

Three sources behind token buckets of 40, 80 and 160 Mbit/s and a receiver build a group as a
swap does (phase 1 probes the receiver's links), then the receiver pulls 32 MiB three ways. The
planned pull must end within 10% of the plan's own prediction, before equal striping and before
the fastest single source; every pull ends with the sources' bytes, bit for bit. Measured here:
planned 1.06 s against 1.02 s predicted, striped 3.37 s, single 1.80 s.
"""

from __future__ import annotations

import pytest

from tests.netlab import NetLab, pull_over, unavailable_reason

pytestmark = [pytest.mark.hosts,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

MBITS = (40, 80, 160)


@pytest.fixture
def lab():
    lab = NetLab(4).up()
    yield lab
    lab.down()


@pytest.mark.timeout(240)
def test_a_three_source_pull_ends_when_its_plan_says_and_before_striping_or_one_source(lab):
    lines, digests = pull_over(lab, MBITS, mib=32)
    by_pull = {line["pull"]: line for line in lines}
    assert sorted(by_pull) == ["planned", "single", "striped"]
    assert len(set(digests)) == 1 and all(line["digest"] == digests[0] for line in lines)  # bit for bit

    probed = {int(src): rate for src, rate in by_pull["planned"]["probed"].items()}
    for src, mbit in enumerate(MBITS):  # the probe saw each bucket's rate
        assert probed[src] == pytest.approx(mbit * 1e6 / 8, rel=0.15), probed

    planned = by_pull["planned"]
    sent = {int(src): size for src, size in planned["links"].items()}
    assert sum(sent.values()) == planned["bytes"] > 31 << 20
    for src in (1, 2):  # shares in proportion to the rates, to a shard
        assert sent[src] / sent[0] == pytest.approx(MBITS[src] / MBITS[0], rel=0.15), sent

    assert planned["seconds"] == pytest.approx(planned["predicted"], rel=0.10), planned
    assert planned["seconds"] < by_pull["striped"]["seconds"], by_pull
    assert planned["seconds"] < by_pull["single"]["seconds"], by_pull
    print({pull: round(line["seconds"], 3) for pull, line in by_pull.items()}, "predicted",
          round(planned["predicted"], 3))
