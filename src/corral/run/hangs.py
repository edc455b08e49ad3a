"""A job that has gone quiet: say where its ranks are, or declare it hung.

Without ``--hang-timeout`` a long silence is only reported (a hang, or a
quiet stretch of training); with it, every rank's stack and the flight
recorder's analysis name the rank that is out of step, and the job fails
as hung.  Called by the run loop (``runner``).
"""

from __future__ import annotations

from pathlib import Path

from corral.agent.session import AgentPool
from corral.diagnose.stacks import fold_keys, fold_ranks, key_rank
from corral.run.control import stack_snapshot
from corral.run.flightrec import at_hang
from corral.run.watch import JobWatch


async def quiet_notice(view, pool: AgentPool, watch: JobWatch, run_dir: Path, silent: float) -> None:
    """No output for a while and no --hang-timeout: a hang or a quiet
    stretch of training.  Say so, and where the ranks are when that tells
    something (some ranks apart from the others, or waiting for a
    rendezvous that is not corral's); the job goes on."""
    snap = await stack_snapshot(pool, watch.plan, run_dir)
    minutes = f"{silent / 60:.0f} min" if silent >= 60 else f"{silent:.0f}s"
    view.message(f"no rank has written anything for {minutes}; the job goes on (--hang-timeout N "
                 f"stops a job silent for N seconds; `corral stacks` shows where the ranks are now; "
                 f"stacks: {snap.path})")
    if snap.odd or snap.note:
        for line in snap.lines:
            view.message("  " + line)
    if snap.odd:
        view.message(f"{fold_keys(snap.odd)} elsewhere than the others")
    if snap.note:
        view.message(snap.note)


async def declare_hang(view, pool: AgentPool, watch: JobWatch, run_dir: Path, silent: float, flight, *,
                       flight_recorder: bool, since: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """No rank made progress: show where every rank is, then fail the job;
    returns the lines shown (the stacks, the flight recorder's analysis)."""
    view.message(f"no rank wrote anything for {silent:.0f}s: collecting every rank's Python stack")
    snap = await stack_snapshot(pool, watch.plan, run_dir)
    lines = snap.lines + ([snap.note] if snap.note else [])
    for line in lines:
        view.message(line)
    report, more = await at_hang(pool, flight, run_dir, watch.plan.world_size,
                                 enabled=flight_recorder, since=since,
                                 stacks={k: t for k, t in snap.dumps.items() if isinstance(k, int)})
    for line in more:
        view.message(line)
    if report is not None and report.culprits and not snap.odd:
        rank = report.culprits[0]
        node = watch.plan.node_of_rank(rank)
        watch.hang(node.host.name if node else watch.plan.nodes[0].host.name, rank,
                   f"no progress for {silent:.0f}s; {fold_ranks(set(report.culprits))} out of step in the "
                   f"flight recorder (stacks: {snap.path})")
    elif snap.odd:
        rank = min(key_rank(k) for k in snap.odd)
        node = watch.plan.node_of_rank(rank)
        watch.hang(node.host.name if node else watch.plan.nodes[0].host.name, rank,
                   f"no progress for {silent:.0f}s; {fold_keys(snap.odd)} elsewhere than the others "
                   f"(stacks: {snap.path})")
    else:
        watch.hang(watch.plan.nodes[0].host.name, None, f"no progress for {silent:.0f}s (stacks: {snap.path})")
    return tuple(lines), tuple(more)
