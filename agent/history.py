"""A job's history on disk, so that ``tmrun events`` still answers after the job's etcd is gone.

When a job ends, the launcher copies the job's ``events/`` keys and its ``outcome`` from the
store into ``<log root>/<job>/events.jsonl``: JSON lines, the first a header
``{"v": 1, "job": ..., "outcome": {...} or null, "written": unix time}``, then one event per line
in time order, each the row ``tmrun events --json`` prints (:func:`read_events`). The file is
replaced atomically (a temporary file in the same directory, then ``os.replace``), so a reader
never sees half of it and, when several nodes write it on a shared file system, the last write
wins. Nothing here reads the environment: :func:`default_log_root` is handed the mapping.

Events are written through :func:`append_event`, which keeps the latest :data:`MAX_EVENTS` under
``events/`` and deletes older ones, so that the prefix does not grow with the job's age; the
history file (and ``tmrun events``) then holds the latest :data:`MAX_EVENTS` events.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from agent.errors import HistoryError, JobNotFound, StoreError
from agent.keys import JobKeys
from agent.records import SCHEMA, EventRecord, Outcome, RecordError, parse
from agent.store import Entry, Store

log = logging.getLogger("tmrun.history")

FILE_NAME = "events.jsonl"
MAX_EVENTS = 1000  # events kept under events/; the oldest go when a new one is written


async def append_event(store: Store, keys: JobKeys, seq: int, record: EventRecord, *, once: bool = False,
                       known: list[str] | None = None) -> None:
    """Write ``events/<seq>`` (with ``once``: only if absent) and delete the oldest events beyond
    :data:`MAX_EVENTS`. ``seq`` is wall-clock nanoseconds, so key order is time order.

    ``known``: the event keys already there, when the caller has them (the leader's copy of the
    job's keys); otherwise they are read, keys only.
    """
    key = keys.event(seq)
    if once:
        if not await store.create(key, record.to_dict()):
            return
    else:
        await store.put(key, record.to_dict())
    if known is None:
        known = list(await store.keys(keys.events))
    present = sorted({*known, key})
    for old in present[:-MAX_EVENTS]:
        await store.delete(old)


def default_log_root(environ: Mapping[str, str]) -> Path:
    """``$TMRUN_LOG_DIR``, else ``$XDG_STATE_HOME/tmrun/logs``, else ``~/.local/state/tmrun/logs``."""
    if environ.get("TMRUN_LOG_DIR"):
        return Path(environ["TMRUN_LOG_DIR"])
    if environ.get("XDG_STATE_HOME"):
        return Path(environ["XDG_STATE_HOME"]) / "tmrun" / "logs"
    home = environ.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir
    return Path(home) / ".local" / "state" / "tmrun" / "logs"


def history_path(log_root: Path | str, job: str) -> Path:
    """``<log_root>/<job>/events.jsonl``."""
    return Path(log_root) / job / FILE_NAME


def list_histories(log_root: Path | str) -> list[str]:
    """The jobs that have a history file under ``log_root``, by name."""
    root = Path(log_root)
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob(f"*/{FILE_NAME}") if p.is_file())


async def read_events(store: Store, job: str) -> list[dict[str, Any]]:
    """The job's events in time order, as JSON rows (``EventRecord.to_dict``); unreadable ones skipped."""
    entries, _ = await store.get_prefix(JobKeys(job).events)
    return _event_rows(entries)


def _event_rows(entries: Mapping[str, Entry]) -> list[dict[str, Any]]:
    found = (parse(EventRecord, entries[key]) for key in sorted(entries))  # seq: nanoseconds, key order is time order
    return [record.to_dict() for record in found if record is not None]


async def save_history(store: Store, job: str, log_root: Path | str) -> Path | None:
    """Write the job's history file from the store; its path, or None (one warning logged) when the
    store or the file system failed. Never raises for a store that went away."""
    path = history_path(log_root, job)
    keys = JobKeys(job)
    try:
        entries, _ = await store.get_prefix(keys.root)  # one read: the events and the outcome agree
    except StoreError as exc:
        log.warning("job %s: history not saved, the store failed: %s", job, exc)
        return None
    rows = _event_rows({k: e for k, e in entries.items() if k.startswith(keys.events)})
    found = parse(Outcome, entries.get(keys.outcome))
    outcome = found.to_dict() if found is not None else None
    header = {"v": SCHEMA, "job": job, "outcome": outcome, "written": time.time()}
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in [header, *rows])
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{FILE_NAME}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide it from others on a shared file system
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        log.warning("job %s: history not saved to %s: %s", job, path, exc)
        return None
    return path


def load_history(path: Path | str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the event rows of a history file.

    JobNotFound when the file does not exist; HistoryError when it cannot be read or is malformed.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise JobNotFound(f"no history file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HistoryError(f"history file {path} cannot be read: {exc}") from None
    docs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            raise HistoryError(f"history file {path}, line {number}: not JSON") from None
        if not isinstance(doc, dict):
            raise HistoryError(f"history file {path}, line {number}: not a JSON object")
        docs.append((number, doc))
    if not docs:
        raise HistoryError(f"history file {path} is empty")
    _, header = docs[0]
    if (header.get("v") != SCHEMA or not isinstance(header.get("job"), str)
            or not isinstance(header.get("outcome", ""), (dict, type(None)))):
        raise HistoryError(f"history file {path}: line 1 is not a version {SCHEMA} header")
    if header["outcome"] is not None:
        try:
            Outcome.from_dict(header["outcome"])
        except RecordError as exc:
            raise HistoryError(f"history file {path}, line 1: {exc}") from None
    rows = []
    for number, doc in docs[1:]:
        try:
            row = EventRecord.from_dict(doc).to_dict()
        except RecordError as exc:
            raise HistoryError(f"history file {path}, line {number}: {exc}") from None
        rows.append(row)
    return header, rows
