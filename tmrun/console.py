"""Everything a person reads from the CLI goes through here (rich); ``--json`` output does not.

Errors and warnings are one plain line on stderr (``tmrun: error: …``) so that they read the same
in a terminal, a log file and a SLURM output file.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

_err = Console(stderr=True, highlight=False, soft_wrap=True)
# Piped output (scripts, logs, tests) gets a wide table instead of rich's 80-column default.
_out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def screen() -> Console:
    """The console a live view (``tmrun top``) draws on: standard output."""
    return _out


def error(message: str) -> None:
    print(f"tmrun: error: {message}", file=sys.stderr, flush=True)


def warning(message: str) -> None:
    print(f"tmrun: warning: {message}", file=sys.stderr, flush=True)


def info(message: str) -> None:
    print(f"tmrun: {message}", file=sys.stderr, flush=True)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


_ROLE_STYLE = {"active": "green", "standby": "cyan", "draining": "yellow", "drained": "dim",
               "failed": "red", "lost": "red", "joining": "yellow"}


def print_status(doc: dict[str, Any]) -> None:
    outcome = doc.get("outcome") or {}
    headline = (f"job [bold]{doc['job']}[/] · {doc['state']} · generation {doc['generation']} · "
                f"world size {doc['world_size']} · restarts {doc['restarts']} · hot swaps {doc['hot_swaps']} · "
                f"leader {doc['leader'] or '-'} · standby pool {doc['standby_pool']}"
                + (" · hot swap" if doc.get("hot_swap") else ""))
    _out.print(headline)
    if outcome:
        _out.print(f"outcome: {outcome.get('state')}: {outcome.get('reason')}")
    if doc["standby_pool"] == 0 and doc["state"] == "running":
        _out.print("[yellow]the standby pool is empty: a failure now restarts workers in place[/]")
    table = Table(show_header=True, header_style="bold")
    for column in ("node", "role", "host", "ranks", "gen", "workers", "step", "step time", "last swap", "agent pid"):
        table.add_column(column)
    for row in doc["nodes"]:
        ranks = row["ranks"]
        rank_text = "-" if not ranks else (str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}")
        style = _ROLE_STYLE.get(row["role"], "")
        workers = row["state"] + (f" ({row['exitcode']})" if row["exitcode"] not in (None, 0) else "")
        swap = row.get("last_swap") or {}
        stall = f"gen {swap['gen']}: {swap['stall']:.3f} s" if "stall" in swap else "-"
        step_time = f"{row['step_time']:.3f} s" if row.get("step_time") else "-"
        table.add_row(row["node"], f"[{style}]{row['role']}[/]" if style else row["role"], row["host"] or "-",
                      rank_text, str(row["generation"] or "-"), workers, str(row.get("step") or "-"), step_time,
                      stall, str(row["agent_pid"] or "-"))
    _out.print(table)


def print_events(rows: list[dict[str, Any]]) -> None:
    table = Table(show_header=True, header_style="bold")
    for column in ("time", "gen", "kind", "what happened"):
        table.add_column(column)
    for row in rows:
        at = datetime.datetime.fromtimestamp(row["at"]).strftime("%H:%M:%S.%f")[:-3]
        table.add_row(at, str(row["gen"]), row["kind"], row["text"])
    _out.print(table)
