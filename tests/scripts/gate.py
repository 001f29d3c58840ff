"""Gates a test opens by creating a file: the job's steps slow down, or speed up, until it exists.

A test that must see something before the job's last step (a newcomer at work, a live view with
a rate) opens the gate, by creating the file, once it has, instead of racing the job's end on a
loaded machine (``--hold-from N --gate FILE``). A test whose job is paced (``--step-time``) so
that it can act while the job runs lets the rest of the job go unpaced once it has acted
(``--fast-when FILE``): the steps left only have to reach the end, with the same weights.
Imported by the scripts beside it (a script's own directory is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import os

HOLD = 0.25  # seconds more per step while the gate is shut: 50 held steps give a test 12.5 s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hold-from", type=int, default=None, help="from this step on, slower until --gate exists")
    parser.add_argument("--gate", default=None, help="the file whose existence opens the gate")
    parser.add_argument("--fast-when", default=None, help="the file whose existence ends --step-time's pacing")


def pause(args: argparse.Namespace, step: int) -> float:
    """The seconds step ``step`` sleeps: its pace (``--step-time``, none once ``--fast-when``
    exists) and :func:`held`."""
    fast = args.fast_when is not None and os.path.exists(args.fast_when)
    return (0.0 if fast else args.step_time) + held(args, step)


def held(args: argparse.Namespace, step: int) -> float:
    """The seconds step ``step`` waits beyond its own pace: ``HOLD`` while the gate is shut."""
    if args.hold_from is None or step < args.hold_from or os.path.exists(args.gate):
        return 0.0
    return HOLD
