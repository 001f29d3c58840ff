"""The summary of one swap, from what its members reported: the ``swap`` event's timings.

A resize without a restart (a hot shrink: no joiners) is summarized the same way.

Every member of a swapped-into generation keeps its side of the swap in ``last_swap`` (see
:mod:`agent.node`): when its workers had built the new group (``ready_at``), switched to it
(``switched_at``) and committed their first step in it (``first_step_at``), and what the switch
cost (``stall``, bytes received, step times during phase 1). The swap's stall is the longest
among the members that held the state before (the training the job lost); a joiner's own stall
runs from its promotion and includes waiting for the switch, and is reported apart. Once every member has committed a
step in the new generation, the leader folds these into one event, timed from the request or
failure report that started the swap (``Plan.requested``)::

    request ─► plan written ─► phase 1 started on all ─► phase 1 done on all ─► switch on all
            ─► first committed step on all

Wall-clock times come from different machines' clocks; on one machine (a local cluster) they are
exact, across machines they are as good as the nodes' clock synchronisation.
"""

from __future__ import annotations

from typing import Any, Mapping

from agent.records import Plan, RunState


def summarize(plan: Plan, runs: Mapping[str, RunState]) -> dict[str, Any] | None:
    """The swap into ``plan``'s generation, or None while a member has not committed a step in it."""
    if not plan.mode.startswith("swap"):
        return None
    swaps, holders, joined = [], [], []
    for member in plan.members:
        last = runs[member].last_swap if member in runs else {}
        if last.get("gen") != plan.gen or "first_step_at" not in last:
            return None
        swaps.append(last)
        (joined if member in plan.joiners else holders).append(last)
    start = plan.requested or plan.created

    def since(field: str) -> float | None:
        times = [s[field] for s in swaps if field in s]
        return round(max(times) - start, 4) if times else None

    survivors = [s for s in swaps if s.get("phase1_step_time") is not None]
    return {
        "gen": plan.gen,
        "mode": plan.mode,
        "joiners": list(plan.joiners),
        "members": len(plan.members),
        "handover": dict(plan.handover),
        "requested": start,
        "plan_written_s": round(plan.created - start, 4),
        "phase1_started_s": since("prepared_at"),
        "phase1_done_s": since("ready_at"),
        "switched_s": since("switched_at"),
        "first_step_s": since("first_step_at"),
        # the job's stall is the holders' (a joiner's own wait for the switch is not lost training)
        "stall_s": max(float(s.get("stall", 0.0)) for s in holders or swaps),
        "joiner_stall_s": max((float(s.get("stall", 0.0)) for s in joined), default=0.0),
        "bytes_moved": sum(int(s.get("bytes_received", 0)) for s in swaps),
        "bytes_from_leaver": sum(int(s.get("from_leaver", 0)) for s in swaps),
        "handover_s": max(float(s.get("handover_s", 0.0)) for s in swaps),
        "handover_errors": [str(s["handover_error"]) for s in swaps if s.get("handover_error")],
        "transfer_s": max(float(s.get("transfer", 0.0)) for s in swaps),
        # the slowest member's own group build (store client, then gloo's pairs), from its prepare's arrival
        "group_build_s": max((float(s["group_build"]) for s in swaps if s.get("group_build") is not None), default=None),
        "store_connect_s": max((float(s["store_connect"]) for s in swaps if s.get("store_connect") is not None),
                               default=None),
        "gloo_connect_s": max((float(s["gloo_connect"]) for s in swaps if s.get("gloo_connect") is not None),
                              default=None),
        "phase1_steps": max((int(s.get("phase1_steps", 0)) for s in swaps), default=0),
        "phase1_step_time": max((s["phase1_step_time"] for s in survivors), default=None),
        "normal_step_time": max((s["normal_step_time"] for s in survivors if s.get("normal_step_time")),
                                default=None),
        "at": max(s["first_step_at"] for s in swaps),
    }


def describe(summary: dict[str, Any]) -> str:
    """One line for ``tmrun events``."""
    who = f"{', '.join(summary['joiners'])} switched in" if summary["joiners"] else \
        f"the job switched to {summary.get('members', '?')} nodes without a restart"
    text = (f"{who}: phase 1 done {summary['phase1_done_s']} s, switch {summary['switched_s']} s, "
            f"first step {summary['first_step_s']} s after the {'request' if summary['mode'] == 'swap-agreed' else 'failure'}; "
            f"stall {summary['stall_s']:.3f} s, {summary['bytes_moved'] / 1e6:.1f} MB moved")
    if summary["bytes_from_leaver"]:
        text += " (from the leaver)"
    if summary.get("handover_errors"):
        text += f"; the handover failed, state from the replicas: {summary['handover_errors'][0]}"
    return text
