"""The worker runtime's phases and the one table of the moves between them.

A :class:`tmrun.runtime.Run` is in exactly one :class:`Phase` at a time and changes it only
through :meth:`Phases.move` (a :class:`tmrun.states.States`), which checks :data:`MOVES`. A move that is not in the table is a
bug or a contradictory order from the agent: it is logged as an error naming both phases and why
the move was asked for, and the phase stays as it was. It is never raised into the user's
training loop and never silently ignored. Which role the worker plays (``standby`` or
``active``) follows from its phase.

The moves (:data:`MOVES`), each with what makes it::

    STANDBY      -> JOINING       ``prepare``: this standby is promoted
    JOINING      -> ACTIVE        the state exchange on the new group is done
    ACTIVE       -> PREPARING     ``prepare``: the next group is built in the background (phase 1)
    PREPARING    -> ACTIVE        switched to the next group (agreed, or a failover), or its build dropped
    ACTIVE       -> LEAVING       ``leave`` (also from PREPARING; one received while JOINING or
                                  RECOVERING waits until the worker is ACTIVE)
    LEAVING      -> HANDING_OVER  every rank voted for the switch
    HANDING_OVER -> LEFT          the state was handed over and ``switched`` sent: the process exits 0
    HANDING_OVER -> STANDBY       the same with ``rejoin``: a warm standby again, in the same process
    ACTIVE       -> RECOVERING    a step did not commit under an agent (also from PREPARING, LEAVING)
    RECOVERING   -> ACTIVE        the state exchange on the next generation's group is done
    ACTIVE       -> FINISHED      the step loop ran to its end (also from PREPARING, LEAVING)
    any of JOINING, ACTIVE, PREPARING, LEAVING, RECOVERING -> FAILED
                                  StepFailed, StateLost or ModelMismatch stops the worker

Data that goes with a phase (the pending next group, the leave order, byte counters) stays on
the run; the phase says what the worker is doing with it.
"""

from __future__ import annotations

import enum
import logging
from typing import Callable

from tmrun.states import States

log = logging.getLogger("tmrun.runtime")


class Phase(str, enum.Enum):
    """What a worker is doing, each phase documented by what it waits for."""

    STANDBY = "standby"  # shadow iterations in the sandbox, then waiting for ``prepare`` (or a leaver that rejoined)
    JOINING = "joining"  # promoted: building the new group, taking the leaver's state, exchanging state
    ACTIVE = "active"  # training in the current generation, nothing pending
    PREPARING = "preparing"  # training; the next generation's group is built in the background (phase 1)
    LEAVING = "leaving"  # ``leave`` received: training, voting ready, building the handover pair; waiting for the switch
    HANDING_OVER = "handing-over"  # the switch was agreed: sending the state to the joiner, then ``switched``
    RECOVERING = "recovering"  # the group broke: ``broken`` sent, waiting for the next generation and building it
    LEFT = "left"  # handed over and reported: the process exits 0
    FINISHED = "finished"  # the step loop ran to its end
    FAILED = "failed"  # StepFailed, StateLost or ModelMismatch was raised: the worker stops

    @property
    def role(self) -> str:
        """``standby`` until the state exchange made this worker a member, ``active`` from then on."""
        return "standby" if self in (Phase.STANDBY, Phase.JOINING) else "active"


# from -> the phases it may move to; nothing else is allowed
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.STANDBY: frozenset({Phase.JOINING}),
    Phase.JOINING: frozenset({Phase.ACTIVE, Phase.FAILED}),
    Phase.ACTIVE: frozenset({Phase.PREPARING, Phase.LEAVING, Phase.RECOVERING, Phase.FINISHED, Phase.FAILED}),
    Phase.PREPARING: frozenset({Phase.ACTIVE, Phase.LEAVING, Phase.RECOVERING, Phase.FINISHED, Phase.FAILED}),
    Phase.LEAVING: frozenset({Phase.HANDING_OVER, Phase.RECOVERING, Phase.FINISHED, Phase.FAILED}),
    Phase.HANDING_OVER: frozenset({Phase.LEFT, Phase.STANDBY}),
    Phase.RECOVERING: frozenset({Phase.ACTIVE, Phase.FAILED}),
    Phase.LEFT: frozenset(),
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
}


class Phases(States[Phase]):
    """One worker's phase; :meth:`move` is the only way to change it.

    ``error`` reports a move the table refuses (the runtime passes its own warning path, which
    puts the worker's rank, generation and step on the line).
    """

    def __init__(self, start: Phase, error: Callable[[str], None]) -> None:
        super().__init__(start, MOVES, error, log)


__all__ = ["Phase", "Phases", "MOVES"]
