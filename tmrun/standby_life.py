"""A standby's life inside a worker process: shadow iterations, promotion, and back to the pool.

A standby runs the script's own loop with every collective answered in the process
(:class:`~tmrun.groups.SandboxGroup`) for ``warmup`` steps, then blocks until its agent promotes
it with a ``prepare``: it joins that generation, receiving the leaver's state in place when the
plan pairs it with one (:class:`~tmrun.swap.TakeOver`), else from the replicas. A leaver that
rejoins the pool becomes a standby again in the same process (``_demote``), warm at once.

:class:`StandbyLife` is a part of :class:`tmrun.runtime.Run`, kept in its own module: it uses the
run's channel, phase, tracked state and pending group (``_next``), and hands the joined group to
the run's switch (``_on_prepare``, ``_join_next``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterator

from tmrun.groups import SandboxGroup
from tmrun.phases import Phase
from tmrun.swap import GroupSpec, Handover, TakeOver


class StandbyLife:
    """The standby path of :class:`tmrun.runtime.Run` (a mixin: the attributes are the run's)."""

    def _shadow(self, total: int) -> Iterator[int]:
        """Warm iterations on a standby: the user's own loop, every collective answered locally."""
        for index in range(min(self.warmup, total)):
            self._begin()
            yield index
        # the sandbox's optimizer steps changed the state: it is overwritten on promotion
        if self.channel is None:
            return
        self._wait_for_promotion()

    def _wait_for_promotion(self) -> None:
        """Block until the agent promotes this standby (``prepare``), then join that generation."""
        while True:
            message = self.channel.wait(timeout=3600.0)
            if message is None:
                raise SystemExit(0)  # the agent is gone or never promoted us: nothing to do
            if message["type"] == "prepare":
                self._promote(GroupSpec.from_message(message))
                return
            if message["type"] == "leave":  # the agent sent it before it read that this worker left and rejoined
                self._warn(f"the leave of generation {message.get('gen')} is stale", "this worker is a standby",
                           logging.INFO)
                continue
            self._phase.move(Phase.LEAVING, f"{message['type']} of generation {message.get('gen')} to a standby")

    def _demote(self, left: int) -> None:
        """A leaver that rejoins the pool: become a standby in this process, warm, and wait.

        The model and optimizer stay allocated (they are overwritten on the next promotion), so
        the node is a warm standby at once, without a new process.
        """
        self.group = SandboxGroup(self.rank, self.world_size)
        if self._native is not None:
            self._native.attach(None, None, self.world_size)
        self.identity = dataclasses.replace(self.identity, generation=0)
        self._leave, self._pair = None, None
        if self._next is not None:
            self._drop_next(self._next, "left to rejoin the pool")
        self._phase.move(Phase.STANDBY, f"left generation {left} to rejoin the pool")
        self._wait_for_promotion()

    def _promote(self, spec: GroupSpec) -> None:
        started = time.monotonic()
        self._phase.move(Phase.JOINING, f"promoted to rank {spec.rank} of generation {spec.gen}")
        self._on_prepare(spec)
        my_step = -1
        if spec.handover:
            my_step = self._take_over(spec)
        self._join_next(started, my_step=my_step)

    def _take_over(self, spec: GroupSpec) -> int:
        """Receive the leaver's state in place; -1 when it failed or a newer generation came first."""
        handover = Handover.of_joiner(spec)
        assert handover is not None
        receiving = TakeOver(handover, self._tracked, self.group_timeout)
        while not receiving.done:
            message = self.channel.wait(timeout=0.05)
            if message is not None:
                self._on_message(message)
            if self._next is None or self._next.spec.gen != spec.gen:
                receiving.abandon()  # superseded: nothing it receives is written; the replicas send the state
                newer = self._next.spec.gen if self._next is not None else None
                self._handover_error = f"abandoned: generation {newer} superseded generation {spec.gen}"
                self._warn("the handover from the leaver was abandoned, taking the state from the replicas",
                           self._handover_error)
                return -1
        if receiving.step < 0:
            self._handover_error = str(receiving.error or "the leaver sent nothing")[:300]
            self._warn(f"the handover from the leaver failed (rank {handover.rank}, generation {handover.gen}), "
                       "taking the state from the replicas", self._handover_error)
        self._handover_bytes, self._handover_seconds = receiving.bytes_received, receiving.seconds
        return receiving.step
