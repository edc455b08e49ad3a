"""What ``run.json`` says about a run: its plan, its attempts, what failed.

Written by the run loop (runner.py) at every change of state, read by
``corral runs``, ``corral diagnose`` and whatever a user builds on it; the
keys are documented in docs/run.md ("Run directory").
"""

from __future__ import annotations

import os
import socket
from typing import Any

from corral.errors import CorralError, HostError, PreflightError
from corral.model import Cluster
from corral.run.plan import LaunchPlan, RunSpec
from corral.run.watch import Failure


def plan_record(plan: LaunchPlan, spec: RunSpec, cluster: Cluster) -> dict[str, Any]:
    """The part of the record that is the same for every attempt's plan."""
    return {
        "run_id": plan.run_id,
        "launcher": plan.launcher,
        "program": spec.program,
        "args": list(spec.args),
        "master_addr": plan.master_addr,
        # who writes this record: `corral runs` tells a run whose head died
        # (SIGKILL, a crashed laptop) from one still running
        "head": {"host": socket.gethostname(), "pid": os.getpid()},
        "master_port": plan.master_port,
        # what the job holds on its nodes (other jobs are refused them): `corral ps` shows them
        "ports": {"master": plan.master_port},
        "world_size": plan.world_size,
        "cluster": {"source": cluster.source, "name": cluster.name},
        "hosts": [
            {"name": n.host.name, "node_rank": n.node_rank, "ranks": list(n.ranks),
             "argv": list(n.argv), "cwd": n.cwd, "env_names": sorted(n.env),
             "gpus": list(n.gpus) if n.gpus is not None else None}
            for n in plan.nodes
        ],
    }


def failure_record(failure: Failure | None, left_early: tuple[tuple[str, int], ...] = ()) -> dict | None:
    """The first failure of the last attempt (None: it did not fail)."""
    if failure is None:
        return None
    return {
        "host": failure.host, "rank": failure.rank, "kind": failure.kind,
        "exit_code": failure.code, "signal": failure.signal_name, "exception": failure.exc,
        "reason": failure.reason, "description": failure.describe(),
        "left_early": [{"host": h, "rank": r} for h, r in left_early],
    }


def error_record(error: CorralError, description: str) -> dict:
    """A restart that never started (a node not back, ssh refused): kind ``restart``."""
    host = None
    if isinstance(error, HostError):
        host = error.host
    elif isinstance(error, PreflightError) and error.problems:
        host = error.problems[0].host
    return {"host": host, "rank": None, "kind": "restart", "exit_code": None, "signal": None,
            "exception": None, "reason": error.message, "description": description, "left_early": []}


def one_line(error: CorralError) -> str:
    """A (multi-line) error as one line: its lines without the hints."""
    return " ".join(ln.strip() for ln in error.message.splitlines()
                    if ln.strip() and not ln.strip().startswith("hint:"))
