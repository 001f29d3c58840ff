"""Files in shared directories: the runtime directory and the SLURM etcd data directory.

A directory another user could have made first (or a link planted in it) must never make tmrun
write, read or delete somewhere else: a planted link is ignored or replaced, never followed, and
a directory that is not the user's own, or is writable by others, is refused in one line (exit 2).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.shared_dirs import private_dir, read_private_file
from tmrun.cli import main
from tmrun.jobs import find_job, running_jobs, write_runtime_file

pytestmark = pytest.mark.timeout(30)


def _runtime_doc(job: str, pid: int) -> str:
    return json.dumps({"v": 1, "job": job, "endpoint": "127.0.0.1:1", "pid": pid, "started": 1.0})


def test_planted_links_in_the_runtime_directory_are_never_followed(tmp_path: Path) -> None:
    runtime = private_dir(tmp_path / "rt")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, runtime / "job.json")  # the file tmrun is about to write
    os.symlink(victim, runtime / "job.tmp")  # and the temporary name an older tmrun used
    written = write_runtime_file(runtime, "job", "127.0.0.1:1", os.getpid(), 1.0)
    assert victim.read_text() == "precious"  # nothing was written through a link
    assert not written.is_symlink() and stat.S_IMODE(written.stat().st_mode) == 0o600
    assert [ref.job for ref in running_jobs(runtime)] == ["job"]

    decoy = outside / "decoy.json"  # a live-looking job file of someone else's making, behind a link
    decoy.write_text(_runtime_doc("decoy", os.getpid()))
    os.symlink(decoy, runtime / "decoy.json")
    os.mkfifo(runtime / "fifo.json")  # would block a plain open()
    assert [ref.job for ref in running_jobs(runtime)] == ["job"]
    assert read_private_file(runtime / "decoy.json") is None
    assert find_job(runtime, None).job == "job"


def test_runtime_directory_is_created_private(tmp_path: Path) -> None:
    runtime = tmp_path / "deep" / "runtime"
    write_runtime_file(runtime, "job", "127.0.0.1:1", os.getpid(), 1.0)
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700


@pytest.mark.parametrize(("make", "why"), [
    (lambda p: os.symlink(p.parent / "elsewhere", p), "is a symbolic link"),
    (lambda p: (p.mkdir(), p.chmod(0o777)), "is writable by group or others (mode 0777)"),
    (lambda p: (p.mkdir(), p.chmod(0o770)), "is writable by group or others (mode 0770)"),
    (lambda p: p.write_text("x"), "is not a directory"),
])
def test_an_unsafe_runtime_directory_is_refused(tmp_path: Path, make, why: str) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    runtime = tmp_path / "rt"
    make(runtime)
    for attempt in (lambda: write_runtime_file(runtime, "job", "e", 1, 1.0), lambda: running_jobs(runtime)):
        with pytest.raises(ConfigError, match=re.escape(f"refusing to use directory {runtime}: it {why}")):
            attempt()
    assert not list((tmp_path / "elsewhere").iterdir())


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_runtime_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534, not to you"):
        running_jobs(runtime)


def test_status_refuses_an_unsafe_runtime_directory_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    runtime = tmp_path / "shared"
    runtime.mkdir()
    runtime.chmod(0o777)
    monkeypatch.setenv("TMRUN_RUNTIME_DIR", str(runtime))
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tmrun: error: refusing to use directory"), err
    assert "TMRUN_RUNTIME_DIR" in err


def test_a_process_refuses_a_linked_runtime_directory(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir(mode=0o700)
    os.symlink(tmp_path / "target", tmp_path / "rt")
    done = subprocess.run([sys.executable, "-c", "from tmrun.cli import main; main()", "status"], text=True,
                          capture_output=True, timeout=20,
                          env={**os.environ, "TMRUN_RUNTIME_DIR": str(tmp_path / "rt")})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [f"tmrun: error: refusing to use directory {tmp_path / 'rt'}: it is a "
                                        "symbolic link; remove it, or choose another directory with TMRUN_RUNTIME_DIR"]


def test_the_slurm_etcd_data_directory_is_checked_before_anything_is_deleted(tmp_path: Path) -> None:
    from agent.etcd_cluster import Layout
    from agent.etcd_member import MemberHost

    keep = tmp_path / "keep"
    (keep / "etcd-n1").mkdir(parents=True)
    (keep / "etcd-n1" / "data.txt").write_text("not tmrun's")
    os.symlink(keep, tmp_path / "tmrun-slurm-1")  # planted where the job's data would go
    host = MemberHost(Layout(("n1",), 20001, 30001, 1), "n1", "127.0.0.1", tmp_path / "tmrun-slurm-1")
    with pytest.raises(ConfigError, match="it is a symbolic link; remove it, or set TMPDIR"):
        host._server({}, "new")
    assert (keep / "etcd-n1" / "data.txt").read_text() == "not tmrun's"
