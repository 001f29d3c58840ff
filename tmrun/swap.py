"""Moving a rank: build the next generation's group, then bring every member to the same state.

Phase 1 (:class:`NextGroup`): the group of the next generation is built in a background thread
while training goes on (or at once, when there is nothing else to do); when the agent names
joiners to probe, it then times each joiner's link from every other rank (:func:`tmrun.pull.probe_links`).

Phase 2 (:func:`exchange_state`), on the new group, at a step boundary every member reached:

1. every rank tells the others its committed step count (a joiner says -1);
2. the ranks at the highest count are the *sources*; every other rank is a *receiver*;
3. each receiver pulls every tracked tensor from the sources in shares set by the measured rate
   of each source's link to it (:mod:`tmrun.pull`: the rates travel in step 1's header, so every
   rank plans every pull alike; phase 1 probes a joiner's links first), all sends and receives in
   flight at once, straight into the receiver's own tensors: nothing is copied on the sources
   (zero memory overhead);
4. the non-tensor leaves (learning rates, step counters kept as numbers) follow as one JSON blob
   from the first source.

For data parallelism every surviving rank holds a full replica, so this serves a drain (the
joiner replaces the leaver), a failure (the joiner replaces a dead rank) and a survivor that
missed the last commit alike.

A planned swap goes one better (:func:`hand_over` / :class:`TakeOver`): the leaver and the joiner
that takes its rank build a two-rank *handover* group in phase 1, both from the same
:class:`Handover`, and at the switch the leaver streams its own tracked state to the joiner (one
pair per local rank, all pairs at once), which loads it once all of it arrived, so the joiner
enters the new generation as a source and the survivors send nothing. If the leaver is gone
before it could hand over, the joiner falls back to the replicas.

The background threads never raise and never swallow: a :class:`NextGroup` whose build fails
reports it once to its ``on_error`` (the runtime logs it and tells its agent in ``switched``);
a :class:`TakeOver` keeps its ``error`` for the runtime, which does the same.

Errors (drawn here; the runtime catches ``RuntimeError`` to drop a group and wait for the next)::

    BaseException
    ├── StateLost          no rank of the new group holds the state: restart from a checkpoint
    └── ModelMismatch      this rank's tracked state differs from the sources': it must not train
    RuntimeError
    └── GroupRefused       a peer built a different model: this group is dropped, the next awaited
    TypeError
    └── UnportableState    a state-dict leaf that JSON cannot carry (raised by ``run.track``)
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import sys
import threading
import time
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from tmrun.groups import RealGroup
from tmrun.pull import probe_links, tags_used, transfer
from tmrun.redundancy import Redundancy, restore
from tmrun.replicas import Key, NoReplica, key_of, local, replica_pulls

log = logging.getLogger("tmrun.swap")


class StateLost(BaseException):
    """Every replica of the training state is gone: continuing would train on shadow state.

    A BaseException so that the runtime's retry paths (which catch RuntimeError) cannot swallow it.
    """


class ModelMismatch(BaseException):
    """This rank's tracked state differs in names, shapes or dtypes from the sources': it built
    another model and must not train in the job (a BaseException, like :class:`StateLost`)."""


class GroupRefused(RuntimeError):
    """A peer of the new group built a different model; every matching rank drops the group."""


class UnportableState(TypeError):
    """A non-tensor state-dict leaf that the swap cannot send as JSON (named by its path)."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """What the agent said about the next generation (a ``prepare`` message)."""

    gen: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    mode: str  # agreed | now
    handover: bool = False  # a joiner: the leaver whose rank it takes hands its state over
    probe: tuple[int, ...] = ()  # the joiners whose links phase 1 measures (the same list on every rank)
    links: tuple[tuple[int, float], ...] = ()  # (source rank, bytes/s) its agent measured before

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "GroupSpec":
        links = tuple((rank, float(rate)) for first, stop, rate in message.get("links") or ()
                      for rank in range(int(first), int(stop)))
        return cls(int(message["gen"]), int(message["rank"]), int(message["world_size"]),
                   str(message["store_host"]), int(message["store_port"]), str(message["mode"]),
                   bool(message.get("handover", False)), tuple(int(r) for r in message.get("probe") or ()), links)

    @property
    def prefix(self) -> str:
        return f"tmrun/gen{self.gen}"


@dataclasses.dataclass(frozen=True)
class Handover:
    """A planned swap's pairing: the leaver of ``rank`` hands its state to the joiner that takes
    ``rank`` in generation ``gen``.

    Both ends build this same value from their own message (:meth:`of_leaver` from ``leave`` and
    the leaver's rank, :meth:`of_joiner` from ``prepare``), and from it the same two-rank group
    (:meth:`build`): prefix ``tmrun/gen<G>/handover<rank>`` on the generation's store, the leaver
    member :attr:`LEAVER`, the joiner member :attr:`JOINER`. The plan pairs a leaver with a joiner
    of the same number of slots, so the leaver's rank ``r`` in the old generation is the joiner's
    rank ``r`` in the new one.
    """

    gen: int
    rank: int  # the rank the joiner takes over: the leaver's before the switch, the joiner's after
    store_host: str
    store_port: int

    LEAVER: ClassVar[int] = 0
    JOINER: ClassVar[int] = 1

    @classmethod
    def of_leaver(cls, message: dict[str, Any], rank: int) -> "Handover | None":
        """The pairing a ``leave`` asks for (None: no store, nobody to hand over to)."""
        if not message.get("store_host"):
            return None
        return cls(int(message["gen"]), rank, str(message["store_host"]), int(message["store_port"]))

    @classmethod
    def of_joiner(cls, spec: GroupSpec) -> "Handover | None":
        """The pairing a ``prepare`` asks for (None: this joiner gets its state from the replicas)."""
        return cls(spec.gen, spec.rank, spec.store_host, spec.store_port) if spec.handover else None

    @property
    def prefix(self) -> str:
        return f"tmrun/gen{self.gen}/handover{self.rank}"

    def build(self, side: int, timeout: float) -> RealGroup:
        """This side's end of the pair (``side``: :attr:`LEAVER` or :attr:`JOINER`)."""
        return _connect(self.store_host, self.store_port, self.prefix, side, 2, timeout)


@dataclasses.dataclass(frozen=True)
class Leave:
    """A ``leave`` message: this worker is not part of generation ``gen``."""

    gen: int
    rejoin: bool  # wait as a standby in this process instead of exiting
    handover: Handover | None  # the joiner that takes this rank, when the state is handed over

    @classmethod
    def from_message(cls, message: dict[str, Any], rank: int) -> "Leave":
        return cls(int(message["gen"]), bool(message.get("rejoin", False)), Handover.of_leaver(message, rank))


def _connect(host: str, port: int, prefix: str, rank: int, size: int, timeout: float) -> RealGroup:
    """The group, with where its build went in ``connect_s``: the store client, then gloo's pairs
    (which includes waiting for the last member to reach the store)."""
    delta = datetime.timedelta(seconds=timeout)
    started = time.monotonic()
    store = dist.TCPStore(host, port, size, False, timeout=max(delta, RealGroup.CONNECT_TIMEOUT),
                          wait_for_workers=False)
    stored = time.monotonic()
    group = RealGroup(dist.PrefixStore(prefix, store), rank, size, delta)
    group.connect_s = {"store": stored - started, "gloo": time.monotonic() - stored}
    return group


def build_group(spec: GroupSpec, timeout: float) -> RealGroup:
    """Connect to the generation's store and build its group."""
    return _connect(spec.store_host, spec.store_port, spec.prefix, spec.rank, spec.world_size, timeout)


class NextGroup:
    """A group being built in a thread: the next generation's, or a leaver's handover pair.

    A failed build is reported once, from the thread, to ``on_error`` (the runtime logs it with its
    identity and tells its agent), unless :meth:`drop` came first; ``error`` keeps it. A dropped
    group (superseded by a newer generation, or refused) is closed, also when it is built later.
    """

    def __init__(self, spec: GroupSpec, timeout: float, on_ready: Callable[[GroupSpec], None] | None = None,
                 on_error: Callable[["NextGroup", BaseException], None] | None = None, *,
                 handover: Handover | None = None) -> None:
        self.spec = spec
        self.handover = handover  # set: this is the leaver's end of that pair, not a generation's group
        self.group: RealGroup | None = None
        self.error: BaseException | None = None
        self.probed: dict[int, float] = {}  # phase 1's probe of this rank's links: source rank -> bytes/s
        self.rates: dict[int, float] = dict(spec.links)  # this rank's links, probed ones replacing its agent's
        self._lock = threading.Lock()
        self._dropped = False
        self._done = threading.Event()
        self.started = time.monotonic()
        self.seconds = 0.0  # from the start of the build to the group (or the error), the probe included
        connect = (lambda: build_group(spec, timeout)) if handover is None else \
            (lambda: handover.build(Handover.LEAVER, timeout))
        self._thread = threading.Thread(target=self._build, args=(connect, on_ready, on_error), daemon=True,
                                        name=f"tmrun-build-gen{spec.gen}")
        self._thread.start()

    @classmethod
    def pair(cls, handover: Handover, timeout: float,
             on_error: Callable[["NextGroup", BaseException], None] | None = None) -> "NextGroup":
        """The leaver's end of ``handover``, built in a thread."""
        spec = GroupSpec(handover.gen, Handover.LEAVER, 2, handover.store_host, handover.store_port, "agreed")
        return cls(spec, timeout, None, on_error, handover=handover)

    @property
    def what(self) -> str:
        """This group in words, for a log line."""
        if self.handover is not None:
            return f"the handover pair with the joiner of rank {self.handover.rank} in generation {self.spec.gen}"
        return f"the group of generation {self.spec.gen} (as rank {self.spec.rank} of {self.spec.world_size})"

    def _build(self, connect: Callable[[], RealGroup], on_ready: Callable[[GroupSpec], None] | None,
               on_error: Callable[["NextGroup", BaseException], None] | None) -> None:
        try:
            group = connect()
            if self.spec.probe and self.handover is None:
                try:
                    self.probed = probe_links(group, self.spec.probe)
                    self.rates.update(self.probed)
                except BaseException:
                    group.close()
                    raise
            with self._lock:
                self.group = group
                if self._dropped:
                    group.close()
                    return
            if on_ready is not None:
                on_ready(self.spec)
        except BaseException as exc:  # reported to on_error, never raised in a thread
            self.error = exc
            with self._lock:
                report = on_error is not None and not self._dropped
            if report:
                on_error(self, exc)
        finally:
            self.seconds = time.monotonic() - self.started
            self._done.set()

    def drop(self) -> None:
        """Nobody will use this group: close it (now, or once built) and report no failure of it."""
        with self._lock:
            self._dropped = True
            group = self.group
        if group is not None:
            group.close()

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self.group is not None

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self.group is None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the build to end (built or failed); whether it did."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> RealGroup:
        if not self._done.wait(timeout):
            raise TimeoutError(f"group of generation {self.spec.gen} not built within {timeout} s")
        if self.group is None:
            raise RuntimeError(f"building the group of generation {self.spec.gen} failed: {self.error}")
        return self.group


def flatten(state: Any, path: str = "", keys: list[Key | None] | None = None,
            ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """Tensors (in a deterministic order) and JSON-able leaves of a nested state_dict.

    A DTensor stands for its local shard (the bytes this rank holds); ``keys``, when given, gets
    each tensor's replica key (:mod:`tmrun.replicas`), in the same order.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    leaves: dict[str, Any] = {}
    if isinstance(state, torch.Tensor):
        tensors.append((path, local(state)))
        if keys is not None:
            keys.append(key_of(state))
    elif isinstance(state, dict):
        for key, value in state.items():
            sub_t, sub_l = flatten(value, f"{path}/{key}", keys)
            tensors += sub_t
            leaves.update(sub_l)
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            sub_t, sub_l = flatten(value, f"{path}[{index}]", keys)
            tensors += sub_t
            leaves.update(sub_l)
    else:
        leaves[path] = state
    return tensors, leaves


_PLAIN = (bool, int, float, str, type(None))


def portable(leaves: dict[str, Any]) -> dict[str, Any]:
    """The leaves as JSON carries them exactly: numpy scalars become Python numbers (lossless);
    anything else that is not a plain number, string, bool or None raises :class:`UnportableState`."""
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only if numpy was imported
    out = {}
    for path, value in leaves.items():
        if type(value) not in _PLAIN and numpy is not None and isinstance(value, numpy.generic):
            value = value.item()  # float32 -> float, int64 -> int, bool_ -> bool: exact
        if type(value) not in _PLAIN:
            raise UnportableState(f"state leaf {path or '/'} is a {type(value).__module__}.{type(value).__qualname__}, "
                                  "which the hot swap cannot carry (JSON): keep it as a tensor, a number, a "
                                  "string, a bool, None, or a list/tuple/dict of those")
        out[path] = value
    return out


def _signature(tensors: list[tuple[str, torch.Tensor]]) -> int:
    text = ";".join(f"{p}:{tuple(t.shape)}:{t.dtype}" for p, t in tensors)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big")


def _assign(state: Any, leaves: dict[str, Any], path: str = "") -> Any:
    """``state`` with its non-tensor leaves replaced by ``leaves`` (tensors untouched)."""
    if isinstance(state, torch.Tensor):
        return state
    if isinstance(state, dict):
        return {k: _assign(v, leaves, f"{path}/{k}") for k, v in state.items()}
    if isinstance(state, list):
        return [_assign(v, leaves, f"{path}[{i}]") for i, v in enumerate(state)]
    if isinstance(state, tuple):
        return tuple(_assign(v, leaves, f"{path}[{i}]") for i, v in enumerate(state))
    return leaves.get(path, state)


@dataclasses.dataclass(frozen=True)
class Exchange:
    step: int  # the committed step count everybody continues from
    sources: tuple[int, ...]
    receivers: tuple[int, ...]
    bytes_received: int
    # on a receiver: per source rank, (bytes received from it, seconds until its last tensor was in);
    # the seconds are an upper bound (the receives are waited for in the order they were posted)
    links: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)
    predicted: float | None = None  # on a receiver: its plan's finish (s), when every rate it used was measured
    rolled_back: bool = False  # a lost shard came from a redundant copy: everyone went back to its snapshot


def exchange_state(group: RealGroup, tracked: dict[str, Any], my_step: int, timeout: float, *,
                   rates: dict[int, float] | None = None, pull: str = "planned",
                   redundancy: Redundancy | None = None) -> Exchange:
    """Phase 2 on the new group: agree on the step, then pull the state from the sources.

    ``rates``: this rank's measured links, ``{source rank: bytes/s}`` (phase 1's probe, or what
    its agent kept); they travel in the header, so every rank plans every receiver's pull alike
    (:mod:`tmrun.pull`; ``pull`` picks how). ``redundancy``: this rank's snapshots; when a
    receiver's shard has no replica, every source rolls back to the agreed snapshot and the
    receiver's shard comes from its left neighbour's copy (:mod:`tmrun.redundancy`).
    """
    states = {name: obj.state_dict() for name, obj in tracked.items()}
    keys: list[Key | None] = []
    tensors, leaves = flatten(states, keys=keys)
    leaves = portable(leaves)  # before anything is sent: a leaf JSON cannot carry fails every rank alike
    row = [0] * group.size
    for src, rate in (rates or {}).items():
        if 0 <= src < group.size and rate > 0:
            row[src] = int(min(rate, 2 ** 62))
    held = redundancy.holds() if redundancy is not None else -1
    header = torch.tensor([my_step, _signature(tensors), held, *row], dtype=torch.int64)
    everyone = group.all_gather(header)
    steps = [int(h[0]) for h in everyone]
    top = max(steps)
    if top < 0:
        raise StateLost("no rank of the new generation holds the training state (every replica was lost); "
                        "the job must restart from a checkpoint")
    sources = tuple(r for r, s in enumerate(steps) if s == top)
    _check_signatures([int(h[1]) for h in everyone], sources[0], group.rank)
    receivers = tuple(r for r, s in enumerate(steps) if s != top)
    me = group.rank
    if not receivers:
        return Exchange(top, sources, receivers, 0)
    live = [t for _, t in tensors]
    paths, rows = [p for p, _ in tensors], [h[3:].tolist() for h in everyone]
    sending = None
    try:  # every rank plans alike, so every rank raises alike
        plans = replica_pulls(live, keys, paths, sources, receivers, rows, pull)
    except NoReplica as exc:
        snapshot = _agreed_snapshot([int(h[2]) for h in everyone], sources)
        if snapshot < 0:
            raise StateLost(f"{exc}: a shard that only the lost rank held is gone (no replica, no redundant "
                            "copy); the job must restart from a checkpoint") from None
        from_copies: set[tuple[int, int]] = set()
        try:  # the lost shards come from their keepers' copies, everything else from the rolled-back sources
            plans = replica_pulls(live, keys, paths, sources, receivers, rows, pull,
                                  copies=lambda dst: (dst - 1) % group.size, from_copies=from_copies)
        except NoReplica as lost:
            raise StateLost(f"{lost}: neither a replica nor a redundant copy survived (two neighbours lost?); "
                            "the job must restart from a checkpoint") from None
        top = snapshot
        if me in sources:  # roll back to the agreed snapshot
            assert redundancy is not None and redundancy.agreed is not None
            restore(redundancy.agreed, live)
            leaves = redundancy.agreed.leaves
            _load_leaves(tracked, states, leaves)
            sending = _from_copy(redundancy, keys, from_copies, live)
    received, links = transfer(group, live, plans, sending)
    blob = _leaf_blob(group, leaves, sources[0], receivers, tags_used(plans))
    if me in receivers:
        _load_leaves(tracked, states, blob)
    predicted = next((plan.predicted for plan in plans if plan.receiver == me), None)
    return Exchange(top, sources, receivers, received, links, predicted, rolled_back=top != max(steps))


def _agreed_snapshot(held: list[int], sources: tuple[int, ...]) -> int:
    """The snapshot every source agreed on (:mod:`tmrun.redundancy`), -1 when they hold none or differ."""
    steps = {held[src] for src in sources}
    return steps.pop() if len(steps) == 1 else -1


def _from_copy(redundancy: Redundancy, keys: list[Key | None], from_copies: set[tuple[int, int]],
               live: list[torch.Tensor]) -> Callable[[int, int], torch.Tensor]:
    """What this source sends of tensor ``index`` to ``receiver``: its copy of the receiver's shard
    where the plan says so, else its own (rolled back) tensor."""
    snapshot = redundancy.agreed
    assert snapshot is not None
    position = {index: n for n, index in enumerate(i for i, key in enumerate(keys) if key is not None)}

    def sending(receiver: int, index: int) -> torch.Tensor:
        if (receiver, index) in from_copies:
            return snapshot.neighbour[position[index]]
        return live[index]

    return sending


def _check_signatures(signatures: list[int], reference: int, me: int) -> None:
    """Every rank checks every rank's model against the first source's, the joiners' included.

    A rank that differs raises :class:`ModelMismatch` (it must not train); the others raise
    :class:`GroupRefused` at once, before any state moves, instead of waiting for the odd rank's
    receives until the collective timeout.
    """
    expected = signatures[reference]
    odd = [rank for rank, signature in enumerate(signatures) if signature != expected]
    if not odd:
        return
    if me in odd:
        raise ModelMismatch(f"rank {me}'s tracked state (signature {signatures[me]:x}) differs in parameter names, "
                            f"shapes or dtypes from the job's (rank {reference}: {expected:x}); "
                            "this worker built another model and cannot join the job")
    raise GroupRefused(f"rank(s) {odd} of the new group built another model (tracked state signature "
                       f"{', '.join(f'{signatures[r]:x}' for r in odd)}, the job's {expected:x}): group refused")


def _nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def _load_leaves(tracked: dict[str, Any], states: dict[str, Any], blob: dict[str, Any]) -> None:
    """Load the received non-tensor leaves (the tensors were received in place already)."""
    for name, obj in tracked.items():
        mine = {k[len(f"/{name}"):]: v for k, v in blob.items() if k.startswith(f"/{name}/")}
        if not isinstance(obj, torch.nn.Module):
            obj.load_state_dict(_assign(states[name], mine))


def _leaf_blob(group: RealGroup, leaves: dict[str, Any], src: int, receivers: tuple[int, ...], tag0: int) -> dict:
    me = group.rank
    if me == src:
        data = json.dumps(leaves).encode()
        length = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works = []
        for dst in receivers:
            works += [group.send(length, dst, tag0), group.send(payload, dst, tag0 + 1)]
        for work in works:
            work.wait()
        return leaves
    if me in receivers:
        length = torch.zeros(1, dtype=torch.int64)
        group.recv(length, src, tag0).wait()
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        group.recv(payload, src, tag0 + 1).wait()
        return json.loads(bytes(payload.tolist()).decode())
    return leaves


def hand_over(group: RealGroup, tracked: dict[str, Any], step: int) -> int:
    """The leaver's side of a planned swap, over its end of the :class:`Handover` pair: send the
    header, every tensor and the leaves to the joiner."""
    joiner = Handover.JOINER
    tensors, leaves = flatten({name: obj.state_dict() for name, obj in tracked.items()})
    leaves = portable(leaves)
    group.send(torch.tensor([step, _signature(tensors)], dtype=torch.int64), joiner, 0).wait()
    works = [group.send(tensor.contiguous(), joiner, index + 1) for index, (_, tensor) in enumerate(tensors)]
    for work in works:
        work.wait()
    _leaf_blob(group, leaves, Handover.LEAVER, (joiner,), len(tensors) + 1)
    return _nbytes(tensors)


class TakeOver:
    """The joiner's side of a planned swap, in a thread: build the pair, receive, then load.

    ``step`` is the leaver's committed step once everything arrived, -1 when the handover failed
    (``error`` says why) or was abandoned (a newer generation superseded this one); the joiner then
    takes the state from the replicas instead.

    An abandoned handover never writes into the tracked tensors: the leaver's tensors are received
    into buffers of the joiner's own, copied into the tracked tensors only when all of them (and the
    leaves) arrived, under a lock that :meth:`abandon` takes too. So once ``abandon()`` returned,
    receives the leaver may still complete land in those buffers only, and the fallback from the
    replicas is the last writer. The price: a second copy of the tracked tensors on the joiner (a
    standby, idle until then) while the handover runs; the leaver still copies nothing.
    """

    def __init__(self, handover: Handover, tracked: dict[str, Any], timeout: float) -> None:
        self.handover = handover
        self.step = -1
        self.bytes_received = 0
        self.seconds = 0.0  # from the leaver's header to the last byte: the transfer itself
        self.error: BaseException | None = None
        self.receiving = threading.Event()  # set once the tensors' receives are posted
        self._lock = threading.Lock()
        self._abandoned = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(handover, tracked, timeout), daemon=True,
                                        name=f"tmrun-takeover-gen{handover.gen}")
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def abandon(self) -> None:
        """Stop writing: once this returned, nothing this handover receives reaches the tracked state
        (a copy-in under way finishes first; the fallback from the replicas overwrites it all)."""
        with self._lock:
            self._abandoned = True

    def _run(self, handover: Handover, tracked: dict[str, Any], timeout: float) -> None:
        group = None
        leaver = Handover.LEAVER
        try:
            group = handover.build(Handover.JOINER, timeout)
            states = {name: obj.state_dict() for name, obj in tracked.items()}
            tensors, leaves = flatten(states)
            header = torch.zeros(2, dtype=torch.int64)
            group.recv(header, leaver, 0).wait()
            started = time.monotonic()
            if int(header[1]) != _signature(tensors):
                raise RuntimeError("the leaver's tracked state differs in parameter names, shapes or dtypes "
                                   "from the joiner's")
            staged = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _, tensor in tensors]
            works = [group.recv(buffer, leaver, index + 1) for index, buffer in enumerate(staged)]
            self.receiving.set()
            for work in works:
                work.wait()
            blob = _leaf_blob(group, leaves, leaver, (Handover.JOINER,), len(tensors) + 1)
            with self._lock:
                if self._abandoned:
                    return
                with torch.no_grad():
                    for (_, tensor), buffer in zip(tensors, staged):
                        tensor.copy_(buffer)
                _load_leaves(tracked, states, blob)
                self.bytes_received = _nbytes(tensors)
                self.seconds = time.monotonic() - started
                self.step = int(header[0])
        except BaseException as exc:  # reported through ``step == -1`` and ``error``, never raised in a thread
            self.error = exc
        finally:
            if group is not None:
                group.close()
            self._done.set()
