"""``corral check job.sbatch``: the mistakes of hand-written Slurm batch
scripts that cost people days, named with the line and the fix.

Each check reads the script as :mod:`corral.slurm.script` cuts it (which
shell expands each variable, what srun starts with which options) and the
job's shape from its ``#SBATCH`` lines (:mod:`corral.slurm.job`).  What
happens on a real cluster, and why:

- ``$SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NODEID`` expanded by the
  batch shell: it runs once, on the first node, as task 0 of the batch
  step, before srun starts anything; every task gets its 0.
- Lightning under Slurm takes its processes from srun
  (``SLURMEnvironment``): ``--ntasks-per-node`` must equal
  ``Trainer(devices=...)`` and ``--nodes`` ``num_nodes``, or it refuses to
  start (recent versions) or hangs with colliding ranks (older ones).
- srun does not inherit ``--cpus-per-task`` from sbatch on Slurm 22.05 to
  23.10 (release notes of 22.05): each task gets one CPU and its data
  loaders share it, unless ``SRUN_CPUS_PER_TASK`` is exported or srun is
  given ``--cpus-per-task`` again.
- ``--gpus-per-task`` with several tasks per node binds each task to its
  own GPU (CUDA_VISIBLE_DEVICES of one): ``cuda:LOCAL_RANK`` is an "invalid
  device ordinal" and NCCL cannot see its peers' GPUs.
- MASTER_ADDR must be the first host of the allocation (where the batch
  shell runs, and where rank 0 starts).
- without ``--kill-on-bad-exit`` a crashed task leaves the others waiting
  in a collective until the time limit (unless the site sets
  KillOnBadExit=1).
- job-level variables (``SLURM_NNODES``, ``SLURM_NTASKS``) in a step that
  has fewer nodes or tasks.
- no ``--signal`` on a long job: the time limit kills it with no warning,
  no checkpoint, no requeue; and the ``B:`` form without a ``trap`` kills
  the batch shell itself.
- torchrun, accelerate and DeepSpeed options that disagree with the
  allocation, and a hard-coded rendezvous port two jobs on a node share.

Silence is the goal on a correct script: a check that cannot tell (a value
computed at run time, a site setting) says nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from corral.slurm.findings import (
    MAX_SCRIPT_BYTES,
    STEP_VARS,
    Ctx,
    Finding,
    multi,
    step_nodes,
    step_tasks,
    trains,
)
from corral.slurm.job import job_shape, launches, option, raw_assignments, variables
from corral.slurm.launchcheck import (
    accelerate_checks,
    lightning_checks,
    port_checks,
    torchrun_checks,
)
from corral.slurm.script import Command, as_int, assignment, read_script

__all__ = ["Finding", "Report", "check_file", "check_text"]

#: Variables that differ per task, and so must be expanded by each task's shell.
PER_TASK = {"SLURM_PROCID": "the task's global rank", "SLURM_LOCALID": "the task's rank on its node",
            "SLURM_NODEID": "the node's index in the job"}
#: Jobs at least this long (minutes) should ask for a signal before the limit.
LONG_JOB_MINUTES = 60
#: Signals torchrun catches and passes to its workers (others kill it on the spot).
TORCHRUN_SIGNALS = frozenset({"TERM", "INT", "HUP", "QUIT", "15", "2", "1", "3"})
_FIRST_HOST = re.compile(r"scontrol\s+show\s+hostnames?\b(?![^)]*\b(?:tail|sort\s+-r)\b)")
_OWN_HOST = re.compile(r"\$\(\s*hostname\b|`\s*hostname\b|\$\{?HOSTNAME\b|\$\{?SLURMD_NODENAME\b|"
                       r"\$\{?SLURM_LAUNCH_NODE_IPADDR\b|\$\(\s*(?:ip|ifconfig)\b")


@dataclass(frozen=True, kw_only=True)
class Report:
    """Everything ``corral check`` found in one script."""

    path: str
    findings: tuple[Finding, ...]
    #: The training scripts read for what they say (Lightning's Trainer).
    read: tuple[str, ...] = ()

    @property
    def errors(self) -> int:
        return sum(1 for f in self.findings if f.severity == "error")


def check_text(source: str, path: str = "job.sbatch", *, base: Path | None = None,
               training_script: Path | None = None) -> Report:
    """Check a batch script's text (``base``: the directory its relative
    paths are read from; ``training_script``: the Python script to read
    instead of the one the script names)."""
    script = read_script(source, path)
    job = job_shape(script)
    ctx = Ctx(script, job, tuple(launches(script)), variables(script, job), base or Path(path).parent)
    findings: list[Finding] = []
    for check in (_early_rank, _gpus_per_task, _cpus_per_task, _master_addr, _kill_on_bad_exit, _step_vars,
                  _signal, torchrun_checks, accelerate_checks, port_checks):
        findings.extend(check(ctx))
    lightning, read = lightning_checks(ctx, training_script)
    findings.extend(lightning)
    unique = {(f.line, f.code, f.message): f for f in findings}
    return Report(path=path, findings=tuple(sorted(unique.values(), key=lambda f: (f.line, f.code))),
                  read=tuple(read))


def check_file(path: Path, *, training_script: Path | None = None) -> Report:
    """Check the batch script at ``path`` (OSError when it cannot be read;
    ValueError when it is not a regular file of a batch script's size)."""
    if path.exists() and not path.is_dir() and not path.is_file():
        raise ValueError(f"{path} is not a regular file")
    if path.is_file() and path.stat().st_size > MAX_SCRIPT_BYTES:
        raise ValueError(f"{path} is bigger than a batch script may be ({MAX_SCRIPT_BYTES // 1024 // 1024} MiB)")
    source = path.read_text(errors="replace")
    return check_text(source, str(path), base=_workdir(source, path), training_script=training_script)


def _workdir(source: str, path: Path) -> Path:
    """Where the job's relative paths point: ``#SBATCH --chdir``, else the
    directory of the script (sbatch's default is the submitting directory,
    which is where people keep the script and train.py)."""
    script = read_script(source, str(path))
    chdir = script.option("chdir")
    if chdir and chdir.value and Path(chdir.value).is_absolute():
        return Path(chdir.value)
    return path.parent


def _is_batch(ctx: Ctx) -> bool:
    """A batch script (not a per-task wrapper that srun runs, where the
    per-task variables are right): it has #SBATCH lines or runs srun."""
    return bool(ctx.script.directives) or any(l.under_srun for l in ctx.launches)


# --------------------------------------------------------------------------
# the checks


def _early_rank(ctx: Ctx) -> list[Finding]:
    if not _is_batch(ctx):
        return []
    found = []
    for command in (*ctx.script.commands, *ctx.script.heredoc_lines):
        if not command.heredoc and command.words[:1] in (("echo",), ("printf",)):
            continue  # a log line of the batch shell: says 0, harms nothing
        for exp in command.expansions:
            if not exp.early or exp.name not in PER_TASK:
                continue
            name = exp.name
            if command.heredoc:
                fix = (f"quote the heredoc's delimiter (<<'EOF') so the file keeps ${name} as written and each "
                       "task's shell expands it")
            else:
                fix = (f"let each task's shell expand it: put it in single quotes, srun bash -c '... ${name} ...' "
                       f"(or escape it, \\${name}, inside double quotes)")
            found.append(Finding(
                line=exp.line, code="per-task-variable-expanded-early", severity="error",
                message=(f"${name} ({PER_TASK[name]}) is expanded by the batch shell, which runs once, on the "
                         "first node, before srun starts any task: every task gets the batch step's value, 0 "
                         "(every node thinks it is node 0, ranks collide or the job hangs)"),
                fix=fix))
    return found


def _gpus_per_task(ctx: Ctx) -> list[Finding]:
    found = []
    job_level = ctx.script.option("gpus-per-task")
    job_bind = ctx.script.option("gpu-bind")
    for launch in ctx.launches:
        if not launch.under_srun or launch.kind in ("srun", "deepspeed") and launch.program is None:
            continue
        per_task = launch.srun.get("gpus-per-task") or (job_level.value if job_level else None)
        bind = launch.srun.get("gpu-bind") or (job_bind.value if job_bind else None)
        tasks = step_tasks(ctx, launch)
        if per_task is None or (bind or "").endswith("none") or tasks is None or tasks < 2:
            continue
        line = launch.command.line_of("--gpus-per-task") if "gpus-per-task" in launch.srun else job_level.line
        found.append(Finding(
            line=line, code="gpus-per-task", severity="error",
            message=(f"--gpus-per-task={per_task} with {tasks} tasks per node binds each task to its own GPU "
                     "(CUDA_VISIBLE_DEVICES holds one): torch.cuda.set_device(LOCAL_RANK) fails with "
                     "\"invalid device ordinal\" on every task but the first of a node, and NCCL cannot see its "
                     "peers' GPUs (no P2P/NVLink between them)"),
            fix=("ask for the GPUs per node instead (#SBATCH --gpus-per-node=G with --ntasks-per-node=G) so every "
                 "task sees all of its node's GPUs and picks its own by LOCAL_RANK; or keep --gpus-per-task and "
                 "add --gpu-bind=none")))
    return found


def _assigned_before(ctx: Ctx, name: str, line: int) -> bool:
    return any(c.line < line for c, _ in raw_assignments(ctx.script).get(name, []))


def _cpus_per_task(ctx: Ctx) -> list[Finding]:
    if not ctx.job.cpus_per_task or ctx.job.cpus_per_task < 2:
        return []
    found = []
    for launch in {l.command.line: l for l in ctx.launches if trains(l)}.values():
        command = launch.command
        if "cpus-per-task" in launch.srun:
            continue
        if _assigned_before(ctx, "SRUN_CPUS_PER_TASK", command.line):
            continue
        n = ctx.job.cpus_per_task
        found.append(Finding(
            line=command.line, code="srun-cpus-per-task", severity="warning",
            message=(f"srun does not inherit --cpus-per-task={n} from the job on Slurm 22.05 to 23.10: each task "
                     "gets 1 CPU, so its data loader workers and threads share one core and the GPUs starve"),
            fix=("export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK before this srun (or give srun "
                 "--cpus-per-task=$SLURM_CPUS_PER_TASK)")))
    return found


def _address_problem(ctx: Ctx, raw: str, *, per_task: bool) -> str | None:
    """Why ``raw`` (a MASTER_ADDR as written) is not the allocation's first
    host, or None when it is (or corral cannot tell)."""
    for _ in range(4):  # follow MASTER_ADDR=$head_node to head_node's own value
        m = re.fullmatch(r"[\"']?\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?[\"']?", raw.strip())
        if not m or m.group(1) not in raw_assignments(ctx.script):
            break
        raw = raw_assignments(ctx.script)[m.group(1)][-1][1]
    if _FIRST_HOST.search(raw) or re.search(r"srun\b.*(?:-w|--nodelist)\b", raw):
        return None
    if _OWN_HOST.search(raw):
        if per_task:
            return ("it is the host each task runs on, so every node has its own MASTER_ADDR and the ranks "
                    "wait on different stores")
        return None  # the batch shell runs on the allocation's first node: its own name is right
    text = raw.strip().strip("\"'")
    if "$" in text or "`" in text or not text:
        return None
    if text in ("localhost", "::1") or text.startswith("127."):
        return (f"{text} is each node's own loopback: the ranks of the other nodes never reach rank 0's store"
                if multi(ctx) else None)
    return (f"{text} is hard-coded: Slurm may give the job other nodes, and rank 0 starts on the allocation's "
            "first node, so the ranks wait for a store that is not there (or join another job's)")


def _master_addr(ctx: Ctx) -> list[Finding]:
    found = []
    fix = ('export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) in the batch script, '
           "before srun")
    for command, raw in raw_assignments(ctx.script).get("MASTER_ADDR", []):
        why = _address_problem(ctx, raw, per_task=False)
        if why:
            found.append(Finding(line=command.line, code="master-addr", severity="error",
                                 message=f"MASTER_ADDR is not the allocation's first host: {why}", fix=fix))
    for launch in ctx.launches:
        for sub in launch.inner:
            pair = assignment(sub)
            if pair and pair[0] == "MASTER_ADDR":
                why = _address_problem(ctx, pair[1], per_task=True)
                if why:
                    found.append(Finding(line=sub.line, code="master-addr", severity="error",
                                         message=f"MASTER_ADDR is not the allocation's first host: {why}", fix=fix))
        for names in (("--master_addr", "--master-addr"), ("--main_process_ip", "--main-process-ip"),
                      ("--rdzv_endpoint", "--rdzv-endpoint")):
            got = option(launch.words, *names)
            if not got:
                continue
            host = got[1].rsplit(":", 1)[0] if names[0] == "--rdzv_endpoint" else got[1]
            raw = _raw_word(launch.command, got[1]) or host
            why = _address_problem(ctx, raw.rsplit(":", 1)[0] if names[0] == "--rdzv_endpoint" else raw,
                                   per_task=launch.per_task and not _early_text(launch.command, raw))
            if why:
                found.append(Finding(line=launch.command.line_of(got[0]), code="master-addr", severity="error",
                                     message=f"{got[0]} is not the allocation's first host: {why}",
                                     fix=fix + f", and pass {names[0]}=$MASTER_ADDR"))
    return found


def _raw_word(command: Command, word: str) -> str | None:
    """A word as written in the command's text (before quote removal), when found."""
    return word if word in command.text else None


def _early_text(command: Command, raw: str) -> bool:
    return any(e.early for e in command.expansions if e.name in raw)


def _kill_on_bad_exit(ctx: Ctx) -> list[Finding]:
    if "SLURM_KILL_BAD_EXIT" in raw_assignments(ctx.script):
        return []
    found = []
    for launch in {l.command.line: l for l in ctx.launches if trains(l)}.values():
        tasks = (step_tasks(ctx, launch) or 1) * (step_nodes(ctx, launch) or 2)
        value = launch.srun.get("kill-on-bad-exit", "absent")
        if tasks < 2 or (value != "absent" and value != "0") or "K" in launch.srun:
            continue
        found.append(Finding(
            line=launch.command.line, code="kill-on-bad-exit", severity="warning",
            message=("srun without --kill-on-bad-exit: when one task crashes the others stay in their next "
                     "collective, waiting for it, until the NCCL timeout or the job's time limit (unless the site "
                     "sets KillOnBadExit=1)"),
            fix="srun --kill-on-bad-exit=1 ... (or export SLURM_KILL_BAD_EXIT=1 before srun)"))
    return found


def _step_vars(ctx: Ctx) -> list[Finding]:
    found = []
    for launch in ctx.launches:
        if not launch.under_srun:
            continue
        step_nodes = as_int(launch.srun.get("nodes"))
        step_tasks = as_int(launch.srun.get("ntasks"))
        job_tasks = (ctx.job.nodes or 0) * (ctx.job.tasks_per_node or 0) or None
        for exp in launch.command.expansions:
            if exp.name not in STEP_VARS or not exp.early:  # per task, srun may give the step's own
                continue
            better, what = STEP_VARS[exp.name]
            step, job = (step_nodes, ctx.job.nodes) if what == "nodes" else (step_tasks, job_tasks)
            if step is None or job is None or step >= job:
                continue
            found.append(Finding(
                line=exp.line, code="job-variable-in-step", severity="error",
                message=(f"${exp.name} is the job's {what} ({job}), but this srun step has {step}: "
                         f"the {what} it counts never all arrive and the rendezvous waits until it times out"),
                fix=(f"use ${better} (the step's own count), expanded inside the step: srun ... bash -c "
                     f"'... ${better} ...'")))
    return found


def _signal(ctx: Ctx) -> list[Finding]:
    found = []
    signal = ctx.script.option("signal")
    srun_signal = any("signal" in l.srun for l in ctx.launches)
    time = ctx.script.option("time")
    if signal is None and not srun_signal:
        if ctx.job.minutes is not None and ctx.job.minutes >= LONG_JOB_MINUTES and time is not None:
            found.append(Finding(
                line=time.line, code="no-signal", severity="warning",
                message=(f"a {ctx.job.minutes // 60} h job with no --signal: at the time limit Slurm kills "
                         "every task with no warning, so nothing saves a checkpoint and nothing requeues it"),
                fix=("ask for a signal before the limit and save a checkpoint when it comes: #SBATCH "
                     "--signal=TERM@120 for torchrun/accelerate (they pass SIGTERM to the ranks), "
                     "--signal=SIGUSR1@90 for Lightning (its SLURMEnvironment checkpoints and requeues)")))
        return found
    if signal is None:
        return found
    value = signal.value or ""
    name = value.split("@")[0].removeprefix("B:").removeprefix("R:").removeprefix("SIG").upper()
    if value.startswith(("B:", "RB:", "BR:")):
        traps = [c for c in ctx.script.commands if c.words[:1] == ("trap",)]
        if not any(name in " ".join(c.words[2:]).upper() for c in traps):
            found.append(Finding(
                line=signal.line, code="signal-batch-untrapped", severity="error",
                message=(f"--signal={value} goes to the batch shell only, and the script has no trap for "
                         f"SIG{name}: bash ends at the signal, the job ends with it, the tasks get no warning"),
                fix=(f"trap it and pass it on: trap 'kill -TERM $SRUN_PID' {name}; start srun in the background "
                     "(srun ... & SRUN_PID=$!) and wait $SRUN_PID; or drop B: so the tasks get it themselves")))
        else:
            foreground = [l for l in ctx.launches if l.under_srun and not l.command.background]
            if foreground:
                found.append(Finding(
                    line=foreground[0].command.line, code="signal-trap-foreground", severity="warning",
                    message=(f"the batch shell traps SIG{name}, but runs srun in the foreground: bash runs a trap "
                             "only when the command it waits for ends, i.e. at the time limit, too late"),
                    fix="start srun in the background and wait for it: srun ... & wait $!"))
        return found
    handled = " ".join(raw for _, raw in raw_assignments(ctx.script).get("TORCHELASTIC_SIGNALS_TO_HANDLE", []))
    if name in TORCHRUN_SIGNALS or re.search(rf"\bSIG{name}\b", handled.upper()):
        return found
    for launch in ctx.launches:
        told = option(launch.words, "--signals-to-handle", "--signals_to_handle")
        if told and re.search(rf"\bSIG{name}\b", told[1].upper()):
            continue
        if launch.under_srun and launch.kind in ("torchrun", "accelerate"):
            before = value.split("@")[1] if "@" in value else "120"
            found.append(Finding(
                line=signal.line, code="signal-kills-launcher", severity="error",
                message=(f"--signal={value} goes to every task, here {launch.kind}, which catches only SIGTERM, "
                         f"SIGINT, SIGHUP and SIGQUIT: SIG{name} kills it on the spot and its ranks never hear of "
                         "the time limit"),
                fix=(f"send SIGTERM instead (#SBATCH --signal=TERM@{before}): {launch.kind} passes it to every "
                     "rank and gives them 30 s to save a checkpoint (torch 2.9 and later can pass SIG{name} on: "
                     f"torchrun --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIG{name})")))
            break
    return found


