"""Where worker output goes: prefixed lines on the agent's console and/or per-rank log files.

torchrun's flags, same meaning: ``--redirects`` sends a local rank's stdout (1), stderr (2) or both
(3) to files only, ``--tee`` to files and console, ``--local-ranks-filter`` limits which local
ranks reach the console. Spec strings are ``"3"`` (all ranks) or ``"0:3,1:1"`` (per local rank).
Files: ``<log_dir>/<job>/<node>/gen<G>/<local_rank>/{stdout,stderr}.log`` (see docs/cli.md).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import BinaryIO, Callable

from agent.errors import ConfigError

STDOUT, STDERR = 1, 2


def parse_std_spec(spec: str, flag: str = "--redirects") -> dict[int | None, int]:
    """``"3"`` → {None: 3}; ``"0:3,1:1"`` → {0: 3, 1: 1}. ``None`` stands for every rank."""
    spec = spec.strip()
    try:
        if ":" not in spec:
            value = int(spec or "0")
            if not 0 <= value <= 3:
                raise ValueError(spec)
            return {None: value}
        result: dict[int | None, int] = {}
        for item in spec.split(","):
            rank, _, value_text = item.partition(":")
            value = int(value_text)
            if not 0 <= value <= 3:
                raise ValueError(item)
            result[int(rank)] = value
        return result
    except ValueError:
        raise ConfigError(f"{flag} {spec!r}: expected 0-3 or LOCAL_RANK:0-3,...") from None


def _lookup(spec: dict[int | None, int], local_rank: int) -> int:
    return spec.get(local_rank, spec.get(None, 0))


class OutputRouter:
    """Pumps one generation's worker streams to the console and to log files."""

    def __init__(self, node: str, *, log_dir: Path | None, redirects: str = "0", tee: str = "0",
                 local_ranks_filter: tuple[int, ...] = (), console_out: BinaryIO | None = None,
                 console_err: BinaryIO | None = None, on_line: Callable[[int], None] | None = None) -> None:
        self._node = node
        self._on_line = on_line  # called with the local rank of each line read (the stall watch)
        self._log_dir = log_dir
        self._redirects = parse_std_spec(redirects, "--redirects")
        self._tee = parse_std_spec(tee, "--tee")
        self._filter = set(local_ranks_filter)
        self._console = {STDOUT: console_out or sys.stdout.buffer, STDERR: console_err or sys.stderr.buffer}
        self._ranks: dict[int, int] = {}  # local rank -> the global rank its lines are prefixed with

    def attach(self, proc: asyncio.subprocess.Process, local_rank: int, rank: int) -> list[asyncio.Task]:
        self._ranks[local_rank] = rank
        return [asyncio.ensure_future(self._pump(proc.stdout, STDOUT, local_rank)),
                asyncio.ensure_future(self._pump(proc.stderr, STDERR, local_rank))]

    def _targets(self, stream: int, local_rank: int) -> tuple[bool, Path | None]:
        redirected = bool(_lookup(self._redirects, local_rank) & stream)
        teed = bool(_lookup(self._tee, local_rank) & stream)
        to_console = (not redirected or teed) and (not self._filter or local_rank in self._filter)
        path = None
        if (redirected or teed) and self._log_dir is not None:
            name = "stdout.log" if stream == STDOUT else "stderr.log"
            path = self._log_dir / str(local_rank) / name
        return to_console, path

    def set_rank(self, local_rank: int, rank: int) -> None:
        """A worker's rank changed (a promoted standby's placeholder became its real rank): its
        next lines carry the new one."""
        self._ranks[local_rank] = rank

    def _prefix(self, local_rank: int) -> bytes:
        return f"[{self._node} r{self._ranks[local_rank]}]: ".encode()

    async def _pump(self, reader: asyncio.StreamReader | None, stream: int, local_rank: int) -> None:
        if reader is None:
            return
        to_console, path = self._targets(stream, local_rank)
        file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            file = path.open("ab")
        console = self._console[stream]
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # a line longer than the reader's limit
                    line = await reader.read(1 << 16)
                if not line:
                    break
                if self._on_line is not None:
                    self._on_line(local_rank)
                if to_console:
                    prefix = self._prefix(local_rank)
                    console.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    console.flush()
                if file is not None:
                    file.write(line)
                    file.flush()
        finally:
            if file is not None:
                file.close()
