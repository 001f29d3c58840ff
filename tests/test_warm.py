"""agent/warm.py: a warm interpreter runs a script or a module exactly as ``python -u`` would.

Real interpreters (each imports torch before its launch), real pipes and exit codes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from agent.warm import WarmPool, launch_line, script_args
from agent.workers import spawn

pytestmark = pytest.mark.timeout(90)

SHOW = """import json, os, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "x": os.environ.get("X"), "old": os.environ.get("OLD"),
                  "path0": sys.path[0], "cwd": os.getcwd(), "stdin": sys.stdin.read(), "torch": "torch" in sys.modules}))
sys.exit(3)
"""


def test_script_args_reads_what_follows_python_u():
    py = sys.executable
    assert script_args((py, "-u", "train.py", "--lr", "1")) == ["train.py", "--lr", "1"]
    assert script_args((py, "-u", "-m", "pkg.train", "x")) == ["-m", "pkg.train", "x"]
    assert script_args(("./train.sh", "x")) is None  # --no-python
    assert script_args(("/other/python", "-u", "train.py")) is None
    assert script_args((py, "-u", "-X", "dev", "train.py")) is None


async def _run_warm(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, dict, int, int]:
    pool = WarmPool(spawn)
    pool.fill({0: {**env, "OLD": "spawn-time"}}, delay=0.0)
    await pool._filling  # the interpreter is started (its import of torch may still be running)
    proc = pool.take(0)
    warm_pid = proc.pid
    proc.stdin.write(launch_line(argv, env, str(cwd)))
    await proc.stdin.drain()
    proc.stdin.close()
    out, err = await proc.communicate()
    await pool.close()
    return proc.returncode, json.loads(out.decode().splitlines()[-1]), warm_pid, proc.pid


def test_a_script_runs_as_main_with_its_argv_env_path_and_exit_code(tmp_path):
    script = tmp_path / "sub" / "show.py"
    script.parent.mkdir()
    script.write_text(SHOW)
    env = {"PATH": "/usr/bin:/bin", "X": "launch-time"}
    code, seen, warm_pid, pid = asyncio.run(_run_warm([str(script), "a", "b"], env, tmp_path))
    assert code == 3 and warm_pid == pid
    assert seen == {"name": "__main__", "argv": [str(script), "a", "b"], "x": "launch-time", "old": None,
                    "path0": str(script.parent), "cwd": str(tmp_path), "stdin": "", "torch": True}


def test_a_module_runs_as_main_with_python_m_semantics(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "show.py").write_text(SHOW)
    code, seen, _, _ = asyncio.run(_run_warm(["-m", "pkg.show", "z"], {"PATH": "/usr/bin:/bin", "X": "m"}, tmp_path))
    assert code == 3
    assert seen["name"] == "__main__" and seen["argv"] == [str(tmp_path / "pkg" / "show.py"), "z"]
    assert seen["path0"] == str(tmp_path) and seen["x"] == "m"


def test_a_closed_pool_leaves_no_interpreter(tmp_path):
    async def scenario() -> tuple[int, int | None]:
        pool = WarmPool(spawn)
        pool.fill({0: {"PATH": "/usr/bin:/bin"}}, delay=0.0)
        await pool._filling
        proc = pool._ready[0]
        await pool.close()
        return proc.pid, proc.returncode

    pid, code = asyncio.run(scenario())
    assert code is not None and not Path(f"/proc/{pid}").exists()
