"""What a run is asked for beyond the job itself (``RunOptions``), and what it tells its user (``RunView``).

Apart from the run loop (``runner``) because everything that starts a run
builds these: the CLI, the doctor's workloads, a detached job's supervisor
(which reads them back from ``job.json``, field by field: ``jobcodec``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from corral.run.recovery import RecoveryOptions
from corral.run.watch import Sink

#: Without --hang-timeout: after this long with no output from any rank, say
#: where the ranks are (then after twice as long again, and so on).
QUIET_NOTICE_S = 120.0


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    runs_dir: Path
    max_restarts: int = 0
    #: Agent silence after which the head declares a node lost (seconds).
    node_timeout: float = 10.0
    #: SIGTERM -> SIGKILL grace when tearing the job down after a failure (seconds).
    grace: float = 3.0
    #: The same after Ctrl-C / SIGTERM / SIGHUP of corral itself: long enough
    #: for a script that saves a checkpoint when it is stopped (preemption),
    #: short enough that nothing of the run is left on any node 10 s after
    #: Ctrl-C, and inside a scheduler's own wait before SIGKILL (Slurm's
    #: KillWait is 30 s).  torchrun waits 30 s: ``--grace 30``.
    interrupt_grace: float = 7.0
    connect_timeout: float = 10.0
    #: Keep the node-side temp dir (rank files) after the run, for debugging.
    keep_node_tmp: bool = False
    #: No output from any rank for this long = a hang: dump every rank's stack, stop.
    hang_timeout: float | None = None
    #: Without hang_timeout: no output for this long = say where the ranks
    #: are, and go on (again after twice as long, and so on).
    quiet_notice: float = QUIET_NOTICE_S
    #: Ranks the user asked to see on the console (--ranks); None = all.  The
    #: world size is known only once every node's GPUs are counted, so a rank
    #: that does not exist is refused here, before anything starts.
    shown_ranks: frozenset[int] | None = None
    #: Turn PyTorch's collective flight recorder on in every rank; its dumps
    #: are gathered into the run directory on a hang or failure (``--no-flight-recorder``).
    flight_recorder: bool = True
    #: --min-nodes, --rejoin-timeout, --checkpoint-dir (run/recovery.py).
    recovery: RecoveryOptions = RecoveryOptions()
    #: Each node samples its GPUs, ranks and links once a second into the
    #: run directory (``corral top``, ``corral report``); --no-telemetry: off.
    telemetry: bool = True


class RunView(Sink, Protocol):
    """What the run loop tells its user interface (the CLI's console)."""

    def message(self, text: str) -> None: ...
    def stopping(self) -> None: ...
    def close(self) -> None: ...


class _NullView:
    def line(self, host: str, rank: int | None, stream: str, text: str) -> None: ...
    def status(self, host: str, rank: int | None, text: str) -> None: ...
    def message(self, text: str) -> None: ...
    def stopping(self) -> None: ...
    def close(self) -> None: ...


__all__ = ["QUIET_NOTICE_S", "RunOptions", "RunView"]
