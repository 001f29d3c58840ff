"""End to end hot swaps: real etcd, agents, gloo workers running the tmrun runtime, real SIGKILLs.

Each schedule (seeded, so a failure can be replayed) drains a node or kills a worker at a chosen
step, in a chosen phase. Every run must end with the weights of an uninterrupted torchrun run,
every step index committed exactly once per rank, and the surviving workers' process ids
unchanged (nobody else restarted).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.history import history_path, load_history
from tests.harness import FAST, assert_same_weights, fast_gate, job_ref, run_tmrun, wait_status

pytestmark = pytest.mark.e2e

JOB = Path(__file__).parent / "scripts" / "runtime_job.py"
FAIL_AFTER_LOOP = Path(__file__).parent / "scripts" / "fail_after_loop.py"
STEPS = 120
PACE = ["--step-time", "0.08"]


_REFERENCES: dict[tuple[int, int], Path] = {}  # (world, steps) -> weights: one torchrun per test process


def _reference(tmp_path_factory, world: int, steps: int = STEPS) -> Path:
    """runtime_job.py's weights after ``steps`` uninterrupted steps on ``world`` ranks (torchrun)."""
    if (world, steps) not in _REFERENCES:
        _REFERENCES[world, steps] = _train_reference(tmp_path_factory, world, steps)
    return _REFERENCES[world, steps]


def _train_reference(tmp_path_factory, world: int, steps: int) -> Path:
    out = tmp_path_factory.mktemp(f"ref{world}") / "ref.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TMRUN_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(JOB), str(out), "--steps", str(steps)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, Path]:
    return {2: _reference(tmp_path_factory, 2), 3: _reference(tmp_path_factory, 3)}


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    seed: int
    nodes: int = 2
    standby: int = 1
    action: str = "drain"  # drain | kill | none
    rank: int = 1  # whose node is drained / whose worker is killed
    script: tuple[str, ...] = ()  # faults injected inside the workers ({step} is replaced)
    swaps: int = 1  # expected generations after the first
    conf: str = ""  # more --rdzv-conf
    replaced: tuple[int, ...] | None = None  # ranks a joiner takes over (None: ``rank``); the rest survive

    @property
    def survivors(self) -> set[int]:
        """The ranks whose workers must keep their process from start to end."""
        return set(range(self.nodes)) - set((self.rank,) if self.replaced is None else self.replaced)


SCHEDULES = [
    Schedule("drain-rank1", 1),
    Schedule("drain-rank0-the-first-rank", 2, rank=0),
    Schedule("kill-9-worker-rank1", 3, action="kill"),
    Schedule("kill-9-worker-rank0", 4, action="kill", rank=0),
    Schedule("kill-inside-gradient-allreduce", 5, action="none", script=("--kill-in-allreduce", "{step}:1"),
             replaced=(1,)),
    Schedule("kill-at-step-start", 6, action="none", script=("--exit-at", "{step}:0"), replaced=(0,)),
    Schedule("kill-during-phase-1-of-a-drain", 7, nodes=3, standby=2, action="drain", rank=1,
             script=("--kill-on-prepare", "0"), swaps=2, replaced=(0, 1)),
    Schedule("kill-the-joiner", 8, standby=2, action="kill", rank=1, script=("--kill-joiner",), swaps=2),
    Schedule("two-simultaneous-failures-two-standbys", 9, nodes=3, standby=2, action="none",
             script=("--exit-at", "{step}:0,{step}:2"), replaced=(0, 2)),
    Schedule("drain-on-three-nodes", 10, nodes=3, standby=1, rank=2),
    Schedule("hang-caught-by-the-watchdog", 11, action="none", script=("--hang-at", "{step}:1"), replaced=(1,),
             conf=",collective_timeout=2,progress_timeout=6"),
]


def test_every_schedule_has_survivors() -> None:
    assert all(schedule.survivors for schedule in SCHEDULES)


def _assert_each_step_committed_once(events: list[dict], rank: int, killed: set[int] = frozenset()) -> None:
    """``rank``'s workers committed every step once. A worker the test SIGKILLed (``killed`` pids) may
    have committed one step more than it printed (killed between its vote and its line): that step
    may be missing, and only that one, right after the killed worker's last line."""
    steps = sorted(e["step"] for e in events if e["rank"] == rank and e["committed"])
    assert len(steps) == len(set(steps)), f"rank {rank}: a step committed twice"
    missing = sorted(set(range(STEPS)) - set(steps))
    if not missing:
        return
    last_lines = {max((e["step"] for e in events if e["pid"] == pid and e["committed"]), default=-1) for pid in killed}
    assert len(missing) == 1 and missing[0] - 1 in last_lines, f"rank {rank}: steps {missing} never committed"


def _events(text: str) -> list[dict]:
    return [event for _, event in _prefixed_events(text)]


def _prefixed_events(text: str) -> list[tuple[int | None, dict]]:
    """Each JSON line of the workers' output, with the rank its console prefix shows (``[node-1 r0]: ``)."""
    events = []
    for line in text.splitlines():
        if "{" in line:
            try:
                event = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            prefix = re.match(r"\[\S+ r(\d+)\]: ", line)
            events.append((int(prefix[1]) if prefix else None, event))
    return events


@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s.name for s in SCHEDULES])
def test_hot_swap_schedule(schedule: Schedule, jobs, tmp_path, references):
    rng = random.Random(schedule.seed)
    step = rng.randrange(15, 45)
    script = [arg.replace("{step}", str(step)) for arg in schedule.script]
    acted = fast_gate(tmp_path)  # the steps left once the swap was seen run unpaced (gate.py)
    job = jobs(["--nnodes", str(schedule.nodes), "--standby", str(schedule.standby), "--rdzv-conf", FAST + schedule.conf,
                str(JOB), str(tmp_path / "final.pt"), "--steps", str(STEPS), *PACE, "--fast-when", str(acted),
                *script])
    ref = job_ref(job)
    wait_status(ref, lambda d: d["hot_swap"] and sum(1 for n in d["nodes"] if n["state"] == "shadow")
                == schedule.standby, 90)
    job.out.wait_for(rf'"step": {step}, "committed"', 90)
    doc = wait_status(ref, lambda d: True, 10)
    job.track()
    target = next(n for n in doc["nodes"] if n["ranks"] == [schedule.rank])
    if schedule.action == "drain":
        drained = run_tmrun(["drain", target["node"]], cwd=tmp_path, timeout=120)
        assert drained.returncode == 0, drained.stderr
        assert "hot swap" in drained.stderr
    elif schedule.action == "kill":
        os.kill(target["worker_pids"][0], signal.SIGKILL)
    final = wait_status(ref, lambda d: d["generation"] >= 1 + schedule.swaps or d["state"] != "running", 120)
    job.track()
    if final["state"] == "running" and final["mode"].startswith("swap"):
        # the links that carried each joiner's state were measured, and its node record says so
        # (read while the job runs: the records go with it; under load the job may end first)
        active_before = {n["node"] for n in doc["nodes"] if n["ranks"]}
        joiners = [n["node"] for n in final["nodes"] if n["ranks"] and n["node"] not in active_before]

        def measured(d: dict) -> bool:
            return all(n["links"] for n in d["nodes"] if n["node"] in joiners)

        seen = wait_status(ref, lambda d: d["state"] != "running" or measured(d), 60)
        if seen["state"] == "running":
            rows = {n["node"]: n for n in seen["nodes"]}
            for joiner in joiners:
                links = rows[joiner]["links"]
                assert all(rate > 0 for rate in links.values()), rows[joiner]
                assert set(links) <= set(rows) - {joiner}, links
    acted.touch()
    assert job.wait(150) == 0, job.err.text()[-4000:]
    swap = None
    if final["mode"].startswith("swap"):  # the swap's event, with its timings, from the job's history
        _, history = load_history(history_path(tmp_path / "logs", ref.job))
        swap = next(r for r in history if r["kind"] == "swap" and r["gen"] == final["generation"])["data"]
        timings = [swap[k] for k in ("plan_written_s", "phase1_started_s", "phase1_done_s", "switched_s",
                                     "first_step_s")]
        assert all(t is not None and t >= 0 for t in timings) and timings == sorted(timings), swap
        if schedule.action == "drain":  # a failure's stall starts before the report (when a peer noticed)
            assert swap["stall_s"] <= swap["first_step_s"], swap
            if swap["phase1_step_time"] and swap["normal_step_time"]:  # training went on during phase 1
                print(f"phase 1: {swap['phase1_steps']} steps of {swap['phase1_step_time']:.3f} s "
                      f"against {swap['normal_step_time']:.3f} s before")
                assert swap["phase1_step_time"] <= 2 * swap["normal_step_time"] + 0.05, swap  # loose: 2 cores
    assert final["restarts"] == 0 and final["hot_swaps"] == final["generation"] - 1, final  # swaps, not restarts

    assert_same_weights(tmp_path / "final.pt", references[schedule.nodes])
    events = [e for e in _events(job.out.text()) if e.get("role") == "active" and "step" in e]
    pids: dict[int, set[int]] = {}
    for event in events:
        pids.setdefault(event["rank"], set()).add(event["pid"])
    killed = {target["worker_pids"][0]} if schedule.action == "kill" else set()
    for rank in range(schedule.nodes):
        _assert_each_step_committed_once(events, rank, killed)
    before = {n["ranks"][0]: n["worker_pids"][0] for n in doc["nodes"] if n["ranks"]}
    for rank in schedule.survivors:  # the same process from the first step to the last
        assert pids[rank] == {before[rank]}, f"rank {rank} was restarted: pids {pids[rank]}, before {before[rank]}"
    for shown, event in _prefixed_events(job.out.text()):  # a promoted standby's lines carry its real rank
        if event.get("role") == "active" and "step" in event:
            assert shown == event["rank"], (shown, event)
    assert "started generation 2" not in job.err.text()  # nobody was restarted: generations came by swap
    if schedule.action == "drain" and not script:  # a planned swap: the leaver handed its state over
        done = [e for e in _events(job.out.text()) if e.get("done")]
        joiner = [s for e in done for s in e["swaps"] if s["from_leaver"]]
        assert joiner and joiner[0]["bytes_received"] == joiner[0]["from_leaver"] > 0, done
        survivors = [s for e in done for s in e["swaps"] if not s["from_leaver"]]
        assert survivors and all(s["bytes_received"] == 0 for s in survivors), done
        assert swap is not None and swap["bytes_from_leaver"] == joiner[0]["from_leaver"], swap


@pytest.mark.timeout(240)
def test_a_worker_stopped_while_it_waits_for_the_next_generation_is_swapped_out(jobs, tmp_path, references):
    """Chaos seed 116: rank 1's worker is SIGKILLed; rank 2's reports its group broken and is then
    SIGSTOPped. Its steps stopped for a reason (broken), so the step watchdog is not the one to
    catch it; its silence is: its agent kills it after ``progress_timeout`` seconds without a word,
    and the second standby takes its rank. Rank 0 waits in the swap all along, saying alive, and
    is spared: the job ends with the weights of an uninterrupted run, in two swaps."""
    job = jobs(["--nnodes", "3", "--standby", "2", "--rdzv-conf", FAST + ",collective_timeout=2,progress_timeout=6",
                str(JOB), str(tmp_path / "final.pt"), "--steps", str(STEPS), *PACE])
    ref = job_ref(job)
    wait_status(ref, lambda d: d["hot_swap"] and sum(1 for n in d["nodes"] if n["state"] == "shadow") == 2, 90)
    job.out.wait_for(r'"step": 30, "committed"', 90)
    doc = wait_status(ref, lambda d: True, 10)
    job.track()
    by_rank = {n["ranks"][0]: n for n in doc["nodes"] if n["ranks"]}
    os.kill(by_rank[1]["worker_pids"][0], signal.SIGKILL)
    stopped = by_rank[2]["worker_pids"][0]
    job.err.wait_for(rf"{by_rank[2]['node']} worker {stopped}: generation 1 broke at step", 60)
    os.kill(stopped, signal.SIGSTOP)
    job.err.wait_for(rf"{by_rank[2]['node']}: worker pid {stopped} said nothing for \d+ s \(stopped or frozen\)", 60)
    final = wait_status(ref, lambda d: d["generation"] >= 3 or d["state"] != "running", 120)
    assert final["state"] == "running" and final["restarts"] == 0 and final["hot_swaps"] == 2, final
    assert job.wait(150) == 0, job.err.text()[-4000:]
    assert_same_weights(tmp_path / "final.pt", references[3])
    events = [e for e in _events(job.out.text()) if e.get("role") == "active" and "step" in e]
    assert {e["pid"] for e in events if e["rank"] == 0} == {by_rank[0]["worker_pids"][0]}  # rank 0 never restarted
    for rank in range(3):
        _assert_each_step_committed_once(events, rank, {by_rank[1]["worker_pids"][0]})


@pytest.mark.timeout(300)
def test_drains_during_a_swap_of_a_standby_and_rejoin(jobs, tmp_path, tmp_path_factory):
    """A drain --rejoin, a drain that arrives while that swap is in progress, a drain of the node
    that came back as a standby, and one of a node that already left: each gets a clear answer,
    and the job ends with the weights of an uninterrupted run."""
    steps = 400
    reference = _reference(tmp_path_factory, 2, steps)
    acted = fast_gate(tmp_path)  # the steps left once the drains are answered run unpaced (gate.py)
    job = jobs(["--nnodes", "2", "--standby", "2", "--rdzv-conf", FAST, str(JOB), str(tmp_path / "final.pt"),
                "--steps", str(steps), *PACE, "--fast-when", str(acted)])
    ref = job_ref(job)
    ready = wait_status(ref, lambda d: d["hot_swap"] and sum(1 for n in d["nodes"] if n["state"] == "shadow") == 2, 90)
    job.track()
    pids_before = next(n["worker_pids"] for n in ready["nodes"] if n["node"] == "node-1")

    standbys = {"node-2", "node-3"}
    first = run_tmrun(["drain", "node-1", "--rejoin", "--no-wait"], cwd=tmp_path, timeout=60)
    joiner = re.search(r"drain node-1: (node-\d) takes its place \(hot swap\); node-1 rejoins the pool", first.stderr)
    assert first.returncode == 0 and joiner and joiner[1] in standbys, first.stderr
    # sent while the joiner switches in; node-1 may already be back (warm, in its own process) and take the place
    during = run_tmrun(["drain", "node-0"], cwd=tmp_path, timeout=120)
    second = re.search(r"drain node-0: (node-\d) takes its place \(hot swap\)", during.stderr)
    assert during.returncode == 0 and second and second[1] in (standbys - {joiner[1]}) | {"node-1"}, during.stderr
    back = wait_status(ref, lambda d: d["standby_pool"] == 1 and d["generation"] == 3
                       and all(r["state"] in ("running", "shadow") for r in d["nodes"] if r["node"] != "node-0"), 120)
    actives = {r["node"] for r in back["nodes"] if r["role"] == "active"}
    assert back["state"] == "running" and actives == {joiner[1], second[1]}, back
    rejoined = next(n for n in back["nodes"] if n["node"] == "node-1")
    assert rejoined["worker_pids"] == pids_before, rejoined  # left, waited and maybe came back: one process
    left_standby = next(r["node"] for r in back["nodes"] if r["role"] == "standby")

    again = run_tmrun(["drain", "node-0"], cwd=tmp_path, timeout=60)
    assert again.returncode == 0 and "node-0 already left the job (drained)" in again.stderr, again.stderr
    standby = run_tmrun(["drain", left_standby], cwd=tmp_path, timeout=60)
    assert standby.returncode == 0 and "it was a standby and leaves the pool" in standby.stderr, standby.stderr
    empty = wait_status(ref, lambda d: d["standby_pool"] == 0, 30)
    assert empty["state"] == "running" and empty["generation"] == 3, empty  # two swaps, no restart

    acted.touch()
    assert job.wait(200) == 0, job.err.text()[-4000:]
    assert_same_weights(tmp_path / "final.pt", reference)
    committed: dict[int, list[int]] = {}
    for event in _events(job.out.text()):
        if event.get("role") == "active" and event.get("committed"):
            committed.setdefault(event["rank"], []).append(event["step"])
    assert {rank: sorted(s) for rank, s in committed.items()} == {0: list(range(steps)), 1: list(range(steps))}
    assert "started generation 2" not in job.err.text()


@pytest.mark.timeout(200)
def test_a_worker_failing_after_the_last_step_fails_the_job(jobs, tmp_path):
    """Rank 0 raises OSError after its loop (a final save that fails) while a standby waits: the
    job fails with the worker's rank and exit code; a swap that nobody can switch into does not
    turn it into a success."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    job = jobs(["--nnodes", "2", "--standby", "1", "--rdzv-conf", FAST, str(FAIL_AFTER_LOOP), "20", str(gate)])
    ref = job_ref(job)
    ready = wait_status(ref, lambda d: d["hot_swap"] and any(n["state"] == "shadow" for n in d["nodes"]), 90)
    job.track()
    ranks = {n["node"]: n["ranks"] for n in ready["nodes"]}
    assert ranks == {"node-0": [0], "node-1": [1], "node-2": []}, ranks  # ranks follow node order
    with open(gate, "w"):  # rank 0 waits in its last step until this opens the FIFO
        pass
    assert job.wait(120) == 1, job.err.text()[-4000:]
    err = job.err.text()
    assert "OSError: [Errno 28] No space left on device: 'final.pt'" in err, err[-4000:]
    ended = re.search(r"tmrun: job \S+ (succeeded|failed): (.*)", err)
    assert ended and ended[1] == "failed", err[-4000:]
    # The script leaves without run.finish(), its process group alive: torch's teardown can then
    # abort the interpreter after the traceback (gloo's threads still hold tensors when Python
    # finalizes; pytorch/pytorch#179291), and the exit code is SIGABRT's, said as such.
    aborted = "terminate called without an active exception" in err
    said = "node-0 worker rank 0 killed by signal 6" if aborted else "node-0 worker rank 0 exited with code 1"
    assert said in ended[2], ended[0]
