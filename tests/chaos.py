"""A seeded chaos harness: random fault schedules over a hot-swap job on the local cluster.

The job: ``tests/scripts/runtime_job.py`` on 3 nodes and 2 standbys (``--nnodes 3 --standby 2``),
``STEPS`` steps of about ``STEP_TIME`` seconds. A schedule is one or two faults, drawn from a seed:

    kind               what the harness does                                  who is replaced
    kill-worker        SIGKILL a rank's worker, at a random point of its step  that rank
    kill-agent         SIGKILL the agent of a rank's node (its workers follow) that rank
    kill-leader-agent  SIGKILL the leader's agent (active or standby)          its rank, if any
    hang-worker        SIGSTOP a rank's worker: alive, silent (the watchdog)   that rank
    drain              ``tmrun drain NODE``                                    that rank
    drain-rejoin       ``tmrun drain NODE --rejoin``                           that rank
    etcd-kill          SIGKILL the job's etcd (the launcher restarts it)       nobody

A fault lands at a step drawn from the job's first steps, its last steps, or anywhere between; a
second fault, when there is one, lands a few steps after the first ("two events close together").
``run`` then checks what every schedule must end with:

- the job exits 0, within ``END_BOUND`` seconds of its last committed step; unless a worker was
  killed or stopped after its own last step (in the script's epilogue): then it must exit 1 and
  say so: the worker failed "after the job's last step", or, when its loss was seen before the
  others finished, a standby was swapped in but "the job's last step ran before" it could switch
  in (seed 18); no swap can redo an epilogue;
- weights bit-identical to an uninterrupted run (``reference``);
- every step committed exactly once per rank;
- the workers of ranks no fault touched keep their process ids, where the schedule promises it:
  one fault, taken while both standbys were warm (a fault before that may cost a restart);
- no worker or agent logged a move its phase or role table refuses;
- nothing left running (the ``jobs`` fixture's check, or ``leftovers`` for the benchmark).

``python -m bench.chaos`` runs many seeds and writes docs/reliability.md; tests/test_chaos.py runs
a fixed handful. A failure names its seed: ``generate(seed)`` gives the same schedule again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from agent.procfs import descendants
from tests.harness import FAST, Job, assert_same_weights, job_ref, wait_status

JOB = Path(__file__).parent / "scripts" / "runtime_job.py"
NODES, STANDBY = 3, 2
STEPS = 120
STEP_TIME = 0.08
CONF = FAST + ",collective_timeout=3,progress_timeout=12"  # a hang is caught; a slow step on 2 busy cores is not one
END_BOUND = 20.0  # seconds from the last committed step to the job's exit
KINDS = ("kill-worker", "kill-agent", "kill-leader-agent", "hang-worker", "drain", "drain-rejoin", "etcd-kill")
REPLACES = {"kill-worker", "kill-agent", "hang-worker", "drain", "drain-rejoin"}  # the target's rank goes


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # injected once this step was reported by some rank
    rank: int  # whose worker / node (unused by kill-leader-agent and etcd-kill)
    delay: float  # seconds after the step's line: a random point of the step


@dataclasses.dataclass(frozen=True)
class Schedule:
    seed: int
    faults: tuple[Fault, ...]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(f.kind for f in self.faults)

    def describe(self) -> str:
        return f"seed {self.seed}: " + ", ".join(f"{f.kind} rank {f.rank} at step {f.step}" for f in self.faults)


def generate(seed: int) -> Schedule:
    """The schedule of ``seed``: the same seed always gives the same faults."""
    rng = random.Random(seed)
    where = rng.random()
    if where < 0.15:
        first = rng.randrange(0, 3)  # the job's first steps
    elif where < 0.3:
        first = rng.randrange(STEPS - 3, STEPS)  # its last steps
    else:
        first = rng.randrange(10, STEPS - 10)
    ranks = rng.sample(range(NODES), 2)
    faults = [Fault(rng.choice(KINDS), first, ranks[0], round(rng.uniform(0, STEP_TIME), 3))]
    if rng.random() < 0.3:  # a second event close to the first
        second = min(first + rng.randrange(0, 4), STEPS - 1)
        faults.append(Fault(rng.choice(KINDS), second, ranks[1], round(rng.uniform(0, STEP_TIME), 3)))
    return Schedule(seed, tuple(faults))


@dataclasses.dataclass
class Outcome:
    schedule: Schedule
    hot: bool  # both standbys were warm when the first fault landed
    replaced: set[int]
    end_s: float  # last committed step → job exit
    epilogue: bool = False  # a worker was struck after its last step: the job failed, as it must


def run(schedule: Schedule, workdir: Path, reference: Path, start: Callable[[list[str]], Job]) -> Outcome:
    """Run one schedule end to end; raises AssertionError (naming the seed) when a check fails.

    The job's whole output is kept in ``workdir`` (``tmrun.out``, ``tmrun.err``) for a post-mortem.
    """
    jobs: list[Job] = []

    def started(args: list[str]) -> Job:
        jobs.append(start(args))
        return jobs[-1]

    try:
        return _run(schedule, workdir, reference, started)
    finally:
        for job in jobs:
            (workdir / "tmrun.out").write_text(job.out.text())
            (workdir / "tmrun.err").write_text(job.err.text())


def _run(schedule: Schedule, workdir: Path, reference: Path, start: Callable[[list[str]], Job]) -> Outcome:
    from tests.harness import TMRUN

    out = workdir / "final.pt"
    job = start(["--nnodes", str(NODES), "--standby", str(STANDBY), "--rdzv-conf", CONF, str(JOB), str(out),
                 "--steps", str(STEPS), "--step-time", str(STEP_TIME)])
    ref = job_ref(job)
    drains: list[subprocess.Popen] = []
    replaced: set[int] = set()
    struck: list[set[int]] = []  # per fault: the pids of the workers it killed or stopped
    hot = False
    try:
        for index, fault in enumerate(schedule.faults):
            if index == 0 and fault.step >= 10:  # a fault in the first steps may come before any standby is warm
                wait_status(ref, lambda d: d["hot_swap"] and sum(n["state"] == "shadow" for n in d["nodes"]) == STANDBY,
                            90)
            job.out.wait_for(rf'"step": {fault.step}, "committed"', 120)
            doc = wait_status(ref, lambda d: True, 10)
            if index == 0:
                hot = doc["hot_swap"] and sum(n["state"] == "shadow" for n in doc["nodes"]) == STANDBY
            job.track()
            time.sleep(fault.delay)  # fault placement inside the step, not a synchronisation
            replaced |= inject(fault, doc, lambda node: _kill_all(_descendants_named(job, "etcd")),
                               lambda name, rejoin: drains.append(start_drain(TMRUN + ["drain", name, "--job", ref.job],
                                                                         rejoin, workdir)))
            struck.append(struck_pids(fault, doc))
        code = job.wait(240)
        ended = time.monotonic()
    finally:
        reap_drains(drains)
    where = schedule.describe()
    if check_end(where, code == 0, job.err.text(), job.out.text(), struck, failed=f"tmrun exited {code}"):
        return Outcome(schedule, hot, replaced, 0.0, epilogue=True)
    check_drains(where, drains)
    check_work(where, out, reference, job.out.text(), replaced, hot and len(schedule.faults) == 1)
    last = job.out.last_time(rf'"step": {STEPS - 1}, "committed": true')
    end_s = ended - last
    assert end_s <= END_BOUND, f"{where}: the job ended {end_s:.1f} s after its last step"
    return Outcome(schedule, hot, replaced, end_s)


def check_end(where: str, succeeded: bool, err: str, out: str, struck: list[set[int]], failed: str,
              steps: int = STEPS) -> bool:
    """How the job ended: succeeded, and no move refused by a phase or role table. True when a
    fault struck a worker after its last step (in the script's epilogue): no swap can redo that part
    of the script, so the job must have said it failed (issue 9: an honest end); nothing else is
    checked then."""
    refused = [line for line in err.splitlines() if "is not allowed (" in line]
    assert not refused, f"{where}: a phase or role move was refused: {refused[:3]}"
    finished = {e["pid"] for e in _events(out)
                if e.get("role") == "active" and e.get("step") == steps - 1 and e.get("committed")}
    if any(pids & finished for pids in struck):
        assert not succeeded and "the job's last step" in err, \
            f"{where}: a worker struck after the last step, yet the job did not fail\n" + err[-4000:]
        return True
    assert succeeded, f"{where}: {failed}\n" + err[-4000:]
    return False


def check_drains(where: str, drains: list[subprocess.Popen], etcd_ends_with_the_job: bool = False) -> None:
    """Each ``tmrun drain`` succeeded, or met the job's end and said so in one line. Where the job's
    etcd ends with the job (under SLURM it runs on the job's nodes), a drain that met the end may
    find no etcd at all: exit 3, "etcd ... is unreachable", is its honest answer then."""
    ended = ["has ended", "already", "ended before the drain was answered"]
    if etcd_ends_with_the_job:
        ended.append("is unreachable")
    for proc in drains:
        err = proc.stderr.read() if proc.stderr else ""
        raced = any(text in err for text in ended) and len(err.strip().splitlines()) <= 3
        assert "Traceback" not in err and (proc.returncode == 0 or raced), \
            f"{where}: drain exited {proc.returncode}: {' '.join(err.split())}"


def check_work(where: str, out: Path, reference: Path, printed: str, replaced: set[int], promised: bool,
               steps: int = STEPS) -> None:
    """The weights of an uninterrupted run; each step committed once per rank; with ``promised``,
    the ranks no fault replaced kept one worker process throughout."""
    assert_same_weights(out, reference)
    events = [e for e in _events(printed) if e.get("role") == "active" and "step" in e]
    for rank in range(NODES):
        check_commits(where, rank, [(e["step"], e["pid"]) for e in events if e["rank"] == rank and e["committed"]],
                      rank in replaced, steps, caught_up(printed, rank))
    pids: dict[int, set[int]] = {}
    for event in events:
        pids.setdefault(event["rank"], set()).add(event["pid"])
    if promised:
        for rank in set(range(NODES)) - replaced:
            assert len(pids[rank]) == 1, f"{where}: rank {rank} (no fault touched it) was restarted: {pids[rank]}"


def caught_up(printed: str, rank: int) -> set[int]:
    """Steps ``rank`` took from the others at a switch instead of committing them itself: a survivor
    that missed the last commit before a generation broke (the vote reached some ranks and not
    others) receives the state of the ranks one step ahead (design.md, "State exchange"). Its
    ``done`` line shows it: a swap at step S with bytes received and none from a leaver."""
    return {swap["step"] - 1 for e in _events(printed) if e.get("done") and e.get("rank") == rank
            for swap in e.get("swaps", []) if swap.get("bytes_received") and not swap.get("from_leaver")}


def check_commits(where: str, rank: int, rows: list[tuple[int, int]], replaced: bool, steps: int = STEPS,
                  caught: set[int] = frozenset()) -> None:
    """Every step committed exactly once by ``rank``, as its workers printed them (``rows``: step, pid).

    A worker SIGKILLed (itself, or with its agent, whose pipe carries its output) may die between
    committing a step and printing it: for a replaced rank, one step right at a handover may be
    missing from the output, and only there (the weights, compared bit for bit, show it was done).
    A step in ``caught`` (see :func:`caught_up`) may be missing too.
    """
    rows = sorted(rows)
    done = [step for step, _ in rows]
    doubled = sorted({s for s in done if done.count(s) > 1})
    assert not doubled, f"{where}: rank {rank} committed steps {doubled[:5]} twice"
    missing = sorted(set(range(steps)) - set(done) - set(caught))
    if not missing:
        return
    handovers = {later for (_, a), (later, b) in zip(rows, rows[1:]) if a != b}  # first step of a new process
    unseen = [s for s in missing if not (replaced and s + 1 in handovers and len(missing) == 1)]
    assert not unseen, f"{where}: rank {rank} never committed steps {unseen[:5]}"


def struck_pids(fault: Fault, doc: dict) -> set[int]:
    """The worker pids a fault kills or stops (those of the node it hits)."""
    if fault.kind == "kill-leader-agent":
        node = next((n for n in doc["nodes"] if n["node"] == doc["leader"]), None)
    elif fault.kind in ("kill-worker", "kill-agent", "hang-worker"):
        node = next((n for n in doc["nodes"] if n["ranks"] == [fault.rank]), None)
    else:
        node = None
    return set(node["worker_pids"]) if node else set()


def inject(fault: Fault, doc: dict, kill_etcd: Callable[[str | None], None],
           drain: Callable[[str, bool], None]) -> set[int]:
    """Do one fault now (``doc``: the job's status); returns the ranks it replaces.

    ``kill_etcd(node)`` SIGKILLs the job's etcd (the member on ``node``, the struck rank's node, where
    there is one), ``drain(node, rejoin)`` starts ``tmrun drain``: they differ between the local
    cluster and separate hosts; the processes are found by pid from the status on both."""
    node = next((n for n in doc["nodes"] if n["ranks"] == [fault.rank]), None)
    if fault.kind == "etcd-kill":
        kill_etcd(node["node"] if node else None)
        return set()
    if fault.kind == "kill-leader-agent":
        leader = next((n for n in doc["nodes"] if n["node"] == doc["leader"]), None)
        if leader is None or leader["agent_pid"] is None or not _signal(leader["agent_pid"], signal.SIGKILL):
            return set()  # no leader, or the status still names one that an earlier fault killed
        return set(leader["ranks"])
    if node is None:  # that rank's node already left (a second fault after the first)
        return set()
    if fault.kind in ("kill-worker", "hang-worker"):
        for pid in node["worker_pids"]:
            _signal(pid, signal.SIGKILL if fault.kind == "kill-worker" else signal.SIGSTOP)
    elif fault.kind == "kill-agent":
        _signal(node["agent_pid"], signal.SIGKILL)
    else:
        drain(node["node"], fault.kind == "drain-rejoin")
    return set(node["ranks"]) if fault.kind in REPLACES else set()


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig``; False when the process is gone already (a second fault on what the first killed:
    the status read between them can still name it)."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def reap_drains(drains: list[subprocess.Popen], timeout: float = 120) -> None:
    """Wait for each ``tmrun drain`` a schedule started (killed past ``timeout``)."""
    for proc in drains:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_drain(argv: list[str], rejoin: bool, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv + (["--rejoin"] if rejoin else []), cwd=cwd, text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _descendants_named(job: Job, name: str) -> list[int]:
    found = []
    for pid in descendants(job.proc.pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    found.append(pid)
        except OSError:
            continue
    return found


def _events(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        if "{" in line:
            try:
                events.append(json.loads(line[line.index("{"):]))
            except ValueError:
                continue
    return events


def leftovers(job: Job) -> list[int]:
    """Processes of the job still alive once it has exited (for the benchmark, beside the fixture)."""
    from tests.harness import alive

    return sorted(pid for pid in job.seen_pids - {job.proc.pid} if alive(pid))

