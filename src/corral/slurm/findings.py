"""What every ``corral check`` check shares: a finding, the script as read,
and the shape of each srun step (its nodes and tasks per node).

Kept apart from the checks so that the shell-level ones (:mod:`corral.slurm.check`)
and the launcher ones (:mod:`corral.slurm.launchcheck`) read the job the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from corral.slurm.job import UTILITIES, Job, Launch
from corral.slurm.script import BatchScript, as_int

#: Job-level counts and the step-level variables to use inside a smaller step.
STEP_VARS = {"SLURM_NNODES": ("SLURM_STEP_NUM_NODES", "nodes"),
             "SLURM_JOB_NUM_NODES": ("SLURM_STEP_NUM_NODES", "nodes"),
             "SLURM_NTASKS": ("SLURM_STEP_NUM_TASKS", "tasks"), "SLURM_NPROCS": ("SLURM_STEP_NUM_TASKS", "tasks")}

#: sbatch's own limit on a batch script (slurm.conf max_script_size, 4 MB by default);
#: a training script bigger than this is not read either.
MAX_SCRIPT_BYTES = 4 * 1024 * 1024


def read_text(path: Path) -> str | None:
    """A regular file's text, or None when it is something else (a FIFO
    named train.py would block), bigger than :data:`MAX_SCRIPT_BYTES`, or
    unreadable."""
    try:
        if not path.is_file() or path.stat().st_size > MAX_SCRIPT_BYTES:
            return None
        return path.read_text(errors="replace")
    except OSError:
        return None


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One mistake: where, what it does on a real cluster, and the fix."""

    line: int
    code: str
    severity: str  # "error": breaks or hangs the job; "warning": slow, loses work, or depends on the site
    message: str
    fix: str


@dataclass(frozen=True)
class Ctx:
    """The script, its job, its launches, its literal variables and where its relative paths point."""

    script: BatchScript
    job: Job
    launches: tuple[Launch, ...]
    values: dict[str, str]
    base: Path  # where relative training-script paths are read from


def multi(ctx: Ctx) -> bool:
    """More than one node, or not said (then srun may spread it)."""
    return ctx.job.nodes is None or ctx.job.nodes > 1


def trains(launch: Launch) -> bool:
    """A step that runs the job's work (not ``srun hostname``, ``srun mkdir``)."""
    return launch.under_srun and (launch.kind != "srun" or not launch.words
                                  or Path(launch.words[0]).name not in UTILITIES)


def step_tasks(ctx: Ctx, launch: Launch) -> int | None:
    """Tasks per node of the step srun starts."""
    given = as_int(launch.srun.get("ntasks-per-node"))
    if given is not None:
        return given
    nodes = as_int(launch.srun.get("nodes")) or ctx.job.nodes
    ntasks = as_int(launch.srun.get("ntasks"))
    if ntasks is not None and nodes:
        return ntasks // nodes if ntasks % nodes == 0 else None
    return ctx.job.tasks_per_node


def step_nodes(ctx: Ctx, launch: Launch) -> int | None:
    return as_int(launch.srun.get("nodes")) or ctx.job.nodes
