"""The srun transport: inside a Slurm allocation, a node is reached as a job step.

``corral run`` inside ``salloc`` or an ``sbatch`` script opens its agents
with ``srun``, not ``ssh``: no keys, no sshd, and Slurm accounts for every
process (they are in the job's steps; ``scancel`` and the time limit reach
them).  Each node is one step of one task (``--nodes=1 --ntasks=1
--nodelist=NODE``), so each agent has its own stdin/stdout pipe, exactly
like an ssh channel, and the agent protocol is unchanged: one step per node
rather than one step of N tasks, whose stdout srun would merge and whose
stdin it would broadcast.  The options, and why:

- ``--overlap``: the steps share the allocation's CPUs with each other, with
  the batch script and with any other step (``corral doctor`` while a run
  goes on); without it a second step waits for the first to end;
- ``--kill-on-bad-exit=1``: a step whose task fails is ended at once;
- ``--cpus-per-task=C``, C = the CPUs the *job* has on that node
  (``SLURM_JOB_CPUS_PER_NODE``): the agent's one task holds every rank of the
  node; a one-CPU task (the default, or a ``--cpus-per-task`` inherited from
  the job for *one* rank) would bind all of them to one CPU and starve the
  data loaders;
- ``--unbuffered``: frames reach the head as they are written;
- ``--quiet``: no "job step created" chatter on stderr;
- ``--export=ALL``: the node sees the environment corral was started in, as
  Slurm's own tasks do (modules loaded in the batch script); the agent drops
  the step's own rank variables from what the ranks get
  (``corral.agent.jobenv.FOREIGN_RANK_VARS``).

Stopping: srun forwards a SIGTERM to the step and ends it (Slurm cancels it,
then SIGKILLs it after ``KillWait``); a SIGKILLed srun would leave the step
running, so ``kill`` starts with SIGTERM.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from corral.errors import HostError
from corral.hostrange import expand
from corral.model import Cluster, Host
from corral.transport.ssh import quote

#: The command that launches steps (``$CORRAL_SRUN`` names another one).
SRUN = "srun"
#: Options every agent step gets (see the module docstring).
STEP_OPTIONS = ("--nodes=1", "--ntasks=1", "--overlap", "--kill-on-bad-exit=1", "--unbuffered",
                "--quiet", "--export=ALL")


def in_allocation(environ: Mapping[str, str] | None = None) -> bool:
    """Whether corral runs inside a Slurm allocation (salloc, sbatch, srun)."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def job_cpus_per_node(environ: Mapping[str, str]) -> dict[str, int]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``16(x2),8``) by node name; {} when it cannot be read."""
    nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    text = environ.get("SLURM_JOB_CPUS_PER_NODE") or ""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return {}
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    try:
        names = expand(nodes)
    except ValueError:
        return {}
    return dict(zip(names, counts)) if len(names) == len(counts) else {}


class SrunTransport:
    """Builds ``srun`` argv for the nodes of the current allocation."""

    name = "srun"

    def __init__(self, cluster: Cluster, *, connect_timeout: float = 10.0, job_id: str | None = None):
        self.cluster = cluster
        self.connect_timeout = connect_timeout
        self.job_id = job_id or os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
        self.cpus = job_cpus_per_node(os.environ)

    def argv(self, host: Host, remote: list[str]) -> list[str]:
        argv = [os.environ.get("CORRAL_SRUN") or SRUN, *STEP_OPTIONS, f"--nodelist={host.name}",
                f"--job-name=corral:{host.name}"]
        if host.name in self.cpus:
            argv.append(f"--cpus-per-task={self.cpus[host.name]}")
        if self.job_id:
            argv.append(f"--jobid={self.job_id}")
        # srun runs the argv itself (no login shell in between): no quoting.
        return argv + ["--", *remote]

    def env(self) -> None:
        """srun passes corral's environment on (``--export=ALL``): the node
        runs in the allocation's environment, as Slurm's tasks do."""
        return None

    def failure(self, host: Host, returncode: int, stderr: str) -> HostError:
        return classify_srun_failure(host, returncode, stderr)


_RULES: list[tuple[str, str, str, str]] = [
    # (regex on srun's stderr, kind, message, hint)
    (r"Invalid job id|Job has been cancelled|job \d+ (?:queued|has been revoked)|Unable to confirm allocation",
     "unreachable", "the Slurm allocation is gone (cancelled, or past its time limit)",
     "start corral again inside a live allocation (salloc/sbatch), or check `squeue --me`"),
    (r"Requested node configuration is not available|not in the allocation|Invalid node name",
     "unknown-host", "it is not a node of this Slurm allocation",
     "run corral with no -c/-H inside the allocation: it reads the node list from SLURM_JOB_NODELIST"),
    (r"Unable to contact slurm controller|Socket timed out|Zero Bytes were transmitted",
     "unreachable", "srun cannot reach the Slurm controller",
     "check `scontrol ping` and SLURM_CONF; retry once the controller answers"),
    (r"Communication connection failure|Connection refused|No route to host|Node failure|NODE_FAIL"
     r"|Task launch for StepId=\S+ failed|Unable to launch",
     "unreachable", "Slurm could not start the agent's step there (its slurmd did not answer)",
     "check the node with `sinfo -N -n {name}` and `scontrol show node {name}`"),
    (r"CANCELLED|forcing job termination|Job step aborted",
     "lost", "its job step was cancelled (scancel, the time limit, or a failed node)",
     "see `sacct -j $SLURM_JOB_ID` for why the step ended"),
]


def classify_srun_failure(host: Host, returncode: int, stderr: str) -> HostError:
    """Turn srun's exit status and stderr into a named, hinted HostError."""
    text = stderr.strip()
    for pattern, kind, message, hint in _RULES:
        if re.search(pattern, text):
            return HostError(host.name, message, hint=hint.format(name=host.name), kind=kind)
    if returncode == 127 or "execve()" in text:  # slurmstepd could not exec the interpreter
        return HostError(host.name, f"cannot run the interpreter {host.python!r} there",
                         hint=f"install Python 3.8+ on {host.name} or set `python` for it", kind="no-python")
    if not text:
        return HostError(host.name, f"its job step ended (srun exit code {returncode}) without a message",
                         hint=f"the node went down, or its slurmd or corral's agent there was killed: "
                              f"`sinfo -N -n {host.name}`", kind="ssh-failed")
    last = quote(text.splitlines()[-1])
    return HostError(host.name, f"srun failed: {last}", kind="ssh-failed")
