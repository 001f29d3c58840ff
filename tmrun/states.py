"""A state that changes only through a table of allowed moves (the runtime's phases, the agent's roles).

:class:`States` holds one value of an enum and a table ``from -> the states it may move to``.
:meth:`States.move` is the only way to change it: a move the table allows happens (logged at
debug level); any other is a bug or a contradictory order, reported through ``error`` with both
states and the reason the move was asked for, and the state stays as it was. Nothing is raised:
the caller decides what a refused move means (it skips the action the move stood for).
"""

from __future__ import annotations

import enum
import logging
from typing import Callable, Generic, Mapping, TypeVar

S = TypeVar("S", bound=enum.Enum)


class States(Generic[S]):
    """One state out of ``moves``' keys; :meth:`move` checks every change against ``moves``."""

    def __init__(self, start: S, moves: Mapping[S, frozenset[S]], error: Callable[[str], None],
                 log: logging.Logger) -> None:
        if set(moves) != set(type(start)):
            raise ValueError(f"the table of {type(start).__name__} moves must name every state")
        self._now = start
        self._moves = moves
        self._error = error
        self._log = log

    @property
    def now(self) -> S:
        return self._now

    def move(self, to: S, why: str) -> bool:
        """Go to ``to`` if the table allows it from here (True); otherwise report an error and stay (False)."""
        came = self._now
        if to not in self._moves[came]:
            self._error(f"{came.value} -> {to.value} is not allowed ({why}); staying {came.value}")
            return False
        self._now = to
        self._log.debug("%s -> %s: %s", came.value, to.value, why)
        return True


__all__ = ["States"]
