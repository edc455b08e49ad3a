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

from corral.run.scriptcheck import lightning_shape
from corral.slurm.job import UTILITIES, Job, Launch, has_flag, job_shape, launches, option, raw_assignments, variables
from corral.slurm.script import BatchScript, Command, as_int, assignment, expand, read_script

#: Variables that differ per task, and so must be expanded by each task's shell.
PER_TASK = {"SLURM_PROCID": "the task's global rank", "SLURM_LOCALID": "the task's rank on its node",
            "SLURM_NODEID": "the node's index in the job"}
#: Job-level counts and the step-level variables to use inside a smaller step.
STEP_VARS = {"SLURM_NNODES": ("SLURM_STEP_NUM_NODES", "nodes"),
             "SLURM_JOB_NUM_NODES": ("SLURM_STEP_NUM_NODES", "nodes"),
             "SLURM_NTASKS": ("SLURM_STEP_NUM_TASKS", "tasks"), "SLURM_NPROCS": ("SLURM_STEP_NUM_TASKS", "tasks")}
#: Jobs at least this long (minutes) should ask for a signal before the limit.
LONG_JOB_MINUTES = 60
#: Signals torchrun catches and passes to its workers (others kill it on the spot).
TORCHRUN_SIGNALS = frozenset({"TERM", "INT", "HUP", "QUIT", "15", "2", "1", "3"})
_LIGHTNING_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:lightning|pytorch_lightning)\b", re.M)
_FIRST_HOST = re.compile(r"scontrol\s+show\s+hostnames?\b(?![^)]*\b(?:tail|sort\s+-r)\b)")
_OWN_HOST = re.compile(r"\$\(\s*hostname\b|`\s*hostname\b|\$\{?HOSTNAME\b|\$\{?SLURMD_NODENAME\b|"
                       r"\$\{?SLURM_LAUNCH_NODE_IPADDR\b|\$\(\s*(?:ip|ifconfig)\b")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One mistake: where, what it does on a real cluster, and the fix."""

    line: int
    code: str
    severity: str  # "error": breaks or hangs the job; "warning": slow, loses work, or depends on the site
    message: str
    fix: str


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


@dataclass(frozen=True)
class _Ctx:
    script: BatchScript
    job: Job
    launches: tuple[Launch, ...]
    values: dict[str, str]
    base: Path  # where relative training-script paths are read from


def check_text(source: str, path: str = "job.sbatch", *, base: Path | None = None,
               training_script: Path | None = None) -> Report:
    """Check a batch script's text (``base``: the directory its relative
    paths are read from; ``training_script``: the Python script to read
    instead of the one the script names)."""
    script = read_script(source, path)
    job = job_shape(script)
    ctx = _Ctx(script, job, tuple(launches(script)), variables(script, job), base or Path(path).parent)
    findings: list[Finding] = []
    for check in (_early_rank, _gpus_per_task, _cpus_per_task, _master_addr, _kill_on_bad_exit, _step_vars,
                  _signal, _torchrun, _accelerate, _ports):
        findings.extend(check(ctx))
    lightning, read = _lightning(ctx, training_script)
    findings.extend(lightning)
    unique = {(f.line, f.code, f.message): f for f in findings}
    return Report(path=path, findings=tuple(sorted(unique.values(), key=lambda f: (f.line, f.code))),
                  read=tuple(read))


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


def _is_batch(ctx: _Ctx) -> bool:
    """A batch script (not a per-task wrapper that srun runs, where the
    per-task variables are right): it has #SBATCH lines or runs srun."""
    return bool(ctx.script.directives) or any(l.under_srun for l in ctx.launches)


def _multi(ctx: _Ctx) -> bool:
    """More than one node, or not said (then srun may spread it)."""
    return ctx.job.nodes is None or ctx.job.nodes > 1


# --------------------------------------------------------------------------
# the checks


def _early_rank(ctx: _Ctx) -> list[Finding]:
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


def _trains(launch: Launch) -> bool:
    """A step that runs the job's work (not ``srun hostname``, ``srun mkdir``)."""
    return launch.under_srun and (launch.kind != "srun" or not launch.words
                                  or Path(launch.words[0]).name not in UTILITIES)


def _step_tasks(ctx: _Ctx, launch: Launch) -> int | None:
    """Tasks per node of the step srun starts."""
    given = as_int(launch.srun.get("ntasks-per-node"))
    if given is not None:
        return given
    nodes = as_int(launch.srun.get("nodes")) or ctx.job.nodes
    ntasks = as_int(launch.srun.get("ntasks"))
    if ntasks is not None and nodes:
        return ntasks // nodes if ntasks % nodes == 0 else None
    return ctx.job.tasks_per_node


def _step_nodes(ctx: _Ctx, launch: Launch) -> int | None:
    return as_int(launch.srun.get("nodes")) or ctx.job.nodes


def _gpus_per_task(ctx: _Ctx) -> list[Finding]:
    found = []
    job_level = ctx.script.option("gpus-per-task")
    job_bind = ctx.script.option("gpu-bind")
    for launch in ctx.launches:
        if not launch.under_srun or launch.kind in ("srun", "deepspeed") and launch.program is None:
            continue
        per_task = launch.srun.get("gpus-per-task") or (job_level.value if job_level else None)
        bind = launch.srun.get("gpu-bind") or (job_bind.value if job_bind else None)
        tasks = _step_tasks(ctx, launch)
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


def _assigned_before(ctx: _Ctx, name: str, line: int) -> bool:
    return any(c.line < line for c, _ in raw_assignments(ctx.script).get(name, []))


def _cpus_per_task(ctx: _Ctx) -> list[Finding]:
    if not ctx.job.cpus_per_task or ctx.job.cpus_per_task < 2:
        return []
    found = []
    for launch in {l.command.line: l for l in ctx.launches if _trains(l)}.values():
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


def _address_problem(ctx: _Ctx, raw: str, *, per_task: bool) -> str | None:
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
                if _multi(ctx) else None)
    return (f"{text} is hard-coded: Slurm may give the job other nodes, and rank 0 starts on the allocation's "
            "first node, so the ranks wait for a store that is not there (or join another job's)")


def _master_addr(ctx: _Ctx) -> list[Finding]:
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


def _kill_on_bad_exit(ctx: _Ctx) -> list[Finding]:
    if "SLURM_KILL_BAD_EXIT" in raw_assignments(ctx.script):
        return []
    found = []
    for launch in {l.command.line: l for l in ctx.launches if _trains(l)}.values():
        tasks = (_step_tasks(ctx, launch) or 1) * (_step_nodes(ctx, launch) or 2)
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


def _step_vars(ctx: _Ctx) -> list[Finding]:
    found = []
    for launch in ctx.launches:
        if not launch.under_srun:
            continue
        step_nodes = as_int(launch.srun.get("nodes"))
        step_tasks = as_int(launch.srun.get("ntasks"))
        job_tasks = (ctx.job.nodes or 0) * (ctx.job.tasks_per_node or 0) or None
        for exp in launch.command.expansions:
            if exp.name not in STEP_VARS:
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


def _signal(ctx: _Ctx) -> list[Finding]:
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
    for launch in ctx.launches:
        if launch.under_srun and launch.kind in ("torchrun", "accelerate") and name not in TORCHRUN_SIGNALS:
            found.append(Finding(
                line=signal.line, code="signal-kills-launcher", severity="error",
                message=(f"--signal={value} goes to every task, here {launch.kind}, which does not catch "
                         f"SIG{name}: it dies on the spot and its ranks never hear of the time limit"),
                fix=(f"send SIGTERM instead (#SBATCH --signal=TERM@{value.split('@')[1] if '@' in value else 120}): "
                     f"{launch.kind} passes it to every rank and waits for them to save a checkpoint")))
            break
    return found


def _torchrun(ctx: _Ctx) -> list[Finding]:
    found = []
    for launch in ctx.launches:
        if launch.kind != "torchrun":
            continue
        line = launch.command.line
        nodes = _step_nodes(ctx, launch) if launch.under_srun else ctx.job.nodes
        if not launch.under_srun and (nodes or 0) > 1:
            found.append(Finding(
                line=line, code="launcher-without-srun", severity="error",
                message=(f"torchrun runs in the batch shell, on the first of {nodes} nodes only: the other nodes "
                         "start nothing and the rendezvous waits for them until it times out"),
                fix=("start one torchrun per node with srun: "
                     "srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun ...")))
            continue
        tasks = _step_tasks(ctx, launch) if launch.under_srun else 1
        if tasks and tasks > 1:
            found.append(Finding(
                line=line, code="several-launchers-per-node", severity="error",
                message=(f"srun starts {tasks} tasks per node, each a torchrun that starts its own processes: "
                         f"{tasks}x too many ranks per node, fighting over GPUs and ports"),
                fix="one torchrun per node: #SBATCH --ntasks-per-node=1 (or srun --ntasks-per-node=1), and let "
                    "torchrun's --nproc-per-node start one process per GPU"))
        found.extend(_count_option(ctx, launch, ("--nnodes",), nodes, "--nodes", "nodes"))
        found.extend(_count_option(ctx, launch, ("--nproc_per_node", "--nproc-per-node"), ctx.job.gpus_per_node,
                                   "GPUs per node", "processes per node"))
        backend = option(launch.words, "--rdzv_backend", "--rdzv-backend")
        rendezvous = backend is not None and backend[1] != "static" or has_flag(launch.words, "--standalone")
        if (nodes or 0) > 1 and not rendezvous and not option(launch.words, "--node_rank", "--node-rank"):
            found.append(Finding(
                line=line, code="torchrun-node-rank", severity="error",
                message=("torchrun on several nodes with neither --node-rank nor a c10d rendezvous: every node "
                         "takes node rank 0 and the ranks collide"),
                fix=("--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID "
                     "(or --node-rank=$SLURM_NODEID, expanded per task inside srun bash -c '...')")))
    return found


def _count_option(ctx: _Ctx, launch: Launch, names: tuple[str, ...], expected: int | None, what: str,
                  counts: str) -> list[Finding]:
    got = option(launch.words, *names)
    if not got or expected is None:
        return []
    raw = got[1]
    if any(v in raw for v in STEP_VARS) and as_int(launch.srun.get("nodes")):
        return []  # a step smaller than the job: _step_vars says it
    value = as_int(expand(raw, ctx.values))
    if value is None or value == expected:
        return []
    return [Finding(
        line=launch.command.line_of(got[0]), code="launcher-count-mismatch", severity="error",
        message=(f"{launch.kind} {got[0]}={raw}" + (f" ({value})" if raw != str(value) else "")
                 + f" but the job has {expected} {what}: "
                 + ("the rendezvous waits for nodes that never come until it times out" if value > expected else
                    "fewer " + counts + " than the job holds: the rest sit idle, or the ranks do not add up")),
        fix=f"{got[0]}={expected}, or better from Slurm's own variables so the two cannot drift apart")]


def _accelerate(ctx: _Ctx) -> list[Finding]:
    found = []
    for launch in ctx.launches:
        if launch.kind != "accelerate":
            continue
        nodes = _step_nodes(ctx, launch) if launch.under_srun else ctx.job.nodes
        if not launch.under_srun and (nodes or 0) > 1:
            found.append(Finding(
                line=launch.command.line, code="launcher-without-srun", severity="error",
                message=(f"accelerate launch runs in the batch shell, on the first of {nodes} nodes only: the "
                         "other nodes start nothing and the rendezvous waits for them until it times out"),
                fix="start one accelerate launch per node: srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
                    "'accelerate launch --machine_rank $SLURM_NODEID ...'"))
            continue
        tasks = _step_tasks(ctx, launch) if launch.under_srun else 1
        if tasks and tasks > 1:
            found.append(Finding(
                line=launch.command.line, code="several-launchers-per-node", severity="error",
                message=f"srun starts {tasks} accelerate launches per node, each starting its own processes",
                fix="one accelerate launch per node: srun --ntasks-per-node=1"))
        found.extend(_count_option(ctx, launch, ("--num_machines", "--num-machines"), nodes, "nodes", "machines"))
        if nodes and ctx.job.gpus_per_node:
            found.extend(_count_option(ctx, launch, ("--num_processes", "--num-processes"),
                                       nodes * ctx.job.gpus_per_node, "GPUs in all", "processes"))
        machines = as_int(expand((option(launch.words, "--num_machines", "--num-machines") or ("", ""))[1],
                                 ctx.values))
        backend = option(launch.words, "--rdzv_backend", "--rdzv-backend")
        if (machines or 0) > 1 and not option(launch.words, "--machine_rank", "--machine-rank") \
                and (backend is None or backend[1] == "static"):
            found.append(Finding(
                line=launch.command.line, code="accelerate-machine-rank", severity="error",
                message="accelerate launch on several machines without --machine_rank: every node is machine 0",
                fix="--machine_rank $SLURM_NODEID, expanded per task: srun bash -c 'accelerate launch "
                    "--machine_rank $SLURM_NODEID ...'"))
    return found


def _ports(ctx: _Ctx) -> list[Finding]:
    found = []
    fix = ("derive it from the job id so no two jobs share it: export MASTER_PORT=$((20000 + SLURM_JOB_ID % "
           "20000))")
    why = ("a fixed port: a second job on the same first node (yours or another user's, or this one requeued) "
           "binds it too: \"address already in use\", or ranks of two jobs meet in one store")
    if ctx.job.nodes == 1 and not any(l.under_srun for l in ctx.launches):
        return []
    for command, raw in raw_assignments(ctx.script).get("MASTER_PORT", []):
        if as_int(raw.strip("\"'")) is not None:
            found.append(Finding(line=command.line, code="fixed-port", severity="warning",
                                 message=f"MASTER_PORT={raw.strip(chr(34) + chr(39))} is {why}", fix=fix))
    for launch in ctx.launches:
        for names in (("--master_port", "--master-port"), ("--main_process_port", "--main-process-port"),
                      ("--rdzv_endpoint", "--rdzv-endpoint")):
            got = option(launch.words, *names)
            if not got:
                continue
            port = got[1].rsplit(":", 1)[1] if names[0] == "--rdzv_endpoint" and ":" in got[1] else (
                got[1] if names[0] != "--rdzv_endpoint" else "")
            if as_int(port) is not None:
                found.append(Finding(line=launch.command.line_of(got[0]), code="fixed-port", severity="warning",
                                     message=f"{got[0]} {got[1]}: port {port} is {why}",
                                     fix=fix + f", and pass {names[0]}=...$MASTER_PORT"))
    return found


def _lightning(ctx: _Ctx, given: Path | None) -> tuple[list[Finding], list[str]]:
    found: list[Finding] = []
    read: list[str] = []
    for launch in ctx.launches:
        if launch.kind != "python" or not launch.program:
            continue
        path = given or _resolve(ctx, launch.program)
        source = read_text(path) if path else None
        if source is None or not _LIGHTNING_IMPORT.search(source):
            continue
        read.append(str(path))
        shape = lightning_shape(source, launch.program_args)
        if shape is None:
            continue
        where = f"{launch.program}:{shape.line}"
        nodes = _step_nodes(ctx, launch) if launch.under_srun else ctx.job.nodes
        if not launch.under_srun:
            if (nodes or 0) > 1:
                found.append(Finding(
                    line=launch.command.line, code="lightning-without-srun", severity="error",
                    message=(f"a Lightning script ({where}) started by the batch shell on {nodes} nodes: it runs "
                             "on the first node only, and Lightning, seeing Slurm, waits for ranks srun never "
                             "starts"),
                    fix="srun python ... with #SBATCH --ntasks-per-node equal to Trainer(devices=...)"))
            continue
        tasks = _step_tasks(ctx, launch)
        devices = shape.devices
        if devices is None and shape.auto:
            devices = 1 if shape.cpu else ctx.job.gpus_per_node
        if tasks is not None and devices is not None and tasks != devices:
            found.append(Finding(
                line=launch.command.line, code="lightning-devices", severity="error",
                message=(f"srun starts {tasks} task(s) per node but {where} {shape.call}(devices=...) is {devices}: "
                         "under Slurm Lightning takes its processes from srun, one per device, so it refuses to "
                         f"start (\"You set `devices={devices}` in Lightning, but the number of tasks per node "
                         "configured in SLURM ... does not match\") or, in older versions, hangs"),
                fix=f"#SBATCH --ntasks-per-node={devices} (one task per GPU), or Trainer(devices={tasks})"))
        if shape.num_nodes is not None and nodes is not None and shape.num_nodes != nodes:
            found.append(Finding(
                line=launch.command.line, code="lightning-num-nodes", severity="error",
                message=(f"the job has {nodes} node(s) but {where} {shape.call}(num_nodes=...) is "
                         f"{shape.num_nodes}: Lightning refuses to start (or waits for nodes that never come)"),
                fix=f"Trainer(num_nodes={nodes}) (e.g. int(os.environ['SLURM_NNODES'])), or #SBATCH "
                    f"--nodes={shape.num_nodes}"))
    return found, read


def _resolve(ctx: _Ctx, program: str) -> Path | None:
    """The training script's path, as the job would find it: after the
    script's last literal ``cd``, else from its working directory."""
    program = expand(program, ctx.values)
    if "$" in program:
        return None
    base = ctx.base
    for command in ctx.script.commands:
        if command.words[:1] == ("cd",) and len(command.words) == 2:
            target = expand(command.words[1], ctx.values)
            if "$" not in target:
                base = base / target
    path = Path(program)
    return path if path.is_absolute() else base / path
