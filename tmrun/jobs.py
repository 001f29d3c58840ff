"""Finding a running job from another shell: runtime files written by the local cluster.

A local cluster writes ``<runtime dir>/<job>.json`` (endpoint, pid, start time) while it runs and
removes it on exit; ``tmrun status`` / ``drain`` / ``events`` read these files when no endpoint
is given. A file whose pid is gone is stale and is ignored (and removed). Under SLURM the job id
and endpoint come from the allocation instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Mapping

from agent.errors import JobNotFound

SCHEMA = 1


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
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{job}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"v": SCHEMA, "job": job, "endpoint": endpoint, "pid": pid, "started": started}))
    os.replace(tmp, path)
    return path


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
    if not directory.is_dir():
        return []
    for path in directory.glob("*.json"):
        try:
            data = json.loads(path.read_text())
            if data.get("v") != SCHEMA:
                continue
            if not _alive(int(data["pid"])):
                path.unlink(missing_ok=True)
                continue
            found.append((float(data["started"]), JobRef(data["job"], data["endpoint"])))
        except (OSError, ValueError, KeyError):
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
