"""What /proc says about processes: parent, state, CPU time, command line, and process trees.

One copy for the agent (its stall watch reads a worker's CPU time), the tests (every process a
job started must be gone at the end) and the benchmarks (CPU time per process, a launcher's
workers). Linux only; a process that exits while it is read is simply left out.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the parenthesised name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (all threads), or None when it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def table() -> dict[int, tuple[int, int, str]]:
    """Every process: ``pid -> (parent pid, CPU ticks, state)``."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None:
            found[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]), fields[0])
    return found


def children(pid: int, procs: Mapping[int, tuple[int, int, str]] | None = None) -> list[int]:
    """The live (not zombie) children of ``pid``, sorted."""
    procs = table() if procs is None else procs
    return sorted(p for p, (parent, _, state) in procs.items() if parent == pid and state != "Z")


def descendants(roots: int | Iterable[int], procs: Mapping[int, tuple[int, int, str]] | None = None) -> set[int]:
    """Every process below ``roots`` (one pid or several), not the roots themselves."""
    kids: dict[int, list[int]] = {}
    for pid, (parent, *_) in (table() if procs is None else procs).items():
        kids.setdefault(parent, []).append(pid)
    found: set[int] = set()
    todo = [roots] if isinstance(roots, int) else list(roots)
    while todo:
        for kid in kids.get(todo.pop(), []):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def cmdline(pid: int) -> list[bytes] | None:
    """The process's argv, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[:-1]
    except OSError:
        return None


def running(pids: Iterable[int], needle: str) -> list[int]:
    """Those of ``pids`` whose command line contains ``needle`` (in any argument), sorted."""
    return sorted(p for p in pids if any(needle.encode() in arg for arg in cmdline(p) or []))
