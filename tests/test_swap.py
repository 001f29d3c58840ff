"""The swap's state exchange and handover, between gloo ranks in one process (one thread each).

Real gloo groups over a real TCPStore on port 0; faults are made at a chosen point (a leaver that
stalls after its header, a joiner that built another model, a header that does not match), and
every wait is on an event, a thread or a group, with a bound.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from tmrun.groups import SandboxGroup
from tmrun.runtime import Identity, Run
from tmrun.swap import (Exchange, GroupRefused, GroupSpec, ModelMismatch, TakeOver, UnportableState, build_group,
                        exchange_state, flatten, portable, _leaf_blob, _signature)

HOST = "127.0.0.1"


@pytest.fixture
def store_port():
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


def in_threads(*parties: Callable[[], Any], timeout: float = 60) -> list[Any]:
    """Run each party in a thread; their results or the exceptions they raised, in order."""
    results: list[Any] = [None] * len(parties)

    def run(index: int) -> None:
        try:
            results[index] = parties[index]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(parties))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a party did not finish"
    return results


def replica(seed: int, lr: float, steps: int, width: int = 3) -> dict[str, Any]:
    """A model and an AdamW optimizer with state, different per seed."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, width)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        model(torch.randn(2, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model, "optimizer": opt}


def assert_bit_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    tensors_a, leaves_a = flatten({n: o.state_dict() for n, o in a.items()})
    tensors_b, leaves_b = flatten({n: o.state_dict() for n, o in b.items()})
    assert [p for p, _ in tensors_a] == [p for p, _ in tensors_b]
    for (path, x), (_, y) in zip(tensors_a, tensors_b):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), path
    assert leaves_a == leaves_b


def spec(gen: int, rank: int, world: int, port: int, mode: str = "now", handover: bool = False) -> GroupSpec:
    return GroupSpec(gen, rank, world, HOST, port, mode, handover)


# -- an abandoned handover never writes ----------------------------------------------------------

@pytest.mark.timeout(90)
def test_abandoned_takeover_never_writes_after_the_fallback(store_port):
    """The joiner abandons a handover whose receives are posted; the replicas' state is received;
    then the stalled leaver sends everything. The joiner must hold the replicas' state, bit for bit."""
    joiner, leaver, source = replica(0, 0.3, 1), replica(1, 0.1, 3), replica(2, 0.2, 5)
    expected = replica(2, 0.2, 5)
    abandoned, fallback_done = threading.Event(), threading.Event()

    def leave() -> None:  # a leaver that stalls between its header and its tensors
        pair = build_group(GroupSpec.pair(1, HOST, store_port, 0), 30, pair_of=0)
        tensors, leaves = flatten({n: o.state_dict() for n, o in leaver.items()})
        pair.send(torch.tensor([7, _signature(tensors)], dtype=torch.int64), 1, 0).wait()
        assert abandoned.wait(30) and fallback_done.wait(30)
        works = [pair.send(t, 1, i + 1) for i, (_, t) in enumerate(tensors)]
        for work in works:
            work.wait()
        _leaf_blob(pair, portable(leaves), 0, (1,), len(tensors) + 1)
        pair.close()

    def serve() -> Exchange:  # the surviving replica, source of the fallback
        return exchange_state(build_group(spec(2, 0, 2, store_port), 30), source, 5, 30)

    def join() -> tuple[TakeOver, Exchange]:
        receiving = TakeOver(spec(1, 0, 2, store_port, "agreed", handover=True), joiner, 30)
        assert receiving.receiving.wait(30), receiving.error
        receiving.abandon()
        abandoned.set()
        result = exchange_state(build_group(spec(2, 1, 2, store_port), 30), joiner, -1, 30)
        fallback_done.set()
        return receiving, result

    left, served, (receiving, result) = in_threads(leave, serve, join)
    assert left is None and isinstance(served, Exchange)
    assert receiving.wait(30)  # every late byte of the leaver has arrived and been dealt with
    assert result.sources == (0,) and result.receivers == (1,) and result.step == 5
    assert receiving.step == -1 and receiving.bytes_received == 0
    assert_bit_identical(joiner, expected)
    assert joiner["optimizer"].param_groups[0]["lr"] == 0.2


@pytest.mark.timeout(60)
def test_completed_takeover_loads_the_leavers_state(store_port):
    from tmrun.swap import hand_over

    joiner, leaver, expected = replica(0, 0.3, 1), replica(1, 0.1, 3), replica(1, 0.1, 3)

    def join() -> TakeOver:
        receiving = TakeOver(spec(1, 0, 2, store_port, "agreed", handover=True), joiner, 30)
        assert receiving.wait(30)
        return receiving

    sent, receiving = in_threads(
        lambda: hand_over(build_group(GroupSpec.pair(1, HOST, store_port, 0), 30, pair_of=0), leaver, 7), join)
    assert receiving.step == 7 and receiving.error is None and receiving.bytes_received == sent > 0
    assert_bit_identical(joiner, expected)


@pytest.mark.timeout(60)
def test_failed_takeover_is_warned_about_and_reported_in_switched(store_port, caplog):
    """A leaver whose header does not match: the joiner falls back, says why once, and tells its agent."""

    class Channel:
        def __init__(self) -> None:
            self.sent: list[tuple[str, dict]] = []

        def wait(self, timeout: float) -> None:
            return None

        def send(self, kind: str, **fields: Any) -> None:
            self.sent.append((kind, fields))

    channel = Channel()
    run = Run(Identity(1, 2, 0, "standby"), SandboxGroup(1, 2), channel=channel, group_timeout=30)
    run.track(**replica(0, 0.3, 1))
    promotion = spec(1, 1, 2, store_port, "agreed", handover=True)
    run._next = types.SimpleNamespace(spec=promotion)  # the generation being joined (its group is not needed here)

    def leave() -> None:
        pair = build_group(GroupSpec.pair(1, HOST, store_port, 0), 30, pair_of=1)
        pair.send(torch.tensor([7, 12345], dtype=torch.int64), 1, 0).wait()
        pair.close()

    with caplog.at_level(logging.WARNING, logger="tmrun.runtime"):
        _, step = in_threads(leave, lambda: run._take_over(promotion))
    assert step == -1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "handover from the leaver failed" in warnings[0]
    assert "differs in parameter names, shapes or dtypes" in warnings[0]
    run._record_switch(1, 0.0, 0.0, Exchange(5, (0,), (1,), 0))
    kind, fields = channel.sent[-1]
    assert kind == "switched" and "differs in parameter names" in fields["handover_error"]
    run._record_switch(2, 0.0, 0.0, Exchange(6, (0,), (1,), 0))
    assert channel.sent[-1][1]["handover_error"] is None  # reported once, for the swap it concerned


# -- the joiner's model is checked by everyone -------------------------------------------------

@pytest.mark.timeout(60)
def test_joiner_with_another_model_is_refused_by_everyone_at_once(store_port):
    states = [replica(0, 0.1, 2), replica(0, 0.1, 2), replica(1, 0.1, 2, width=5)]  # rank 2: another model
    steps = [5, 5, -1]
    started = time.monotonic()
    results = in_threads(*[
        (lambda r=r: exchange_state(build_group(spec(1, r, 3, store_port), 45), states[r], steps[r], 45))
        for r in range(3)])
    assert time.monotonic() - started < 15  # refused at once, not after the 45 s collective timeout
    assert isinstance(results[0], GroupRefused) and isinstance(results[1], GroupRefused)
    assert "rank(s) [2] of the new group built another model" in str(results[0])
    assert isinstance(results[2], ModelMismatch) and "rank 2's tracked state" in str(results[2])
    assert not isinstance(results[2], Exception)  # no retry path catches it: the worker stops


# -- leaves JSON cannot carry ------------------------------------------------------------------

class Counter:
    """Tracked state with one non-tensor leaf of the given value."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.weight = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "meta": {"seen": self.value}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["meta"]["seen"]
        self.weight = state["weight"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value, kind", [({1, 2}, "builtins.set"), (object(), "builtins.object"),
                                         (b"raw", "builtins.bytes")])
def test_track_refuses_a_leaf_json_cannot_carry_naming_its_path(value, kind):
    run = Run(Identity(), SandboxGroup(0, 1))
    with pytest.raises(UnportableState, match=f"state leaf /counter/meta/seen is a {kind}"):
        run.track(counter=Counter(value))
    assert isinstance(UnportableState("x"), TypeError)


@pytest.mark.timeout(60)
def test_numpy_scalars_travel_as_python_numbers(store_port):
    np = pytest.importorskip("numpy")
    values = {"i": np.int64(2**40 + 1), "f": np.float32(0.1), "b": np.bool_(True), "d": np.float64(1 / 3)}
    assert portable(values) == {"i": 2**40 + 1, "f": float(np.float32(0.1)), "b": True, "d": 1 / 3}
    assert [type(v) for v in portable(values).values()] == [int, float, bool, float]
    source, receiver = Counter(np.int64(41)), Counter(0)
    source.weight += 1
    run = Run(Identity(), SandboxGroup(0, 1))
    run.track(counter=source)  # accepted: converted losslessly at the swap
    results = in_threads(
        lambda: exchange_state(build_group(spec(1, 0, 2, store_port), 30), {"counter": source}, 3, 30),
        lambda: exchange_state(build_group(spec(1, 1, 2, store_port), 30), {"counter": receiver}, -1, 30))
    assert all(isinstance(r, Exchange) for r in results), results
    assert receiver.value == 41 and type(receiver.value) is int
    assert torch.equal(receiver.weight, torch.ones(3))
