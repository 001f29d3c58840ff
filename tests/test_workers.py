"""A promoted standby's workers take their real ranks: output prefixes and a failure's rank follow.

A standby's shadow workers start with placeholder ranks (the last ranks of the world); when the
agent promotes them it renumbers the group (:meth:`agent.workers.WorkerGroup.renumber`).
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import types

import pytest

from agent.output import OutputRouter
from agent.workers import WorkerGroup, WorkerLaunch

pytestmark = pytest.mark.timeout(60)


class Console(io.BytesIO):
    """A console that tells a waiting test each time a line was written."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = asyncio.Event()

    def write(self, data) -> int:
        self.wrote.set()
        return super().write(data)


def test_the_prefix_follows_a_new_rank() -> None:
    async def go() -> bytes:
        console = Console()
        router = OutputRouter("node-2", log_dir=None, console_out=console, console_err=console)
        reader = asyncio.StreamReader()
        pumps = router.attach(types.SimpleNamespace(stdout=reader, stderr=None), local_rank=0, rank=1)
        reader.feed_data(b"shadow\n")
        await console.wrote.wait()  # the first line went out under the placeholder rank
        router.set_rank(0, 0)
        reader.feed_data(b"promoted\n")
        reader.feed_eof()
        await asyncio.gather(*pumps)
        return console.getvalue()

    assert asyncio.run(go()).splitlines() == [b"[node-2 r1]: shadow", b"[node-2 r0]: promoted"]


def test_a_failure_reports_the_renumbered_rank() -> None:
    async def go():
        console = Console()
        router = OutputRouter("node-2", log_dir=None, console_out=console, console_err=console)
        launches = [WorkerLaunch((sys.executable, "-c", f"raise SystemExit({3 + local})"), dict(os.environ), local,
                                 6 + local) for local in range(2)]
        group = WorkerGroup(launches, router, grace=5.0)
        await group.start()
        group.renumber(2)  # promoted: placeholder ranks 6-7 become 2-3
        return await group.wait()

    result = asyncio.run(go())
    assert result.state == "failed" and (result.exitcode, result.rank) in ((3, 2), (4, 3)), result
