"""``tmrun top``: the live view in a real terminal (tmux), its ``--json`` frames, and its errors."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from agent.keys import JobKeys
from tests.harness import FAST, TMRUN, job_ref, job_store, run_tmrun, wait_status
from tests.slurm_cluster import wait_for
from tests.test_e2e_hot_swap import JOB

pytestmark = pytest.mark.timeout(30)


def _reported(ref, node: str, *, seconds: float = 0.0, top: list[str] | None = None, cwd: Path | None = None):
    """The steps ``node``'s agent wrote into its record (a watch on the job's etcd) for ``seconds``,
    or while ``tmrun top`` with ``top``'s arguments ran; with that run's output and exit code, and
    whether the job's ``viewer`` key was left behind."""
    async def go():
        store = job_store(ref.endpoint, retry_deadline=5)
        keys = JobKeys(ref.job)
        steps: list[int] = []
        try:
            _, revision = await store.stat(keys.node(node))
            watch = await store.watch_prefix(keys.node(node), start_revision=revision + 1)

            async def collect() -> None:
                async for event in watch:
                    if event.value is not None and event.value["run"]["step"] not in steps[-1:]:
                        steps.append(event.value["run"]["step"])

            collecting = asyncio.ensure_future(collect())
            if top is None:
                await asyncio.wait([collecting], timeout=seconds)
                out, code = b"", None
            else:
                proc = await asyncio.create_subprocess_exec(*TMRUN, "top", *top, "--job", ref.job, cwd=cwd,
                                                            stdout=asyncio.subprocess.PIPE,
                                                            stderr=asyncio.subprocess.PIPE)
                out, err = await asyncio.wait_for(proc.communicate(), 60)
                code = proc.returncode
                assert code == 0, err.decode()
            await watch.cancel()
            await collecting
            return steps, out.decode(), await store.get(keys.viewer)
        finally:
            await store.close()

    return asyncio.run(go())


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_json_frames_show_nodes_step_rates_and_events(jobs, tmp_path: Path) -> None:
    job = jobs(["--nnodes", "2", "--standby", "1", "--metrics-port", "0", "--rdzv-conf", FAST, str(JOB),
                str(tmp_path / "final.pt"), "--steps", "600", "--step-time", "0.05"])
    ref = job_ref(job)
    wait_status(ref, lambda d: d["hot_swap"] and all(n["step"] for n in d["nodes"] if n["role"] == "active"), 90)
    # Nobody watching, an agent writes its workers' step every 10 s (the workers tell it each second).
    quiet, _, _ = _reported(ref, "node-0", seconds=6.0)
    assert len(quiet) <= 1, quiet
    # While top runs, it holds the viewer key and the agents write the step each second: the frames
    # see it move, and the key goes with top.
    viewed, out, viewer = _reported(ref, "node-0", top=["--json", "--count", "6", "--interval", "1"], cwd=tmp_path)
    assert len(viewed) >= 3 and viewed == sorted(viewed), viewed
    assert viewer is None
    frames = [json.loads(line) for line in out.splitlines()]
    assert len(frames) == 6 and all(f["v"] == 1 and f["job"] == ref.job and f["state"] == "running" for f in frames)
    first, last = frames[0], frames[-1]
    assert all(0 < f["steps_per_s"] <= 1 / 0.05 for f in frames), frames  # at most the script's pace
    roles = {n["node"]: n["role"] for n in last["nodes"]}
    assert roles == {"node-0": "active", "node-1": "active", "node-2": "standby"}, roles
    assert all(n["steps_per_s"] > 0 and n["metrics"].startswith("http://") for n in last["nodes"] if n["role"] == "active")
    assert last["links"] == {"measured": False, "matrix": {}}
    assert [e["kind"] for e in last["events"]][:2] == ["start", "hot"], last["events"]
    assert last["nodes"][0]["step"] > first["nodes"][0]["step"]
    assert job.wait(90) == 0, job.err.text()[-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(150)
@pytest.mark.skipif(shutil.which("tmux") is None and not os.environ.get("CI"),
                    reason="needs tmux (.ci/run installs it; in CI its absence fails the test)")
def test_the_live_view_in_a_terminal_follows_the_job_to_its_end(jobs, tmp_path: Path) -> None:
    gate = tmp_path / "gate"  # the steps from 100 on are slower until the view has been seen to move
    job = jobs(["--nnodes", "2", "--standby", "1", "--rdzv-conf", FAST, str(JOB), str(tmp_path / "final.pt"),
                "--steps", "300", "--step-time", "0.05", "--hold-from", "100", "--gate", str(gate)])
    ref = job_ref(job)
    wait_status(ref, lambda d: d["hot_swap"], 90)
    session = f"tmrun-top-{os.getpid()}"
    command = " ".join(map(shlex.quote, [sys.executable, "-m", "tmrun.cli", "top", "--job", ref.job]))
    passed = [f"{k}={os.environ[k]}" for k in ("PATH", "PYTHONPATH", "HOME", "TMRUN_RUNTIME_DIR", "XDG_RUNTIME_DIR")
              if k in os.environ]  # a tmux server already running would not pass this process's environment on
    # COLUMNS/LINES exported by the caller would win over the pane's size in rich (COLUMNS=80: an 80-column view)
    shell = f"cd {shlex.quote(str(tmp_path))} && unset COLUMNS LINES && {command}; echo EXIT=$?; sleep 60"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "45",
                    *[arg for kv in passed for arg in ("-e", kv)], shell], check=True,
                   env={**os.environ, "TERM": "xterm-256color"}, timeout=10)
    try:
        def screen() -> str:
            return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                                  timeout=10).stdout

        def steps(text: str) -> list[int]:
            return [int(line.split("│")[5]) for line in text.splitlines()
                    if line.startswith("│ node-") and line.split("│")[5].strip().isdigit()]

        def until(condition: Callable[[str], bool], timeout: float, what: str) -> str:
            try:
                return wait_for(lambda: (lambda s: s if condition(s) else None)(screen()), timeout, what)
            except TimeoutError as e:
                raise AssertionError(f"{e}; the screen:\n{screen()}") from None

        live = until(lambda s: "steps/s ·" in s and len(steps(s)) == 3, 60, "the live view with a rate")
        assert f"{ref.job} · running" in live and "┃ node " in live and "recent events" in live, live
        before = max(steps(live))
        until(lambda s: max(steps(s) or [0]) > before, 30, "the view to move on")  # in place, refreshed
        assert screen().count("┃ node ") == 1  # one table: redrawn, not printed again
        gate.touch()
        end = until(lambda s: "EXIT=" in s, 90, "top to end with the job")
        # the last frame shows the outcome, or the job's etcd stopped with it between two frames
        assert "EXIT=0" in end and ("· succeeded ·" in end or f"job {ref.job} has ended and its etcd with it" in end), end
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=10)
    assert job.wait(60) == 0


def test_top_of_no_job_is_one_line_and_exit_5(tmp_path: Path) -> None:
    done = run_tmrun(["top", "--job", "nope"], cwd=tmp_path, env={"TMRUN_RUNTIME_DIR": str(tmp_path / "rt")})
    assert done.returncode == 5 and done.stderr.startswith("tmrun: error: no running job named 'nope'"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("args", "says"), [
    (["--interval", "0"], "--interval 0: at least 0.1 seconds"),
    (["--interval", "nan"], "--interval"),
    (["--count", "0"], "0: expected 1 to"),
])
def test_bad_top_flags_are_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    done = run_tmrun(["top", *args, "--job", "x"], cwd=tmp_path, env={"TMRUN_RUNTIME_DIR": str(tmp_path / "rt")})
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_link_matrix_shows_each_measured_link_in_mb_per_s() -> None:
    from rich.console import Console

    from tmrun.top import frame, render

    row = {"role": "active", "state": "running", "ranks": [0], "step": 5, "step_time": 0.1, "last_swap": {},
           "metrics": None, "links": {}}
    doc = {"job": "j", "state": "running", "generation": 3, "world_size": 3, "hot_swaps": 2, "restarts": 0,
           "standby_pool": 0, "leader": "n0", "nodes": [{**row, "node": "n0"}, {**row, "node": "n1"},
                                                       {**row, "node": "n2", "links": {"n1": 2.5e8, "n0": 1.25e8}}]}
    f = frame(doc, [])
    assert f["links"] == {"measured": True, "matrix": {"n2": {"n0": 1.25e8, "n1": 2.5e8}}}
    console = Console(width=120, record=True)
    console.print(render(f))
    text = console.export_text()
    assert "links (MB/s, source → node)" in text
    line = [line for line in text.splitlines() if line.startswith("│ n2 ")][-1]  # the nodes table's row comes first
    assert [cell.strip() for cell in line.split("│")[2:4]] == ["125.0", "250.0"], text
    assert frame({**doc, "nodes": doc["nodes"][:2]}, [])["links"] == {"measured": False, "matrix": {}}


@pytest.mark.parametrize(("interval", "ttl"), [(1.0, 10), (20.0, 60)])
def test_the_viewer_key_lives_while_a_view_holds_it_and_goes_with_it(interval: float, ttl: int) -> None:
    """The key the agents watch to report each second: on a lease that outlives the wait between
    two refreshes, taken away when the view ends, put again after its lease was lost."""
    from agent.memory_store import MemoryStore
    from tmrun.top import Viewer

    async def go() -> None:
        now = [0.0]
        store = MemoryStore(clock=lambda: now[0])
        key = JobKeys("j").viewer
        viewer = Viewer(store, "j", interval, clock=lambda: now[0])
        await viewer.hold()
        assert (await store.get(key)).value["v"] == 1
        now[0] = ttl / 3 - 0.5
        await viewer.hold()  # not due yet: the lease runs from the put
        now[0] = ttl - 0.5
        assert await store.get(key) is not None
        now[0] = ttl + 0.5  # no refresh came in time: the lease is gone, and the key with it
        assert await store.get(key) is None
        await viewer.hold()  # due: the lease is found gone, and the key is put again
        assert await store.get(key) is not None
        now[0] += ttl / 3
        await viewer.hold()  # refreshed in time
        now[0] += ttl - 0.5
        assert await store.get(key) is not None
        await viewer.release()
        assert await store.get(key) is None
        await viewer.release()  # twice: nothing left to take away

    asyncio.run(go())
