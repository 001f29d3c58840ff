"""Batch-invariant steps (:mod:`tmrun.shares`): the same samples and the same gradient at any size."""

from __future__ import annotations

import pytest
import torch

import tmrun
from tmrun.shares import iterate, share_range

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("count", [4, 7, 12, 30])
def test_every_share_of_a_step_is_taken_once_at_every_size(count: int) -> None:
    for world in range(1, count + 1):
        taken = [i for rank in range(world) for i in share_range(rank, world, count)]
        assert taken == list(range(count)), world
        sizes = {len(share_range(rank, world, count)) for rank in range(world)}
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_fewer_shares_than_ranks_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="4 shares cannot be split over 5 ranks") as caught:
        share_range(0, 5, 4)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="outside"):
        share_range(3, 3, 12)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + index)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _step_gradient(world: int, count: int, step: int = 3) -> list[torch.Tensor]:
    """The gradient a step of ``world`` ranks ends with, each rank accumulating its weighted shares
    and the ranks averaged as the run's all-reduce ("mean") does."""
    model = _model()
    per_rank = []
    for rank in range(world):
        model.zero_grad()
        for share in iterate(rank, world, count):
            x, y = _batch(step, share.index)
            (torch.nn.functional.mse_loss(model(x), y) * share.weight).backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
    return [torch.stack(grads).mean(dim=0) for grads in zip(*per_rank)]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_step_gradient_does_not_depend_on_the_number_of_ranks(world: int) -> None:
    alone = _step_gradient(1, 12)
    for got, want in zip(_step_gradient(world, 12), alone):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)  # the order of additions differs


def test_a_rank_all_reduces_once_per_step_however_many_shares_it_takes() -> None:
    run = tmrun.init(env={})  # a world of one: every share of the step is this rank's
    model = _model()
    ddp = run.data_parallel(model)
    reduced = []
    issue = run.group.all_reduce

    def counting(tensor, op="sum"):
        reduced.append(tensor.numel())
        return issue(tensor, op)

    run.group.all_reduce = counting
    for step in run.steps(total=2):
        shares = 0
        for share in run.shares(5, ddp=ddp):
            x, y = _batch(step, share.index)
            (torch.nn.functional.mse_loss(ddp(x), y) * share.weight).backward()
            shares += 1
        assert shares == 5
        gradient_reductions = [n for n in reduced if n > 2]  # the commit vote is 2 numbers
        assert len(gradient_reductions) == step + 1, reduced
        run.commit()
        model.zero_grad()
    run.finish()
