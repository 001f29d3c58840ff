"""The ranks of one torchrun round agree on its id over a store that outlives the round.

A real TCPStore server; each rank is a thread with a client of its own. The order in which the
ranks of a later round arrive is forced with the keys themselves, never with sleeps.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time

import pytest
import torch.distributed as dist

from tmrun import torchrun_round

pytestmark = pytest.mark.timeout(60)
WORLD = 3


@pytest.fixture()
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    yield store


def client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))


def start(pool, server, rank: int, timeout: float = 20.0):
    return pool.submit(torchrun_round.agree, client(server), rank, WORLD, timeout=timeout)


def first_round(server) -> str:
    with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
        ids = [f.result(timeout=30) for f in [start(pool, server, r) for r in range(WORLD)]]
    assert len(set(ids)) == 1
    return ids[0]


def hello(server, rank: int) -> str:
    return server.get(f"{torchrun_round.PREFIX}/hello/{rank}").decode()


def until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what


def test_every_rank_of_a_round_gets_the_same_fresh_id(server):
    ids = {first_round(server) for _ in range(3)}
    assert len(ids) == 3  # a new id each round


def test_rank_0_arriving_first_answers_the_fresh_hellos_not_only_the_stale_ones(server):
    old = first_round(server)
    stale = {r: hello(server, r) for r in range(1, WORLD)}
    with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
        zero = start(pool, server, 0)
        # rank 0 has answered the previous round's hellos before the new ranks exist
        server.wait([f"{torchrun_round.PREFIX}/welcome/{r}/{n}" for r, n in stale.items()])
        assert not zero.done()
        others = [start(pool, server, r) for r in range(1, WORLD)]
        ids = [f.result(timeout=30) for f in [zero, *others]]
    assert len(set(ids)) == 1 and ids[0] != old


def test_ranks_arriving_before_rank_0_wait_for_the_new_round(server):
    old = first_round(server)
    stale = {r: hello(server, r) for r in range(1, WORLD)}
    with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
        others = [start(pool, server, r) for r in range(1, WORLD)]
        until(lambda: all(hello(server, r) != n for r, n in stale.items()), "the new hellos were not written")
        assert not any(f.done() for f in others)  # the old round's answers are not theirs
        zero = start(pool, server, 0)
        ids = [f.result(timeout=30) for f in [zero, *others]]
    assert len(set(ids)) == 1 and ids[0] != old


def test_rank_0_names_the_ranks_that_never_joined(server):
    first_round(server)
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not join within 1 s"):
        torchrun_round.agree(client(server), 0, WORLD, timeout=1.0)


def test_a_world_of_one_needs_no_store():
    assert torchrun_round.agree(None, 0, 1) != torchrun_round.agree(None, 0, 1)
