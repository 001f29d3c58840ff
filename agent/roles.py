"""The node agent's role and the one table of the moves between roles.

A :class:`agent.node.NodeAgent`'s role says what its worker processes are doing for the job. It
changes only through :meth:`Roles.move` (a :class:`tmrun.states.States`), which checks
:data:`MOVES`; a move the table refuses is logged as an error naming both roles and why the move
was asked for, the role stays, and the action the move stood for (telling the workers to leave,
promoting a standby) is not taken. What goes with a role (the generation the workers run, the
leave already sent, the last swap's times) stays on the agent; the role says what it is for.

The moves, each with what makes it::

    IDLE    -> SHADOW   the plan is hot and this node is not a member: shadow workers started
    IDLE    -> MEMBER   this node is a member of a generation: its workers started (a restart)
    SHADOW  -> MEMBER   ``prepare`` sent: the standby is promoted without a restart
    MEMBER  -> LEAVING  drained in a planned swap: ``leave`` sent, the workers go at the agreed switch
    LEAVING -> SHADOW   the workers left with ``rejoin``: warm standbys again, in the same processes
    MEMBER  -> ENDED    the workers exited (also from LEAVING): reported, the plan says what next
    SHADOW, MEMBER, LEAVING, ENDED -> IDLE
                        the workers were stopped (replaced, a new generation, the plan went cold),
                        or a standby's shadow workers ended by themselves
    any but GONE -> GONE  the job ended or this node was drained: the agent leaves

A member whose workers are handed the next generation without a restart stays a MEMBER.
"""

from __future__ import annotations

import enum
import logging
from typing import Callable

from tmrun.states import States

log = logging.getLogger("tmrun.agent")


class Role(str, enum.Enum):
    """What this node's workers do for the job."""

    IDLE = "idle"  # no workers on this node
    SHADOW = "shadow"  # standby workers: shadow iterations in the sandbox, then waiting to be promoted
    MEMBER = "member"  # workers training as ranks of the current generation (or prepared for the next)
    LEAVING = "leaving"  # drained in a planned swap: the workers leave at the switch the ranks agree on
    ENDED = "ended"  # the workers exited (succeeded or failed) and that was reported
    GONE = "gone"  # the agent leaves the job: it ended, or this node was drained

    @property
    def has_workers(self) -> bool:
        """Whether worker processes of this node may be running (or have just exited, not yet stopped)."""
        return self in (Role.SHADOW, Role.MEMBER, Role.LEAVING, Role.ENDED)


_STOPPED = {Role.IDLE, Role.GONE}
MOVES: dict[Role, frozenset[Role]] = {
    Role.IDLE: frozenset({Role.SHADOW, Role.MEMBER, Role.GONE}),
    Role.SHADOW: frozenset({Role.MEMBER, *_STOPPED}),
    Role.MEMBER: frozenset({Role.LEAVING, Role.ENDED, *_STOPPED}),
    Role.LEAVING: frozenset({Role.SHADOW, Role.ENDED, *_STOPPED}),
    Role.ENDED: frozenset(_STOPPED),
    Role.GONE: frozenset(),
}


class Roles(States[Role]):
    """One agent's role, from IDLE; ``error`` reports a move the table refuses (with the node's name)."""

    def __init__(self, error: Callable[[str], None]) -> None:
        super().__init__(Role.IDLE, MOVES, error, log)


__all__ = ["MOVES", "Role", "Roles"]
