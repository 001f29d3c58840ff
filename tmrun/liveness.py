"""``tmrun.heartbeat()``: one line in a torchrun script's loop that tells its agent it is alive.

Under tmrun every worker gets ``TMRUN_HEARTBEAT_FILE``; calling :func:`heartbeat` touches that file
(at most once every ``EVERY`` seconds, so a fast loop pays one clock read per call). Once a worker
has touched it, its agent counts only the heartbeat as progress, not output or CPU time: a rank
that spins in a collective burns CPU without progress (see ``agent/stall.py``). Outside tmrun
(plain ``python``, torchrun) the variable is absent and the call does nothing. No torch import.
"""

from __future__ import annotations

import os
import time

EVERY = 0.5  # seconds between touches, at most

_last = float("-inf")


def heartbeat() -> None:
    """Say "this worker is making progress" to the agent (a no-op outside tmrun)."""
    global _last
    now = time.monotonic()
    path = os.environ.get("TMRUN_HEARTBEAT_FILE")
    if not path or now - _last < EVERY:
        return
    _last = now
    try:
        os.utime(path)
    except FileNotFoundError:
        with open(path, "ab"):
            pass
