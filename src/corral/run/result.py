"""What a run ends with: its ``RunResult``, and corral's own explanation of a failure.

Kept apart from the run loop (``runner``): a result is plain data that the
CLI, the doctor's workloads and a supervisor read, and the explanations
(a variable that did not travel, the knowledge base's diagnosis) are pure
functions of what the watch saw.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.run.plan import LaunchPlan
from corral.run.watch import Failure

_ENV_KEYERROR = re.compile(r"KeyError: '([A-Za-z_][A-Za-z0-9_]*)'")

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    run_id: str
    status: str  # "succeeded", "failed", "interrupted"
    exit_code: int
    run_dir: Path | None
    plan: LaunchPlan | None
    failure: Failure | None = None
    failure_tail: tuple[str, ...] = ()
    failure_log: Path | None = None
    diagnoses: tuple[Any, ...] = ()
    #: (host, rank) that exited cleanly before a failure that echoes a vanished peer.
    left_early: tuple[tuple[str, int], ...] = ()
    #: Corral's own explanations of the failure (a variable that did not travel...).
    hints: tuple[str, ...] = ()
    #: Why each restarted attempt failed (--max-restarts), oldest first.
    restarts: tuple[str, ...] = ()
    attempts: int = 1
    duration_s: float = 0.0
    #: The merged stack tree, when a hang was detected.
    stacks: tuple[str, ...] = ()
    #: What the ranks' collective flight recorder dumps say (``diagnose/flightrec.py``).
    flightrec: tuple[str, ...] = ()
    #: (host, rank, exception line, rank log) of ranks that printed a traceback
    #: in a run that still succeeded (the script caught its own error).
    caught: tuple[tuple[str, int, str, str], ...] = ()


def env_hint(head_env: Mapping[str, str], plan: LaunchPlan, failure: Failure, tail: list[str]) -> str | None:
    """``KeyError: 'DATA_DIR'`` from os.environ, for a variable set where corral
    runs but not on the node: only named variables travel."""
    m = _ENV_KEYERROR.search(failure.exc or "")
    if not m or not any("environ" in line or "<frozen os>" in line for line in tail):
        return None
    name = m.group(1)
    node = next((n for n in plan.nodes if n.host.name == failure.host), None)
    if name not in head_env or (node is not None and name in node.env):
        return None
    return (f"{name} is set where corral runs but does not travel to the nodes (only named and "
            f"allow-listed variables do): pass it with --env {name}, or set it in the cluster "
            "file's [cluster.env]")


def diagnose_failure(text: str, failure: Failure) -> tuple[Any, ...]:
    """Likely cause and fix from the knowledge base, when it is available."""
    try:
        from corral.diagnose import diagnose_text
    except ImportError:
        return ()
    try:
        return tuple(diagnose_text(text, origin=f"{failure.host} (live)", host=failure.host,
                                   rank=failure.rank)[:3])
    except Exception as e:  # noqa: BLE001 - diagnosis must never hide the failure itself
        log.debug("diagnosis failed: %s", e)
        return ()
