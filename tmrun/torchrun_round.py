"""Which torchrun round this worker belongs to, agreed by every rank over the launcher's store.

Under tmrun the agent tells each worker its generation (``TMRUN_GENERATION``). Under torchrun the
only per-round number a worker sees is ``TORCHELASTIC_RESTART_COUNT``, and it is the *agent's* count
of its own restarts: after one node's worker fails, that node's agent counts a restart while the
others re-rendezvous with their count unchanged. With torchrun's shared store (its default) the
store outlives the round, so keys named by that count would put the ranks of one round in
different places, each waiting for the others until the store timeout.

The ranks therefore agree on a fresh round id themselves. Each rank writes a random nonce under
``hello/<rank>``. Rank 0 reads every hello and answers each one under ``welcome/<rank>/<nonce>``
with its own nonce, which becomes the round id. A hello can be stale (the previous round's, if
that rank's new process has not written yet), but a stale hello is never answered to anyone alive:
its writer is gone, and the rank that replaces it waits for the answer to its *own* nonce. Rank 0
returns once every rank acknowledged ``ack/<round>/<rank>``. Every hello and ack also bumps a
counter and writes ``event/<n>``; while an ack is missing, rank 0 waits for the next event and
reads the hellos again, so a hello that was stale when first read is answered once its rank writes
the fresh one.

Every worker of an old round has exited before torchrun starts the next one, so nothing of an old
round can acknowledge a new round id. Nothing polls and nothing waits on a clock.
"""

from __future__ import annotations

import datetime
import secrets
import time

import torch.distributed as dist

PREFIX = "tmrun/round"


def agree(store: dist.Store, rank: int, world_size: int, *, timeout: float = 300.0) -> str:
    """Return the id every rank of this torchrun round agrees on (rank 0's fresh nonce)."""
    nonce = secrets.token_hex(8)
    if world_size == 1:
        return nonce
    if rank != 0:
        _post(store, f"{PREFIX}/hello/{rank}", nonce)
        round_id = _get(store, f"{PREFIX}/welcome/{rank}/{nonce}", timeout)
        _post(store, f"{PREFIX}/ack/{round_id}/{rank}", "1")
        return round_id
    hellos = [f"{PREFIX}/hello/{r}" for r in range(1, world_size)]
    acks = [f"{PREFIX}/ack/{nonce}/{r}" for r in range(1, world_size)]
    answered: set[str] = set()
    deadline = time.monotonic() + timeout
    _wait(store, hellos, timeout)
    while True:
        seen = store.add(f"{PREFIX}/events", 0)
        for r, key in enumerate(hellos, start=1):
            theirs = store.get(key).decode()
            if theirs not in answered:
                store.set(f"{PREFIX}/welcome/{r}/{theirs}", nonce)
                answered.add(theirs)
        if store.check(acks):
            return nonce
        try:  # until the next hello or ack anywhere: a hello read above may have been stale
            _wait(store, [f"{PREFIX}/event/{seen + 1}"], deadline - time.monotonic())
        except TimeoutError:
            missing = [r for r, key in enumerate(acks, start=1) if not store.check([key])]
            raise TimeoutError(f"torchrun round: ranks {missing} did not join within {timeout:.0f} s") from None


def _post(store: dist.Store, key: str, value: str) -> None:
    """Write ``key``, then count it as an event, so that rank 0 waiting on the next event wakes."""
    store.set(key, value)
    store.set(f"{PREFIX}/event/{store.add(f'{PREFIX}/events', 1)}", key)


def _get(store: dist.Store, key: str, timeout: float) -> str:
    _wait(store, [key], timeout)
    return store.get(key).decode()


def _wait(store: dist.Store, keys: list[str], timeout: float) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except dist.DistStoreError as exc:  # torch raises its own timeout type; callers see TimeoutError
        raise TimeoutError(str(exc)) from None
