"""Groups whose build starts the moment the agent's ``prepare`` arrives, not at the next step boundary.

The runtime handles the agent's messages between steps (``Run._follow_agent``). A ``prepare``
that arrives while a step runs would wait for that step's end: up to a whole step before the
next group's build even starts, and for a failure's generation the step is doomed anyway. So the
channel's reader thread hands each ``prepare`` to :meth:`EarlyBuilds.arrived`, which starts its
:class:`~tmrun.swap.NextGroup` at once (only in a worker that is in a generation: ACTIVE or
PREPARING). At the boundary ``Run._on_prepare`` claims the build it would have started; a
``prepare`` that the runtime refuses or ignores there drops its early build, and so does
``finish()`` for any left.
"""

from __future__ import annotations

import threading
from typing import Callable

from tmrun.swap import GroupSpec, NextGroup


class EarlyBuilds:
    """Builds started from the reader thread, by generation, until the main thread claims them."""

    def __init__(self, start: Callable[[GroupSpec], NextGroup]) -> None:
        self._start = start
        self._lock = threading.Lock()
        self._builds: dict[int, NextGroup] = {}
        self._closed = False

    def arrived(self, spec: GroupSpec) -> None:
        """Start building ``spec``'s group now (reader thread); a second ``prepare`` of a generation is ignored."""
        with self._lock:
            if self._closed or spec.gen in self._builds:
                return
            self._builds[spec.gen] = self._start(spec)

    def claim(self, spec: GroupSpec) -> NextGroup | None:
        """The build started for ``spec``, if any; builds of older generations are dropped."""
        with self._lock:
            mine = self._builds.pop(spec.gen, None)
            older = [gen for gen in self._builds if gen < spec.gen]
            stale = [self._builds.pop(gen) for gen in older]
        for build in stale:
            build.drop()
        if mine is not None and mine.spec != spec:  # the same generation, another spec: not this one's
            mine.drop()
            return None
        return mine

    def refuse(self, spec: GroupSpec) -> None:
        """``spec`` is not built after all (stale, or refused in this phase): drop its early build."""
        build = self.claim(spec)
        if build is not None:
            build.drop()

    def close(self) -> None:
        """Drop every unclaimed build; none starts after this."""
        with self._lock:
            self._closed = True
            builds, self._builds = list(self._builds.values()), {}
        for build in builds:
            build.drop()
