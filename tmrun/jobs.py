"""Finding a running job from another shell: runtime files written by the local cluster.

A local cluster writes ``<runtime dir>/<job>.json`` (endpoint, pid, start time) while it runs and
removes it on exit; ``tmrun status`` / ``drain`` / ``events`` read these files when no endpoint
is given. A file whose pid is gone is stale and is ignored (and removed). Under SLURM the job id
and endpoint come from the allocation instead.

The default directory is in ``/tmp``, where anyone can create it first: it is made with mode 0700,
an existing one is used only if it is this user's and not writable by others, files are written
through a fresh temporary file and a rename, and read only when they are regular files of this
user (a planted symbolic link is ignored, never followed): :mod:`agent.shared_dirs`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Mapping

from agent.errors import JobNotFound
from agent.shared_dirs import check_private_dir, private_dir, read_private_file, write_private_file

SCHEMA = 1
HINT = "remove it, or choose another directory with TMRUN_RUNTIME_DIR"


@dataclasses.dataclass(frozen=True)
class JobRef:
    """Where a job's keys live: its id and its etcd endpoint."""

    job: str
    endpoint: str


def runtime_dir(environ: Mapping[str, str]) -> Path:
    """``$TMRUN_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/tmrun``, else ``/tmp/tmrun-<uid>``."""
    if environ.get("TMRUN_RUNTIME_DIR"):
        return Path(environ["TMRUN_RUNTIME_DIR"])
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "tmrun"
    return Path(f"/tmp/tmrun-{os.getuid()}")


def write_runtime_file(directory: Path, job: str, endpoint: str, pid: int, started: float) -> Path:
    private_dir(directory, HINT)
    data = json.dumps({"v": SCHEMA, "job": job, "endpoint": endpoint, "pid": pid, "started": started})
    return write_private_file(directory, f"{job}.json", data.encode())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_jobs(directory: Path) -> list[JobRef]:
    """Jobs with a live runtime file, oldest first."""
    found: list[tuple[float, JobRef]] = []
    if not os.path.lexists(directory):
        return []
    check_private_dir(directory, HINT)
    for path in directory.glob("*.json"):
        raw = read_private_file(path)
        if raw is None:  # a link, not a regular file, or someone else's: not ours to read
            continue
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("v") != SCHEMA:
                continue
            pid = int(data["pid"])
            if pid <= 0 or not _alive(pid):
                path.unlink(missing_ok=True)
                continue
            found.append((float(data["started"]), JobRef(str(data["job"]), str(data["endpoint"]))))
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            continue
    return [ref for _, ref in sorted(found, key=lambda item: item[0])]


def find_job(directory: Path, job: str | None) -> JobRef:
    """The one running local job, or the one named ``job``; JobNotFound otherwise."""
    jobs = running_jobs(directory)
    if job is not None:
        for ref in jobs:
            if ref.job == job:
                return ref
        raise JobNotFound(f"no running job named {job!r} (looked in {directory}); "
                          "give --rdzv-endpoint for a job on another machine")
    if not jobs:
        raise JobNotFound(f"no running tmrun job found in {directory}; start one, or give --rdzv-endpoint and --job")
    if len(jobs) > 1:
        names = ", ".join(ref.job for ref in jobs)
        raise JobNotFound(f"{len(jobs)} jobs are running ({names}); choose one with --job")
    return jobs[0]
