"""Early builds (tmrun/early_build.py): claimed once, dropped when stale, refused or left over."""

from __future__ import annotations

import dataclasses

import pytest

from tmrun.early_build import EarlyBuilds
from tmrun.swap import GroupSpec

pytestmark = pytest.mark.timeout(10)


@dataclasses.dataclass
class Build:
    spec: GroupSpec
    dropped: bool = False

    def drop(self) -> None:
        self.dropped = True


def spec(gen: int, mode: str = "now", rank: int = 0) -> GroupSpec:
    return GroupSpec(gen, rank, 2, "127.0.0.1", 1234, mode)


def builds() -> tuple[EarlyBuilds, list[Build]]:
    started: list[Build] = []

    def start(s: GroupSpec) -> Build:
        started.append(Build(s))
        return started[-1]

    return EarlyBuilds(start), started


def test_a_build_is_claimed_once_and_a_repeated_prepare_starts_none() -> None:
    early, started = builds()
    early.arrived(spec(2))
    early.arrived(spec(2))
    assert len(started) == 1
    assert early.claim(spec(2)) is started[0] and not started[0].dropped
    assert early.claim(spec(2)) is None


def test_claiming_a_newer_generation_drops_the_older_builds() -> None:
    early, started = builds()
    early.arrived(spec(2))
    early.arrived(spec(3))
    assert early.claim(spec(3)) is started[1]
    assert started[0].dropped and not started[1].dropped


def test_a_refused_prepare_and_another_spec_of_the_same_generation_drop_the_build() -> None:
    early, started = builds()
    early.arrived(spec(2))
    early.refuse(spec(2))
    assert started[0].dropped
    early.arrived(spec(4, rank=0))
    assert early.claim(spec(4, rank=1)) is None and started[1].dropped


def test_close_drops_what_is_left_and_starts_nothing_after() -> None:
    early, started = builds()
    early.arrived(spec(2))
    early.close()
    early.arrived(spec(3))
    assert [b.dropped for b in started] == [True]
