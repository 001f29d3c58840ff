"""The runtime a training script imports: ``run = tmrun.init()``.

A script written against it runs unchanged under plain ``python`` (a world of one), under
``torchrun`` or tmrun's restart mode (a static world), and as a standby's shadow (every collective
answered inside the process, see :class:`tmrun.groups.SandboxGroup`)::

    run = tmrun.init()
    run.track(model=model, optimizer=opt)
    ddp = run.data_parallel(model)
    for step in run.steps(total=1000):
        loss = ddp(x(step, run.rank)).mean()
        loss.backward()
        if run.commit():          # False: this step failed somewhere and is yielded again
            opt.step()
        opt.zero_grad()

Errors inside a step (a collective that fails because a peer died) are latched, never thrown
into the user's code; ``commit()`` is where the ranks vote whether the step counts. A step that
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
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from tmrun.channel import AgentChannel
from tmrun.groups import Group, RealGroup, SandboxGroup
from tmrun.swap import Exchange, GroupSpec, NextGroup, TakeOver, exchange_state, flatten, hand_over, portable

log = logging.getLogger("tmrun.runtime")


class StepFailed(RuntimeError):
    """A step did not commit after the allowed number of tries."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who this worker is, read once from the launcher's environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    role: str = "single"  # single | active | standby
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


class Run:
    """One worker's view of the job: its rank, its group, its tracked state, its step loop."""

    def __init__(self, identity: Identity, group: Group, *, channel: AgentChannel | None = None,
                 max_retries: int = 3, warmup: int = 3, group_timeout: float = 120.0,
                 recover_timeout: float = 300.0) -> None:
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
        self._tracked: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._voted: bool | None = None
        self._switch = False
        self._rng: torch.Tensor | None = None
        self._next: NextGroup | None = None
        self._leave_gen = 0
        self._rejoin = False  # a leaver that becomes a standby again instead of exiting
        self._handover: NextGroup | None = None  # a leaver's pair with the joiner taking its rank
        self._handover_bytes = 0  # what a joiner received from the leaver in the pending switch
        self._handover_seconds = 0.0
        self._handover_error: str | None = None  # why the pending switch's handover failed, if it did
        self._last_progress = 0.0
        self._step_times: collections.deque = collections.deque(maxlen=64)  # (seconds, during phase 1)

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    @property
    def is_main(self) -> bool:
        return self.identity.rank == 0 and self.identity.role != "standby"

    @property
    def role(self) -> str:
        return self.identity.role

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
    def _warn(self, what: str, error: object) -> None:
        """One warning line with this worker's identity: an error the swap survives, never swallowed."""
        log.warning("tmrun: warning: [rank %d gen %d step %d] %s: %s", self.rank, self.generation, self.step, what,
                    str(error).splitlines()[0][:300] if str(error) else type(error).__name__)

    def latch(self, error: BaseException) -> None:
        """Remember the first error of this step; ``commit()`` will vote against the step."""
        if self._error is None:
            self._error = error

    @property
    def step_error(self) -> BaseException | None:
        return self._error

    def commit(self) -> bool:
        """All ranks vote: True only if no rank latched an error in this step.

        The same vote carries "I am ready for the next generation": when every rank is, all of
        them switch after this step (phase 2 of a planned swap), without any extra round trip.
        """
        ok = self._error is None
        leaving = self._leave_gen > 0 and (self._handover is None or self._handover.done)
        ready = leaving or (self._next is not None and self._next.ready and self._next.spec.mode == "agreed")
        votes = torch.tensor([1.0 if ok else 0.0, 1.0 if ready else 0.0])
        try:
            self.group.all_reduce(votes, "sum").wait()
            agreed = ok and int(votes[0].item()) == self.group.contributors
            self._switch = agreed and ready and int(votes[1].item()) == self.group.contributors
        except RuntimeError as exc:  # the vote itself failed: a peer is gone
            self.latch(exc)
            agreed = False
        self._voted = agreed
        return agreed

    # ------------------------------------------------------------------ the step loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the job's step indices from ``self.step`` to ``total``; retry steps that failed.

        On a standby this first runs ``warmup`` shadow iterations in the sandbox, then waits to
        be promoted and continues at the job's step. Between steps it follows the agent: builds
        the next generation's group in the background, switches when every rank voted ready.
        """
        if self.role == "standby":
            yield from self._shadow(total)
            if self.role == "standby":
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
            self._step_times.append((time.monotonic() - started, self._next is not None))
            self._report_progress(time.monotonic() - started)
            if self._switch:
                self._switch_generation()
            elif self._failover_due():
                self._fail_over()
        self._finish_pending_switch()

    def _finish_pending_switch(self) -> None:
        """The last step ran while a swap was prepared: hand the final state to the joiner anyway,
        so that it ends with the job instead of waiting for a switch that will never be voted."""
        if self.channel is None or self._leave_gen:
            return
        self._follow_agent()
        pending = self._next
        if pending is None:
            return
        try:
            self._adopt(pending.spec, pending.wait(self.recover_timeout), time.monotonic(), time.monotonic())
        except (TimeoutError, RuntimeError) as exc:
            self._warn(f"the final state did not reach generation {pending.spec.gen}", exc)
            self._next = None  # the joiner is gone too: nobody needs the state

    def _begin(self) -> None:
        self._error = None
        self._voted = None
        self._switch = False
        self._rng = torch.random.get_rng_state()

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
                spec = GroupSpec.from_message(message)
                self._promote(spec)
                return

    def _demote(self) -> None:
        """A leaver that rejoins the pool: become a standby in this process, warm, and wait.

        The model and optimizer stay allocated (they are overwritten on the next promotion), so
        the node is a warm standby at once, without a new process.
        """
        self.group = SandboxGroup(self.rank, self.world_size)
        self.identity = dataclasses.replace(self.identity, role="standby", generation=0)
        self._leave_gen, self._handover, self._next, self._rejoin = 0, None, None, False
        self._wait_for_promotion()

    def _promote(self, spec: GroupSpec) -> None:
        started = time.monotonic()
        self._on_message({"type": "prepare", **dataclasses.asdict(spec)})
        my_step = -1
        if spec.handover:
            my_step = self._take_over(spec)
        self._join_next(started, my_step=my_step)
        self.identity = dataclasses.replace(self.identity, role="active")

    def _take_over(self, spec: GroupSpec) -> int:
        """Receive the leaver's state in place; -1 when it failed or a newer generation came first."""
        receiving = TakeOver(spec, self._tracked, self.group_timeout)
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
            self._warn("the handover from the leaver failed, taking the state from the replicas", self._handover_error)
        self._handover_bytes, self._handover_seconds = receiving.bytes_received, receiving.seconds
        return receiving.step

    def _follow_agent(self) -> None:
        """Handle the agent's messages at a step boundary, without blocking."""
        if self.channel is None:
            return
        while (message := self.channel.poll()) is not None:
            self._on_message(message)

    def _on_message(self, message: dict[str, Any]) -> None:
        if message["type"] == "leave":
            self._leave_gen = int(message["gen"])
            self._rejoin = bool(message.get("rejoin", False))
            if message.get("store_host") and self._handover is None:
                pair = GroupSpec.pair(self._leave_gen, str(message["store_host"]), int(message["store_port"]), 0)
                self._handover = NextGroup(pair, self.group_timeout, lambda s: None, pair_of=self.rank)
        elif message["type"] == "prepare":
            spec = GroupSpec.from_message(message)
            if spec.gen > self.generation and (self._next is None or spec.gen > self._next.spec.gen):
                self._next = NextGroup(spec, self.group_timeout,
                                       lambda s: self.channel.send("ready", gen=s.gen))

    def _switch_generation(self) -> None:
        """Phase 2: every rank voted ready after a committed step; move to the next group."""
        if self._leave_gen:
            started = time.monotonic()
            sent, failed = 0, None
            if self._handover is not None and self._handover.ready:
                try:
                    sent = hand_over(self._handover.group, self._tracked, self.step)
                except RuntimeError as exc:  # the joiner is gone: it (or the next one) takes the state from the replicas
                    failed = str(exc)[:300] or type(exc).__name__
                    self._warn("the handover to the joiner failed, it takes the state from the replicas", exc)
                self._handover.group.close()
            elif self._handover is not None:
                failed = f"the handover pair was not built: {self._handover.error}"[:300]
                self._warn("no handover to the joiner, it takes the state from the replicas", failed)
            self.channel.send("switched", gen=self._leave_gen, step=self.step, stall=0.0, left=True,
                              rejoin=self._rejoin, bytes_sent=sent, transfer=round(time.monotonic() - started, 4),
                              handover_error=failed)
            self.group.close()
            if not self._rejoin:
                raise SystemExit(0)  # this rank's place is taken by the joiner
            self._demote()  # returns once promoted again, with the job's state and step
            return
        started = time.monotonic()
        pending = self._next
        assert pending is not None
        try:
            self._adopt(pending.spec, pending.wait(self.group_timeout), started, started)
        except (TimeoutError, RuntimeError) as exc:  # the old group is gone too: wait for the next generation
            self._warn(f"the switch to generation {pending.spec.gen} failed", exc)
            if self._next is pending:
                self._next = None
            self.latch(exc)
            self._recover(started)

    def _failover_due(self) -> bool:
        """A failure's generation (``now``) is built while the old group still works.

        That happens when the node declared lost is alive and cut off from etcd only: it may still
        answer the old group's collectives. The survivors leave the old group at this step
        boundary; the lost node's next collective fails (its peers aborted the old group), so it
        can never commit a step again (see "Fencing" in docs/design.md).
        """
        pending = self._next
        return pending is not None and pending.spec.mode == "now" and pending.ready and not self._leave_gen

    def _fail_over(self) -> None:
        pending = self._next
        assert pending is not None and pending.group is not None
        started = time.monotonic()
        try:
            self._adopt(pending.spec, pending.group, started, started)
        except RuntimeError as exc:  # a peer of the new group failed too: the next step or prepare sorts it out
            self._warn(f"the failover to generation {pending.spec.gen} failed", exc)
            if self._next is pending:
                self._next = None

    def _recover(self, started: float | None = None) -> None:
        """The group broke: tell the agent, wait for the next generation, rebuild, re-sync state."""
        self.channel.send("broken", gen=self.generation, step=self.step, error=str(self._error)[:500])
        self._join_next(time.monotonic() if started is None else started, my_step=self.step)

    def _join_next(self, started: float, my_step: int) -> None:
        """Build the newest generation the agent announces and exchange state in it.

        A newer ``prepare`` supersedes one still being built (its group may wait for a rank that
        died meanwhile); a group that fails while state is exchanged is dropped for the next one.
        """
        deadline = started + self.recover_timeout
        while time.monotonic() < deadline:
            pending = self._next
            if pending is not None and pending.done:
                if pending.group is None:
                    self._warn(f"building the group of generation {pending.spec.gen} failed", pending.error)
                    self._next = None
                    continue
                try:
                    self._adopt(pending.spec, pending.group, started, time.monotonic(), my_step)
                    return
                except RuntimeError as exc:
                    self._warn(f"generation {pending.spec.gen} failed during the state exchange, "
                               "waiting for the next", exc)
                    if self._next is pending:
                        self._next = None
                    continue
            message = self.channel.wait(timeout=0.05 if pending is not None else deadline - time.monotonic())
            if message is not None:
                self._on_message(message)
        raise StepFailed(f"step {self.step}: no working generation came within {self.recover_timeout:g} s "
                         f"(last error: {self._error})")

    def _adopt(self, spec: GroupSpec, group: RealGroup, started: float, built: float,
               my_step: int | None = None) -> None:
        result = exchange_state(group, self._tracked, self.step if my_step is None else my_step,
                                self.group_timeout)
        old = self.group
        self.group = group
        self.identity = dataclasses.replace(self.identity, rank=spec.rank, world_size=spec.world_size,
                                            generation=spec.gen)
        self.step = result.step
        self._next = None
        old.close()
        self._record_switch(spec.gen, started, built, result)

    def _record_switch(self, gen: int, started: float, built: float, result: Exchange) -> None:
        now = time.monotonic()
        handover, self._handover_bytes = self._handover_bytes, 0
        handover_s, self._handover_seconds = self._handover_seconds, 0.0
        handover_error, self._handover_error = self._handover_error, None
        record = {"gen": gen, "step": self.step, "build": round(built - started, 4),
                  "transfer": round(now - built, 4), "stall": round(now - started, 4),
                  "bytes_received": result.bytes_received + handover, "from_leaver": handover,
                  "handover_s": round(handover_s, 4), "handover_error": handover_error,
                  "sources": len(result.sources), **self._phase1_step_times()}
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
        """Reduce across ranks (in place); on failure the error is latched and the input returned."""
        try:
            return self.group.all_reduce(tensor, op).wait()
        except RuntimeError as exc:
            self.latch(exc)
            return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        try:
            return self.group.broadcast(tensor, src).wait()
        except RuntimeError as exc:
            self.latch(exc)
            return tensor

    def data_parallel(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """DDP whose gradient traffic goes over this run's (swappable) group."""
        from tmrun.ddp import data_parallel

        return data_parallel(self, module, **ddp_kwargs)

    def finish(self) -> None:
        self.group.close()
        if self.channel is not None:
            self.channel.close()


def init(*, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> Run:
    """Join the job as the launcher describes it in the environment."""
    env = os.environ if env is None else env
    identity = Identity.from_env(env)
    collective = float(env.get("TMRUN_COLLECTIVE_TIMEOUT", "120"))
    channel = None
    if env.get("TMRUN_AGENT_SOCKET") and identity.role != "single":
        channel = AgentChannel(env["TMRUN_AGENT_SOCKET"])
        channel.send("hello", rank=identity.rank, pid=os.getpid(), role=identity.role)
    if identity.role == "single":
        return Run(identity, SandboxGroup(0, 1))
    if identity.role == "standby":  # not in any generation until promoted
        identity = dataclasses.replace(identity, generation=0)
        return Run(identity, SandboxGroup(identity.rank, identity.world_size), channel=channel,
                   group_timeout=collective)
    delta = datetime.timedelta(seconds=timeout)
    is_master = identity.rank == 0 and not identity.agent_store
    store = dist.TCPStore(identity.master_addr, identity.master_port, identity.world_size, is_master,
                          timeout=delta, wait_for_workers=False, multi_tenant=not identity.agent_store)
    prefix = dist.PrefixStore(f"tmrun/gen{identity.generation}", store)
    group = RealGroup(prefix, identity.rank, identity.world_size, datetime.timedelta(seconds=collective))
    return Run(identity, group, channel=channel, group_timeout=collective)


__all__ = ["init", "Run", "StepFailed", "Identity"]

