"""``corral export sbatch``: a plain Slurm batch script that needs no corral on the cluster.

For people who must hand a script to their admins, or who run where corral
is not installed: srun with torchrun, accelerate or Lightning, written the
way that avoids every mistake ``corral check`` names (see
:mod:`corral.slurm.check`), each line commented with why.  The test of this
module runs ``corral check`` on what it renders: it must be silent.

Pure text from a typed spec; nothing here runs Slurm.  Every value that
lands in the script is either checked against a strict pattern (job name,
partition, time...) or quoted with ``shlex.quote`` (the program and its
arguments), so no spec can add a line or a command to the script.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from corral.errors import UsageError
from corral.slurm.job import minutes

LAUNCHERS = ("torchrun", "accelerate", "lightning")
#: What a Slurm name or option value may hold here (no blank, quote, newline or shell character).
_SAFE = re.compile(r"[A-Za-z0-9_.,:@%=+/-]+")
_OPTION = re.compile(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9_.,:@%=+/-]+)?")


@dataclass(frozen=True, kw_only=True)
class SbatchSpec:
    """What the batch script runs, and on what."""

    program: str
    args: tuple[str, ...] = ()
    #: torchrun (one per node, starting one process per GPU), accelerate (the same),
    #: lightning (one srun task per GPU: Lightning's SLURMEnvironment).
    launcher: str = "torchrun"
    nodes: int = 1
    gpus_per_node: int = 1
    #: CPUs for each task (torchrun/accelerate: for all the node's ranks; Lightning: for one rank).
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    #: Seconds before the time limit the ranks are told (SIGTERM, Lightning: SIGUSR1).
    signal_seconds: int = 120
    #: Requeue the job when the time limit ended it, to resume from the checkpoint.
    requeue: bool = False
    #: Further ``#SBATCH`` options as sbatch takes them (``--constraint=a100``).
    sbatch_options: tuple[str, ...] = ()
    python: str = "python"


def _check(spec: SbatchSpec) -> None:
    """Refuse what would not make a valid, safe script, naming the flag."""
    if spec.launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {spec.launcher}: export sbatch writes {', '.join(LAUNCHERS)}",
                         hint="DeepSpeed's own launcher uses pdsh, not srun: run it with --launcher torchrun "
                              "(deepspeed.initialize works under torchrun)")
    for flag, value in (("--nodes", spec.nodes), ("--gpus-per-node", spec.gpus_per_node),
                        ("--cpus-per-task", spec.cpus_per_task or 1), ("--signal-before", spec.signal_seconds)):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    for flag, value in (("--partition", spec.partition), ("--account", spec.account),
                        ("--job-name", spec.job_name), ("--time", spec.time), ("--python", spec.python)):
        if value is not None and not _SAFE.fullmatch(value):
            raise UsageError(f"{flag} {value!r}: only letters, digits and _.,:@%=+/- may appear in a batch "
                             "script's option here", hint=f"give {flag} a plain Slurm value")
    if spec.time is not None and minutes(spec.time) is None:
        raise UsageError(f"--time {spec.time}: not a Slurm time",
                         hint="minutes, HH:MM:SS or D-HH:MM:SS (e.g. --time 24:00:00)")
    for option in spec.sbatch_options:
        if not _OPTION.fullmatch(option):
            raise UsageError(f"--sbatch {option!r}: give one long sbatch option as --name or --name=value",
                             hint="e.g. --sbatch --constraint=a100 --sbatch --exclusive")


def _directives(spec: SbatchSpec) -> list[str]:
    g = spec.gpus_per_node
    lightning = spec.launcher == "lightning"
    lines = [f"#SBATCH --job-name={spec.job_name or _job_name(spec.program)}"]
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    lines.append(f"#SBATCH --nodes={spec.nodes}")
    if lightning:
        lines.append(f"#SBATCH --ntasks-per-node={g}"
                     "  # one task per GPU: Lightning takes its processes from srun (Trainer devices must be "
                     f"{g}, num_nodes {spec.nodes})")
    else:
        lines.append(f"#SBATCH --ntasks-per-node=1  # one {spec.launcher} per node; it starts one process per GPU")
    lines.append(f"#SBATCH --gpus-per-node={g}  # per node, not --gpus-per-task: every rank sees all its node's "
                 "GPUs (NCCL needs them; no \"invalid device ordinal\")")
    if spec.cpus_per_task:
        whom = "each rank and its data loaders" if lightning else f"{spec.launcher} and the node's {g} ranks"
        lines.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task}  # CPUs for {whom}")
    if spec.time:
        lines.append(f"#SBATCH --time={spec.time}")
    if lightning:
        lines.append(f"#SBATCH --signal=SIGUSR1@{spec.signal_seconds}  # Lightning saves a checkpoint on SIGUSR1 "
                     "and requeues the job (SLURMEnvironment auto_requeue)")
    else:
        lines.append(f"#SBATCH --signal=TERM@{spec.signal_seconds}  # SIGTERM {spec.signal_seconds} s before the "
                     f"time limit: {spec.launcher} passes it to every rank, which can save a checkpoint")
    if spec.requeue:
        lines.append("#SBATCH --requeue  # may go back to the queue and resume from its checkpoint")
    lines.append("#SBATCH --output=%x-%j.out")
    lines.extend(f"#SBATCH {option}" for option in spec.sbatch_options)
    return lines


def _job_name(program: str) -> str:
    stem = re.sub(r"\.py$", "", program.rsplit("/", 1)[-1])
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "train"


def _program_words(spec: SbatchSpec) -> str:
    return " ".join(shlex.quote(w) for w in (spec.program, *spec.args))


def _launch(spec: SbatchSpec) -> list[str]:
    g = spec.gpus_per_node
    if spec.launcher == "lightning":
        return [
            "# srun starts every rank (one per GPU); Lightning reads its rank, node and MASTER_ADDR from Slurm.",
            "# --kill-on-bad-exit: when one rank fails the whole step ends, instead of the others waiting in",
            "# a collective until the time limit.",
            f"srun --kill-on-bad-exit=1 {shlex.quote(spec.python)} {_program_words(spec)}",
        ]
    if spec.launcher == "torchrun":
        tool = [
            "exec torchrun \\",
            '    --nnodes="$SLURM_STEP_NUM_NODES" \\',
            f"    --nproc-per-node={g} \\",
            '    --node-rank="$SLURM_NODEID" \\',
            '    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \\',
            '    "$@"',
        ]
    else:
        tool = [
            "exec accelerate launch \\",
            *(["    --multi_gpu \\"] if spec.nodes * g > 1 else []),
            '    --num_machines "$SLURM_STEP_NUM_NODES" \\',
            f'    --num_processes "$((SLURM_STEP_NUM_NODES * {g}))" \\',
            '    --machine_rank "$SLURM_NODEID" \\',
            '    --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \\',
            '    "$@"',
        ]
    return [
        f"# One task per node, each a {spec.launcher}. The command is in single quotes so that each task's own",
        "# shell expands $SLURM_NODEID (this batch shell would give every node its 0); the script and its",
        '# arguments come after it, as "$@". --kill-on-bad-exit: when one node fails the whole step ends,',
        "# instead of the others waiting in a collective until the time limit.",
        "srun --kill-on-bad-exit=1 bash -c '",
        *("  " + line for line in tool),
        f"' bash {_program_words(spec)}",
    ]


def render(spec: SbatchSpec) -> str:
    """The batch script for ``spec``: plain bash and sbatch, commented line by
    line.  UsageError for a value that cannot go into a batch script."""
    _check(spec)
    n, g = spec.nodes, spec.gpus_per_node
    what = "one task per GPU" if spec.launcher == "lightning" else f"one {spec.launcher} per node"
    lines = [
        "#!/bin/bash",
        f"# {spec.program} on {n} node(s) x {g} GPU(s), {what}; written by `corral export sbatch`.",
        "# Plain sbatch and srun, no corral needed on the cluster: sbatch this file. `corral check` reads it.",
        *_directives(spec),
        "",
        "# srun does not inherit --cpus-per-task from the job on Slurm 22.05 to 23.10: hand it on.",
        'export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"',
    ]
    if spec.launcher != "lightning":
        lines += [
            "# The rendezvous host: the allocation's first node (this batch shell runs there, rank 0 too).",
            'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            "# A port of this job's own: a fixed one (29500) clashes with any other job on that node.",
            "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        ]
    lines += ["", *_launch(spec), "status=$?"]
    if spec.requeue and spec.launcher != "lightning":
        lines += [
            "",
            "# Ended by the time limit's signal (the ranks saved a checkpoint): back to the queue, to resume.",
            'if [ "$status" -ne 0 ] && [ -n "${SLURM_JOB_END_TIME:-}" ] \\',
            f'        && [ $((SLURM_JOB_END_TIME - $(date +%s))) -le {spec.signal_seconds} ]; then',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "fi",
        ]
    lines += ['exit "$status"', ""]
    return "\n".join(lines)
