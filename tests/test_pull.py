"""A receiver's pull by measured link rate (:mod:`tmrun.pull`), between gloo ranks in one process.

Real gloo groups over a real TCPStore, one thread per rank (as in tests/test_swap.py). Checked:
the plans themselves (pure), phase 1's probe, and an exchange in which the rates each rank
reports decide who sends what: the bytes each source sent the joiner are the plan's, and the
joiner ends bit-identical to the sources. The timing side (unequal links in network namespaces)
is tests/test_pull_links.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.test_swap import HOST, in_threads, spec
from tmrun.protocol import ProtocolError, check
from tmrun.pull import Piece, probe_links, pull_plans
from tmrun.swap import Exchange, GroupSpec, NextGroup, build_group, exchange_state, flatten
from tmrun.transfer_plan import Link, plan_transfer

pytestmark = pytest.mark.timeout(90)
MiB = 1 << 20


@pytest.fixture
def store_port():
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


class State:
    """Tracked state with large and small tensors, one not contiguous, one empty, and a leaf."""

    def __init__(self, seed: int | None) -> None:
        make = torch.randn if seed is not None else torch.zeros
        if seed is not None:
            torch.manual_seed(seed)
        self.big = make(6 * MiB // 4)  # float32: cut into shards
        self.wide = make(1024, 512).t()  # 2 MiB, not contiguous: travels whole
        self.empty = torch.zeros(0)
        self.steps = torch.arange(5, dtype=torch.int64) if seed is not None else torch.zeros(5, dtype=torch.int64)
        self.seen = seed

    def state_dict(self) -> dict[str, Any]:
        return {"big": self.big, "wide": self.wide, "empty": self.empty, "steps": self.steps, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def tensors_of(state: State) -> list[torch.Tensor]:
    return [t for _, t in flatten({"s": state.state_dict()})[0]]


# -- the plans ----------------------------------------------------------------------------------

def test_a_planned_pull_is_the_planners_plan_and_the_faster_link_sends_more():
    tensors = tensors_of(State(0))
    rates = [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [10**8, 2 * 10**8, 4 * 10**8, 0]]
    (pull,) = pull_plans(tensors, (0, 1, 2), (3,), rates)
    sent = {src: sum(p.stop - p.start for p in pull.pieces if p.source == src) for src in (0, 1, 2)}
    assert sum(sent.values()) == sum(t.numel() * t.element_size() for t in tensors)
    assert sent[0] < sent[1] < sent[2]
    specs = [(str(i), t.numel() * t.element_size(), t.element_size() if t.is_contiguous() else
              t.numel() * t.element_size()) for i, t in enumerate(tensors)]
    expected = plan_transfer(specs, {0: Link(1e8), 1: Link(2e8), 2: Link(4e8)})
    assert pull.predicted == pytest.approx(expected.finish)
    wide = [p for p in pull.pieces if p.tensor == 1]  # not contiguous: travels whole
    assert wide == [Piece(1, 0, 2 * MiB, wide[0].source)]
    assert len([p for p in pull.pieces if p.tensor == 0]) > 1  # 6 MiB: cut


def test_striped_and_single_pulls():
    tensors = tensors_of(State(0))
    rates = [[0, 0, 0], [0, 0, 0], [5, 9, 0]]
    (striped,) = pull_plans(tensors, (0, 1), (2,), rates, "striped")
    assert [(p.tensor, p.source) for p in striped.pieces] == [(0, 0), (1, 1), (3, 1)]  # the empty one is skipped
    (single,) = pull_plans(tensors, (0, 1), (2,), rates, "single")
    assert {p.source for p in single.pieces} == {1}
    (unmeasured,) = pull_plans(tensors, (0, 1), (2,), [[0] * 3] * 3)
    assert unmeasured.predicted is None  # equal shares, nothing to predict from
    with pytest.raises(ValueError, match="unknown pull 'fastest'"):
        pull_plans(tensors, (0, 1), (2,), rates, "fastest")


def test_prepare_carries_probe_and_links_checked():
    base = {"v": 1, "type": "prepare", "gen": 2, "rank": 1, "world_size": 4, "store_host": "h", "store_port": 5,
            "mode": "agreed", "handover": False}
    message = check({**base, "probe": [3], "links": [[0, 2, 1.5e8], [2, 3, 4e8]]})
    assert GroupSpec.from_message(message).links == ((0, 1.5e8), (1, 1.5e8), (2, 4e8))
    assert GroupSpec.from_message(message).probe == (3,)
    for bad in ({"probe": [-1]}, {"probe": "3"}, {"links": [[2, 2, 1.0]]}, {"links": [[0, 1, 0]]},
                {"links": [[0, 1]]}, {"links": [[0, 1, float("nan")]]}):
        with pytest.raises(ProtocolError):
            check({**base, **bad})


# -- on real gloo -------------------------------------------------------------------------------

def test_the_probe_measures_every_source_on_the_receiver_only(store_port):
    def party(rank: int) -> dict[int, float]:
        group = build_group(spec(1, rank, 4, store_port), 30)
        try:
            return probe_links(group, (2, 3), nbytes=256 * 1024)
        finally:
            group.close()

    results = in_threads(*[lambda r=r: party(r) for r in range(4)])
    assert results[0] == {} and results[1] == {}
    for receiver in (2, 3):
        assert sorted(results[receiver]) == [0, 1]
        assert all(rate > 0 for rate in results[receiver].values()), results


def test_a_next_group_probes_in_the_background_and_keeps_its_agents_rates(store_port):
    groups = [NextGroup(GroupSpec(1, r, 3, HOST, store_port, "agreed", probe=(2,), links=((0, 7.0),) if r == 2 else ()),
                        30) for r in range(3)]
    built = [g.wait(30) for g in groups]
    try:
        assert groups[0].probed == {} and groups[1].probed == {}
        assert sorted(groups[2].probed) == [0, 1] and groups[2].rates == groups[2].probed  # the probe replaces 7.0
        assert groups[0].rates == {}
    finally:
        for group in built:
            group.close()


def test_the_rates_each_receiver_reports_decide_who_sends_what(store_port):
    """Two receivers (a joiner, and a survivor one step behind) report different links; each gets
    the bytes its own plan says from each source, and both end bit-identical to the sources."""
    states = [State(1), State(1), State(1), State(None), State(2)]
    steps = [9, 9, 9, -1, 8]
    rates = [{}, {}, {}, {0: 1e8, 1: 2e8, 2: 4e8}, {0: 4e8, 1: 1e8}]  # rank 4 never measured rank 2

    def party(rank: int) -> Exchange:
        group = build_group(spec(3, rank, 5, store_port), 30)
        try:
            return exchange_state(group, {"s": states[rank]}, steps[rank], 30, rates=rates[rank])
        finally:
            group.close()

    results = in_threads(*[lambda r=r: party(r) for r in range(5)])
    assert all(isinstance(r, Exchange) for r in results), results
    tensors = tensors_of(State(1))
    matrix = [[int(rates[dst].get(src, 0)) for src in range(5)] for dst in range(5)]
    plans = {p.receiver: p for p in pull_plans(tensors, (0, 1, 2), (3, 4), matrix)}
    for receiver in (3, 4):
        result = results[receiver]
        assert result.sources == (0, 1, 2) and result.receivers == (3, 4) and result.step == 9
        expected = {}
        for piece in plans[receiver].pieces:
            expected[piece.source] = expected.get(piece.source, 0) + piece.stop - piece.start
        assert {src: size for src, (size, _) in result.links.items()} == expected
        assert result.predicted == plans[receiver].predicted
        assert states[receiver].seen == 1
        for mine, theirs in zip(tensors_of(states[receiver]), tensors):
            assert torch.equal(mine.contiguous().view(-1).view(torch.uint8), theirs.contiguous().view(-1).view(torch.uint8))
    assert results[3].predicted is not None and results[4].predicted is None  # rank 2's link to 4 is unknown
    three = {src: size for src, (size, _) in results[3].links.items()}
    assert three[0] < three[1] < three[2]
