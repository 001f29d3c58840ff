"""Whether a torchrun script's workers still make progress, seen from outside their processes.

A script on the tmrun runtime reports every committed step, and the agent's step watchdog uses
that (``agent/node.py``). A plain torchrun script reports nothing, so its agent watches three
signs that a worker is still doing something:

- **its heartbeat file** (``TMRUN_HEARTBEAT_FILE``), touched by ``tmrun.heartbeat()`` in the
  script's loop. Once a worker has touched it, only the heartbeat counts: a rank that spins in
  a collective (NCCL's wait does) burns CPU without making progress;
- **a line of output** on its stdout or stderr;
- **CPU time**: the worker process (all its threads) used at least ``min_cpu`` of a core between
  two samples. A rank blocked in a gloo collective, a deadlock or a stopped process uses none.

A node is *stalled* when none of its workers showed a sign for ``report_after`` seconds; it says
so in its node record (``run.stalled_since``: when its first worker stopped, wall clock). The job
is *hung* when the first worker stopped ``limit`` seconds ago and every member node is stalled:
one rank that still makes progress (a long checkpoint save on rank 0, with the others waiting in
a barrier) keeps the job alive. Pure bookkeeping: the agent feeds it samples and output lines.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterable

from agent.procfs import cpu_seconds

def mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


@dataclasses.dataclass
class Worker:
    pid: int
    rank: int
    heartbeat: Path | None
    last: float  # monotonic: the last sign of progress
    last_wall: float  # the same moment, wall clock (compared across nodes)
    cpu: float | None = None
    beat: int | None = None  # the heartbeat file's mtime at the last sample
    beats: bool = False  # it touched its heartbeat file at least once: only that counts now
    why: str = "started"  # the last sign seen: "heartbeat", "output", "cpu" or "started"


@dataclasses.dataclass(frozen=True)
class Stall:
    """This node's workers have shown no progress since ``since_wall`` (its first to stop: ``rank``)."""

    rank: int
    since_wall: float
    idle: float  # seconds since the node's most recent sign of progress
    first_idle: float  # seconds since its first-stopping worker's last sign
    signal: str  # "heartbeat" or "output or CPU": what the first-stopping worker was judged by


class Progress:
    """The signs of progress of one node's workers, sampled by the agent about once a second."""

    def __init__(self, workers: Iterable[tuple[int, int, Path | None]], now: float, wall: float, *,
                 min_cpu: float = 0.05, read_cpu: Callable[[int], float | None] = cpu_seconds,
                 read_beat: Callable[[Path], int | None] = mtime_ns) -> None:
        self._workers = {pid: Worker(pid, rank, beat, now, wall) for pid, rank, beat in workers}
        self._min_cpu = min_cpu
        self._read_cpu = read_cpu
        self._read_beat = read_beat
        self._sampled = now
        for w in self._workers.values():
            w.cpu = read_cpu(w.pid)
            w.beat = read_beat(w.heartbeat) if w.heartbeat is not None else None

    def output(self, pid: int, now: float, wall: float) -> None:
        """A line of output from worker ``pid``."""
        w = self._workers.get(pid)
        if w is not None and not w.beats:
            self._saw(w, now, wall, "output")

    def sample(self, now: float, wall: float) -> None:
        """Read each worker's heartbeat file and CPU time."""
        elapsed = max(now - self._sampled, 1e-6)
        self._sampled = now
        for w in self._workers.values():
            if w.heartbeat is not None:
                beat = self._read_beat(w.heartbeat)
                if beat is not None and beat != w.beat:
                    w.beat, w.beats = beat, True
                    self._saw(w, now, wall, "heartbeat")
                    continue
            cpu = self._read_cpu(w.pid)
            if cpu is None:
                continue
            used, w.cpu = cpu - (w.cpu if w.cpu is not None else cpu), cpu
            if not w.beats and used >= self._min_cpu * elapsed:
                self._saw(w, now, wall, "cpu")

    def stall(self, now: float) -> Stall | None:
        """How long this node has shown no progress, or None while some worker shows some."""
        if not self._workers:
            return None
        first = min(self._workers.values(), key=lambda w: (w.last, w.rank))
        latest = max(w.last for w in self._workers.values())
        return Stall(first.rank, first.last_wall, now - latest, now - first.last,
                     "heartbeat" if first.beats else "output or CPU")

    @staticmethod
    def _saw(w: Worker, now: float, wall: float, why: str) -> None:
        w.last, w.last_wall, w.why = now, wall, why


def hung(own: Stall, limit: float, others: dict[str, tuple[float, int] | None]) -> str | None:
    """Why the job is hung, or None. ``others``: each other member node's ``(stalled_since, rank)``
    from its record, or None when it is not stalled."""
    if own.first_idle < limit or any(v is None for v in others.values()):
        return None
    stops = sorted([(own.since_wall, own.rank), *(v for v in others.values() if v is not None)])
    first_at, first_rank = stops[0]
    later = ", ".join(f"rank {r} {at - first_at:.1f} s later" for at, r in stops[1:])
    return (f"hung: no progress on any rank for {own.idle:.0f} s (progress_timeout {limit:g} s); "
            f"rank {first_rank} stopped first" + (f", {later}" if later else ""))
