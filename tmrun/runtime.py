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

import dataclasses
import datetime
import os
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from tmrun.groups import Group, RealGroup, SandboxGroup


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

    def __init__(self, identity: Identity, group: Group, *, max_retries: int = 3) -> None:
        self.identity = identity
        self.group = group
        self.max_retries = max_retries
        self.step = 0  # the next step index to run (the job's)
        self.device = torch.device("cpu")
        self._tracked: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._voted: bool | None = None
        self._rng: torch.Tensor | None = None

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    @property
    def is_main(self) -> bool:
        return self.identity.rank == 0

    @property
    def role(self) -> str:
        return self.identity.role

    # ------------------------------------------------------------------ state
    def track(self, **objects: Any) -> None:
        """Register the state that moves with a rank: anything with state_dict/load_state_dict."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict")
            self._tracked[name] = obj

    def state_dict(self) -> dict[str, Any]:
        """The tracked state plus the step counter (tensors are the live ones, not copies)."""
        return {"step": self.step, **{name: obj.state_dict() for name, obj in self._tracked.items()}}

    # ------------------------------------------------------------------ errors and votes
    def latch(self, error: BaseException) -> None:
        """Remember the first error of this step; ``commit()`` will vote against the step."""
        if self._error is None:
            self._error = error

    @property
    def step_error(self) -> BaseException | None:
        return self._error

    def commit(self) -> bool:
        """All ranks vote: True only if no rank latched an error in this step."""
        ok = self._error is None
        flag = torch.tensor([1.0 if ok else 0.0])
        try:
            self.group.all_reduce(flag, "sum").wait()
            agreed = ok and int(flag.item()) == self.group.contributors
        except RuntimeError as exc:  # the vote itself failed: a peer is gone
            self.latch(exc)
            agreed = False
        self._voted = agreed
        return agreed

    # ------------------------------------------------------------------ the step loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the job's step indices from ``self.step`` to ``total``; retry steps that failed."""
        tries = 0
        while self.step < total:
            self._begin()
            yield self.step
            if self._voted is False:
                tries += 1
                if tries >= self.max_retries:
                    raise StepFailed(f"step {self.step} did not commit after {tries} tries: {self._error}")
                torch.random.set_rng_state(self._rng)  # the retry sees the same randomness
                continue
            tries = 0
            self.step += 1

    def _begin(self) -> None:
        self._error = None
        self._voted = None
        self._rng = torch.random.get_rng_state()

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


def init(*, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> Run:
    """Join the job as the launcher describes it in the environment."""
    identity = Identity.from_env(os.environ if env is None else env)
    if identity.role == "single":
        return Run(identity, SandboxGroup(0, 1))
    if identity.role == "standby":
        return Run(identity, SandboxGroup(identity.rank, identity.world_size))
    delta = datetime.timedelta(seconds=timeout)
    is_master = identity.rank == 0 and not identity.agent_store
    store = dist.TCPStore(identity.master_addr, identity.master_port, identity.world_size, is_master,
                          timeout=delta, wait_for_workers=False, multi_tenant=not identity.agent_store)
    prefix = dist.PrefixStore(f"tmrun/gen{identity.generation}", store)
    return Run(identity, RealGroup(prefix, identity.rank, identity.world_size, delta))


__all__ = ["init", "Run", "StepFailed", "Identity"]

