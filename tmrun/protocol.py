"""Every message between a node agent and its workers: versioned JSON lines over a Unix socket.

The agent listens on the socket named by ``TMRUN_AGENT_SOCKET``; each worker connects once, says
``hello`` and keeps the connection for its life. One JSON object per line, ``{"v": 1, "type": …}``.
Nothing here is pickled. This module is imported by both sides (``agent`` may import it; workers
never import ``agent``).

Worker → agent:

- ``hello``     {rank, pid}: this worker runs the tmrun runtime (it can be hot-swapped).
- ``progress``  {step, step_time, gen}: throttled to one a second, except the first committed step
  after a switch; shown by ``tmrun status``, and the agent's hang watchdog feeds on it.
- ``ready``     {gen}: this worker has built the communicator of generation ``gen``.
- ``switched``  {gen, step, stall, build, transfer, bytes_received, from_leaver, handover_s,
  handover_error, sources, phase1_steps, phase1_step_time, normal_step_time}: this worker trains in
  ``gen`` from ``step`` on; a leaver sends {gen, step, left, rejoin, bytes_sent, transfer,
  handover_error} instead, just before it exits (or, with ``rejoin``, becomes a standby again in
  the same process). ``handover_error`` is null, or why the handover between leaver and joiner
  failed or was abandoned (the joiner then took the state from the replicas).
- ``broken``    {gen, step, error}: a collective of ``gen`` failed; the worker waits for a plan.

Agent → worker:

- ``prepare``   {gen, rank, world_size, store_host, store_port, mode, handover}: build the group
  of ``gen`` (phase 1). ``mode`` is ``agreed`` (switch at a step boundary all ranks vote for) or
  ``now`` (the current group is broken: switch as soon as the group is built). ``handover``: this
  joiner receives its state from the leaver whose rank it takes.
- ``leave``     {gen, rejoin[, store_host, store_port]}: this worker is not part of ``gen``; vote
  for the switch, then exit 0 (``rejoin``: wait as a standby for the next ``prepare`` instead). With a store: first build the handover pair with the joiner that takes
  this rank and, at the switch, send it the tracked state.
"""

from __future__ import annotations

import json
from typing import Any

SCHEMA = 1
WORKER_TYPES = frozenset({"hello", "progress", "ready", "switched", "broken"})
AGENT_TYPES = frozenset({"prepare", "leave"})


class ProtocolError(ValueError):
    """A line that is not a message of this schema."""


def encode(kind: str, **fields: Any) -> bytes:
    if kind not in WORKER_TYPES | AGENT_TYPES:
        raise ProtocolError(f"unknown message type {kind!r}")
    return (json.dumps({"v": SCHEMA, "type": kind, **fields}, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"not JSON: {line[:80]!r}") from exc
    if not isinstance(message, dict) or message.get("v") != SCHEMA:
        raise ProtocolError(f"unsupported message: {str(line)[:80]}")
    if message.get("type") not in WORKER_TYPES | AGENT_TYPES:
        raise ProtocolError(f"unknown message type {message.get('type')!r}")
    return message
