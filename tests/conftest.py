"""Shared fixtures: one real etcd server per test session, and a clean environment per test.

Under pytest-xdist (``-n 2 --dist loadgroup``; README.md and .ci/run use it) every test that
brings up network namespaces (the ``slurm`` and ``hosts`` markers) runs on one worker, in file
order: the SLURM lab and tests/netlab.py use fixed namespace names and addresses, and the lab is
brought up once per worker that needs it.
"""

from __future__ import annotations

import os

import pytest

from agent.etcd_server import EmbeddedEtcd
from tests.slurm_cluster import slurm, slurm_cluster  # noqa: F401  (fixtures)


HOSTS_GROUP = "hosts"


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    """Put the tests that use network namespaces in one xdist group, and check that xdist kept it."""
    grouped = [item for item in items if item.get_closest_marker("slurm") or item.get_closest_marker("hosts")]
    for item in grouped:
        item.add_marker(pytest.mark.xdist_group(HOSTS_GROUP))
    result = yield
    if getattr(config.option, "loadgroup", False):  # an xdist worker of a --dist loadgroup run
        lost = [item.nodeid for item in grouped if not item.nodeid.endswith(f"@{HOSTS_GROUP}")]
        if lost:  # pytest 9.2 with xdist 3.8 drops the group (pytest-dev/pytest-xdist#1386)
            raise pytest.UsageError(f"xdist did not group {lost[0]} (and {len(lost) - 1} more): "
                                    "the namespace tests would run on two workers at once")
    return result


JOBS = pytest.StashKey[list]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that started jobs (the ``jobs`` fixture) shows the end of each job's stderr."""
    report = yield
    if report.when == "call" and report.failed:
        for job in item.stash.get(JOBS, []):
            code = job.proc.poll()
            report.sections.append((f"tmrun pid {job.proc.pid} ({'running' if code is None else f'exit {code}'}), "
                                    "the end of its stderr", job.err.text()[-6000:]))
    return report


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory):
    """A real etcd on loopback, port 0, shared by the session (give each test its own prefix)."""
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _session_state(tmp_path_factory: pytest.TempPathFactory):
    """The tests' own tmrun CA (TMRUN_CREDENTIALS), made by the first job, and session-wide runtime
    and log directories for jobs that module fixtures start (the per-test ones below come later):
    nothing a test runs reads or writes the home directory's tmrun state."""
    parent = tmp_path_factory.mktemp("session-state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMRUN_CREDENTIALS", str(parent / "credentials"))
        patch.setenv("TMRUN_LOG_DIR", str(parent / "logs"))
        patch.setenv("TMRUN_RUNTIME_DIR", str(parent / "runtime"))
        yield parent / "credentials"


@pytest.fixture(autouse=True)
def _runtime_dir(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Each test gets its own TMRUN_RUNTIME_DIR, so no runtime file leaks between tests."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("TMRUN_RUNTIME_DIR", str(runtime))
    return runtime


@pytest.fixture(autouse=True)
def _log_dir(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Each test gets its own TMRUN_LOG_DIR, so jobs' history files stay out of the home directory."""
    logs = tmp_path / "logs"
    monkeypatch.setenv("TMRUN_LOG_DIR", str(logs))
    return logs


@pytest.fixture
def jobs(tmp_path, request: pytest.FixtureRequest):
    """Start ``tmrun`` jobs; afterwards assert that no process any of them started is still alive,
    and that no worker or agent of theirs logged a move its phase or role table refuses. When the
    test failed, its report shows the end of each job's stderr."""
    from tests.harness import Job, alive

    started: list[Job] = []
    request.node.stash[JOBS] = started

    def start(args: list[str], env: dict | None = None) -> Job:
        job = Job(args, cwd=tmp_path, env=env)
        started.append(job)
        return job

    yield start
    leftovers = []
    for job in started:
        job.track()
        if job.proc.poll() is None:
            leftovers.append(f"tmrun pid {job.proc.pid}")
        leftovers += [f"pid {pid}" for pid in job.seen_pids - {job.proc.pid} if alive(pid)]
        job.kill()
    assert not leftovers, f"processes outlived the test: {leftovers}"
    refused = [line for job in started for line in job.err.text().splitlines() if "is not allowed (" in line]
    assert not refused, f"refused phase or role moves: {refused[:5]}"
