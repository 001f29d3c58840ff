"""The runtime a training script imports: ``run = tmrun.init()``.

A script written against it runs unchanged under plain ``python`` (a world of one), under
``torchrun`` or tmrun's restart mode (a static world), and as a standby's shadow (every collective
answered inside the process, see :class:`tmrun.groups.SandboxGroup`)::

    run = tmrun.init()
    run.track(model=model, optimizer=opt)
    ddp = run.data_parallel(model)
    for step in run.steps(total=1000):
        loss = ddp(x(step, run.rank)).mean()
        run.backward(loss)        # loss.backward(), stopped at once if the step is doomed
        if run.commit():          # False: this step failed somewhere and is yielded again
            opt.step()
        opt.zero_grad()

Errors inside a step (a collective that fails because a peer died) are latched, never thrown
into the user's code; ``commit()`` is where the ranks vote whether the step counts. A step that
cannot count any more (a collective of it failed, or the agent announced a failure's
generation) stops its backward at once (:mod:`tmrun.abandon`), and the next generation's group
is built from the moment its ``prepare`` arrives (:mod:`tmrun.early_build`). A step that
does not count is retried with the same index, the same data and the same RNG state; after
``max_retries`` failed tries :class:`StepFailed` says so with the count, and the launcher's
restart semantics take over. The hot swap (promotion, state transfer, group switch) builds on
these pieces; see docs/design.md for what is built.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import os
import statistics
import time
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from tmrun import torchrun_round
from tmrun.abandon import StepGuard
from tmrun.channel import AgentChannel
from tmrun.early_build import EarlyBuilds
from tmrun.groups import Group, RealGroup, SandboxGroup
from tmrun.heap import HeapTrim
from tmrun.native import NativeGroups, NativeResize
from tmrun.phases import Phase, Phases
from tmrun.redundancy import Redundancy
from tmrun.shares import Share, iterate
from tmrun.standby_life import StandbyLife
from tmrun.swap import (Exchange, GroupSpec, Leave, ModelMismatch, NextGroup, StateLost,
                         exchange_state, flatten, hand_over, portable)

log = logging.getLogger("tmrun.runtime")


class StepFailed(RuntimeError):
    """A step did not commit after the allowed number of tries."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who this worker is, read once from the launcher's environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    role: str = "single"  # as launched: single | active | standby (run.role follows the phase)
    generation: int = 0
    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Identity":
        if "RANK" not in env:
            return cls()
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                   env.get("TMRUN_ROLE", "active"),
                   int(env.get("TMRUN_GENERATION", env.get("TORCHELASTIC_RESTART_COUNT", "0"))),
                   env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "0")),
                   env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


class Run(StandbyLife):
    """One worker's view of the job: its rank, its group, its tracked state, its step loop.

    What the worker is doing is its phase (:mod:`tmrun.phases`), changed only by
    ``self._phase.move``; the attributes beside it are data that a phase uses.
    """

    def __init__(self, identity: Identity, group: Group, *, channel: AgentChannel | None = None,
                 max_retries: int = 3, warmup: int = 3, group_timeout: float = 120.0,
                 recover_timeout: float = 300.0, redundancy: int = 0, heap: HeapTrim | None = None) -> None:
        self.identity = identity
        self.group = group
        self.channel = channel
        self.max_retries = max_retries
        self.warmup = warmup
        self.group_timeout = group_timeout
        self.recover_timeout = recover_timeout
        self.step = 0  # the next step index to run (the job's)
        self.device = torch.device("cpu")
        self.swaps: list[dict[str, Any]] = []  # what each switch cost, for logs and tests
        self._phase = Phases(Phase.STANDBY if identity.role == "standby" else Phase.ACTIVE,
                             lambda text: self._warn("phase move refused", text, level=logging.ERROR))
        self._tracked: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._group_failed = False  # a collective of this step failed (see latch)
        self._voted: bool | None = None
        self._switch = False
        self._rng: torch.Tensor | None = None
        self._next: NextGroup | None = None  # the newest generation's group being built (phase 1)
        self._leave: Leave | None = None  # the agent's leave order (kept while JOINING or RECOVERING)
        self._pair: NextGroup | None = None  # the leaver's end of its handover pair, being built
        # what the pending switch reports: bytes and seconds from the leaver, and why something failed
        self._handover_bytes = 0
        self._handover_seconds = 0.0
        self._handover_error: str | None = None  # why this joiner's handover failed or was abandoned
        self._build_error: str | None = None  # why building a group failed since the last switch
        self._last_progress = 0.0
        self._step_times: collections.deque = collections.deque(maxlen=64)  # (seconds, during phase 1)
        self._native: NativeGroups | None = None  # run.process_group and run.device_mesh, once asked for
        # --redundancy: snapshots every ``redundancy`` steps, a neighbour's shards kept (tmrun/redundancy.py)
        self._redundancy = Redundancy(redundancy, group_timeout) if redundancy > 0 else None
        self.heap = heap if heap is not None else HeapTrim(0)  # malloc_trim every N committed steps
        # a failure's generation announced (reader thread): the steps of older generations are doomed
        self._doomed_gen = 0
        self._guard = StepGuard(self._doomed)
        self._early = EarlyBuilds(self._start_build)
        if channel is not None:
            channel.on_arrival = self._on_arrival

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    @property
    def is_main(self) -> bool:
        return self.identity.rank == 0 and self.role != "standby"

    @property
    def phase(self) -> Phase:
        """What this worker is doing now (see :mod:`tmrun.phases`)."""
        return self._phase.now

    @property
    def role(self) -> str:
        """``single`` (no launcher), else ``standby`` or ``active`` as the phase says."""
        return "single" if self.identity.role == "single" else self._phase.now.role

    @property
    def generation(self) -> int:
        return self.identity.generation

    @property
    def pending_generation(self) -> int | None:
        """The generation being prepared in the background (phase 1), if any."""
        return self._next.spec.gen if self._next is not None else None

    # ------------------------------------------------------------------ state
    def track(self, **objects: Any) -> None:
        """Register the state that moves with a rank: anything with state_dict/load_state_dict."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict")
            portable(flatten({name: obj.state_dict()})[1])  # a leaf JSON cannot carry fails here, not at a swap
            self._tracked[name] = obj

    def state_dict(self) -> dict[str, Any]:
        """The tracked state plus the step counter (tensors are the live ones, not copies)."""
        return {"step": self.step, **{name: obj.state_dict() for name, obj in self._tracked.items()}}

    # ------------------------------------------------------------------ errors and votes
    def _warn(self, what: str, error: object, level: int = logging.WARNING) -> None:
        """One line with this worker's identity: an error the swap survives, never swallowed."""
        log.log(level, "tmrun: %s: [rank %d gen %d step %d] %s: %s", logging.getLevelName(level).lower(),
                self.rank, self.generation, self.step, what,
                str(error).splitlines()[0][:300] if str(error) else type(error).__name__)

    def _build_failed(self, build: NextGroup, error: BaseException) -> None:
        """A group's build failed in its thread: said once here, and told to the agent in ``switched``."""
        text = f"{build.what}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"[:300]
        self._warn("building a group failed", text)
        if build.handover is None and self._build_error is None:
            self._build_error = text  # a handover pair's failure goes in the leaver's ``switched`` instead

    def latch(self, error: BaseException, *, group_failed: bool = False) -> None:
        """Remember the first error of this step; ``commit()`` will vote against the step.

        ``group_failed``: the error came from a collective of the group (a peer is gone). This
        rank then issues nothing more on that group in this step, the vote included: its peers
        may still be sending gradient buckets that this rank skipped, and gloo pairs messages by
        order, so a vote sent among them would meet a bucket and gloo would abort the process
        ("Received data size doesn't match expected size"). The step fails on this rank without
        a vote; its peers learn it when the group is closed (``_recover``).
        """
        if self._error is None:
            self._error = error
        if group_failed:
            self._group_failed = True

    @property
    def step_error(self) -> BaseException | None:
        return self._error

    @property
    def group_failed(self) -> bool:
        """Whether a collective of this step failed: the group must not be used until the next one."""
        return self._group_failed

    def commit(self) -> bool:
        """All ranks vote: True only if no rank latched an error in this step.

        The same vote carries "I am ready for the next generation": when every rank is, all of
        them switch after this step (phase 2 of a planned swap), without any extra round trip.
        """
        if self._doomed():  # see latch(): no vote on a group that failed or is being replaced
            self._latch_doomed()
            self._switch = False
            self._voted = False
            return False
        ok = self._error is None
        ready = self._ready_to_switch()
        votes = torch.tensor([1.0 if ok else 0.0, 1.0 if ready else 0.0])
        if self._redundancy is not None:  # a third vote: this rank's snapshot is complete
            votes = torch.cat([votes, torch.tensor([1.0 if self._redundancy.vote() else 0.0])])
        try:
            self.group.all_reduce(votes, "sum").wait()
            agreed = ok and int(votes[0].item()) == self.group.contributors
            self._switch = agreed and ready and int(votes[1].item()) == self.group.contributors
            if self._redundancy is not None and int(votes[2].item()) == self.group.contributors:
                self._redundancy.agree()  # every rank's snapshot is complete: the one to roll back to
        except RuntimeError as exc:  # the vote itself failed: a peer is gone
            self.latch(exc, group_failed=True)
            agreed = False
        self._voted = agreed
        return agreed

    def _doomed(self) -> bool:
        """Whether this step can no longer commit: a collective of it failed, or a failure's
        generation was announced (any thread may ask)."""
        return self._group_failed or self._doomed_gen > self.identity.generation

    def _latch_doomed(self) -> None:
        self.latch(RuntimeError(f"step {self.step} abandoned: generation {self._doomed_gen} replaces generation "
                                f"{self.generation} after a failure"), group_failed=True)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, stopped at once when the step cannot commit any more (a
        collective of it failed, or the agent announced a failure's generation): no exception
        reaches the script, and ``commit()`` returns False (see :mod:`tmrun.abandon`). With torch's
        own parallelism on ``run.process_group`` it is ``loss.backward()``: their hooks keep state."""
        if self._native is not None:
            loss.backward(**kwargs)
        elif not self._guard.backward(loss, **kwargs):
            self._latch_doomed()

    def _ready_to_switch(self) -> bool:
        """A leaver once its handover pair is built (or failed); otherwise the next group is built."""
        if self.phase is Phase.LEAVING:
            return self._pair is None or self._pair.done
        if self.phase is Phase.PREPARING:
            return self._next is not None and self._next.ready and self._next.spec.mode == "agreed"
        return False

    # ------------------------------------------------------------------ the step loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the job's step indices from ``self.step`` to ``total``; retry steps that failed.

        On a standby this first runs ``warmup`` shadow iterations in the sandbox, then waits to
        be promoted and continues at the job's step. Between steps it follows the agent: builds
        the next generation's group in the background, switches when every rank voted ready.
        """
        try:
            yield from self._steps(total)
        except (StepFailed, StateLost, ModelMismatch, NativeResize) as exc:
            self._phase.move(Phase.FAILED, f"{type(exc).__name__}: {str(exc)[:200]}")
            if self.channel is not None:  # the leader's decision names the cause, not only the exit code
                self.channel.send("failed", gen=self.generation, step=self.step,
                                  error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500])
            raise

    def _steps(self, total: int) -> Iterator[int]:
        if self.phase is Phase.STANDBY:
            yield from self._shadow(total)
            if self.phase is Phase.STANDBY:
                return  # no agent to promote this standby: the warm-up was all there was to do
        tries = 0
        while self.step < total:
            self._begin()
            started = time.monotonic()
            yield self.step
            self._follow_agent()
            if self._voted is False:
                tries += 1
                if self.channel is not None:
                    self._recover()
                elif tries >= self.max_retries:
                    raise StepFailed(f"step {self.step} did not commit after {tries} tries: {self._error}")
                torch.random.set_rng_state(self._rng)  # the retry sees the same randomness
                continue
            tries = 0
            self.step += 1
            self._snapshot_if_due()
            self.heap.after_step(self.step)
            self._step_times.append((time.monotonic() - started, self.phase is Phase.PREPARING))
            self._report_progress(time.monotonic() - started)
            if self._switch:
                self._switch_generation()
            elif self._failover_due():
                self._fail_over()
        self._finish_pending_switch()
        self._phase.move(Phase.FINISHED, f"the loop ended at step {self.step} of {total}")

    def _snapshot_if_due(self) -> None:
        """--redundancy: every N committed steps, copy this rank's state and send its shards to its
        left neighbour in the background (:mod:`tmrun.redundancy`); nothing when nothing is sharded."""
        redundancy = self._redundancy
        if redundancy is None or not isinstance(self.group, RealGroup) or not redundancy.due(self.step):
            return
        keys: list = []
        tensors, leaves = flatten({name: obj.state_dict() for name, obj in self._tracked.items()}, keys=keys)
        keyed = [key is not None for key in keys]
        if not any(keyed):
            return  # every tensor has a replica on every rank: the replicas are the redundancy
        try:
            redundancy.start(self.group, self.generation, self.step, [t for _, t in tensors], keyed, portable(leaves))
        except RuntimeError as exc:  # a neighbour is gone: the failure is handled by the next step's vote
            self._warn("a redundant snapshot could not start", exc)

    def _finish_pending_switch(self) -> None:
        """The last step ran while a swap was prepared: hand the final state to the joiner anyway,
        so that it ends with the job instead of waiting for a switch that will never be voted."""
        if self.channel is None or self.phase is Phase.LEAVING:
            return
        self._follow_agent()
        pending = self._next
        if self.phase is not Phase.PREPARING or pending is None:
            return
        try:
            self._adopt(pending, pending.wait(self.recover_timeout), time.monotonic(), time.monotonic())
        except (TimeoutError, RuntimeError) as exc:
            self._warn(f"the final state did not reach generation {pending.spec.gen}", exc)
            self._drop_next(pending, "the final state did not reach it")  # the joiner is gone too

    def _begin(self) -> None:
        self._error = None
        self._group_failed = False
        self._voted = None
        self._switch = False
        self._rng = torch.random.get_rng_state()

    def _follow_agent(self) -> None:
        """Handle the agent's messages at a step boundary, without blocking; drop a failed build."""
        if self.channel is None:
            return
        while (message := self.channel.poll()) is not None:
            self._on_message(message)
        pending = self._next
        if self.phase is Phase.PREPARING and pending is not None and pending.failed:
            self._drop_next(pending, f"building the group of generation {pending.spec.gen} failed")

    def _on_arrival(self, message: dict[str, Any]) -> None:
        """The channel's reader thread, as a message arrives: a ``prepare`` for a worker in a
        generation starts its group's build now, and a failure's (mode ``now``) dooms the step."""
        if message["type"] != "prepare" or self.phase not in (Phase.ACTIVE, Phase.PREPARING):
            return
        spec = GroupSpec.from_message(message)
        if spec.gen <= self.identity.generation:
            return
        if spec.mode == "now":
            self._doomed_gen = max(self._doomed_gen, spec.gen)
        self._early.arrived(spec)

    def _start_build(self, spec: GroupSpec) -> NextGroup:
        return NextGroup(spec, self.group_timeout, lambda s: self.channel.send("ready", gen=s.gen), self._build_failed)

    def _on_message(self, message: dict[str, Any]) -> None:
        if message["type"] == "leave":
            self._on_leave(Leave.from_message(message, self.rank))
        elif message["type"] == "prepare":
            self._on_prepare(GroupSpec.from_message(message))

    def _on_prepare(self, spec: GroupSpec) -> None:
        """Start building the group of ``spec`` (phase 1); one older than what is pending is ignored."""
        pending = self._next
        if spec.gen <= (pending.spec.gen if pending is not None else self.generation):
            self._early.refuse(spec)
            return
        if self.phase is Phase.ACTIVE:
            self._phase.move(Phase.PREPARING, f"prepare of generation {spec.gen}")
        elif self.phase not in (Phase.PREPARING, Phase.JOINING, Phase.RECOVERING):
            self._phase.move(Phase.PREPARING, f"prepare of generation {spec.gen}")  # refused: logged
            self._early.refuse(spec)
            if self._doomed_gen == spec.gen:
                self._doomed_gen = 0  # not this worker's generation to join: its steps go on
            return
        if pending is not None:
            pending.drop()  # superseded: it may wait forever for a rank that is gone
        self._next = self._early.claim(spec) or self._start_build(spec)

    def _on_leave(self, leave: Leave) -> None:
        """Leave at the agreed switch (ACTIVE, PREPARING); kept for later while JOINING or RECOVERING."""
        current = self._leave
        if current is not None and leave.gen <= current.gen:
            return  # the same order again, or an older one
        if self.phase in (Phase.ACTIVE, Phase.PREPARING):
            self._phase.move(Phase.LEAVING, f"leave at generation {leave.gen}")
        elif self.phase not in (Phase.LEAVING, Phase.JOINING, Phase.RECOVERING):
            self._phase.move(Phase.LEAVING, f"leave at generation {leave.gen}")  # refused: logged
            return
        if self._pair is not None:
            self._pair.drop()  # a newer leave: the joiner of the older one builds no pair any more
        self._leave = leave
        self._pair = NextGroup.pair(leave.handover, self.group_timeout, self._build_failed) \
            if leave.handover is not None else None

    def _drop_next(self, pending: NextGroup, why: str) -> None:
        """Give up the pending group (PREPARING goes back to ACTIVE)."""
        pending.drop()
        if self._next is pending:
            self._next = None
            if self.phase is Phase.PREPARING:
                self._phase.move(Phase.ACTIVE, why)

    def _switch_generation(self) -> None:
        """Phase 2: every rank voted ready after a committed step; move to the next group."""
        if self.phase is Phase.LEAVING:
            self._hand_over_and_leave()
            return
        started = time.monotonic()
        pending = self._next
        assert pending is not None
        try:
            self._adopt(pending, pending.wait(self.group_timeout), started, started)
        except (TimeoutError, RuntimeError) as exc:  # the old group is gone too: wait for the next generation
            self._warn(f"the switch to generation {pending.spec.gen} failed", exc)
            self._drop_next(pending, f"the switch to generation {pending.spec.gen} failed")
            self.latch(exc)
            self._recover(started)

    def _hand_over_and_leave(self) -> None:
        """The leaver at the agreed switch: hand the state to the joiner, report, then exit (or rejoin)."""
        leave, pair = self._leave, self._pair
        assert leave is not None
        self._phase.move(Phase.HANDING_OVER, f"the switch to generation {leave.gen} was agreed")
        started = time.monotonic()
        sent, failed = 0, None
        if pair is not None and pair.ready:
            try:
                sent = hand_over(pair.group, self._tracked, self.step)
            except RuntimeError as exc:  # the joiner is gone: it (or the next one) takes the state from the replicas
                failed = str(exc)[:300] or type(exc).__name__
                self._warn("the handover to the joiner failed, it takes the state from the replicas", exc)
            pair.group.close()
        elif pair is not None:  # its thread said why already
            failed = f"the handover pair was not built: {pair.error}"[:300]
        self.channel.send("switched", gen=leave.gen, step=self.step, stall=0.0, left=True,
                          rejoin=leave.rejoin, bytes_sent=sent, transfer=round(time.monotonic() - started, 4),
                          handover_error=failed)
        self.group.close()
        if self._native is not None:
            self._native.close()
        if not leave.rejoin:
            self._phase.move(Phase.LEFT, f"handed over to generation {leave.gen}")
            raise SystemExit(0)  # this rank's place is taken by the joiner
        self._demote(leave.gen)  # returns once promoted again, with the job's state and step

    def _failover_due(self) -> bool:
        """A failure's generation (``now``) is built while the old group still works.

        That happens when the node declared lost is alive and cut off from etcd only: it may still
        answer the old group's collectives. The survivors leave the old group at this step
        boundary; the lost node's next collective fails (its peers aborted the old group), so it
        can never commit a step again (see "Fencing" in docs/design.md).
        """
        pending = self._next
        return self.phase is Phase.PREPARING and pending is not None and pending.spec.mode == "now" and pending.ready

    def _fail_over(self) -> None:
        pending = self._next
        assert pending is not None and pending.group is not None
        started = time.monotonic()
        try:
            self._adopt(pending, pending.group, started, started)
        except RuntimeError as exc:  # a peer of the new group failed too: the next step or prepare sorts it out
            self._warn(f"the failover to generation {pending.spec.gen} failed", exc)
            self._drop_next(pending, f"the failover to generation {pending.spec.gen} failed")

    def _recover(self, started: float | None = None) -> None:
        """The group broke: tell the agent, wait for the next generation, rebuild, re-sync state."""
        self._phase.move(Phase.RECOVERING, f"step {self.step} did not commit: {str(self._error)[:200]}")
        # The group is not used again. Closing it now makes every peer still waiting in one of its
        # collectives fail at once, rather than at the collective timeout: a dead rank's
        # neighbours see its connection drop, the others only see theirs.
        self.group.close()
        if self._native is not None:
            self._native.close()
        if self._redundancy is not None:
            self._redundancy.broken()
        self.channel.send("broken", gen=self.generation, step=self.step, error=str(self._error)[:500])
        self._join_next(time.monotonic() if started is None else started, my_step=self.step)

    def _join_next(self, started: float, my_step: int) -> None:
        """Build the newest generation the agent announces and exchange state in it (JOINING, RECOVERING).

        A newer ``prepare`` supersedes one still being built (its group may wait for a rank that
        died meanwhile); a group that fails while state is exchanged is dropped for the next one.
        """
        deadline = started + self.recover_timeout
        while time.monotonic() < deadline:
            pending = self._next
            if pending is not None and pending.done:
                if pending.group is None:  # its thread logged why
                    self._give_up(pending, "its build failed", f"its group was not built: {pending.error}")
                    continue
                try:
                    self._adopt(pending, pending.group, started, time.monotonic(), my_step)
                    return
                except RuntimeError as exc:
                    self._warn(f"generation {pending.spec.gen} failed during the state exchange, "
                               "waiting for the next", exc)
                    self._give_up(pending, "it failed during the state exchange", f"the state exchange failed: {exc}")
                    continue
            if pending is not None:
                pending.settle(0.05)  # back the moment the build ends; a newer prepare is seen within 50 ms
                message = self.channel.poll()
            else:
                message = self.channel.wait(timeout=deadline - time.monotonic())
            if message is not None:
                self._on_message(message)
        raise StepFailed(f"step {self.step}: no working generation came within {self.recover_timeout:g} s "
                         f"(last error: {self._error})")

    def _give_up(self, pending: NextGroup, why: str, error: str) -> None:
        """Drop a next generation that cannot be joined, and tell the agent (``broken``): this worker
        is alive and waits for a newer one, which the agent's hang watchdog must know."""
        self._drop_next(pending, why)
        self.channel.send("broken", gen=pending.spec.gen, step=self.step,
                          error=f"generation {pending.spec.gen}: {error}"[:500])

    def _adopt(self, pending: NextGroup, group: RealGroup, started: float, built: float,
               my_step: int | None = None) -> None:
        spec = pending.spec
        if self._native is not None:  # before any state moves: a promoted standby's shards are its new rank's
            self._native.check_size(spec.world_size)
            self._native.rebind(spec.rank, self._tracked.values())
        result = exchange_state(group, self._tracked, self.step if my_step is None else my_step,
                                self.group_timeout, rates=pending.rates, redundancy=self._redundancy)
        if self._redundancy is not None:
            self._redundancy.new_generation()
        if result.rolled_back:
            self._warn(f"rolled back to step {result.step}", "a lost rank's shards came from its neighbour's "
                       "redundant copy, and every rank went back to that copy's step")
        old = self.group
        self.group = group
        if self._native is not None:
            self._native.attach(group, group.store, spec.world_size)
        self.identity = dataclasses.replace(self.identity, rank=spec.rank, world_size=spec.world_size,
                                            generation=spec.gen)
        self.step = result.step
        self._next = None
        old.close()
        self._phase.move(Phase.ACTIVE, f"switched to generation {spec.gen} at step {self.step}")
        self._record_switch(spec.gen, started, built, result, pending)
        leave = self._leave
        if leave is not None and leave.gen > spec.gen:  # received while joining or recovering
            self._phase.move(Phase.LEAVING, f"leave at generation {leave.gen}, received before the switch")
        elif leave is not None:
            self._warn(f"the leave of generation {leave.gen} is stale", f"this worker switched to generation {spec.gen}")
            self._leave = None
            if self._pair is not None:
                self._pair.drop()
                self._pair = None

    def _record_switch(self, gen: int, started: float, built: float, result: Exchange,
                       pending: NextGroup | None = None) -> None:
        now = time.monotonic()
        handover, self._handover_bytes = self._handover_bytes, 0
        handover_s, self._handover_seconds = self._handover_seconds, 0.0
        handover_error, self._handover_error = self._handover_error, None
        build_error, self._build_error = self._build_error, None
        record = {"gen": gen, "step": self.step, "build": round(built - started, 4),
                  "transfer": round(now - built, 4), "stall": round(now - started, 4),
                  "bytes_received": result.bytes_received + handover, "from_leaver": handover,
                  "handover_s": round(handover_s, 4), "handover_error": handover_error, "build_error": build_error,
                  "sources": len(result.sources), "predicted_s": result.predicted, **self._phase1_step_times(),
                  "rolled_back": result.rolled_back,
                  # what each source sent this receiver: [bytes, seconds] (its agent keeps the rates)
                  "links": {str(src): [size, round(seconds, 6)] for src, (size, seconds) in result.links.items()},
                  "probed": {str(src): round(rate, 1) for src, rate in (pending.probed if pending else {}).items()}}
        if pending is not None and pending.group is not None:  # its own build, from the prepare's arrival
            record["group_build"] = round(pending.seconds, 4)
            record.update({f"{part}_connect": round(seconds, 4) for part, seconds in pending.group.connect_s.items()})
        self.swaps.append(record)
        self._last_progress = 0.0  # the first committed step in the new generation is reported at once
        if self.channel is not None:
            self.channel.send("switched", **record)

    def _phase1_step_times(self) -> dict[str, Any]:
        """Median step time while the next group was built in the background, and otherwise."""
        during = [t for t, pending in self._step_times if pending]
        normal = [t for t, pending in self._step_times if not pending]
        self._step_times.clear()
        return {"phase1_steps": len(during),
                "phase1_step_time": round(statistics.median(during), 5) if during else None,
                "normal_step_time": round(statistics.median(normal), 5) if normal else None}

    def _report_progress(self, step_time: float) -> None:
        now = time.monotonic()
        if self.channel is not None and now - self._last_progress >= 1.0:
            self._last_progress = now
            self.channel.send("progress", step=self.step, step_time=round(step_time, 4), gen=self.generation)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce across ranks (in place); on failure the error is latched and the input returned
        (also, without communicating, once the step is doomed: a collective of it failed, or a
        failure's generation was announced)."""
        if self._doomed():
            self._latch_doomed()
            return tensor
        try:
            return self.group.all_reduce(tensor, op).wait()
        except RuntimeError as exc:
            self.latch(exc, group_failed=True)
            return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self._doomed():
            self._latch_doomed()
            return tensor
        try:
            return self.group.broadcast(tensor, src).wait()
        except RuntimeError as exc:
            self.latch(exc, group_failed=True)
            return tensor

    def shares(self, count: int, ddp: torch.nn.Module | None = None) -> Iterator[Share]:
        """This rank's shares of the step's global batch of ``count`` (see :mod:`tmrun.shares`): the
        samples of a step do not depend on how many ranks there are. None more once the step is
        doomed (see :meth:`backward`)."""
        for share in iterate(self.rank, self.world_size, count, ddp):
            if self._doomed():
                return
            yield share

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The job's world as a real torch ``ProcessGroup`` (also torch.distributed's default group),
        for torch's own parallelism: ``DistributedDataParallel(model, process_group=...)``,
        ``fully_shard``, DTensor. Its transport follows the run's generations
        (:mod:`tmrun.process_group`); a collective that fails is latched and voted at ``commit()``."""
        return self._natives().world

    def device_mesh(self, shape: Sequence[int], names: Sequence[str] | None = None) -> Any:
        """A ``DeviceMesh`` of the job's ranks (``torch.arange(world).view(shape)``) on groups that
        survive a swap, e.g. ``run.device_mesh((2, 2), ("replicate", "shard"))`` for HSDP."""
        natives = self._natives()
        return natives.device_mesh(shape, names)

    def _natives(self) -> NativeGroups:
        if self._native is None:
            natives = NativeGroups(self.rank, self.world_size, self, self.group_timeout)
            real = self.group if isinstance(self.group, RealGroup) else None
            natives.create_world(real, real.store if real else None)
            self._native = natives
        return self._native

    def data_parallel(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """DDP whose gradient traffic goes over this run's (swappable) group; ``run.backward``
        stops its backward at once when the step is doomed."""
        from tmrun.ddp import data_parallel

        ddp = data_parallel(self, module, **ddp_kwargs)
        self._guard.watch(ddp)
        return ddp

    def finish(self) -> None:
        self._early.close()
        self.group.close()
        if self._native is not None:
            self._native.close()
            if dist.is_initialized():
                dist.destroy_process_group()
        if self.channel is not None:
            self.channel.close()


def init(*, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> Run:
    """Join the job as the launcher describes it in the environment."""
    env = os.environ if env is None else env
    identity = Identity.from_env(env)
    collective = float(env.get("TMRUN_COLLECTIVE_TIMEOUT", "120"))
    redundancy = int(env.get("TMRUN_REDUNDANCY_EVERY", "0")) if env.get("TMRUN_REDUNDANCY", "0") == "1" else 0
    heap = HeapTrim.from_env(env)
    channel = None
    if env.get("TMRUN_AGENT_SOCKET") and identity.role != "single":
        channel = AgentChannel(env["TMRUN_AGENT_SOCKET"])
        channel.send("hello", rank=identity.rank, pid=os.getpid(), role=identity.role)
    if identity.role == "single":
        return Run(identity, SandboxGroup(0, 1), heap=heap)
    if identity.role == "standby":  # not in any generation until promoted
        identity = dataclasses.replace(identity, generation=0)
        return Run(identity, SandboxGroup(identity.rank, identity.world_size), channel=channel,
                   group_timeout=collective, redundancy=redundancy, heap=heap)
    delta = datetime.timedelta(seconds=timeout)
    is_master = identity.rank == 0 and not identity.agent_store
    store = dist.TCPStore(identity.master_addr, identity.master_port, identity.world_size, is_master,
                          timeout=delta, wait_for_workers=False, multi_tenant=not identity.agent_store)
    if "TMRUN_GENERATION" in env:  # tmrun's agents number the generations for every rank alike
        prefix = dist.PrefixStore(f"tmrun/gen{identity.generation}", store)
    else:  # torchrun's restart counts differ between nodes: agree on the round (torchrun_round.py)
        round_id = torchrun_round.agree(store, identity.rank, identity.world_size, timeout=timeout)
        prefix = dist.PrefixStore(f"tmrun/run{round_id}", store)
    group = RealGroup(prefix, identity.rank, identity.world_size, datetime.timedelta(seconds=collective))
    return Run(identity, group, channel=channel, group_timeout=collective, redundancy=redundancy, heap=heap)


__all__ = ["init", "Run", "StepFailed", "Identity", "Share"]

