"""``corral submit``: a batch script that runs ``corral run``, submitted and followed.

The script asks for one task per node (corral's agent; it starts the ranks),
runs ``corral run`` in the background and waits for it, so that the batch
shell can pass Slurm's warning before the time limit (``--signal
B:USR1@120``) on to corral, which forwards it to every rank
(``corral.run.runner.Runner.forward``); with ``requeue`` the script then
asks Slurm to requeue the job, and the next run starts the same command
again (the script resumes from its own checkpoint).

Following a job reads Slurm's own view: ``scontrol show job`` for its state,
reason, nodes, exit code and output file, and the output file itself (on a
file system the head shares with the nodes, as on every Slurm cluster).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from corral.errors import CorralError, UsageError

#: Job states after which nothing more happens (squeue's long names).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"})
#: The warning before the time limit, unless asked otherwise: SIGUSR1 to the
#: batch shell (``B:``) two minutes before.
DEFAULT_SIGNAL = "USR1@120"
#: How often the job's state and output are read (seconds).
POLL_S = 0.5


class SlurmError(CorralError):
    """A Slurm command failed (sbatch refused the job, the controller did not answer)."""

    exit_code = 3
    category = "infrastructure"


@dataclass(frozen=True, kw_only=True)
class SubmitSpec:
    """What ``corral submit`` was asked for."""

    #: The training script (or command) and its arguments, as for ``corral run``.
    script: str
    args: tuple[str, ...] = ()
    nodes: int | None = None
    #: ``--gpus-per-node`` as Slurm takes it (``4``, ``a100:4``).
    gpus_per_node: str | None = None
    #: ``--time`` as Slurm takes it (``30``, ``1:00:00``, ``1-0``).
    time: str | None = None
    partition: str | None = None
    job_name: str | None = None
    #: Further sbatch options, each one word (``--account=proj``), written as ``#SBATCH`` lines.
    sbatch_options: tuple[str, ...] = ()
    #: ``corral run`` options (``--launcher``, ``-n``, ``--max-restarts``...), before the script.
    run_options: tuple[str, ...] = ()
    #: ``SIG@SECONDS`` sent to the batch shell before the time limit, forwarded to the ranks; None: none.
    signal: str | None = DEFAULT_SIGNAL
    #: Requeue the job after the time-limit signal (its script resumes from its checkpoint).
    requeue: bool = False
    #: Where the job's output goes (sbatch's ``%j`` is the job id).
    output: str = "slurm-%j.out"
    #: The directory the job runs in (the head's current one: shared with the nodes).
    workdir: str = field(default_factory=os.getcwd)
    #: The Python that has corral (the head's; the same path on the nodes).
    python: str = field(default_factory=lambda: sys.executable)


def check_signal(value: str) -> str:
    """``USR1@120``, ``SIGUSR2@60`` or ``B:USR1@120``, as sbatch's ``--signal`` (batch shell only)."""
    match = re.fullmatch(r"(?:B:)?(?:SIG)?(USR1|USR2)(?:@(\d+))?", value.strip(), re.IGNORECASE)
    if not match:
        raise UsageError(f"--signal {value!r}: expected USR1@SECONDS or USR2@SECONDS",
                         hint="e.g. --signal USR1@120: SIGUSR1 two minutes before the time limit, "
                              "forwarded to every rank")
    return f"{match.group(1).upper()}@{match.group(2) or 60}"


def check_sbatch_option(word: str) -> str:
    """One sbatch option as one word; a newline would end the ``#SBATCH`` line."""
    if not word.startswith("-") or "\n" in word or "\r" in word:
        raise UsageError(f"sbatch option {word!r}: expected one word such as --account=proj",
                         hint="give sbatch options before the script, with their value after '=' "
                              "(--account=proj, not --account proj)")
    return word


def batch_script(spec: SubmitSpec) -> str:
    """The sbatch script for ``spec`` (what ``corral submit --print`` shows)."""
    sb = ["#!/bin/bash",
          "# Written by `corral submit`: runs `corral run` inside the allocation, which starts",
          "# one corral agent per node as an srun job step and the ranks from there.",
          f"#SBATCH --job-name={spec.job_name or _job_name(spec.script)}"]
    if spec.nodes is not None:
        sb.append(f"#SBATCH --nodes={spec.nodes}")
    sb.append("#SBATCH --ntasks-per-node=1  # corral's agent; it starts the node's ranks")
    if spec.gpus_per_node:
        sb.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.time:
        sb.append(f"#SBATCH --time={spec.time}")
    if spec.partition:
        sb.append(f"#SBATCH --partition={spec.partition}")
    sb.append(f"#SBATCH --output={spec.output}")
    sb.append("#SBATCH --open-mode=append  # a requeued job adds to the same output")
    if spec.signal:
        sb.append(f"#SBATCH --signal=B:{spec.signal}  # to this script, which hands it to corral")
    sb.append("#SBATCH --requeue" if spec.requeue else "#SBATCH --no-requeue")
    sb += [f"#SBATCH {check_sbatch_option(o)}" for o in spec.sbatch_options]
    command = [spec.python, "-m", "corral", "run", *spec.run_options, "--", spec.script, *spec.args]
    sig = spec.signal.split("@")[0] if spec.signal else None
    body = [
        "",
        "set -u",
        f"cd {shlex.quote(spec.workdir)} || exit 2",
        'echo "corral submit: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST'
        ' (restart ${SLURM_RESTART_COUNT:-0})" >&2',
        "signalled=",
    ]
    if sig:
        body.append(f"trap 'signalled=1; kill -{sig} \"$pid\" 2>/dev/null' {sig}")
    body += [
        " ".join(shlex.quote(w) for w in command) + " &",
        "pid=$!",
        "# wait returns early when a trapped signal arrives: wait again until corral is gone",
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done',
        'wait "$pid"; rc=$?',
    ]
    if spec.requeue and sig:
        body += [
            'if [ -n "$signalled" ]; then',
            '  echo "corral submit: the time limit is near: requeueing job $SLURM_JOB_ID" >&2',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "fi",
        ]
    body.append('exit "$rc"')
    return "\n".join(sb + body) + "\n"


def _job_name(script: str) -> str:
    stem = os.path.splitext(os.path.basename(script))[0] or "job"
    return "corral-" + re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:40]


def submit(text: str, *, env: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """Hand ``text`` to ``sbatch``; the job id."""
    try:
        proc = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True, text=True,
                              timeout=60, env=None if env is None else dict(env), cwd=cwd, check=False)
    except FileNotFoundError:
        raise SlurmError("sbatch is not installed here", hint="run corral submit on a Slurm login node "
                         "(apt-get install slurm-client)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError("sbatch got no answer from the Slurm controller in 60 s",
                         hint="check `scontrol ping` and SLURM_CONF") from None
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"sbatch refused the job: {said[-1] if said else f'exit code {proc.returncode}'}",
                         hint="`corral submit --print ...` shows the script it was given")
    job = proc.stdout.strip().split(";")[0]
    if not job.isdigit():
        raise SlurmError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    return job


@dataclass(frozen=True, kw_only=True)
class JobInfo:
    """What ``scontrol show job`` says about a job (the fields corral follows)."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    #: ``rc`` of ``ExitCode=rc:signal``; with ``signal`` set, the job was killed.
    exit_code: int = 0
    exit_signal: int = 0
    stdout: str = ""
    restarts: int = 0

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def job_info(job_id: str, *, env: Mapping[str, str] | None = None) -> JobInfo | None:
    """The job as Slurm sees it now; None when it no longer knows it."""
    try:
        proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                              timeout=30, env=None if env is None else dict(env), check=False)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol did not answer about job {job_id} in 30 s",
                         hint="check `scontrol ping`") from None
    if proc.returncode != 0 or "JobId=" not in proc.stdout:
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout.splitlines()[0]))
    rc, _, sig = fields.get("ExitCode", "0:0").partition(":")
    return JobInfo(
        job_id=job_id, state=fields.get("JobState", "UNKNOWN"), reason=fields.get("Reason", ""),
        nodes=fields.get("NodeList", "") if fields.get("NodeList") != "(null)" else "",
        exit_code=int(rc) if rc.isdigit() else 0, exit_signal=int(sig) if sig.isdigit() else 0,
        stdout=fields.get("StdOut", ""), restarts=int(fields.get("Restarts", "0") or 0),
    )


def cancel(job_id: str, *, env: Mapping[str, str] | None = None) -> None:
    """``scancel`` the job: Slurm signals every step and the batch script, then kills them."""
    proc = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=30,
                          env=None if env is None else dict(env), check=False)
    if proc.returncode != 0:
        raise SlurmError(f"scancel {job_id} failed: {proc.stderr.strip()}",
                         hint=f"cancel it yourself: scancel {job_id}")


@dataclass(frozen=True, kw_only=True)
class Update:
    """One thing that happened to a followed job: a new state, or output."""

    info: JobInfo | None = None
    output: str = ""


def follow(job_id: str, *, env: Mapping[str, str] | None = None, poll: float = POLL_S,
           max_chunk: int = 1 << 20) -> Iterator[Update]:
    """Yield the job's state changes and its new output until it ends.

    The output file is read from where the last read stopped (a requeued job
    appends to it); at most ``max_chunk`` bytes per poll, so a job printing
    without end cannot grow the head's memory.
    """
    last: tuple | None = None
    offset = 0
    info: JobInfo | None = None
    while True:
        info = job_info(job_id, env=env) or info
        if info is None:
            raise SlurmError(f"Slurm does not know job {job_id}", hint="squeue --me lists your jobs")
        key = (info.state, info.reason, info.nodes, info.restarts)
        if key != last:
            last = key
            yield Update(info=info)
        text, offset = _read_from(info.stdout, offset, max_chunk)
        if text:
            yield Update(output=text)
        if info.final and not text:
            return
        if not text:
            time.sleep(poll)


def _read_from(path: str, offset: int, limit: int) -> tuple[str, int]:
    if not path:
        return "", offset
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(limit)
    except OSError:
        return "", offset
    if not data:
        return "", offset
    end = data.rfind(b"\n") + 1 if len(data) == limit and b"\n" in data else len(data)
    return data[:end].decode(errors="replace"), offset + end


def exit_code(info: JobInfo) -> int:
    """The code ``corral submit`` exits with: the job's own, 128+N when killed by signal N."""
    if info.exit_signal:
        return 128 + info.exit_signal
    if info.state == "COMPLETED":
        return info.exit_code
    if info.state == "CANCELLED":
        return 130
    return info.exit_code or 1


def split_leading_options(words: Sequence[str]) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """``[sbatch options...] SCRIPT ARGS`` -> (options, script, args)."""
    options = []
    rest = list(words)
    while rest and rest[0].startswith("-"):
        word = rest.pop(0)
        if word == "--":
            break
        options.append(check_sbatch_option(word))
    if not rest:
        raise UsageError("corral submit needs a script to run",
                         hint="corral submit --nodes 4 --time 1:00:00 train.py --lr 3e-4")
    if options and "=" not in options[-1] and not os.path.exists(rest[0]):
        # `--account proj train.py`: 'proj' is the option's value, not the script.
        raise UsageError(f"sbatch option {options[-1]} is followed by {rest[0]!r}, which is not a file",
                         hint=f"give sbatch options their value after '=': {options[-1]}={rest[0]}")
    return tuple(options), rest[0], tuple(rest[1:])
