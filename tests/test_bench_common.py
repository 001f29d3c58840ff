"""The numbers the benchmarks report, computed from step logs (pure logic of bench/common.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from bench import common

pytestmark = pytest.mark.timeout(10)


def log(points: list[tuple[float, int]]) -> list[dict]:
    return [{"t": t, "step": s} for t, s in points]


def test_a_hot_swap_loses_only_the_extra_time_of_the_step_it_stalled() -> None:
    steps = log([(i * 0.1, i) for i in range(1, 41)] + [(4.0 + 0.35, 41)] + [(4.35 + 0.1 * i, 41 + i) for i in range(1, 10)])
    got = common.interruption(steps, at=4.05)
    assert (got.last_before, got.resumed_from, got.recomputed) == (40, 40, 0)
    assert got.median_step == pytest.approx(0.1)
    assert got.downtime == pytest.approx(0.25)  # a 0.35 s step where 0.1 s was due
    assert got.continued_after == pytest.approx(0.3)


def test_a_restart_from_a_checkpoint_counts_the_recomputed_steps_as_lost_time() -> None:
    before = [(i * 0.1, i) for i in range(1, 36)]  # killed after step 35; the checkpoint holds step 30
    after = [(13.5 + 0.1 * i, 30 + i) for i in range(1, 15)]  # 10 s of restart, then steps 31..44 again
    got = common.interruption(log(before + after), at=3.55)
    assert (got.last_before, got.resumed_from, got.recomputed) == (35, 30, 5)
    # new work (step 36) came at 13.5 + 0.6 = 14.1; from step 35 at 3.5 that is 10.6 s for one step
    assert got.downtime == pytest.approx(10.5)
    assert got.new_work_after == pytest.approx(14.1 - 3.55)


def test_throughput_counts_distinct_steps() -> None:
    steps = log([(1.0, 1), (2.0, 2), (3.0, 2), (4.0, 3)])
    assert common.throughput(steps, 0.5, 4.5) == pytest.approx(3 / 4)


def test_mean_interval_is_the_mean_and_the_t_half_width() -> None:
    mean, half = common.mean_interval([1.0, 1.02, 0.98])  # stdev 0.02, t(2) = 4.30
    assert mean == pytest.approx(1.0) and half == pytest.approx(4.30 * 0.02 / 3 ** 0.5)
    assert common.mean_interval([0.97]) == (0.97, None)


def test_read_log_skips_torn_lines_and_separates_events(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"t": 2.0, "step": 2}) + "\n" + json.dumps({"t": 1.0, "step": 1}) + "\n"
                    + json.dumps({"t": 3.0, "event": "done", "rank": 0, "maxrss_kb": 2048}) + "\n" + '{"t": 4.0, "st')
    steps, other = common.read_log(path)
    assert [r["step"] for r in steps] == [1, 2]
    assert common.peak_rss_mib(other) == {0: 2.0}


def test_read_records_keeps_events_in_file_order_and_skips_a_line_being_written(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    assert common.read_records(path) == []
    lines = [{"t": 1.0, "event": "started"}, {"t": 2.0, "step": 1}, {"t": 1.5, "event": "loaded", "step": 0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"t": 3.0, "step": 2')
    assert common.read_records(path) == lines


def test_wait_record_returns_the_first_match_in_time_order_or_says_why_not(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"t": 2.0, "step": 2}) + "\n" + json.dumps({"t": 1.0, "step": 1}) + "\n")
    assert common.wait_record(path, lambda r: r["step"] >= 1, timeout=1)["t"] == 1.0
    assert common.wait_for_step(path, 2, timeout=1) == 2.0
    assert common.wait_for_step(path, 1, timeout=1, after=1.5) == 2.0
    with pytest.raises(RuntimeError):
        common.wait_record(path, lambda r: r["step"] >= 3, timeout=1, alive=lambda: False)
    with pytest.raises(TimeoutError):
        common.wait_record(tmp_path / "none.jsonl", lambda r: True, timeout=0.1)


def test_etcd_pid_finds_the_etcd_binary_below_the_launcher() -> None:
    import subprocess
    import time

    launcher = subprocess.Popen(["bash", "-c", "(exec -a /opt/bin/etcd sleep 30) & wait"])
    pid = None
    try:
        deadline = time.monotonic() + 5
        while (pid := common.etcd_pid(launcher.pid)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pid is not None and pid != launcher.pid
        assert common.etcd_pid(pid) is None  # nothing below the etcd itself
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        launcher.wait()


def test_md_table_formats_cells_like_the_printed_tables_and_escapes_pipes() -> None:
    assert common.md_table(["a", "b"], [["x|y", 0.12345], [None, 1234.5]]) == \
        "| a | b |\n|---|---|\n| x\\|y | 0.123 |\n| - | 1234 |"


def test_parser_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        common.Parser(prog="x").parse_args(["--nope"])
    assert exit_.value.code == 2 and capsys.readouterr().err == "x: error: unrecognized arguments: --nope\n"


def test_sizes_and_counts_parse_as_every_benchmark_takes_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert common.size_list("5m, 50M,1e6") == ["5M", "50M", "1E6"]
    assert [common.params_of(s) for s in ("5M", "500K", "1E6", "2B")] == [5_000_000, 500_000, 1_000_000, 2 * 10**9]
    parser = common.Parser(prog="b")
    parser.add_argument("--sizes", type=common.size_list)
    parser.add_argument("--drains", type=common.count(0))
    assert parser.parse_args(["--sizes", "5M", "--drains", "0"]).drains == 0
    for bad, said in ((["--drains", "-1"], "must be >= 0: '-1'"), (["--drains", "two"], "not an integer: 'two'"),
                      (["--sizes", "5 MB"], "not a model size: '5 MB'")):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
        assert said in capsys.readouterr().err
    parser.add_argument("--loads", type=common.int_list)
    assert parser.parse_args(["--loads", "0, 2,6"]).loads == [0, 2, 6]
    for bad in ("1,a", "-1", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["--loads", bad])
        assert "expected integers" in capsys.readouterr().err


def test_busy_processes_spin_in_their_own_sessions_during_the_block_only() -> None:
    from agent.procfs import descendants
    from tests.harness import alive

    before = descendants(os.getpid())  # a session's etcd may be running under this process
    with common.busy_processes(2):
        hogs = descendants(os.getpid()) - before
        assert len(hogs) == 2 and all(os.getsid(pid) == pid for pid in hogs)
    assert not any(alive(pid) for pid in hogs)


def test_a_markdown_section_has_the_command_the_tables_the_targets_and_the_images(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.write_markdown("x", "A heading", "What it measures.", [("", ["a"], [[1]]), ("Second:", ["b"], [[2]])],
                                 [{"target": "t <= 1", "measured": "2", "met": False, "reason": "why"}],
                                 [("plot", "x.png")], extra="More.")
    text = path.read_text()
    assert text.startswith("## A heading\n\nWhat it measures.\n\n```\n")
    order = [text.index(s) for s in ("| a |", "Second:", "| b |", "More.", "| t <= 1 | 2 | no: why |",
                                     "![plot](bench/x.png)")]
    assert order == sorted(order)


def test_a_periodic_snapshot_counts_in_full_in_the_mean_and_alone_in_its_cost() -> None:
    from bench.native import cycle_mean, snapshot_cost

    # 1.0 s steps; the step after each snapshot (taken after steps 10, 20, 30, 40) 0.6 s longer,
    # the one after it 0.1 s: 0.7 s per 10 steps, and 1 s more for each of the first two
    t, points = 0.0, []
    for step in range(1, 46):
        first = 1.0 if step in (11, 21) else 0.0  # the first two snapshots fault in their memory
        t += 1.0 + first + (0.6 if step % 10 == 1 and step > 10 else 0.1 if step % 10 == 2 and step > 10 else 0.0)
        points.append((t, step))
    steps = log(points)
    assert cycle_mean(steps, every=10, skip=3) == pytest.approx(1.07 + 2 / 30)  # steps 11-40: 3 whole cycles
    got = snapshot_cost(steps, every=10, skip=3)
    assert got["base_step_s"] == pytest.approx(1.0)
    assert got["excess_s"] == [1.7, 1.7, 0.7, 0.7]  # after steps 10, 20, 30 and 40
    assert got["cost"] == pytest.approx(0.12) and got["throughput"] == pytest.approx(1 / 1.12)
    assert got["steady_cost"] == pytest.approx(0.07)  # from the third snapshot on
    # the run without snapshots, measured at the same positions, costs nothing
    flat = snapshot_cost(log([(1.0 * s, s) for s in range(1, 46)]), every=10, skip=3)
    assert flat["excess_s"] == [0.0, 0.0, 0.0, 0.0] and flat["throughput"] == pytest.approx(1.0)
