"""Values read from etcd that are skipped: decoded and checked at the boundary, reported once.

Every value the agents and the CLI read from etcd goes through :func:`decode_value` (in both
stores: a JSON object, or nothing) and then through :mod:`agent.records` (the right version and
shape, or nothing). A value that fails is skipped, never raised: someone who can write to the
job's prefix (``etcdctl put /tmrun/<job>/junk 'not json'``) must not stop the control plane.

Loops read the same keys again and again, so the warning is given once per key and revision
(:func:`warn_skipped`), not on every read: a new value under the same key is warned about again.
"""

from __future__ import annotations

import collections
import json
import logging
import math

log = logging.getLogger("tmrun.store")

REMEMBERED = 4096  # (key, revision) pairs already warned about; the oldest are forgotten first

_warned: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()


def warn_skipped(key: str, revision: int, why: str) -> bool:
    """Log that ``key`` at ``revision`` is ignored and why; True if this is the first time."""
    mark = (key, revision)
    if mark in _warned:
        _warned.move_to_end(mark)
        return False
    _warned[mark] = None
    if len(_warned) > REMEMBERED:
        _warned.popitem(last=False)
    log.warning("ignoring %s (revision %d): %s", key, revision, why)
    return True


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"number {text[:20]} is out of range")
    return number


def decode_key(raw: bytes) -> str | None:
    """A key as text, or None (with a warning) when it is not UTF-8."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        warn_skipped(repr(raw[:200]), 0, "the key is not UTF-8")
        return None


def decode_value(key: str, raw: bytes, revision: int) -> dict | None:
    """The value stored at ``key`` as a JSON object, or None (with one warning) when it is not one.

    Strict JSON: NaN, Infinity and numbers that overflow a float are refused like any other junk.
    """
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        warn_skipped(key, revision, f"not JSON ({str(exc)[:120]}): {bytes(raw[:60])!r}")
        return None
    if not isinstance(value, dict):
        warn_skipped(key, revision, f"not a JSON object but {type(value).__name__}")
        return None
    return value
