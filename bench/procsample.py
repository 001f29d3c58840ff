"""What the processes of a benchmark run use, read from ``/proc``: CPU time by process, by kind of
process (worker, agent, etcd) and by thread, and where a worker's memory is.

:class:`ProcSampler` samples the benchmark and its descendants (and, as pid 0, every other process
on the machine, so that a machine that is not idle shows); :class:`CpuTrace` keeps its samples
over time during an event; the functions turn two samples into cores, or CPU ms per step.
Shared by ``steady_state.py``, ``transfer_limit.py`` and ``etcd_failure.py``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from agent import procfs

CLK_TCK = procfs.CLOCK_TICKS


def _proc_info(pid: int, worker: bool) -> dict | None:
    """CPU ticks (user + system); for a worker also VmHWM and VmRSS (kB) and its TMRUN_ROLE."""
    fields = procfs.stat_fields(pid)
    if fields is None:
        return None
    info = {"cpu": int(fields[11]) + int(fields[12])}
    if not worker:
        return info
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except (OSError, ValueError, IndexError):
        return None
    if "VmHWM" not in status:
        return None  # a zombie
    return {**info, "hwm_kb": int(status["VmHWM"].split()[0]), "rss_kb": int(status["VmRSS"].split()[0]),
            "role": env.get(b"TMRUN_ROLE", b"active").decode()}


def thread_cpu(pid: int) -> dict[str, int]:
    """CPU ticks of a process's threads, by what they are: ``main`` (the thread that runs the script's
    loop: tid == pid), ``gloo_tcp_loop``/``pt_gloo_runloop`` (gloo's I/O and work threads: the
    all-reduces), ``python threads`` (other threads Python started: no OS name of their own, e.g.
    tmrun's agent-channel reader and its ``alive`` heartbeat), and any other thread name as it is."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
        fields = raw.rsplit(b")", 1)[1].split()
        name = "main" if int(tid) == pid else "python threads" if comm.startswith("python") else comm
        out[name] = out.get(name, 0) + int(fields[11]) + int(fields[12])
    out["threads"] = len(tids)  # (a count, not ticks)
    return out


def memory_parts(pid: int) -> dict[str, int] | None:
    """Where a process's resident memory is (kB, from ``/proc/PID/smaps``): ``heap`` (glibc's main
    arena, the brk heap: the main thread's malloc, tensors under the mmap threshold included),
    ``anon`` (other anonymous mappings: tensors mmap'd on their own, other threads' malloc arenas,
    thread stacks, Python's obmalloc arenas), ``file`` (mapped files: libraries), ``rss`` (the sum)."""
    parts = {"heap": 0, "anon": 0, "file": 0}
    kind = "anon"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 6)
                if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                    name = head[5].strip() if len(head) > 5 else ""
                    kind = "heap" if name == "[heap]" else "file" if name.startswith("/") else "anon"
                elif head and head[0] == "Rss:":
                    parts[kind] += int(head[1])
    except (OSError, ValueError, IndexError):
        return None
    parts["rss"] = sum(parts.values())
    return parts


def worker_detail(pids: list[int]) -> dict[int, dict]:
    """Per worker: its threads' CPU ticks and, from smaps, where its memory is."""
    return {pid: {"threads": thread_cpu(pid), "memory": memory_parts(pid)} for pid in pids}


def detail_use(before: dict[int, dict], after: dict[int, dict], steps: int) -> dict:
    """Mean over the workers: CPU ms per step by thread class between two details; memory (MiB) at
    the end and its growth since the start."""
    cpu: dict[str, list[float]] = {}
    mem: dict[str, list[float]] = {}
    threads = []
    for pid, b in after.items():
        a = before.get(pid)
        if a is None:
            continue
        threads.append(b["threads"].get("threads", 0))
        for name, ticks in b["threads"].items():
            if name != "threads":
                cpu.setdefault(name, []).append((ticks - a["threads"].get(name, 0)) / CLK_TCK / steps * 1e3)
        if a["memory"] and b["memory"]:
            for k, v in b["memory"].items():
                mem.setdefault(k, []).append(v / 1024)
                mem.setdefault(f"{k} growth", []).append((v - a["memory"][k]) / 1024)
    return {"cpu_ms_per_step": {k: round(statistics.mean(v), 2) for k, v in sorted(cpu.items())},
            "memory_mib": {k: round(statistics.mean(v), 1) for k, v in sorted(mem.items())},
            "threads": round(statistics.mean(threads), 1) if threads else None}


def _kind(argv: list[bytes], script: bytes) -> str:
    head = argv[1:3]  # python -u SCRIPT (a worker); python -m agent (.store_host) or torch.distributed.run (an agent)
    if script in head:
        return "worker"
    if b"agent" in head or b"agent.store_host" in head or b"torch.distributed.run" in head:
        return "agent"
    if argv and os.path.basename(argv[0]) == b"etcd":
        return "etcd"
    return "other"


class ProcSampler(threading.Thread):
    """Samples this process and its descendants every ``interval`` s: what kind each process is
    (worker running ``script``, agent, etcd, other), its CPU time, and for workers the memory;
    and, as pid 0, the CPU time all other processes on the machine used between samples (so that
    a machine that is not idle shows; run the thread so that nothing long-lived slips through).

    Keeps, per pid, the latest sample and when its CPU time last moved (a warm standby stops).
    """

    def __init__(self, script: Path, interval: float = 0.5) -> None:
        super().__init__(daemon=True, name="proc-sampler")
        self.roots, self.script, self.interval = [os.getpid()], str(script).encode(), interval
        self.latest: dict[int, dict] = {}
        self.cpu_moved: dict[int, float] = {}
        self._foreign: dict[int, int] = {}  # CPU ticks of the processes not ours, at the last sample
        self._foreign_total = 0
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._halt.set()

    def sample(self) -> dict[int, dict]:
        """Sample now; the processes alive now (pid -> {kind, cpu, t, and for workers role, hwm_kb, rss_kb})."""
        now = time.time()
        with self._lock:
            table = procfs.table()
            ours = self.roots + sorted(procfs.descendants(self.roots, table))
            mine = set(ours)
            foreign = {pid: ticks for pid, (_, ticks, *_) in table.items() if pid not in mine}
            self._foreign_total += sum(max(0, t - self._foreign[p]) for p, t in foreign.items() if p in self._foreign)
            self._foreign = foreign
            for pid in ours:
                try:  # read every time: an exec wrapper becomes an agent or a worker under the same pid
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        kind = _kind(f.read().split(b"\0"), self.script)
                except OSError:
                    continue
                info = _proc_info(pid, kind == "worker")
                if info is None:
                    continue
                old = self.latest.get(pid)
                if old is None or old["cpu"] != info["cpu"]:
                    self.cpu_moved[pid] = now
                self.latest[pid] = {**info, "kind": kind, "t": now, "pid": pid}
            self.latest[0] = {"kind": "foreign", "cpu": self._foreign_total, "t": now}
            return {pid: dict(v) for pid, v in self.latest.items() if v["t"] == now}

    def workers(self, snapshot: dict[int, dict], role: str) -> list[dict]:
        return [v for v in snapshot.values() if v["kind"] == "worker" and v.get("role") == role]

    def wait_quiet(self, pids: list[int], quiet: float, timeout: float, alive) -> float:
        """Until the processes ``pids`` used no CPU for ``quiet`` s; when they last did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if alive.poll() is not None:
                raise RuntimeError(f"the job ended (exit {alive.returncode}) while waiting for a quiet standby")
            now = self.sample()
            live = [p for p in pids if p in now]
            if live and all(time.time() - self.cpu_moved[p] >= quiet for p in live):
                return max(self.cpu_moved[p] for p in live)
            time.sleep(0.25)
        raise TimeoutError(f"the standby workers {pids} did not go idle within {timeout:g} s")


    def wait_warm_standby(self, job, timeout: float) -> dict[int, dict]:
        """Until ``job`` (a :class:`bench.common.TmrunJob`) is hot and its standby's workers are idle
        (their shadow iterations over: warm and waiting); a sample taken then."""
        job.wait_hot(timeout=timeout)
        self.wait_quiet([v["pid"] for v in self.workers(self.sample(), "standby")], 1.0, timeout, job.proc)
        return self.sample()


class CpuTrace(threading.Thread):
    """``sampler.sample()`` every ``interval`` s while a drain happens: CPU time per process over time."""

    def __init__(self, sampler: ProcSampler, interval: float = 0.05) -> None:
        super().__init__(daemon=True, name="cpu-trace")
        self.sampler, self.interval = sampler, interval
        self.samples: list[tuple[float, dict[int, dict]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.time(), self.sampler.sample()))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def cores(self, start: float, end: float, classes: dict[int, str]) -> dict[str, float] | None:
        """Cores used from ``start`` to ``end`` (widened to the samples around them), per class of
        process: ``classes`` maps pids to a class; other processes go by their kind (agent, etcd, other)."""
        before = [x for x in self.samples if x[0] <= start]
        after = [x for x in self.samples if x[0] >= end]
        if not before or not after:
            return None
        (t0, a), (t1, b) = before[-1], after[0]
        used: dict[str, float] = {}
        names = {"agent": "agents", "etcd": "etcd", "other": "tmrun CLIs", "worker": "other workers"}
        for pid, v in b.items():
            if pid == 0:
                continue
            name = classes.get(pid) or ("this benchmark" if pid == os.getpid() else names[v["kind"]])
            used[name] = used.get(name, 0.0) + (v["cpu"] - a.get(pid, {"cpu": 0})["cpu"]) / CLK_TCK / (t1 - t0)
        return {k: round(x, 2) for k, x in sorted(used.items())} | {"seconds": round(t1 - t0, 3)}


def cpu_use(before: dict[int, dict], after: dict[int, dict]) -> dict[str, float]:
    """Cores used between two samples, per kind of our processes (workers split by role; processes
    that ended in between are missing); ``outside``: by processes this benchmark did not start."""
    seconds = after[0]["t"] - before[0]["t"]
    used: dict[str, float] = {}
    for pid, v in after.items():
        if pid == 0:
            continue
        kind = f"worker-{v['role']}" if v["kind"] == "worker" else v["kind"]
        ticks = v["cpu"] - before.get(pid, {"cpu": 0})["cpu"]
        used[kind] = used.get(kind, 0.0) + ticks / CLK_TCK / seconds
    used["outside"] = (after[0]["cpu"] - before[0]["cpu"]) / CLK_TCK / seconds
    return {k: round(x, 3) for k, x in sorted(used.items())}


def cpu_at(samples: list[tuple[float, dict[int, dict]]], pids: list[int], t: float) -> float | None:
    """The summed CPU seconds of ``pids`` at time ``t``, interpolated between the samples around it."""
    before = [x for x in samples if x[0] <= t]
    after = [x for x in samples if x[0] >= t]
    if not before or not after:
        return None
    (t0, a), (t1, b) = before[-1], after[0]
    if not all(p in a and p in b for p in pids):
        return None
    c0, c1 = (sum(x[p]["cpu"] for p in pids) / CLK_TCK for x in (a, b))
    return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def cpu_per_step(commits: list[tuple[int, float]], samples, pids: list[int], start: float, end: float,
                  inside: bool = False) -> float | None:
    """Mean CPU ms per step and per process of ``pids`` over whole committed steps: those that
    overlapped ``start``..``end`` (or, ``inside``, that ran entirely within it)."""
    times = [t for _, t in commits]
    if inside:
        span = [i for i in range(1, len(times)) if times[i - 1] >= start and times[i] <= end]
    else:
        span = [i for i in range(1, len(times)) if times[i - 1] < end and times[i] > start]
    if not span or not pids:
        return None
    t0, t1 = times[span[0] - 1], times[span[-1]]
    c0, c1 = cpu_at(samples, pids, t0), cpu_at(samples, pids, t1)
    if c0 is None or c1 is None:
        return None
    return round((c1 - c0) / len(span) / len(pids) * 1e3, 1)
