"""What a batch script asks of Slurm and what it starts: the job's shape
from its ``#SBATCH`` lines, and each launch (``srun``, torchrun, accelerate,
DeepSpeed, a Python script) with the srun options it runs under.

Shared by ``corral check`` (which judges them) and its tests; pure reading,
no Slurm needed.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from corral.slurm.script import (
    BatchScript,
    Command,
    Directive,
    as_int,
    assignment,
    expand,
    parse_options,
    scan_commands,
    unquote,
)

#: The Slurm variables a batch script can rely on, and what they stand for.
_JOB_VALUES = {"SLURM_NNODES": "nodes", "SLURM_JOB_NUM_NODES": "nodes", "SLURM_GPUS_ON_NODE": "gpus",
               "SLURM_GPUS_PER_NODE": "gpus", "SLURM_NTASKS_PER_NODE": "tasks", "SLURM_CPUS_PER_TASK": "cpus"}
_PYTHON = re.compile(r"(?:.*/)?python[0-9.]*$")
#: Programs a step runs that are no training: a crash of one leaves nothing waiting.
UTILITIES = frozenset({"hostname", "mkdir", "rm", "cp", "mv", "echo", "printf", "nvidia-smi", "ls", "cat", "true",
                       "sleep", "date", "env", "printenv", "touch", "tar", "rsync", "uname", "df", "free", "ip",
                       "sbcast", "which", "pip", "conda", "module", "rocm-smi", "lscpu", "nproc", "id", "pwd"})
_WRAPPERS = frozenset({"exec", "time", "command", "nohup", "stdbuf", "env", "numactl", "apptainer",
                       "singularity", "nsys", "ncu"})


@dataclass(frozen=True, kw_only=True)
class Job:
    """The allocation the ``#SBATCH`` lines ask for (None: not said, or not a number)."""

    nodes: int | None
    tasks_per_node: int | None
    gpus_per_node: int | None
    cpus_per_task: int | None
    minutes: int | None


def minutes(value: str | None) -> int | None:
    """Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None for UNLIMITED or junk."""
    if not value:
        return None
    days, dash, rest = value.partition("-")
    if not dash:
        days, rest = "0", value
    parts = rest.split(":")
    if not days.isdigit() or not all(p.isdigit() for p in parts):
        return None
    d = int(days)
    if dash:  # D-H[:M[:S]]
        h, m = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        return d * 1440 + h * 60 + m
    if len(parts) == 3:
        return int(parts[0]) * 60 + int(parts[1])
    return int(parts[0])  # M or M:S


def _gpu_count(value: str | None) -> int | None:
    """``8``, ``a100:8``, ``gpu:8``, ``gpu:a100:8`` (first gpu entry of a gres list)."""
    if value is None:
        return None
    for item in value.split(","):
        parts = item.split(":")
        if parts[0] in ("gpu",) and len(parts) == 1:
            return 1
        if parts[0] == "gpu" or len(parts) <= 2:
            last = parts[-1].split("(")[0]
            if last.isdigit():
                return int(last)
    return None


def job_shape(script: BatchScript) -> Job:
    """The job's nodes, tasks per node, GPUs per node, CPUs per task and time limit."""
    def value(*names: str) -> str | None:
        d = script.option(*names)
        return d.value if d else None

    nodes_text = value("nodes")
    nodes = as_int(nodes_text)
    if nodes_text and "-" in nodes_text:
        low, _, high = nodes_text.partition("-")
        nodes = as_int(low) if low == high else None
    ntasks = as_int(value("ntasks"))
    if nodes is None and nodes_text is None and ntasks is None:
        nodes = 1
    tasks = as_int(value("ntasks-per-node"))
    if tasks is None and ntasks is not None and nodes:
        tasks = ntasks // nodes if ntasks % nodes == 0 else None
    if tasks is None and ntasks is None and not script.option("ntasks-per-node"):
        tasks = 1
    gpus = _gpu_count(value("gpus-per-node"))
    if gpus is None:
        gres = value("gres")
        gpus = _gpu_count(gres) if gres and "gpu" in gres else None
    if gpus is None and value("gpus-per-task") and tasks:
        per = _gpu_count(value("gpus-per-task"))
        gpus = per * tasks if per else None
    if gpus is None and value("gpus") and nodes:
        total = _gpu_count(value("gpus"))
        gpus = total // nodes if total and total % nodes == 0 else None
    return Job(nodes=nodes, tasks_per_node=tasks, gpus_per_node=gpus,
               cpus_per_task=as_int(value("cpus-per-task")), minutes=minutes(value("time")))


@dataclass(frozen=True, kw_only=True)
class Launch:
    """One program the script starts: under srun (``srun`` set) or by the batch shell."""

    command: Command  # the script's command (the srun line, or the line itself)
    kind: str  # torchrun, accelerate, deepspeed, python, srun (anything else under srun)
    words: tuple[str, ...]  # the program's words, from the launcher on
    srun: dict[str, str | None] = field(default_factory=dict)  # srun's own options
    under_srun: bool = False
    #: Inside a string a per-task shell runs (``srun bash -c '...'``).
    per_task: bool = False
    #: The Python script it runs, when there is one (``train.py``).
    program: str | None = None
    program_args: tuple[str, ...] = ()
    #: The other commands of that per-task string (``export MASTER_ADDR=...; torchrun ...``).
    inner: tuple[Command, ...] = ()


def _strip_wrappers(words: tuple[str, ...]) -> tuple[str, ...]:
    while words and (words[0] in _WRAPPERS or re.match(r"[A-Za-z_][A-Za-z0-9_]*=", words[0])):
        words = words[1:]
    return words


def _program(words: tuple[str, ...], start: int) -> tuple[str | None, tuple[str, ...]]:
    """The ``.py`` script among ``words[start:]`` (after the launcher's own options)."""
    for i in range(start, len(words)):
        if words[i].endswith(".py"):
            return words[i], tuple(words[i + 1:])
    return None, ()


def classify(words: tuple[str, ...]) -> tuple[str, str | None, tuple[str, ...]] | None:
    """(kind, script, its args) of a command's words, or None for anything else."""
    words = _strip_wrappers(words)
    if not words:
        return None
    head = Path(words[0]).name
    if head == "torchrun" or (_PYTHON.match(head) and words[1:3] in (["-m", "torch.distributed.run"],
                                                                      ("-m", "torch.distributed.run"))):
        return ("torchrun", *_program(words, 1))
    if _PYTHON.match(head) and len(words) > 2 and words[1] == "-m" and words[2] == "torch.distributed.launch":
        return ("torchrun", *_program(words, 3))
    if head == "accelerate" and words[1:2] == ("launch",):
        return ("accelerate", *_program(words, 2))
    if head == "deepspeed":
        return ("deepspeed", *_program(words, 1))
    if _PYTHON.match(head):
        return ("python", *_program(words, 1))
    return None


def _spelled_out(words: tuple[str, ...], assigned: dict[str, list[tuple[Command, str]]],
                 before: int) -> tuple[str, ...]:
    """``srun $CMD`` with ``CMD="$LAUNCHER train.py"`` and ``LAUNCHER="accelerate launch ..."``
    (accelerate's Slurm example): the words the variables hold, as written
    before line ``before``, so the launcher and its options can be read."""
    for _ in range(4):
        if not words or not re.fullmatch(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", words[0]):
            return words
        name = words[0].strip("${}")
        earlier = [raw for c, raw in assigned.get(name, []) if c.line < before]
        if not earlier:
            return words
        try:
            held = tuple(shlex.split(unquote(earlier[-1]).replace("\\\n", " ")))
        except ValueError:
            return words
        words = held + words[1:]
    return words


def launches(script: BatchScript) -> list[Launch]:
    """Every launcher or Python script the batch script starts, in order."""
    found: list[Launch] = []
    assigned = raw_assignments(script)
    for command in script.commands:
        words = _spelled_out(_strip_wrappers(command.words), assigned, command.line)
        if not words:
            continue
        if Path(words[0]).name == "srun":
            options, at = parse_options(words[1:])
            srun = dict(options)
            step = _spelled_out(_strip_wrappers(tuple(words[1 + at:])), assigned, command.line)
            inner = _inner(command, step)
            if inner is not None:
                for sub in inner:
                    kind = classify(sub.words)
                    if kind:
                        found.append(Launch(command=command, kind=kind[0], words=_strip_wrappers(sub.words),
                                            srun=srun, under_srun=True, per_task=True, program=kind[1],
                                            program_args=kind[2], inner=tuple(inner)))
                continue
            kind = classify(step)
            found.append(Launch(command=command, kind=kind[0] if kind else "srun", words=step, srun=srun,
                                under_srun=True, program=kind[1] if kind else None,
                                program_args=kind[2] if kind else ()))
            continue
        kind = classify(words)
        if kind:
            found.append(Launch(command=command, kind=kind[0], words=words, program=kind[1],
                                program_args=kind[2]))
    return found


def _inner(command: Command, step: tuple[str, ...]) -> list[Command] | None:
    """The commands of ``bash -c 'STRING'`` (or sh, zsh), which a shell of
    each task runs; None when the step is not such a shell."""
    if len(step) < 3 or Path(step[0]).name not in ("bash", "sh", "zsh", "dash"):
        return None
    flags = 1
    while flags < len(step) - 1 and re.fullmatch(r"-[a-z]+", step[flags]) and "c" not in step[flags]:
        flags += 1  # bash -l -c, sh -e -c
    if flags >= len(step) - 1 or not re.fullmatch(r"-[a-z]*c[a-z]*", step[flags]):
        return None  # bash script.sh: a file, not a string
    string = step[flags + 1]
    return scan_commands(string, command.line_of(string.split("\n", 1)[0][:40]), per_task=True)


def variables(script: BatchScript, job: Job) -> dict[str, str]:
    """What the script's variables hold where that is a literal (``GPUS=8``,
    ``NNODES=$SLURM_NNODES``), plus the Slurm variables the job's shape fixes."""
    values: dict[str, str] = {}
    shape = {"nodes": job.nodes, "gpus": job.gpus_per_node, "tasks": job.tasks_per_node, "cpus": job.cpus_per_task}
    for name, what in _JOB_VALUES.items():
        if shape[what] is not None:
            values[name] = str(shape[what])
    for command in script.commands:
        found = assignment(command)
        if found:
            name, raw = found
            if "$(" not in raw and "`" not in raw:
                values[name] = expand(unquote(raw), values)
            else:
                values.pop(name, None)
    return values


def raw_assignments(script: BatchScript) -> dict[str, list[tuple[Command, str]]]:
    """Every ``NAME=value`` of the batch shell, by name: (command, value as written)."""
    found: dict[str, list[tuple[Command, str]]] = {}
    for command in script.commands:
        pair = assignment(command)
        if pair:
            found.setdefault(pair[0], []).append((command, pair[1]))
    return found


def option(words: tuple[str, ...], *names: str) -> tuple[str, str] | None:
    """(name as written, value) of the first of ``names`` among ``words`` (``--x=v`` or ``--x v``)."""
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in names:
            if eq:
                return name, value
            if i + 1 < len(words):
                return name, words[i + 1]
    return None


def has_flag(words: tuple[str, ...], *names: str) -> bool:
    return any(w.partition("=")[0] in names for w in words)


__all__ = ["Directive", "Job", "Launch", "classify", "has_flag", "job_shape", "launches", "minutes", "option",
           "raw_assignments", "variables"]
