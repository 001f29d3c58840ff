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
from tmrun.phases import Phase
from tmrun.runtime import Identity, Run
from tmrun.swap import (Exchange, GroupRefused, GroupSpec, Handover, Leave, ModelMismatch, TakeOver, UnportableState, build_group,
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


class Channel:
    """The agent's end as a test sees it: messages to hand the worker, and what it sent."""

    def __init__(self, *inbox: dict[str, Any]) -> None:
        self.inbox = list(inbox)
        self.sent: list[tuple[str, dict]] = []

    def poll(self) -> dict[str, Any] | None:
        return self.inbox.pop(0) if self.inbox else None

    def wait(self, timeout: float) -> dict[str, Any] | None:
        return self.poll()

    def send(self, kind: str, **fields: Any) -> None:
        self.sent.append((kind, fields))


# -- an abandoned handover never writes ----------------------------------------------------------

@pytest.mark.timeout(90)
def test_abandoned_takeover_never_writes_after_the_fallback(store_port):
    """The joiner abandons a handover whose receives are posted; the replicas' state is received;
    then the stalled leaver sends everything. The joiner must hold the replicas' state, bit for bit."""
    joiner, leaver, source = replica(0, 0.3, 1), replica(1, 0.1, 3), replica(2, 0.2, 5)
    expected = replica(2, 0.2, 5)
    abandoned, fallback_done = threading.Event(), threading.Event()

    def leave() -> None:  # a leaver that stalls between its header and its tensors
        pair = Handover(1, 0, HOST, store_port).build(Handover.LEAVER, 30)
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
        receiving = TakeOver(Handover(1, 0, HOST, store_port), joiner, 30)
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
        receiving = TakeOver(Handover(1, 0, HOST, store_port), joiner, 30)
        assert receiving.wait(30)
        return receiving

    sent, receiving = in_threads(
        lambda: hand_over(Handover(1, 0, HOST, store_port).build(Handover.LEAVER, 30), leaver, 7), join)
    assert receiving.step == 7 and receiving.error is None and receiving.bytes_received == sent > 0
    assert_bit_identical(joiner, expected)


@pytest.mark.timeout(60)
def test_failed_takeover_is_warned_about_and_reported_in_switched(store_port, caplog):
    """A leaver whose header does not match: the joiner falls back, says why once, and tells its agent."""

    channel = Channel()
    run = Run(Identity(1, 2, 0, "standby"), SandboxGroup(1, 2), channel=channel, group_timeout=30)
    run.track(**replica(0, 0.3, 1))
    promotion = spec(1, 1, 2, store_port, "agreed", handover=True)
    run._next = types.SimpleNamespace(spec=promotion)  # the generation being joined (its group is not needed here)

    def leave() -> None:
        pair = Handover(1, 1, HOST, store_port).build(Handover.LEAVER, 30)
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


# -- one description of the handover pairing -----------------------------------------------------

def test_leaver_and_joiner_build_the_same_handover_from_their_messages():
    leave = {"v": 1, "type": "leave", "gen": 4, "rejoin": False, "store_host": HOST, "store_port": 2345}
    prepare = {"v": 1, "type": "prepare", "gen": 4, "rank": 1, "world_size": 3, "store_host": HOST,
               "store_port": 2345, "mode": "agreed", "handover": True}
    leaver = Leave.from_message(leave, rank=1).handover
    joiner = Handover.of_joiner(GroupSpec.from_message(prepare))
    assert leaver == joiner == Handover(4, 1, HOST, 2345)
    assert leaver.prefix == "tmrun/gen4/handover1" and (Handover.LEAVER, Handover.JOINER) == (0, 1)
    assert Leave.from_message({"gen": 4}, rank=1).handover is None  # nobody to hand over to
    assert Handover.of_joiner(GroupSpec.from_message({**prepare, "handover": False})) is None


# -- errors in the swap's threads are said once and told to the agent ----------------------------

def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.timeout(60)
def test_a_failed_build_of_the_next_group_is_warned_once_and_reported_in_switched(monkeypatch, caplog):
    """Phase 1 fails on this worker: it says so once (rank, generations), goes back to training in
    its group instead of never voting ready, and the next ``switched`` carries the reason."""

    gate = threading.Event()

    def refuse(spec: GroupSpec, timeout: float):
        assert gate.wait(30)
        raise RuntimeError(f"connect to {spec.store_host}:{spec.store_port} refused")

    monkeypatch.setattr("tmrun.swap.build_group", refuse)
    prepare = {"v": 1, "type": "prepare", "gen": 2, "rank": 0, "world_size": 2, "store_host": HOST,
               "store_port": 9, "mode": "agreed", "handover": False}
    channel = Channel(prepare)
    run = Run(Identity(0, 2, 0, "active", generation=1), SandboxGroup(0, 2), channel=channel, group_timeout=30)
    with caplog.at_level(logging.WARNING, logger="tmrun.runtime"):
        run._follow_agent()
        pending = run._next
        assert run.phase is Phase.PREPARING and pending is not None
        gate.set()
        with pytest.raises(RuntimeError):
            pending.wait(30)  # the thread reported the failure before it finished
        assert not run._ready_to_switch()
        run._follow_agent()
    assert run.phase is Phase.ACTIVE and run._next is None
    warned = warnings_of(caplog)
    assert len(warned) == 1, warned
    assert "[rank 0 gen 1 step 0] building a group failed: the group of generation 2 (as rank 0 of 2)" in warned[0]
    assert f"connect to {HOST}:9 refused" in warned[0]
    run._record_switch(3, 0.0, 0.0, Exchange(5, (0, 1), (), 0))
    kind, fields = channel.sent[-1]
    assert kind == "switched" and "generation 2" in fields["build_error"] and fields["sources"] == 2
    run._record_switch(4, 0.0, 0.0, Exchange(6, (0,), (1,), 0))
    assert channel.sent[-1][1]["build_error"] is None  # reported once, with the switch that followed it


@pytest.mark.timeout(60)
def test_a_leaver_whose_pair_was_not_built_says_why_once_and_in_switched(monkeypatch, caplog):
    def refuse(self: Handover, side: int, timeout: float):
        raise RuntimeError("the pair's store is gone")

    monkeypatch.setattr(Handover, "build", refuse)
    leave = {"v": 1, "type": "leave", "gen": 2, "rejoin": False, "store_host": HOST, "store_port": 9}
    channel = Channel(leave)
    run = Run(Identity(1, 2, 0, "active", generation=1), SandboxGroup(1, 2), channel=channel, group_timeout=30)
    with caplog.at_level(logging.WARNING, logger="tmrun.runtime"):
        run._follow_agent()
        assert run.phase is Phase.LEAVING and run._pair is not None
        with pytest.raises(RuntimeError):
            run._pair.wait(30)
        assert run.commit() and run._switch  # a failed pair does not hold the switch up
        with pytest.raises(SystemExit) as exited:
            run._switch_generation()
    assert exited.value.code == 0 and run.phase is Phase.LEFT
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "the handover pair with the joiner of rank 1 in generation 2" in warned[0], warned
    kind, fields = channel.sent[-1]
    assert kind == "switched" and fields["left"] and "the pair's store is gone" in fields["handover_error"]


@pytest.mark.timeout(60)
def test_a_takeover_whose_leaver_sends_nothing_is_warned_about_and_reported(store_port, caplog):
    """The leaver builds the pair and goes away without a byte: the joiner falls back, says so."""
    channel = Channel()
    run = Run(Identity(1, 2, 0, "standby"), SandboxGroup(1, 2), channel=channel, group_timeout=30)
    run.track(**replica(0, 0.3, 1))
    promotion = spec(1, 1, 2, store_port, "agreed", handover=True)
    run._next = types.SimpleNamespace(spec=promotion)

    def leave() -> None:
        Handover(1, 1, HOST, store_port).build(Handover.LEAVER, 30).close()

    with caplog.at_level(logging.WARNING, logger="tmrun.runtime"):
        _, step = in_threads(leave, lambda: run._take_over(promotion))
    assert step == -1
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "the handover from the leaver failed (rank 1, generation 1)" in warned[0], warned
    run._record_switch(1, 0.0, 0.0, Exchange(5, (0,), (1,), 0))
    assert channel.sent[-1][0] == "switched" and channel.sent[-1][1]["handover_error"]


@pytest.mark.timeout(60)
def test_an_abandoned_takeover_is_warned_about_and_reported(monkeypatch, store_port, caplog):
    """A newer generation supersedes the one being joined while the leaver never shows up."""
    gate = threading.Event()
    monkeypatch.setattr("tmrun.swap.build_group", lambda spec, timeout: gate.wait(30) and None)
    newer = {"v": 1, "type": "prepare", "gen": 3, "rank": 1, "world_size": 2, "store_host": HOST,
             "store_port": store_port, "mode": "now", "handover": False}
    channel = Channel(newer)
    run = Run(Identity(1, 2, 0, "standby"), SandboxGroup(1, 2), channel=channel, group_timeout=30)
    run.track(**replica(0, 0.3, 1))
    promotion = spec(2, 1, 2, store_port, "agreed", handover=True)
    assert run._phase.move(Phase.JOINING, "a test's promotion")
    run._next = types.SimpleNamespace(spec=promotion, drop=lambda: None)
    try:
        with caplog.at_level(logging.WARNING, logger="tmrun.runtime"):
            assert run._take_over(promotion) == -1
    finally:
        gate.set()
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "the handover from the leaver was abandoned" in warned[0], warned
    assert run._handover_error == "abandoned: generation 3 superseded generation 2"


@pytest.mark.timeout(30)
def test_orders_a_phase_cannot_take_are_logged_errors_and_not_acted_on(caplog):
    prepare = {"v": 1, "type": "prepare", "gen": 3, "rank": 0, "world_size": 2, "store_host": HOST,
               "store_port": 9, "mode": "agreed", "handover": False}
    channel = Channel({"v": 1, "type": "leave", "gen": 2, "rejoin": False}, prepare)
    run = Run(Identity(0, 2, 0, "active", generation=1), SandboxGroup(0, 2), channel=channel)
    with caplog.at_level(logging.WARNING, logger="tmrun.runtime"):
        run._follow_agent()
    assert run.phase is Phase.LEAVING and run._next is None  # the prepare was not started
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["tmrun: error: [rank 0 gen 1 step 0] phase move refused: leaving -> preparing is not allowed "
                      "(prepare of generation 3); staying leaving"]
