"""Every message between a node agent and its workers: versioned JSON lines over a Unix socket.

The agent listens on the socket named by ``TMRUN_AGENT_SOCKET``; each worker connects once, says
``hello`` and keeps the connection for its life. One JSON object per line, ``{"v": 1, "type": …}``.
Nothing here is pickled. This module is imported by both sides (``agent`` may import it; workers
never import ``agent``).

Worker → agent:

- ``hello``     {rank, pid}: this worker runs the tmrun runtime (it can be hot-swapped).
- ``alive``     {}: sent every :data:`ALIVE_EVERY` seconds by a thread of the worker, whatever its
  step loop does (trains, waits in a collective, waits for a plan): the agent's hang watchdog
  tells a stopped or frozen process from one that waits (see ``agent.node``).
- ``progress``  {step, step_time, gen}: throttled to one a second, except the first committed step
  after a switch; shown by ``tmrun status``, and the agent's hang watchdog feeds on it.
- ``ready``     {gen}: this worker has built the communicator of generation ``gen``.
- ``switched``  {gen, step, stall, build, transfer, bytes_received, from_leaver, handover_s,
  handover_error, build_error, sources, phase1_steps, phase1_step_time, normal_step_time,
  predicted_s, links, probed, rolled_back, group_build, store_connect, gloo_connect}: this worker
  trains in ``gen`` from ``step`` on (``rolled_back``: a redundant copy was used and every rank went
  back to its step); ``sources`` is how many ranks held the state. ``group_build`` is the seconds
  the group's build took in its thread (from the ``prepare``'s arrival), ``store_connect`` and
  ``gloo_connect`` its parts (gloo's includes waiting for the last member). On a receiver, ``links`` is ``{source rank: [bytes, seconds]}`` of
  the pull, ``probed`` ``{source rank: bytes/s}`` of phase 1's probe, ``predicted_s`` the pull's
  planned finish (null when a rate it used was not measured): these grow with the sources. A leaver sends {gen, step, left, rejoin,
  bytes_sent, transfer, handover_error} instead, just before it exits (or, with ``rejoin``,
  becomes a standby again in the same process). ``handover_error`` is null, or why the handover
  between leaver and joiner failed or was abandoned (the joiner then took the state from the
  replicas); ``build_error`` is null, or why building a group of a generation this worker did not
  switch to failed since its last switch (the worker logged it when it happened).
- ``broken``    {gen, step, error}: a collective of ``gen`` failed; the worker waits for a plan.
- ``failed``    {gen, step, error}: this worker cannot go on in the job and exits with an error next
  (the training state is lost, it built another model, or a resize that torch-native groups
  cannot take): the agent reports ``error`` with the exit, and the leader's decision names it.

Agent → worker:

- ``prepare``   {gen, rank, world_size, store_host, store_port, mode, handover, probe, links}: build
  the group of ``gen`` (phase 1). ``mode`` is ``agreed`` (switch at a step boundary all ranks vote
  for) or ``now`` (the current group is broken: switch as soon as the group is built).
  ``handover``: this joiner receives its state from the leaver whose rank it takes. ``probe``: the
  ranks (joiners) whose links phase 1 measures, the same list for every rank; ``links``: what
  this node's agent measured before, ``[[first rank, stop rank, bytes/s], ...]``, one entry per
  source node (both optional, growing with the joiners and the measured nodes).
- ``leave``     {gen, rejoin[, store_host, store_port]}: this worker is not part of ``gen``; vote
  for the switch, then exit 0 (``rejoin``: wait as a standby for the next ``prepare`` instead).
  With a store: first build the handover pair with the joiner that takes this rank and, at the
  switch, send it the tracked state. The leaver (from ``leave`` and its rank) and the joiner (from
  ``prepare`` with ``handover``) describe the pair alike, as :class:`tmrun.swap.Handover`.


Every message is checked against its schema (:data:`FIELDS`) when it is decoded: a required field
missing or of the wrong type, or an optional one of the wrong type, is a :class:`ProtocolError`;
fields not listed are passed through. A line is at most :data:`MAX_LINE` bytes; only the fields
said to grow above grow with the job (by nodes or sources, about 30 bytes each). Both ends skip a bad line with a warning and
keep the connection.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

SCHEMA = 1
MAX_LINE = 16 * 1024 * 1024  # bytes; a longer line is discarded
ALIVE_EVERY = 1.0  # seconds between a worker's ``alive`` messages
WORKER_TYPES = frozenset({"hello", "alive", "progress", "ready", "switched", "broken", "failed"})
AGENT_TYPES = frozenset({"prepare", "leave"})


class ProtocolError(ValueError):
    """A line that is not a message of this schema."""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _int(value) and value > 0


def _number(value: Any) -> bool:
    return (_int(value) or isinstance(value, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number_or_none(value: Any) -> bool:
    return value is None or _number(value)


def _str(value: Any) -> bool:
    return isinstance(value, str)


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _str_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _mode(value: Any) -> bool:
    return value in ("agreed", "now")


def _rate(value: Any) -> bool:
    return _number(value) and value > 0


def _ranks(value: Any) -> bool:
    return isinstance(value, list) and all(_int(rank) and rank >= 0 for rank in value)


def _rate_ranges(value: Any) -> bool:
    """``[[first rank, stop rank, bytes/s], ...]``: one entry per source node."""
    return isinstance(value, list) and all(
        isinstance(item, list) and len(item) == 3 and _int(item[0]) and _int(item[1]) and 0 <= item[0] < item[1]
        and _rate(item[2]) for item in value)


def _rates_by_rank(value: Any) -> bool:
    """``{"<source rank>": bytes/s}``."""
    return isinstance(value, dict) and all(key.isdigit() and _rate(rate) for key, rate in value.items())


Check = Callable[[Any], bool]
# type -> (required fields, optional fields), each field with its check
FIELDS: dict[str, tuple[dict[str, Check], dict[str, Check]]] = {
    "hello": ({"rank": _int, "pid": _positive}, {"role": _str}),
    "alive": ({}, {}),
    "progress": ({"step": _int, "step_time": _number, "gen": _int}, {}),
    "ready": ({"gen": _int}, {}),
    "switched": ({"gen": _int, "step": _int},
                 {"stall": _number, "build": _number, "transfer": _number, "bytes_received": _int,
                  "from_leaver": _int, "handover_s": _number, "sources": _int, "phase1_steps": _int,
                  "phase1_step_time": _number_or_none, "normal_step_time": _number_or_none, "left": _bool,
                  "rejoin": _bool, "rolled_back": _bool, "bytes_sent": _int, "handover_error": _str_or_none,
                  "build_error": _str_or_none, "predicted_s": _number_or_none, "probed": _rates_by_rank,
                  "group_build": _number, "store_connect": _number, "gloo_connect": _number}),
    "broken": ({"gen": _int, "step": _int, "error": _str}, {}),
    "failed": ({"gen": _int, "step": _int, "error": _str}, {}),
    "prepare": ({"gen": _int, "rank": _int, "world_size": _positive, "store_host": _str, "store_port": _positive,
                 "mode": _mode, "handover": _bool}, {"probe": _ranks, "links": _rate_ranges}),
    "leave": ({"gen": _int}, {"rejoin": _bool, "store_host": _str, "store_port": _positive}),
}
assert set(FIELDS) == WORKER_TYPES | AGENT_TYPES


def check(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` if it matches its type's schema; ProtocolError naming what is wrong otherwise."""
    kind = message.get("type")
    if type(message.get("v")) is not int or message["v"] != SCHEMA:
        raise ProtocolError(f"unsupported schema version {message.get('v')!r}")
    if kind not in FIELDS:
        raise ProtocolError(f"unknown message type {_brief(kind)}")
    required, optional = FIELDS[kind]
    for name, ok in required.items():
        if name not in message:
            raise ProtocolError(f"{kind}: field {name!r} is missing")
        if not ok(message[name]):
            raise ProtocolError(f"{kind}: field {name!r} has a bad value {_brief(message[name])}")
    for name, ok in optional.items():
        if name in message and not ok(message[name]):
            raise ProtocolError(f"{kind}: field {name!r} has a bad value {_brief(message[name])}")
    return message


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def encode(kind: str, **fields: Any) -> bytes:
    """One line; ProtocolError if it does not match the schema (a bug of the sender)."""
    message = check({"v": SCHEMA, "type": kind, **fields})
    data = (json.dumps(message, separators=(",", ":"), allow_nan=False) + "\n").encode()
    if len(data) > MAX_LINE:
        raise ProtocolError(f"{kind}: {len(data)} bytes is over the line limit of {MAX_LINE}")
    return data


def decode(line: bytes | str) -> dict[str, Any]:
    """The message on ``line``; ProtocolError saying what is wrong with it otherwise."""
    try:
        message = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise ProtocolError(f"not JSON: {_brief(line[:60])}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"not a JSON object: {_brief(line[:60])}")
    return check(message)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")
