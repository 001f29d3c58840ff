"""What every benchmark shares: the machine, a tmrun job, step logs, the numbers, tables and plots.

Every competitor's training script writes the same step log (one JSON line per committed step,
``{"v": 1, "t": unix_time, "step": committed_steps, ...}``, see ``examples/train_gpt.py
--step-log``), so one set of functions turns any of them into the numbers the benchmarks report:

- :func:`interruption`: around an event at wall time ``t``, the last step committed before it,
  the first step after it that is new work, the steps computed twice, and the *downtime*: wall
  time lost against the median step;
- :func:`throughput`: committed steps per second over a window;
- :func:`plot_step_times`: step time against wall-clock, one panel per competitor, events marked.

Results go to ``bench/results/<name>.json`` (with the machine and the command) and plots to
``docs/bench/<name>.png``; ``docs/benchmarks.md`` quotes them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NoReturn, Sequence

from agent import procfs

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "examples" / "train_gpt.py"
RESULTS = REPO / "bench" / "results"
PLOTS = REPO / "docs" / "bench"
SIZES = {"5M": 5_000_000, "50M": 50_000_000}

# Faster failure handling than the defaults, the same for every tmrun benchmark: a lease of 3 s
# (a lost agent is seen within 3 s), the ambiguous-exit window 4 s.
TMRUN_CONF = "lease_ttl=3,failure_window=4,last_call_timeout=0.5,join_timeout=120,close_timeout=3"


# ---------------------------------------------------------------------------- the machine

def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU, cores, memory, OS, Python, torch, the tmrun commit."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "tmrun_commit": commit}


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])


def save(name: str, doc: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    full = {"benchmark": name, "command": command_line(), "machine": machine(),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **doc}
    path.write_text(json.dumps(full, indent=1, default=float) + "\n")
    return path


# ---------------------------------------------------------------------------- step logs

def read_records(path: Path) -> list[dict]:
    """Every whole record of a step log, in file order (events such as ``started``, ``loaded`` and
    ``done`` included); a line being written, or one cut short by a kill, is skipped. No file: []."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # not a whole JSON line (a JSON object has no prefix that is one)
    return records


def read_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(committed-step records in time order, other records such as ``done``)."""
    steps, other = [], []
    for record in read_records(path):
        (steps if "step" in record and "event" not in record else other).append(record)
    steps.sort(key=lambda r: r["t"])
    return steps, other


def wait_record(path: Path, match: Callable[[dict], bool], timeout: float, alive: Callable[[], bool] = lambda: True,
                what: str = "the step", poll: float = 0.02) -> dict:
    """Poll a step log (every ``poll`` s, reading it only when it grew) for the first committed-step
    record, in time order, that ``match``es; that record.

    Fine enough that a kill lands early in the next step, and it spawns nothing: a benchmark must
    not take CPU from the job it measures. Benchmarks poll a file written by other processes
    (there is nothing to wait on); the tests, which must not sleep, use etcd watches instead.
    ``alive()`` false: RuntimeError; past ``timeout``: TimeoutError.
    """
    deadline, size = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        try:
            now = Path(path).stat().st_size
        except FileNotFoundError:
            now = 0
        if now != size:
            size = now
            hit = next((r for r in read_log(path)[0] if match(r)), None)
            if hit is not None:
                return hit
        if not alive():
            raise RuntimeError(f"the job ended before {what} ({path})")
        time.sleep(poll)
    raise TimeoutError(f"{what}: not within {timeout:g} s ({path})")


def wait_for_step(path: Path, step: int, timeout: float, alive: Iterable[subprocess.Popen] = (),
                  after: float = 0.0) -> float:
    """The wall time of the first committed step ``>= step`` (logged after time ``after``), once the
    step log shows it; while any of ``alive`` runs (none given: no check)."""
    procs = list(alive)
    hit = wait_record(path, lambda r: r["step"] >= step and r["t"] > after, timeout,
                      lambda: not procs or all(p.poll() is None for p in procs), f"step {step}")
    return hit["t"]


def step_times(steps: Sequence[dict]) -> list[tuple[float, float]]:
    """(wall time, seconds since the previous committed step) for each step after the first."""
    return [(b["t"], b["t"] - a["t"]) for a, b in zip(steps, steps[1:])]


def median_step(steps: Sequence[dict], before: float | None = None, skip: int = 5) -> float:
    """The median time between committed steps (before ``before``, skipping the warm-up)."""
    chosen = [r for r in steps if before is None or r["t"] < before]
    gaps = [dt for _, dt in step_times(chosen[skip:])] or [dt for _, dt in step_times(chosen)]
    return statistics.median(gaps)


@dataclasses.dataclass(frozen=True)
class Interruption:
    """What an event at wall time ``at`` cost a job, read from its step log."""

    at: float
    last_before: int  # the highest step committed before the event
    resumed_from: int  # the step count the job continued from (its next step is resumed_from + 1)
    continued_after: float  # seconds from the event to the first committed step after it
    new_work_after: float  # seconds from the event to the first step beyond last_before
    recomputed: int  # steps committed twice (work lost)
    median_step: float
    downtime: float  # wall time lost: the gap around the event, minus one median step, plus recomputation

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


def interruption(steps: Sequence[dict], at: float) -> Interruption:
    before = [r for r in steps if r["t"] <= at]
    after = [r for r in steps if r["t"] > at]
    if not before or not after:
        raise ValueError("the step log has no steps on both sides of the event")
    last = max(r["step"] for r in before)
    first_after = after[0]
    beyond = next(r for r in after if r["step"] > last) if any(r["step"] > last for r in after) else after[-1]
    median = median_step(steps, before=at)
    t_last = max(r["t"] for r in before if r["step"] == last)
    resumed = first_after["step"] - 1
    # Time lost: from the last committed step before the event until new work was committed,
    # less the one step that would have taken that long anyway.
    downtime = (beyond["t"] - t_last) - median * (beyond["step"] - last)
    return Interruption(at, last, resumed, first_after["t"] - at, beyond["t"] - at, max(0, last - resumed),
                        median, max(0.0, downtime))


T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}  # t, 2-sided


def mean_interval(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean of ``values`` and the half-width of its 95% confidence interval (Student's t with
    n - 1 degrees of freedom; None for a single value)."""
    n = len(values)
    half = T95.get(n - 1, 1.96) * statistics.stdev(values) / n ** 0.5 if n > 1 else None
    return statistics.mean(values), half


def throughput(steps: Sequence[dict], start: float, end: float) -> float:
    """Distinct committed steps per second between ``start`` and ``end`` (recomputed steps count once)."""
    inside = {r["step"] for r in steps if start <= r["t"] <= end}
    return len(inside) / (end - start)


# ---------------------------------------------------------------------------- a tmrun job

class TmrunJob:
    """A local tmrun cluster running ``examples/train_gpt.py`` (or ``script``) with a step log."""

    def __init__(self, workdir: Path, script_args: Sequence[str], *, nnodes: int = 2, standby: int = 1,
                 conf: str = TMRUN_CONF, script: Path = GPT, name: str = "bench",
                 flags: Sequence[str] = ()) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.step_log = self.workdir / "steps.jsonl"
        self.step_log.unlink(missing_ok=True)
        self.job = f"{name}-{os.getpid()}-{int(time.time())}"
        self.env = {**os.environ, "TMRUN_RUNTIME_DIR": str(self.workdir / "runtime"), "PYTHONUNBUFFERED": "1"}
        self.env.pop("TMRUN_JOB", None)
        argv = [sys.executable, "-m", "tmrun.cli", "--nnodes", str(nnodes), "--standby", str(standby),
                "--rdzv-id", self.job, "--rdzv-conf", conf, *flags, str(script), *script_args,
                "--step-log", str(self.step_log)]
        self.out = open(self.workdir / "tmrun.out", "w")
        self.err = open(self.workdir / "tmrun.err", "w")
        self.started = time.time()
        self.proc = subprocess.Popen(argv, env=self.env, stdout=self.out, stderr=self.err, cwd=REPO,
                                     start_new_session=True)

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tmrun.cli", *args, "--job", self.job], env=self.env,
                              capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def status(self) -> dict:
        done = self.cli("status", "--json", timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"tmrun status failed: {done.stderr.strip()}")
        return json.loads(done.stdout)

    def wait_until(self, predicate, timeout: float, what: str, interval: float = 0.2) -> dict:
        """Poll ``tmrun status`` every ``interval`` seconds (each poll is a Python process) until
        ``predicate`` holds; the status then."""
        deadline = time.monotonic() + timeout
        last: dict | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the tmrun job ended (exit {self.proc.returncode}) while waiting for {what}")
            try:
                last = self.status()
            except RuntimeError:
                last = None
            if last is not None and predicate(last):
                return last
            time.sleep(interval)
        raise TimeoutError(f"{what}: not within {timeout:g} s; last status {last}")

    def wait_hot(self, standbys: int = 1, timeout: float = 300.0, interval: float = 0.2) -> dict:
        """Until the plan is hot and ``standbys`` standbys shadow-train (warm)."""
        return self.wait_until(lambda d: d["hot_swap"] and sum(n["state"] == "shadow" for n in d["nodes"])
                               >= standbys, timeout, "standbys warm", interval)

    def node_of_rank(self, rank: int) -> dict:
        return next(n for n in self.status()["nodes"] if n["role"] == "active" and rank in n["ranks"])

    def drain(self, node: str, *, rejoin: bool = False, wait: bool = True) -> tuple[float, float, str]:
        """(wall time the command started, wall time it returned, its stderr)."""
        args = ["drain", node] + (["--rejoin"] if rejoin else []) + ([] if wait else ["--no-wait"])
        t0 = time.time()
        done = self.cli(*args, timeout=600)
        t1 = time.time()
        if done.returncode != 0:
            raise RuntimeError(f"tmrun drain {node} failed ({done.returncode}): {done.stderr.strip()}")
        return t0, t1, done.stderr

    def kill_worker(self, rank: int) -> float:
        """SIGKILL the worker of ``rank``; the wall time of the kill."""
        pid = self.node_of_rank(rank)["worker_pids"][0]
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        return at

    def events(self) -> list[dict]:
        done = self.cli("events", "--json", timeout=30)
        return json.loads(done.stdout) if done.returncode == 0 else []

    def swap_events(self, count: int = 1, timeout: float = 120.0) -> list[dict]:
        """The ``swap`` events' data, once there are ``count`` of them."""
        deadline = time.monotonic() + timeout
        while True:
            swaps = [e["data"] for e in self.events() if e["kind"] == "swap"]
            if len(swaps) >= count or time.monotonic() > deadline or self.proc.poll() is not None:
                return swaps
            time.sleep(0.2)

    def wait(self, timeout: float = 1800.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.out.close()
            self.err.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def etcd_pid(launcher: int) -> int | None:
    """The embedded etcd of a tmrun launcher: the process below ``launcher`` running the ``etcd``
    binary (its child where there is one), or None."""
    procs = procfs.table()
    found = [pid for pid in sorted(procfs.descendants(launcher, procs))
             if os.path.basename((procfs.cmdline(pid) or [b""])[0]) == b"etcd"]
    direct = [pid for pid in found if procs[pid][0] == launcher]
    return (direct or found or [None])[0]


def workdir(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"tmrun-bench-{name}-"))


def peak_rss_mib(records: Iterable[dict]) -> dict[int, float]:
    """Per rank, the peak RSS (MiB) the ranks reported at the end (``done`` records)."""
    return {r["rank"]: round(r["maxrss_kb"] / 1024, 1) for r in records if r.get("event") == "done" and "maxrss_kb" in r}


# ---------------------------------------------------------------------------- output

class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}: {text!r}")
        return value
    return parse


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 0."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas: {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0 separated by commas: {text!r}")
    return values


@contextlib.contextmanager
def busy_processes(n: int, own_session: bool = True) -> Iterator[None]:
    """``n`` Python processes spinning on the CPU while the block runs (each in a session of its
    own, as an agent's workers are, or in this process's)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=own_session)
            for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def size_label(text: str) -> str:
    """An argparse type: ``5M``, ``50m``, ``500k``, ``1e6`` -> a label train_gpt.py's --params accepts."""
    if not re.fullmatch(r"[0-9]*\.?[0-9]+(e[0-9]+)?[kKmMgGbB]?", text.strip()):
        raise argparse.ArgumentTypeError(f"not a model size: {text!r} (try 5M, 50M, 1M)")
    return text.strip().upper()


def size_list(text: str) -> list[str]:
    """An argparse type: comma-separated model sizes."""
    return [size_label(s) for s in text.split(",") if s.strip()]


def params_of(label: str) -> int:
    """The parameter count a size label stands for."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:E[0-9]+)?)([KMGB]?)", label)
    return round(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}[m.group(2)])


def md_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table, the cells as :func:`print_table` shows them (``|`` escaped)."""
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] +
                     ["| " + " | ".join(_fmt(v).replace("|", "\\|") for v in row) + " |" for row in rows])


def write_markdown(name: str, heading: str, intro: str, tables: list[tuple[str, list, list]], targets: list[dict],
                   images: list[tuple[str, str]], extra: str = "") -> Path:
    """``bench/results/<name>.md``: a section for docs/benchmarks.md: the heading, the intro, the
    command, each (caption, columns, rows) table, ``extra`` text, the targets, the images (paths
    relative to docs/)."""
    lines = [f"## {heading}", "", intro, "", "```", command_line(), "```", ""]
    for caption, columns, rows in tables:
        lines += ([caption, ""] if caption else []) + [md_table(columns, rows), ""]
    lines += [extra, ""] if extra else []
    lines += ["| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'}"
              f"{': ' + t['reason'] if t.get('reason') and not t['met'] else ''} |" for t in targets]
    lines += [""] + [f"![{alt}](bench/{png})" for alt, png in images] + [""]
    path = RESULTS / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def finish_table(name: str, title: str, columns: Sequence[str], rows: list[Sequence[Any]], doc: dict[str, Any]) -> int:
    """The end of a one-table benchmark: the table on the terminal, ``bench/results/<name>.json``
    (``doc`` with the rows and columns), and the table again as Markdown for docs/benchmarks.md."""
    print_table(title, columns, rows)
    save(name, {**doc, "rows": rows, "columns": list(columns)})
    print(md_table(columns, rows))
    return 0


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    Console(width=160).print(table)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def plot_step_times(name: str, panels: dict[str, tuple[Sequence[dict], Sequence[tuple[float, str]]]],
                    title: str) -> Path:
    """One panel per competitor: step time (s) against seconds since its start, events as lines.

    ``panels`` maps a competitor to (its step records, [(wall time, label), ...]).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOTS.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels)), squeeze=False)
    for ax, (label, (steps, marks)) in zip(axes[:, 0], panels.items()):
        if not steps:
            ax.set_title(f"{label}: no steps")
            continue
        t0 = steps[0]["t"]
        points = step_times(steps)
        ax.plot([t - t0 for t, _ in points], [dt for _, dt in points], ".", markersize=3)
        for at, text in marks:
            ax.axvline(at - t0, color="red", linestyle="--", linewidth=1)
            ax.annotate(text, (at - t0, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize=8, color="red")
        ax.set_yscale("log")
        ax.set_ylabel("step time (s)")
        ax.set_title(label, fontsize=10)
    axes[-1, 0].set_xlabel("wall-clock since the job's first step (s)")
    fig.suptitle(title)
    fig.tight_layout()
    path = PLOTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- loopback bandwidth

def _send(port: int, nbytes: int, chunk: int) -> None:
    data = memoryview(bytearray(chunk))
    with socket.create_connection(("127.0.0.1", port)) as s:
        sent = 0
        while sent < nbytes:
            s.sendall(data[:min(chunk, nbytes - sent)])
            sent += chunk
        s.recv(1)  # the receiver's ack: everything arrived


def loopback_bandwidth(nbytes: int, repeats: int = 3, chunk: int = 4 << 20) -> float:
    """Bytes per second of a plain TCP copy over 127.0.0.1 between two processes (median of runs)."""
    rates = []
    for _ in range(repeats):
        with socket.create_server(("127.0.0.1", 0)) as srv:
            proc = multiprocessing.get_context("fork").Process(
                target=_send, args=(srv.getsockname()[1], nbytes, chunk))
            proc.start()
            conn, _ = srv.accept()
            with conn:
                view, got = memoryview(bytearray(chunk)), 0
                t0 = time.perf_counter()
                while got < nbytes:
                    n = conn.recv_into(view)
                    if not n:
                        raise RuntimeError("the sender closed early")
                    got += n
                rates.append(nbytes / (time.perf_counter() - t0))
                conn.sendall(b"k")
            proc.join(30)
    return statistics.median(rates)
