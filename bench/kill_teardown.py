"""How long a SIGKILLed worker takes to be seen dead: the floor under "kill -9 → failure reported".

An agent reports a worker's failure when the worker's exit is seen (``waitpid``), and the kernel
reports a SIGKILLed process's exit only once it has torn the process down: unmapped its memory,
closed its files and sockets. This measures that time for a process that imported torch and holds
``--mib`` of tensors (a 1M-parameter GPT worker of ``bench/control_plane.py`` is about 300 MB),
beside 0 and 2 busy processes (each in its own session), nothing of tmrun involved:

    python bench/kill_teardown.py --repeats 5
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench import common  # noqa: E402

# The victim: torch imported, ``argv[1]`` MiB of tensors touched, then it says so and waits.
VICTIM = ("import sys, torch; x = torch.ones(int(sys.argv[1]) * 2**18); print('ready', flush=True); "
          "sys.stdin.read()")
COLUMNS = ["busy processes", "tensors (MiB)", "kill → exit seen (ms), each run", "median (ms)"]


def once(mib: int) -> float:
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert victim.stdout is not None
    victim.stdout.readline()
    start = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    return (time.monotonic() - start) * 1000


def main(argv: list[str] | None = None) -> int:
    p = common.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=common.count(1), default=5, help="kills per case (default 5)")
    p.add_argument("--mib", type=common.int_list, default=[0, 150],
                   help="MiB of tensors, comma-separated (default 0,150)")
    args = p.parse_args(argv)
    rows, runs = [], {}
    for load in (0, 2):
        with common.busy_processes(load):
            for mib in args.mib:
                found = [round(once(mib), 1) for _ in range(args.repeats)]
                runs[f"{load}|{mib}"] = found
                rows.append([load, mib, ", ".join(f"{x:g}" for x in found), round(statistics.median(found), 1)])
    return common.finish_table("kill_teardown", "kill -9 → the exit seen by the parent", COLUMNS, rows,
                               {"settings": vars(args), "runs": runs})


if __name__ == "__main__":
    sys.exit(main())
