"""agent/stall.py: which signs count as a torchrun worker's progress, and when a job is hung.

Pure bookkeeping with injected readers, plus the two readers on a real process and a real file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.stall import Progress, Stall, cpu_seconds, hung, mtime_ns
from tmrun import liveness as heartbeat_module

pytestmark = pytest.mark.timeout(30)


class Fake:
    """CPU seconds and heartbeat mtimes the test sets, read the way the real readers are."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self.beat: dict[Path, int] = {}

    def progress(self, *ranks: int, now: float = 0.0) -> Progress:
        for rank in ranks:
            self.cpu[100 + rank] = 0.0
        return Progress([(100 + r, r, Path(f"hb{r}")) for r in ranks], now, 1000.0 + now,
                        read_cpu=self.cpu.get, read_beat=self.beat.get)


def test_cpu_time_and_output_are_progress_until_the_first_heartbeat():
    fake = Fake()
    p = fake.progress(0)
    fake.cpu[100] = 0.5  # half a core over the second
    p.sample(1.0, 1001.0)
    assert p.stall(5.0).idle == 4.0
    fake.cpu[100] = 0.51  # 1% of a core: waiting, not working
    p.sample(6.0, 1006.0)
    assert p.stall(6.0).idle == 5.0 and p.stall(6.0).signal == "output or CPU"
    p.output(100, 7.0, 1007.0)
    assert p.stall(7.0).idle == 0.0
    fake.beat[Path("hb0")] = 1
    p.sample(8.0, 1008.0)
    assert p.stall(8.0).signal == "heartbeat"
    fake.cpu[100] = 50.0  # spinning in a collective after its last heartbeat
    p.output(100, 9.0, 1009.0)
    p.sample(10.0, 1010.0)
    assert p.stall(10.0).idle == 2.0  # neither counts any more


def test_the_node_is_stalled_only_when_every_worker_is_and_names_the_first_to_stop():
    fake = Fake()
    p = fake.progress(2, 3)
    fake.cpu[103] = 1.0
    p.sample(1.0, 1001.0)
    fake.cpu[103] = 2.0
    p.sample(3.0, 1003.0)
    state = p.stall(10.0)
    assert (state.rank, state.since_wall, state.idle, state.first_idle) == (2, 1000.0, 7.0, 10.0)


def test_a_job_is_hung_only_when_every_member_is_stalled_and_the_first_stop_is_old_enough():
    own = Stall(rank=1, since_wall=1000.0, idle=9.0, first_idle=9.0, signal="heartbeat")
    assert hung(own, 8.0, {"node-0": None}) is None  # rank 0 still makes progress
    assert hung(Stall(1, 1000.0, 5.0, 5.0, "heartbeat"), 8.0, {"node-0": (1004.0, 0)}) is None  # too young
    why = hung(own, 8.0, {"node-0": (1012.5, 0), "node-2": (1000.2, 2)})
    assert why == ("hung: no progress on any rank for 9 s (progress_timeout 8 s); rank 1 stopped first, "
                   "rank 2 0.2 s later, rank 0 12.5 s later")
    assert hung(own, 8.0, {}) == "hung: no progress on any rank for 9 s (progress_timeout 8 s); rank 1 stopped first"


def test_the_readers_see_a_real_process_and_a_real_file(tmp_path, monkeypatch):
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                             "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\ninput()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert spin.stdout.readline() == "done\n"
        assert cpu_seconds(spin.pid) >= 0.3
    finally:
        spin.kill()
        spin.wait()
    assert cpu_seconds(spin.pid) is None  # reaped: gone
    beat = tmp_path / "heartbeat"
    assert mtime_ns(beat) is None
    monkeypatch.setenv("TMRUN_HEARTBEAT_FILE", str(beat))
    monkeypatch.setattr(heartbeat_module, "_last", float("-inf"))
    heartbeat_module.heartbeat()
    first = mtime_ns(beat)
    assert first is not None
    os.utime(beat, ns=(0, 0))
    heartbeat_module.heartbeat()  # within EVERY seconds of the last: not touched again
    assert mtime_ns(beat) == 0
    monkeypatch.setattr(heartbeat_module, "_last", float("-inf"))
    heartbeat_module.heartbeat()
    assert mtime_ns(beat) > 0


def test_heartbeat_outside_tmrun_does_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("TMRUN_HEARTBEAT_FILE", raising=False)
    monkeypatch.setattr(heartbeat_module, "_last", float("-inf"))
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    heartbeat_module.heartbeat()
    assert list(here.iterdir()) == [] and heartbeat_module._last == float("-inf")
