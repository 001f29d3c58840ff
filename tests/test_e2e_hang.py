"""End to end: a torchrun script whose rank 1 blocks forever in a collective is restarted.

Real etcd, agents and gloo workers; the script is ``tests/scripts/hang_job.py`` (plain torchrun,
no runtime). In step 5 rank 1 waits in a ``recv`` nobody answers, while rank 0 first works for
``BUSY`` seconds on its own (longer than ``progress_timeout``) and then waits for rank 1 in the
gradient all-reduce. Torch would let both sit there for its 30-minute gloo timeout. tmrun must:

- not kill anyone while rank 0 still makes progress (rank 1's node idle past the limit alone is
  not a hang);
- once every rank is stalled, kill the workers within the documented bound (the first rank
  stopped ``progress_timeout`` ago and every node stalled for half of it, sampled once a second),
  name rank 1 as the rank that stopped first, restart the job, and end with the weights of an
  uninterrupted run;

with the script's ``tmrun.heartbeat()`` calls, and without them (output and CPU time).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import FAST, assert_same_weights

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parent / "scripts" / "hang_job.py"
LIMIT = 8.0  # progress_timeout (must exceed twice collective_timeout)
BUSY = 12.0  # rank 0's own work while rank 1 already waits: longer than LIMIT


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "ref.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TMRUN_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), str(out)], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("heartbeat", [True, False], ids=["heartbeat", "output-and-cpu"])
def test_a_rank_blocked_forever_in_a_collective_is_restarted_within_the_bound(jobs, tmp_path, reference, heartbeat):
    job = jobs(["--nnodes", "2", "--max-restarts", "1", "--rdzv-conf",
                f"{FAST},collective_timeout=2,progress_timeout={LIMIT:g}", str(SCRIPT), str(tmp_path / "final.pt"),
                "--hang-at", "5", "--hang-once", str(tmp_path / "hung-once"), "--busy", str(BUSY),
                *(["--heartbeat"] if heartbeat else [])])
    job.out.wait_for(r"rank 1 hangs in step 5", 90)
    hung_at = time.monotonic()
    # rank 0 works on: rank 1's node is idle past the limit, but that is not a hang
    job.err.wait_for(r"node-\d: idle for \d+ s, but node-\d still make progress: not a hang", BUSY + 5)
    assert "hung: no progress" not in job.err.text()
    # every rank stalled: killed once rank 0 has been idle for half the limit (plus sampling)
    found = job.err.wait_for(r"hung: no progress on any rank for \d+ s \(progress_timeout 8 s\); "
                             r"rank (\d) stopped first, rank (\d) ([\d.]+) s later", BUSY + LIMIT / 2 + 6)
    waited = time.monotonic() - hung_at
    assert (found[1], found[2]) == ("1", "0") and float(found[3]) >= BUSY - 2, found[0]
    assert waited >= BUSY, waited  # not before rank 0 stopped
    assert job.wait(120) == 0, job.err.text()[-4000:]
    text = job.err.text()
    assert "started generation 2" in text and "hung: no progress" in text
    assert (tmp_path / "hung-once").exists()
    assert_same_weights(tmp_path / "final.pt", reference)
