"""Test tools for end-to-end runs: start ``tmrun`` for real, read its output as it comes, watch
its status through etcd (event-driven, no sleeps), inject faults, and check that nothing it started
outlives the test.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from agent.changes import Changes
from agent.errors import JobNotFound
from agent.credentials import credentials_dir
from agent.etcd_store import EtcdStore, client_tls, parse_endpoint
from agent.keys import JobKeys
from agent.procfs import descendants, stat_fields
from tmrun import admin
from tmrun.jobs import JobRef

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_ddp.py"
TMRUN = [sys.executable, "-c", "from tmrun.cli import main; main()"]
FAST = "lease_ttl=3,failure_window=4,last_call_timeout=0.5,join_timeout=60,close_timeout=3"


def alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


class Output:
    """Lines of a stream collected by a thread; ``wait_for`` blocks on a condition, not a sleep."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.times: list[float] = []  # time.monotonic() when each line arrived
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for raw in stream:
            with self._cond:
                self.lines.append(raw.rstrip("\n"))
                self.times.append(time.monotonic())
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + self.text()[-4000:])
                self._cond.wait(left)

    def last_time(self, pattern: str) -> float:
        """When the last line matching ``pattern`` arrived (``time.monotonic()``)."""
        regex = re.compile(pattern)
        with self._cond:
            found = [t for line, t in zip(self.lines, self.times) if regex.search(line)]
        if not found:
            raise AssertionError(f"no line matching {pattern!r}:\n" + self.text()[-4000:])
        return found[-1]

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


class Job:
    """One ``tmrun`` invocation running in the background."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(TMRUN + args, cwd=cwd, env=full_env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out = Output(self.proc.stdout)
        self.err = Output(self.proc.stderr)
        self.seen_pids: set[int] = {self.proc.pid}

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self.out.join(10)
        self.err.join(10)
        return code

    def track(self) -> None:
        if self.proc.poll() is None:
            self.seen_pids |= descendants(self.proc.pid)

    def kill(self) -> None:
        for pid in sorted(self.seen_pids | descendants(self.proc.pid), reverse=True):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


def fast_gate(directory: Path) -> Path:
    """The file that ends a paced job's pacing (``--fast-when``, tests/scripts/gate.py): a test
    creates it once it has acted, and the steps left only have to reach the end. (Not ``acted``:
    a test may also hold its job's steps with ``--gate`` on a file of its own.)"""
    return directory / "unpaced"


def job_ref(job: "Job", timeout: float = 60.0) -> JobRef:
    """The job's id and endpoint, from the line tmrun prints once etcd is up and the runtime file exists."""
    match = job.err.wait_for(r"job (\S+): \d+ agents, etcd at (\S+)", timeout)
    return JobRef(match.group(1), match.group(2))


def wait_status(ref, predicate: Callable[[dict], bool], timeout: float) -> dict:
    """Re-read ``tmrun status`` on every change of the job's keys until ``predicate`` holds."""
    return _wait_job(ref, admin.status, predicate, timeout)


def wait_events(ref, predicate: Callable[[list[dict]], bool], timeout: float) -> list[dict]:
    """Re-read ``tmrun events`` on every change of the job's keys until ``predicate`` holds."""
    return _wait_job(ref, admin.events, predicate, timeout)


def job_store(endpoint: str, **kwargs) -> EtcdStore:
    """A store on a job's etcd, with the user's credentials when the endpoint is ``https://``."""
    tls = client_tls(endpoint, None, None, None, credentials_dir(os.environ))
    return EtcdStore(parse_endpoint(endpoint), tls=tls, **kwargs)


def _wait_job(ref, read, predicate: Callable, timeout: float):
    async def go():
        store = job_store(ref.endpoint, retry_deadline=5)
        keys = JobKeys(ref.job)
        try:
            _, revision = await store.get_prefix(keys.root)
            changes = Changes(store, keys.root)
            await changes.start(revision + 1)
            deadline = time.monotonic() + timeout
            try:
                while True:
                    seen = changes.version
                    try:
                        doc = await read(store, ref.job)
                    except JobNotFound:  # no agent has registered yet
                        doc = None
                    if doc is not None and predicate(doc):
                        return doc
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise AssertionError(f"{read.__name__} never matched within {timeout} s; last: {doc}")
                    await changes.wait(seen, left)
            finally:
                await changes.close()
        finally:
            await store.close()

    return asyncio.run(go())


def roles(doc: dict) -> dict[str, str]:
    return {row["node"]: row["role"] for row in doc["nodes"]}


def node_row(doc: dict, role: str) -> list[dict]:
    return [row for row in doc["nodes"] if row["role"] == role]


def run_tmrun(args: list[str], cwd: Path, timeout: float = 60.0, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(TMRUN + args, cwd=cwd, text=True, capture_output=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_weights(a), load_weights(b)
    assert list(wa) == list(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs"
