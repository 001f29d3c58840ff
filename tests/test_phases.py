"""The worker runtime's phase table (tmrun/phases.py): every allowed move, and what a refused one does."""

from __future__ import annotations

import pytest

from tmrun.phases import MOVES, Phase, Phases

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
