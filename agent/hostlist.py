"""SLURM's compact host-list syntax, expanded without calling ``scontrol``.

``SLURM_JOB_NODELIST`` and friends hold node lists such as ``gpu[01-03,07],cpu5``. This module
turns them into the host names, in the order ``scontrol show hostnames`` prints them::

    gpu[01-03,07],cpu5      → gpu01 gpu02 gpu03 gpu07 cpu5
    rack[1-2]-node[1-2]     → rack1-node1 rack1-node2 rack2-node1 rack2-node2
    x[9-11]                 → x9 x10 x11          (no leading zero: no padding)
    x[09-11]                → x09 x10 x11         (the lower bound's width is kept)

The grammar, as SLURM reads it:

- Items are separated by commas at the top level (a comma inside brackets belongs to the
  bracket). Whitespace around items is ignored; whitespace between two names at the top level
  separates them as a comma would, as in SLURM itself.
- An item is literal text and bracket groups, in any order: ``n[1-2]-ib``, ``[1-3]``,
  ``a[1-2]b[3-4]c``. Several groups make a cartesian product, the first group varying slowest.
- A bracket group is a comma-separated list of decimal numbers and ``lo-hi`` ranges. Each value
  is printed as wide as the number it came from was written: ``[008-011]`` gives ``008 … 011``.
- Duplicates are kept, in order; nothing is sorted.

An empty (or all-whitespace) text is an empty list. Anything else that does not follow the
grammar raises :class:`agent.errors.ConfigError` with one line naming the bad part. A pure module:
no I/O, no environment.
"""

from __future__ import annotations

import itertools
import math
import re

from agent.errors import ConfigError

__all__ = ["MAX_HOSTS", "expand_hostlist"]

MAX_HOSTS = 65536
"""The most host names one list may expand to; a guard against ``n[0-999999999]`` typos."""

_NUMBER = re.compile(r"[0-9]+")


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list (``gpu[01-03,07],cpu5``) into host names, in SLURM's order."""
    if not isinstance(text, str):
        raise ConfigError(f"malformed host list: expected a string, got {type(text).__name__}")
    if not text.strip():
        return []
    hosts: list[str] = []
    for item in _split_items(text):
        for name in _split_names(item):
            expanded = _expand_name(name)
            if len(hosts) + len(expanded) > MAX_HOSTS:
                raise ConfigError(
                    f"malformed host list: more than {MAX_HOSTS} hosts (at {name!r})"
                )
            hosts.extend(expanded)
    return hosts


def _split_items(text: str) -> list[str]:
    """Cut ``text`` at top-level commas, checking that brackets balance and do not nest."""
    items: list[str] = []
    depth = 0
    start = 0
    for index, char in enumerate(text):
        if char == "[":
            if depth:
                bad = text[start : index + 1].strip()
                raise ConfigError(f"malformed host list: nested '[' in {bad!r}")
            depth = 1
        elif char == "]":
            if not depth:
                bad = text[start : index + 1].strip()
                raise ConfigError(f"malformed host list: unbalanced ']' in {bad!r}")
            depth = 0
        elif char == "," and not depth:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ConfigError(f"malformed host list: unbalanced '[' in {text[start:].strip()!r}")
    items.append(text[start:])
    for position, item in enumerate(items):
        if not item.strip():
            raise ConfigError(
                f"malformed host list: empty item #{position + 1} in {text.strip()!r}"
            )
    return items


def _split_names(item: str) -> list[str]:
    """Split one comma item at whitespace outside brackets (SLURM reads ``a b`` as ``a,b``)."""
    names: list[str] = []
    current: list[str] = []
    depth = 0
    for char in item:
        if char == "[":
            depth = 1
        elif char == "]":
            depth = 0
        if char.isspace() and not depth:
            if current:
                names.append("".join(current))
                current = []
            continue
        current.append(char)
    if current:
        names.append("".join(current))
    return names


def _expand_name(name: str) -> list[str]:
    """Expand one name with zero or more bracket groups into its hosts."""
    literals: list[str] = []
    groups: list[list[str]] = []
    position = 0
    while True:
        opening = name.find("[", position)
        if opening < 0:
            literals.append(name[position:])
            break
        closing = name.index("]", opening)  # balance was checked by _split_items
        literals.append(name[position:opening])
        groups.append(_expand_group(name, name[opening + 1 : closing]))
        position = closing + 1
    if not groups:
        return [name]
    if math.prod(len(group) for group in groups) > MAX_HOSTS:
        raise ConfigError(f"malformed host list: {name!r} expands to more than {MAX_HOSTS} hosts")
    hosts = []
    for values in itertools.product(*groups):
        parts = [literals[0]]
        for value, literal in zip(values, literals[1:]):
            parts.append(value)
            parts.append(literal)
        hosts.append("".join(parts))
    return hosts


def _expand_group(name: str, body: str) -> list[str]:
    """The values of one bracket group's ``body`` (``01-03,07``), formatted with their width."""
    if not body.strip():
        raise ConfigError(f"malformed host list: empty brackets in {name!r}")
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        if not part:
            raise ConfigError(f"malformed host list: empty range in {name!r}")
        low_text, dash, high_text = (piece.strip() for piece in part.partition("-"))
        if not _NUMBER.fullmatch(low_text) or (dash and not _NUMBER.fullmatch(high_text)):
            raise ConfigError(
                f"malformed host list: {part!r} in {name!r} is not a number or a lo-hi range"
            )
        low = int(low_text)
        high = int(high_text) if dash else low
        if high < low:
            raise ConfigError(f"malformed host list: reversed range {part!r} in {name!r}")
        if high - low + 1 + len(values) > MAX_HOSTS:
            raise ConfigError(
                f"malformed host list: range {part!r} in {name!r} is longer than {MAX_HOSTS}"
            )
        width = len(low_text)
        values.extend(f"{number:0{width}d}" for number in range(low, high + 1))
    return values

