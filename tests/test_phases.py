"""The worker runtime's phase table (tmrun/phases.py): every allowed move, and what a refused one does."""

from __future__ import annotations

import logging

import pytest

from tmrun.groups import SandboxGroup
from tmrun.phases import MOVES, Phase, Phases
from tmrun.runtime import Identity, Run

pytestmark = pytest.mark.timeout(30)

ALLOWED = [(came, to) for came, tos in MOVES.items() for to in sorted(tos, key=lambda p: p.value)]
REFUSED = [(came, to) for came in Phase for to in Phase if to not in MOVES[came]]


@pytest.mark.parametrize(("came", "to"), ALLOWED, ids=[f"{a.value}->{b.value}" for a, b in ALLOWED])
def test_every_allowed_move_changes_the_phase_and_logs_no_error(came: Phase, to: Phase) -> None:
    errors: list[str] = []
    phases = Phases(came, errors.append)
    assert phases.move(to, "test") is True
    assert phases.now is to and errors == []


@pytest.mark.parametrize(("came", "to"), REFUSED, ids=[f"{a.value}->{b.value}" for a, b in REFUSED])
def test_a_refused_move_is_reported_and_the_phase_stays(came: Phase, to: Phase) -> None:
    errors: list[str] = []
    phases = Phases(came, errors.append)
    assert phases.move(to, "because of a test") is False
    assert phases.now is came
    assert errors == [f"{came.value} -> {to.value} is not allowed (because of a test); staying {came.value}"]


def test_the_table_has_the_expected_shape() -> None:
    terminal = {p for p, tos in MOVES.items() if not tos}
    assert terminal == {Phase.LEFT, Phase.FINISHED, Phase.FAILED}
    assert all(came not in tos for came, tos in MOVES.items())  # no move to the same phase
    reached, frontier = {Phase.STANDBY, Phase.ACTIVE}, [Phase.STANDBY, Phase.ACTIVE]  # where a Run starts
    while frontier:
        for to in MOVES[frontier.pop()] - reached:
            reached.add(to)
            frontier.append(to)
    assert reached == set(Phase)
    assert {p for p in Phase if p.role == "standby"} == {Phase.STANDBY, Phase.JOINING}


def test_a_run_logs_a_refused_move_as_an_error_with_its_identity(caplog: pytest.LogCaptureFixture) -> None:
    run = Run(Identity(3, 4, 0, "active", generation=2), SandboxGroup(3, 4))
    assert run.phase is Phase.ACTIVE and run.role == "active"
    with caplog.at_level(logging.DEBUG, logger="tmrun.runtime"):
        assert run._phase.move(Phase.HANDING_OVER, "a test") is False
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and run.phase is Phase.ACTIVE
    assert errors[0].getMessage() == ("tmrun: error: [rank 3 gen 2 step 0] phase move refused: active -> "
                                      "handing-over is not allowed (a test); staying active")


class Messages:
    """The agent's side of a standby's channel: these messages, then the agent gone (None)."""

    def __init__(self, *messages: dict) -> None:
        self.messages = list(messages)

    def wait(self, timeout: float) -> dict | None:
        return self.messages.pop(0) if self.messages else None


def test_a_leave_that_reaches_a_rejoined_standby_is_stale_not_a_refused_move(caplog) -> None:
    """The agent sends a newer generation's leave before it reads that the workers already left
    (with rejoin) and are standbys again: the standby stays one and says why, at info level."""
    standby = Run(Identity(1, 2, 0, "standby"), SandboxGroup(1, 2))
    standby.channel = Messages({"v": 1, "type": "leave", "gen": 3, "rejoin": True})
    with caplog.at_level(logging.DEBUG, logger="tmrun.runtime"), pytest.raises(SystemExit) as ended:
        standby._wait_for_promotion()
    assert ended.value.code == 0 and standby.phase is Phase.STANDBY
    assert [r.levelno for r in caplog.records if "generation 3" in r.getMessage()] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "the leave of generation 3 is stale: this worker is a standby" in caplog.text


def test_role_follows_the_phase() -> None:
    standby = Run(Identity(1, 2, 0, "standby"), SandboxGroup(1, 2))
    assert standby.phase is Phase.STANDBY and standby.role == "standby" and not standby.is_main
    assert standby._phase.move(Phase.JOINING, "promoted") and standby.role == "standby"
    assert standby._phase.move(Phase.ACTIVE, "joined") and standby.role == "active"
    single = Run(Identity(), SandboxGroup(0, 1))
    assert single.phase is Phase.ACTIVE and single.role == "single" and single.is_main
