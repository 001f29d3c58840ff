"""``--redundancy 1``'s snapshots between two ranks on a real gloo group (two threads, one store).

Each snapshot copies a rank's state and swaps its keyed tensors with its neighbour's; once both
are complete they are agreed on, and a rollback puts the agreed step's state back. The copies
are copies: the live tensors moving on after a snapshot do not change it.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tmrun.redundancy import Redundancy, restore

SHAPES = [(64, 32), (1000,), (3, 5, 7)]


def _state(rank: int, step: int) -> list[torch.Tensor]:
    """A rank's tensors at a step: values that tell rank and step apart."""
    return [torch.full(shape, float(100 * rank + step)) + torch.arange(torch.Size(shape).numel()).view(shape)
            for shape in SHAPES]


def _both(fn) -> list:
    """Run ``fn(rank)`` on ranks 0 and 1 at once, in two threads; their results."""
    results: list = [None, None]
    errors: list = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    return results


def _wait_complete(redundancy: Redundancy) -> None:
    assert redundancy.pending is not None
    assert redundancy.pending._done.wait(30), "the snapshot's sends and receives did not finish"
    assert redundancy.vote()


@pytest.mark.timeout(90)
def test_a_snapshot_holds_its_steps_state_and_the_right_neighbours_keyed_tensors():
    store = dist.HashStore()
    groups = [SimpleNamespace(store=store, rank=rank, size=2) for rank in (0, 1)]
    mine = [Redundancy(every=10, timeout=30), Redundancy(every=10, timeout=30)]
    keyed = [True, True, False]  # the last tensor has a replica: copied, not sent
    live = [_state(0, 0), _state(1, 0)]

    for step in (10, 20, 30):
        def snapshot(rank: int) -> None:
            red = mine[rank]
            assert red.due(step)
            live[rank] = _state(rank, step)
            red.start(groups[rank], 1, step, live[rank], keyed, {"step": step})
            for tensor in live[rank]:  # training goes on: the snapshot must not see it
                tensor.add_(1000.0)
            _wait_complete(red)

        _both(snapshot)
        for rank in (0, 1):  # both voted complete: the vote agrees
            mine[rank].agree()
            agreed = mine[rank].agreed
            assert agreed is not None and agreed.step == step and mine[rank].holds() == step
            for got, want in zip(agreed.own, _state(rank, step)):
                assert torch.equal(got, want)
            right = 1 - rank  # of two ranks, the right neighbour is the other one
            for got, want in zip(agreed.neighbour, [t for t, k in zip(_state(right, step), keyed) if k]):
                assert torch.equal(got, want)
            assert agreed.leaves == {"step": step}

    for rank in (0, 1):
        restore(mine[rank].agreed, live[rank])  # a rollback puts step 30's state back
        assert all(torch.equal(got, want) for got, want in zip(live[rank], _state(rank, 30)))
        mine[rank].new_generation()
        assert mine[rank].agreed is None and mine[rank].holds() == -1
