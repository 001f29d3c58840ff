"""One rank of a pull over real links: the sources hold a model's worth of tensors, the last rank
pulls them, once per way of pulling, timed (tests/test_pull_links.py, bench/pull.py).

Rank 0 serves the store. The group is built as a swap's is (:class:`tmrun.swap.NextGroup`, with
phase 1's probe of the receiver's links), then, for each pull and repetition, the receiver starts
from zeros at step -1 and :func:`tmrun.swap.exchange_state` brings it the sources' state. The
receiver prints one JSON line per pull: seconds, the plan's prediction, the bytes per source, the
probed rates, and a digest of what it holds; every source prints its digest once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist

from tmrun.swap import GroupSpec, NextGroup, exchange_state

MiB = 1 << 20
SHAPE = (8, 4, 4, 3, 2, 2, 1.5, 1, 1, 0.5, 0.25, 0.125)  # MiB per tensor, summing to 27.375, scaled


class Model:
    def __init__(self, mib: float, seed: int | None) -> None:
        scale = mib / sum(SHAPE)
        generator = torch.Generator().manual_seed(seed or 0)
        self.tensors = {f"t{i}": (torch.rand(int(part * scale * MiB) // 4, generator=generator) if seed is not None
                                  else torch.zeros(int(part * scale * MiB) // 4)) for i, part in enumerate(SHAPE)}

    def state_dict(self) -> dict:
        return dict(self.tensors)

    def load_state_dict(self, state: dict) -> None:
        pass

    def digest(self) -> str:
        sha = hashlib.sha256()
        for tensor in self.tensors.values():
            sha.update(tensor.numpy().tobytes())
        return sha.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True, help="host:port of rank 0's store")
    parser.add_argument("--mib", type=float, default=32.0)
    parser.add_argument("--pulls", default="planned,striped,single")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    host, port = args.store.rsplit(":", 1)
    server = dist.TCPStore("0.0.0.0", int(port), is_master=True, wait_for_workers=False) if args.rank == 0 else None
    receiver = args.world - 1
    spec = GroupSpec(1, args.rank, args.world, host, int(port), "agreed", probe=(receiver,))
    pending = NextGroup(spec, 120)
    group = pending.wait(60)
    if args.rank != receiver:
        print(json.dumps({"rank": args.rank, "digest": Model(args.mib, 7).digest()}), flush=True)
    model = Model(args.mib, 7) if args.rank != receiver else None
    for pull in args.pulls.split(","):
        for _ in range(args.repeat):
            if args.rank == receiver:
                model = Model(args.mib, None)
            group.barrier()
            started = time.perf_counter()
            result = exchange_state(group, {"model": model}, 5 if args.rank != receiver else -1, 120,
                                    rates=pending.rates, pull=pull)
            took = time.perf_counter() - started
            if args.rank == receiver:
                print(json.dumps({"pull": pull, "seconds": took, "predicted": result.predicted,
                                  "bytes": result.bytes_received,
                                  "links": {str(s): size for s, (size, _) in result.links.items()},
                                  "probed": {str(s): rate for s, rate in pending.probed.items()},
                                  "digest": model.digest()}), flush=True)
    group.barrier()
    group.close()
    del server


if __name__ == "__main__":
    main()
