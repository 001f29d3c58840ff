"""Abandoning a doomed step: the backward of a step that can no longer commit stops at once.

A step is doomed when a collective of it failed (a peer is gone, see ``Run.latch``) or when the
agent announced a failure's generation (``prepare`` with mode ``now``): in both cases the step
cannot commit in the current group, and every second spent on its backward delays the next
group. ``run.backward(loss)`` runs ``loss.backward()`` with a gradient hook on each parameter of
the modules given to ``run.data_parallel`` armed; once the step is doomed the next hook raises
:class:`Abandoned` inside autograd, which stops the engine (no more gradients, no more buckets).
``run.backward`` catches it, resets DDP's reducer (its buckets are half filled) and returns: the
script's code sees no exception, and ``run.commit()`` returns False as for any failed step::

    loss = ddp(x).mean()
    run.backward(loss)            # instead of loss.backward()
    if run.commit():
        opt.step()
    opt.zero_grad()

A step doomed during its forward finishes that forward *hollow*: a pre-hook on each submodule
of those modules sees the doom and enters :class:`Hollow`, a dispatch mode in which every
functional operator answers zeros of the shape, dtype and strides it would have produced
(computed on the meta device), until the forward returns. The script gets outputs of the right
shapes to compute its loss on, and ``run.backward`` then skips the backward.

The hooks raise only while ``run.backward`` runs: a script that calls ``loss.backward()`` itself
gets today's behaviour (the doomed step's backward runs to its end, its buckets are not sent).
Torch's own parallelism (``DistributedDataParallel`` on ``run.process_group``, ``fully_shard``)
keeps state between its hooks (FSDP2 reshards in them): once ``run.process_group`` or
``run.device_mesh`` is used, ``run.backward`` is plain ``loss.backward()``, and a doomed step
runs to its end with its collectives failing at once.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

log = logging.getLogger("tmrun.abandon")


class Abandoned(BaseException):
    """Raised by a gradient hook to stop the backward of a doomed step; caught by ``StepGuard``.

    A BaseException, so that no ``except Exception`` in between (autograd's or a script's hook)
    takes it for an error of the computation.
    """


def _meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _signature(leaves: list) -> tuple | None:
    """What an operator's meta result depends on: each tensor's shape, strides and dtype, and the
    other arguments as they are; None when one of those cannot be a dictionary key."""
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device.type))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            parts.append((type(leaf), leaf))
    return tuple(parts)


def _cache_key(func, args: tuple, kwargs: dict) -> tuple[tuple | None, torch.device | None]:
    """``(key, device)`` of an operator call that a hollow forward answers from the cache (device
    None: it runs for real; key None: it cannot be cached)."""
    schema = func._schema
    if schema.is_mutable or any(ret.alias_info is not None for ret in schema.returns):
        return None, None  # mutates or aliases its inputs: cheap, and its outputs must be the tensors it names
    leaves, spec = tree_flatten((args, kwargs))
    devices = [t.device for t in leaves if isinstance(t, torch.Tensor)]
    if not devices:  # a factory (arange, zeros): cheap, and its device is in its arguments
        return None, None
    device = next((d for d in devices if d.type != "cpu"), devices[0])  # past a CPU scalar beside a GPU tensor
    signature = _signature(leaves)
    return ((func, spec, signature) if signature is not None else None), device


def _shape_of(value: Any) -> Any:
    """A real result as the cache keeps it: an empty meta tensor of its shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


class Hollow(TorchDispatchMode):
    """Operators answer zeros of the right shape instead of computing (the rest of a doomed forward).

    Operators that mutate or alias their inputs run for real (they are cheap, and their outputs
    must be the tensors they name); so do factories (no tensor argument: their device is theirs)
    and any operator the meta device cannot run. The meta results are kept by operator and
    argument signature (``cache``, shared by the hollow forwards of one run, and filled by
    :class:`ShapeRecorder` in the run's first forward): computing the shapes on the meta device
    costs more than the zeros do (5M GPT: 55 ms a hollow forward with a cold cache, 22 ms with a
    warm one, against 88 ms real).
    """

    def __init__(self, cache: dict | None = None) -> None:
        super().__init__()
        self.cache = cache if cache is not None else {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        key, device = _cache_key(func, args, kwargs)
        if device is None:
            return func(*args, **kwargs)
        shaped = self.cache.get(key) if key is not None else None
        if shaped is None:
            try:
                shaped = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
            except Exception:  # noqa: BLE001 - no meta kernel: compute it
                return func(*args, **kwargs)
            if key is not None:
                self.cache[key] = shaped
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device).as_strided(t.shape, t.stride())
                        if isinstance(t, torch.Tensor) else t, shaped)


class ShapeRecorder(TorchDispatchMode):
    """Runs every operator for real and keeps the shapes of its results in the hollow forwards'
    cache: the run's first forward warms it, so that a failure's hollow forward (usually the run's
    only one) computes no shape. Results are the operators' own, bit for bit."""

    def __init__(self, cache: dict) -> None:
        super().__init__()
        self.cache = cache

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key, _ = _cache_key(func, args, kwargs)
        if key is not None and key not in self.cache:
            self.cache[key] = tree_map(_shape_of, out)
        return out


class _Saved:
    """What autograd keeps of a tensor saved for the backward, while a forward of a watched module
    runs: the tensor, which the guard lets go of once its step was abandoned."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor


def _unpack(saved: _Saved) -> torch.Tensor:
    if saved.tensor is None:
        raise RuntimeError("this graph belongs to a step that was abandoned (its step was doomed, and "
                           "run.backward released what the backward would have needed)")
    return saved.tensor


class StepGuard:
    """The hooks that stop a doomed step's backward, and what to reset after they did.

    While a forward of a watched module runs, what autograd saves for the backward is held through
    a :class:`_Saved` (``saved_tensors_hooks``), which the guard knows by a weak reference. A
    backward releases them as it goes; an abandoned one does not, and the script's ``loss`` keeps
    the graph until the next step's forward has run beside it (5M GPT: 84 MB of activations
    faulted in again, 28 ms more CPU in the first step after a failure). ``_abandon`` lets go of
    them at once instead.
    """

    def __init__(self, doomed: Callable[[], bool]) -> None:
        self._doomed = doomed
        self._armed = False
        self._modules: list[torch.nn.Module] = []  # DDP modules whose reducer a stopped backward leaves mid-step
        self._hooked: set[int] = set()  # ids of the parameters that carry the hook
        self._hollow: Hollow | None = None  # entered while the rest of a doomed forward runs
        self._shapes: dict = {}  # the hollow forwards' meta results, kept between them
        self._recorder: ShapeRecorder | None = None  # entered for the first forward: fills _shapes
        self._recorded = False
        self._saving: torch.autograd.graph.saved_tensors_hooks | None = None  # entered while a forward runs
        self._saved: weakref.WeakSet[_Saved] = weakref.WeakSet()  # what live graphs of watched forwards saved
        self.abandoned = 0  # backwards stopped (or skipped) because their step was doomed

    def watch(self, module: torch.nn.Module) -> None:
        """Hook ``module``'s parameters (once each); reset its reducer after an abandoned backward."""
        for param in module.parameters():
            if param.requires_grad and id(param) not in self._hooked:
                param.register_hook(self._check)
                self._hooked.add(id(param))
        if hasattr(module, "reducer"):
            self._modules.append(module)
        for sub in module.modules():
            if sub is not module:
                sub.register_forward_pre_hook(self._forward_check)
        module.register_forward_pre_hook(self._forward_begin)
        module.register_forward_hook(self._forward_done, always_call=True)

    def _forward_begin(self, module: torch.nn.Module, args: Any) -> None:
        if not self._recorded and not self._doomed():
            self._recorded = True
            self._recorder = ShapeRecorder(self._shapes)
            self._recorder.__enter__()
        if self._saving is None:
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._saving.__enter__()
        self._forward_check(module, args)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        self._saved.add(saved)  # gone from the set once the graph (or its backward) drops it
        return saved

    def _forward_check(self, module: torch.nn.Module, args: Any) -> None:
        if self._hollow is None and self._doomed():
            self._hollow = Hollow(self._shapes)
            self._hollow.__enter__()

    def _forward_done(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        hollow, self._hollow = self._hollow, None
        if hollow is not None:  # entered last: left first
            hollow.__exit__(None, None, None)
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.__exit__(None, None, None)
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)

    def _check(self, grad: torch.Tensor) -> None:
        if self._armed and self._doomed():
            raise Abandoned()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> bool:
        """``loss.backward(**kwargs)``; False when the step was doomed and its backward stopped or skipped."""
        if self._doomed():
            self._abandon()
            return False
        self._armed = True
        try:
            loss.backward(**kwargs)
        except Abandoned:
            self._abandon()
            return False
        finally:
            self._armed = False
        return True

    def _abandon(self) -> None:
        self.abandoned += 1
        for saved in list(self._saved):  # the graph stays with the script's loss: its saved tensors need not
            saved.tensor = None
        for module in self._modules:
            module.reducer._reset_state()  # its buckets are half filled; the retried step starts afresh
