"""How late an agent's event loop runs while torch is imported for its TCPStores, three ways.

An agent keeps its lease alive from its asyncio loop (a refresh every third of ``lease_ttl``), so
a loop that stalls for about ``lease_ttl`` loses the node (CI lost a node that had just joined, at
``lease_ttl=3``). Every agent prepares to host TCPStores at start-up, which means importing
``torch.distributed``. A probe process stands in for the agent: its loop ticks every 10 ms while
the import runs, and the worst lateness of a tick is the stall. Three ways, each in a fresh
process, interleaved, beside 0, 2 and 6 busy processes on this machine, each either in a session
of its own (as an agent's workers are) or in the probe's (as a local cluster's agents, its etcd
and the launcher share one; Linux's autogroups share the CPU fairly between sessions first, so
the two differ):

- ``thread, niced``: the import in a background thread of the agent at nice 10 (tmrun before
  agent/store_host.py);
- ``thread``: the same thread at normal priority;
- ``store host``: ``agent.store_host.StoreHost`` (tmrun now): the import in a child process,
  the probe waits for the host's first store.

    python bench/agent_loop_stall.py --repeats 3
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench import common  # noqa: E402

# The probe: argv[1] is the way; prints {"ready_s", "worst_late_ms"} once torch (or the host's
# first store) is ready.
PROBE = r"""
import asyncio, contextlib, json, os, sys, threading, time

def import_in_thread(nice):
    def run():
        if nice:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        import torch.distributed
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread

async def main(way):
    host = None
    if way == "store host":
        from agent.store_host import StoreHost
        host = StoreHost("127.0.0.1")
        await host.start()
        pending = asyncio.ensure_future(host.open())
        done = pending.done
    else:
        thread = import_in_thread(way == "thread, niced")
        done = lambda: not thread.is_alive()
    start = last = time.monotonic()
    worst = 0.0
    while not done():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        worst, last = max(worst, now - last - 0.01), now
    if host is not None:
        await host.stop()
    print(json.dumps({"ready_s": round(last - start, 3), "worst_late_ms": round(worst * 1000, 1),
                      "torch_in_agent": "torch" in sys.modules}))

asyncio.run(main(sys.argv[1]))
"""

WAYS = ["thread, niced", "thread", "store host"]
COLUMNS = ["busy processes", "their session", "way", "worst loop lateness (ms), each run", "median (ms)",
           "import ready (s), median", "torch in the agent"]


def probe(way: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, way], cwd=common.REPO, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = common.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=common.count(1), default=3, help="runs per way and load (default 3)")
    p.add_argument("--loads", type=common.int_list, default=[0, 2, 6],
                   help="busy processes beside the probe, comma-separated (default 0,2,6)")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {}
    for load, session in [(n, s) for n in args.loads for s in (("own", "the probe's") if n else ("-",))]:
        with common.busy_processes(load, own_session=session == "own"):
            for _ in range(args.repeats):  # interleaved: each way once, then again
                for way in WAYS:
                    runs.setdefault(f"{load}|{session}|{way}", []).append(probe(way))
    rows = []
    for key, found in runs.items():
        load, session, way = key.split("|")
        late = [r["worst_late_ms"] for r in found]
        rows.append([int(load), session, way, ", ".join(f"{x:g}" for x in late), statistics.median(late),
                     statistics.median(r["ready_s"] for r in found), "yes" if found[0]["torch_in_agent"] else "no"])
    return common.finish_table("agent_loop_stall", "agent event loop while torch is imported", COLUMNS, rows,
                               {"settings": vars(args), "runs": runs})


if __name__ == "__main__":
    sys.exit(main())
