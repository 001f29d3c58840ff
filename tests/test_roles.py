"""The node agent's role table (agent/roles.py) and the state table it shares with the runtime's phases."""

from __future__ import annotations

import enum
import logging

import pytest

from agent.roles import MOVES, Role, Roles
from tmrun.states import States

pytestmark = pytest.mark.timeout(30)

ALLOWED = [(came, to) for came, tos in MOVES.items() for to in sorted(tos, key=lambda r: r.value)]
REFUSED = [(came, to) for came in Role for to in Role if to not in MOVES[came]]


def _at(role: Role, errors: list[str]) -> Roles:
    """A table that is at ``role`` (every role is reached from IDLE through allowed moves)."""
    roles = Roles(errors.append)
    path = {Role.IDLE: [], Role.SHADOW: [Role.SHADOW], Role.MEMBER: [Role.MEMBER],
            Role.LEAVING: [Role.MEMBER, Role.LEAVING], Role.ENDED: [Role.MEMBER, Role.ENDED], Role.GONE: [Role.GONE]}
    for step in path[role]:
        assert roles.move(step, "on the way")
    return roles


@pytest.mark.parametrize(("came", "to"), ALLOWED, ids=[f"{a.value}->{b.value}" for a, b in ALLOWED])
def test_every_allowed_move_changes_the_role_and_reports_nothing(came: Role, to: Role) -> None:
    errors: list[str] = []
    roles = _at(came, errors)
    assert roles.move(to, "test") is True
    assert roles.now is to and errors == []


@pytest.mark.parametrize(("came", "to"), REFUSED, ids=[f"{a.value}->{b.value}" for a, b in REFUSED])
def test_a_refused_move_is_reported_and_the_role_stays(came: Role, to: Role) -> None:
    errors: list[str] = []
    roles = _at(came, errors)
    assert roles.move(to, "a test") is False
    assert roles.now is came
    assert errors == [f"{came.value} -> {to.value} is not allowed (a test); staying {came.value}"]


def test_the_table_has_the_expected_shape() -> None:
    assert {r for r, tos in MOVES.items() if not tos} == {Role.GONE}  # the only end
    assert all(Role.GONE in tos for r, tos in MOVES.items() if r is not Role.GONE)  # any role may leave
    assert all(Role.IDLE in tos for r, tos in MOVES.items() if r.has_workers)  # workers can always be stopped
    assert Role.MEMBER not in MOVES[Role.LEAVING] | MOVES[Role.ENDED]  # back to work only through a new start
    assert {r for r in Role if r.has_workers} == {Role.SHADOW, Role.MEMBER, Role.LEAVING, Role.ENDED}


def test_a_table_that_misses_a_state_is_refused() -> None:
    class Light(enum.Enum):
        ON, OFF = "on", "off"

    with pytest.raises(ValueError, match="must name every state"):
        States(Light.ON, {Light.ON: frozenset({Light.OFF})}, print, logging.getLogger("test"))
