"""Give the heap's free pages back to the kernel every few committed steps (glibc's ``malloc_trim``).

A training step frees its activations and gradients' temporaries; glibc keeps the freed pages in
its main arena, and the holes that later steps do not fit into make the worker's resident memory
grow over a run although the bytes in use stay the same (docs/benchmarks.md, "Steady-state
overhead"). ``malloc_trim(0)`` returns every free page of the arenas with ``madvise``; the next
step faults back in what it uses. Once every ``TMRUN_MALLOC_TRIM_EVERY`` committed steps (default
50, ``0`` turns it off) this costs about 0.2% of the time (5M GPT on a CPU: a 3.5 ms call, then
30 ms of page faults in the next step, every 50 steps of 330 ms).

Only glibc has ``malloc_trim``: elsewhere (musl, macOS) :class:`HeapTrim` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Callable, Mapping

log = logging.getLogger("tmrun.heap")

DEFAULT_EVERY = 50


def _glibc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


class HeapTrim:
    """Trims the heap after every ``every``-th committed step; counts what it did."""

    def __init__(self, every: int, trim: Callable[[int], int] | None = None) -> None:
        if every < 0:
            raise ValueError(f"TMRUN_MALLOC_TRIM_EVERY must be 0 (off) or a positive number of steps, not {every}")
        self.every = every
        self._trim = trim if trim is not None else (_glibc_trim() if every else None)
        self.trims = 0
        self.seconds = 0.0  # time spent inside malloc_trim, over the run

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "HeapTrim":
        """From ``TMRUN_MALLOC_TRIM_EVERY``; a value that is no step count is said in one line and
        the default used, since a worker should not fail over a tuning knob."""
        text = env.get("TMRUN_MALLOC_TRIM_EVERY", str(DEFAULT_EVERY)).strip()
        if not text.isascii() or not text.isdigit():
            log.warning("TMRUN_MALLOC_TRIM_EVERY=%r is not 0 (off) or a number of steps; trimming every %d steps",
                        text, DEFAULT_EVERY)
            return cls(DEFAULT_EVERY)
        return cls(int(text))

    @property
    def active(self) -> bool:
        return self.every > 0 and self._trim is not None

    def after_step(self, step: int) -> bool:
        """Called with the number of committed steps; True when this call trimmed."""
        if not self.active or step % self.every:
            return False
        started = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - started
        self.trims += 1
        return True
