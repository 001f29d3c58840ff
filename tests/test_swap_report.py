"""The ``swap`` event's summary, from the members' ``last_swap`` reports (pure logic)."""

from __future__ import annotations

import pytest

from agent.records import Plan, RunState
from agent.swap_report import describe, summarize

pytestmark = pytest.mark.timeout(10)

PLAN = Plan(2, ("a", "s"), {"a": 1, "s": 1}, "127.0.0.1", 1, "a", created=100.05, hot=True, mode="swap-agreed",
            joiners=("s",), handover={"b": "s"}, requested=100.0, out={"b": "drained"})


def reported(gen: int = 2, **extra) -> RunState:
    swap = {"gen": gen, "step": 40, "prepared_at": 100.06, "ready_at": 101.0, "switched_at": 101.2,
            "first_step_at": 101.4, "stall": 0.1, "bytes_received": 0, "from_leaver": 0, **extra}
    return RunState(gen, "running", last_swap=swap)


def test_summary_times_each_phase_from_the_request() -> None:
    runs = {"a": reported(phase1_steps=6, phase1_step_time=0.21, normal_step_time=0.2),
            "s": reported(ready_at=101.1, stall=0.3, bytes_received=1000, from_leaver=1000)}
    got = summarize(PLAN, runs)
    assert got is not None
    assert (got["plan_written_s"], got["phase1_started_s"], got["phase1_done_s"], got["switched_s"],
            got["first_step_s"]) == (0.05, 0.06, 1.1, 1.2, 1.4)
    assert (got["stall_s"], got["joiner_stall_s"], got["bytes_moved"], got["bytes_from_leaver"]) == (0.1, 0.3, 1000, 1000)
    assert (got["phase1_steps"], got["phase1_step_time"], got["normal_step_time"]) == (6, 0.21, 0.2)
    assert "s switched in" in describe(got) and "from the leaver" in describe(got)


def test_no_summary_until_every_member_committed_a_step_in_the_new_generation() -> None:
    waiting = RunState(2, "running", last_swap={"gen": 2, "switched_at": 101.2})
    assert summarize(PLAN, {"a": reported(), "s": waiting}) is None
    assert summarize(PLAN, {"a": reported(), "s": reported(gen=1)}) is None
    assert summarize(PLAN, {"a": reported()}) is None  # a member is gone


def test_restart_generations_have_no_swap_summary() -> None:
    restart = Plan(2, ("a", "s"), {"a": 1, "s": 1}, "127.0.0.1", 1, "a", mode="restart")
    assert summarize(restart, {"a": reported(), "s": reported()}) is None


def test_a_failed_handover_is_named_in_the_event() -> None:
    runs = {"a": reported(), "s": reported(handover_error="abandoned: generation 3 superseded generation 2")}
    got = summarize(PLAN, runs)
    assert got is not None and got["handover_errors"] == ["abandoned: generation 3 superseded generation 2"]
    assert describe(got).endswith("the handover failed, state from the replicas: "
                                  "abandoned: generation 3 superseded generation 2")
    assert summarize(PLAN, {"a": reported(), "s": reported(handover_error=None)})["handover_errors"] == []
