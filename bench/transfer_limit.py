"""The limit: how much state a swap moves, how fast, and how much of the stall that explains.

For each ``--sizes`` model (default 5M and 50M) a tmrun job (2 nodes + 1 standby) trains while
``--drains`` times a non-leader active node is drained with ``--rejoin``; in a planned swap the
leaver streams its tracked state (model and AdamW state) straight into the joiner's tensors.
From each ``swap`` event:

- ``bytes_moved`` (state bytes received by all members) and ``bytes_from_leaver``;
- the transfer bandwidth achieved: ``bytes_from_leaver / handover_s`` (``handover_s``: from the
  leaver's header to the last byte at the joiner);
- the stall: ``stall_s``, the longest time a member that held the state (a survivor) did not
  train because of the swap, the training the job lost; and ``joiner_stall_s``, the joiner's own
  wait from its promotion to its first step (not lost training).

The references, measured in the same run before the jobs start (machine otherwise idle):

- loopback: ``--loopback-mb`` MB copied over a 127.0.0.1 TCP socket from one process into a
  preallocated buffer of another (``sendall`` / ``recv_into``), best of 3;
- gloo: the same tensors as the job's state (GPT + AdamW state of the same size, built the same
  way) sent with ``ProcessGroupGloo.send``/``recv`` between two processes, one message per tensor,
  all in flight at once, as the handover does; best of 3 (``--no-gloo`` skips it).

"Transfer alone" is ``bytes_from_leaver / loopback bandwidth``: the stall a swap could not go
below on this machine; the measured stall is compared with it.

Output: a table, ``bench/results/transfer_limit.json`` and ``bench/results/transfer_limit.md``;
no plot (a handful of numbers). ``--quick``: 1M only, 1 drain, 128 MB loopback.
"""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python bench/X.py`: the repo root, not bench/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from agent.etcd_server import free_port  # noqa: E402
from bench import common  # noqa: E402
# Shared helpers of the benchmarks (candidates for common.py).
from bench.control_plane import next_swap, pick_node, wait_standbys_quiet  # noqa: E402
from bench.procsample import ProcSampler, cpu_use  # noqa: E402

NAME = "transfer_limit"

SENDER = r"""
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
buf = bytearray(n)
buf[::4096] = bytes(len(range(0, n, 4096)))  # touch every page: no page faults while sending
with socket.create_connection(("127.0.0.1", port)) as s:
    s.sendall(memoryview(buf))
"""

GLOO = r"""
import datetime, json, sys, time
sys.path[:0] = [sys.argv[5], sys.argv[6]]
import torch
import torch.distributed as dist
from gpt_model import GPT, config_for_params
from tmrun.swap import flatten

rank, port, params, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(config_for_params(params))
opt = torch.optim.AdamW(model.optim_groups(0.1), lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
for p in model.parameters():
    p.grad = torch.zeros_like(p)
opt.step()  # the optimizer state exists, as in a running job
tensors, _ = flatten({"model": model.state_dict(), "optimizer": opt.state_dict()})
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=300))
seconds = []
for _ in range(repeats):
    pg.barrier().wait()
    t = time.perf_counter()
    if rank == 0:
        works = [pg.send([x], 1, i) for i, (_, x) in enumerate(tensors)]
    else:
        works = [pg.recv([x], 0, i) for i, (_, x) in enumerate(tensors)]
    for w in works:
        w.wait()
    seconds.append(time.perf_counter() - t)
pg.barrier().wait()
if rank == 1:
    print(json.dumps({"bytes": sum(x.numel() * x.element_size() for _, x in tensors), "tensors": len(tensors),
                      "seconds": seconds}))
"""


def loopback(nbytes: int, repeats: int = 3) -> dict:
    """Bytes per second of a plain TCP copy over 127.0.0.1 between two processes (receiver's clock)."""
    buf = bytearray(nbytes)
    buf[::4096] = bytes(len(range(0, nbytes, 4096)))
    view = memoryview(buf)
    seconds = []
    for _ in range(repeats):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            sender = subprocess.Popen([sys.executable, "-c", SENDER, str(server.getsockname()[1]), str(nbytes)])
            try:
                conn, _ = server.accept()
                with conn:
                    got = conn.recv_into(view, nbytes)
                    t0 = time.perf_counter()  # from the first byte: the sender's start-up is not the copy
                    first = got
                    while got < nbytes:
                        n = conn.recv_into(view[got:], nbytes - got)
                        if n == 0:
                            raise RuntimeError("the sender closed early")
                        got += n
                    seconds.append((time.perf_counter() - t0) * nbytes / (nbytes - first))
            finally:
                sender.wait(60)
    best = min(seconds)
    return {"bytes": nbytes, "seconds": [round(s, 4) for s in seconds], "bytes_per_s": nbytes / best}


def gloo_reference(params: int, repeats: int = 3) -> dict:
    """The job's state tensors, sent by gloo point-to-point between two fresh processes."""
    port = free_port()
    argv = [str(port), str(params), str(repeats), str(common.REPO / "examples"), str(common.REPO)]
    procs = [subprocess.Popen([sys.executable, "-c", GLOO, str(rank), *argv], stdout=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the gloo reference failed (exit codes {[p.returncode for p in procs]})")
    result = json.loads(outs[1].strip().splitlines()[-1])
    result["bytes_per_s"] = result["bytes"] / min(result["seconds"])
    result["seconds"] = [round(s, 4) for s in result["seconds"]]
    return result


def drains_of(size: str, args) -> list[dict]:
    wd = common.workdir(f"{NAME}-{size}")
    print(f"[{NAME}] {size}: job with 2 nodes + 1 standby in {wd}", flush=True)
    job = common.TmrunJob(wd, ["--params", size, "--steps", "100000000", "--threads", str(args.threads)],
                          nnodes=2, standby=1, name="transfer")
    found = []
    try:
        common.wait_for_step(job.step_log, 3, args.timeout, [job.proc])
        job.wait_hot(1, args.timeout)
        for k in range(args.drains):
            wait_standbys_quiet(job, args.timeout)
            status = job.status()
            node = pick_node(status)["node"]
            job.drain(node, rejoin=True)
            swap = next_swap(job, k, args.timeout)
            after = job.status()
            members = {n["node"]: n["last_swap"] for n in after["nodes"]
                       if n["role"] == "active" and (n.get("last_swap") or {}).get("gen") == swap["gen"]}
            found.append({"node": node, "swap": swap, "members": members})
            print(f"[{NAME}] {size} drain {k + 1}: {swap['bytes_from_leaver'] / 1e6:.1f} MB from the leaver in "
                  f"{swap['handover_s'] * 1e3:.1f} ms, stall {swap['stall_s'] * 1e3:.0f} ms (joiner's own "
                  f"{swap.get('joiner_stall_s', 0) * 1e3:.0f} ms)", flush=True)
    finally:
        job.stop()
        if not args.keep:
            shutil.rmtree(wd, ignore_errors=True)
    return found


def main(argv: list[str] | None = None) -> int:
    p = common.Parser(prog="bench/transfer_limit.py", description=__doc__.splitlines()[0],
                      epilog="Run nothing else on the machine meanwhile (on a shared machine: "
                             "flock /tmp/tmrun-bench.lock python bench/transfer_limit.py ...).")
    p.add_argument("--sizes", type=common.size_list, default=None, help="model sizes, comma-separated (default 5M,50M)")
    p.add_argument("--drains", type=common.count(1), default=2, help="drains (with --rejoin) per size (default 2)")
    p.add_argument("--loopback-mb", type=common.count(1), default=512, help="MB for the loopback copy (default 512)")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo point-to-point reference")
    p.add_argument("--threads", type=common.count(1), default=1, help="torch threads per worker (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one wait may take (default 900)")
    p.add_argument("--quick", action="store_true", help="1M only, 1 drain, 128 MB loopback; suffix _quick")
    p.add_argument("--keep", action="store_true", help="keep the work directories")
    args = p.parse_args(argv)
    sizes = args.sizes or (["1M"] if args.quick else ["5M", "50M"])
    if args.quick:
        args.drains, args.loopback_mb = 1, min(args.loopback_mb, 128)
    name = NAME + ("_quick" if args.quick else "")
    sampler = ProcSampler(common.GPT)
    sampler.start()  # (to notice processes that are not ours)
    before = sampler.sample()

    print(f"[{NAME}] loopback: {args.loopback_mb} MB over a 127.0.0.1 TCP socket", flush=True)
    lo = loopback(args.loopback_mb * 2**20)
    print(f"[{NAME}]   {lo['bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
    gloo = {}
    if not args.no_gloo:
        for size in sizes:
            print(f"[{NAME}] gloo send/recv of the {size} state between two processes", flush=True)
            gloo[size] = gloo_reference(common.params_of(size))
            print(f"[{NAME}]   {gloo[size]['bytes'] / 1e6:.1f} MB in {len(gloo[size]['seconds'])} tries: "
                  f"{gloo[size]['bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
    results = {size: drains_of(size, args) for size in sizes}
    return report(name, args, sizes, lo, gloo, results, cpu_use(before, sampler.sample()))


def report(name: str, args, sizes: list[str], lo: dict, gloo: dict, results: dict, cpu: dict) -> int:
    cols = ["size", "drain", "bytes moved (MB)", "from leaver (MB)", "handover (ms)", "handover GB/s",
            "vs loopback", "gloo ref GB/s", "transfer alone (ms)", "at gloo's rate (ms)", "stall_s (ms)",
            "stall / transfer alone", "joiner's own stall (ms)"]
    rows, findings, per_size = [], [], {}
    for size in sizes:
        entries = []
        for k, d in enumerate(results[size], 1):
            s = d["swap"]
            bw = s["bytes_from_leaver"] / s["handover_s"] if s["handover_s"] else None
            alone = s["bytes_from_leaver"] / lo["bytes_per_s"]
            entry = {"bytes_moved": s["bytes_moved"], "bytes_from_leaver": s["bytes_from_leaver"],
                     "handover_s": s["handover_s"], "bandwidth_bytes_per_s": bw,
                     "vs_loopback": bw / lo["bytes_per_s"] if bw else None, "transfer_alone_s": alone,
                     "stall_s": s["stall_s"], "joiner_stall_s": s.get("joiner_stall_s"),
                     "stall_over_alone": s["stall_s"] / alone if alone else None, "node": d["node"], "swap": s,
                     "members": d["members"]}
            entries.append(entry)
            rows.append([size, k, s["bytes_moved"] / 1e6, s["bytes_from_leaver"] / 1e6, s["handover_s"] * 1e3,
                         bw / 1e9 if bw else None, f"{entry['vs_loopback']:.0%}" if bw else None,
                         gloo[size]["bytes_per_s"] / 1e9 if size in gloo else None, alone * 1e3,
                         s["bytes_from_leaver"] / gloo[size]["bytes_per_s"] * 1e3 if size in gloo else None,
                         s["stall_s"] * 1e3, f"{entry['stall_over_alone']:.1f}x" if alone else None,
                         s["joiner_stall_s"] * 1e3 if s.get("joiner_stall_s") is not None else None])
        per_size[size] = entries
        if entries:
            bw = statistics.median(e["bandwidth_bytes_per_s"] for e in entries if e["bandwidth_bytes_per_s"])
            stall = statistics.median(e["stall_s"] for e in entries)
            alone = statistics.median(e["transfer_alone_s"] for e in entries)
            text = (f"{size}: {entries[0]['bytes_from_leaver'] / 1e6:.0f} MB per swap; the handover ran at "
                    f"{bw / 1e9:.2f} GB/s, {bw / lo['bytes_per_s']:.0%} of loopback"
                    + (f" and {bw / gloo[size]['bytes_per_s']:.0%} of gloo's point-to-point rate" if size in gloo
                       else "")
                    + f"; the transfer alone at loopback speed would take {alone * 1e3:.0f} ms, {alone / stall:.0%} "
                    f"of the measured stall_s ({stall * 1e3:.0f} ms)"
                    + (f" (at gloo's point-to-point rate {entries[0]['bytes_from_leaver'] / gloo[size]['bytes_per_s'] * 1e3:.0f} ms, "
                       f"{entries[0]['bytes_from_leaver'] / gloo[size]['bytes_per_s'] / stall:.0%})" if size in gloo else ""))
            findings.append(text)
    common.print_table(f"State transfer per swap (loopback {lo['bytes_per_s'] / 1e9:.2f} GB/s)", cols, rows)
    for text in findings:
        print(f"[{NAME}] {text}", flush=True)

    foreign = cpu.get("outside", 0.0)
    if foreign > 0.05:
        findings.append(f"Warning: processes this benchmark did not start used {foreign:.2f} cores on average while it "
                        "ran: the machine was not idle, so the bandwidths are low and the stalls high.")
        print(f"[{NAME}] {findings[-1]}", flush=True)
    doc = {"loopback": lo, "gloo": gloo, "sizes": per_size, "findings": findings, "targets": [],
           "cpu_cores_while_measuring": cpu,
           "note": "no target: this benchmark states the limit (bandwidth, bytes, stall explained)",
           "settings": {"sizes": sizes, "drains": args.drains, "loopback_mb": args.loopback_mb,
                        "threads": args.threads, "tmrun_conf": common.TMRUN_CONF}}
    path = common.save(name, doc)
    ref = [f"- loopback TCP copy of {lo['bytes'] / 2**20:.0f} MiB between two processes: "
           f"{lo['bytes_per_s'] / 1e9:.2f} GB/s (best of {len(lo['seconds'])})"]
    ref += [f"- gloo send/recv of the {size} state ({g['tensors']} tensors, {g['bytes'] / 1e6:.1f} MB) between two "
            f"fresh processes: {g['bytes_per_s'] / 1e9:.2f} GB/s (best of {len(g['seconds'])})" for size, g in gloo.items()]
    lines = ["## The limit: state moved per swap", "",
             "Drains (`tmrun drain --rejoin`) of a running job, 2 nodes + 1 standby: the leaver streams its model "
             "and optimizer state straight into the joiner's tensors. Bandwidth = bytes from the leaver / "
             "handover time (leaver's header to the last byte); *transfer alone* = those bytes at the loopback "
             "rate, the stall no swap could go below on this machine; `stall_s` is the longest time a survivor did "
             "not train because of the swap (the joiner's own wait, from its promotion to its first step, is "
             "listed apart). References, measured in the same run (on this machine gloo's own point-to-point "
             "transfer beats a single Python socket stream, so it is the tighter limit):",
             "", *ref, "", "```", common.command_line(), "```", "", common.md_table(cols, rows), "",
             *[f"- {text}" for text in findings], ""]
    md = common.RESULTS / f"{name}.md"
    md.write_text("\n".join(lines))
    print(f"results: {path}\nsection: {md}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
