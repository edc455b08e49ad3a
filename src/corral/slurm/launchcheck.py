"""``corral check``: what torchrun, accelerate, DeepSpeed and Lightning are told,
against the allocation the ``#SBATCH`` lines ask for.

torchrun and accelerate must run once per node (under srun, one task per
node) with counts that match the job; Lightning must be started by srun,
one task per device, as its ``SLURMEnvironment`` expects (its Trainer is
read from the training script, as :mod:`corral.run.scriptcheck` reads it
for ``corral run``); a rendezvous port must be the job's own.
"""

from __future__ import annotations

import re
from pathlib import Path

from corral.run.scriptcheck import lightning_shape
from corral.slurm.findings import STEP_VARS, Ctx, Finding, read_text, step_nodes, step_tasks
from corral.slurm.job import Launch, has_flag, option, raw_assignments
from corral.slurm.script import as_int, expand

_LIGHTNING_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:lightning|pytorch_lightning)\b", re.M)


def torchrun_checks(ctx: Ctx) -> list[Finding]:
    found = []
    for launch in ctx.launches:
        if launch.kind != "torchrun":
            continue
        line = launch.command.line
        nodes = step_nodes(ctx, launch) if launch.under_srun else ctx.job.nodes
        if not launch.under_srun and (nodes or 0) > 1:
            found.append(Finding(
                line=line, code="launcher-without-srun", severity="error",
                message=(f"torchrun runs in the batch shell, on the first of {nodes} nodes only: the other nodes "
                         "start nothing and the rendezvous waits for them until it times out"),
                fix=("start one torchrun per node with srun: "
                     "srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun ...")))
            continue
        tasks = step_tasks(ctx, launch) if launch.under_srun else 1
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


def _count_option(ctx: Ctx, launch: Launch, names: tuple[str, ...], expected: int | None, what: str,
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


def accelerate_checks(ctx: Ctx) -> list[Finding]:
    found = []
    for launch in ctx.launches:
        if launch.kind != "accelerate":
            continue
        nodes = step_nodes(ctx, launch) if launch.under_srun else ctx.job.nodes
        if not launch.under_srun and (nodes or 0) > 1:
            found.append(Finding(
                line=launch.command.line, code="launcher-without-srun", severity="error",
                message=(f"accelerate launch runs in the batch shell, on the first of {nodes} nodes only: the "
                         "other nodes start nothing and the rendezvous waits for them until it times out"),
                fix="start one accelerate launch per node: srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
                    "'accelerate launch --machine_rank $SLURM_NODEID ...'"))
            continue
        tasks = step_tasks(ctx, launch) if launch.under_srun else 1
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


def port_checks(ctx: Ctx) -> list[Finding]:
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


def lightning_checks(ctx: Ctx, given: Path | None) -> tuple[list[Finding], list[str]]:
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
        nodes = step_nodes(ctx, launch) if launch.under_srun else ctx.job.nodes
        if not launch.under_srun:
            if (nodes or 0) > 1:
                found.append(Finding(
                    line=launch.command.line, code="lightning-without-srun", severity="error",
                    message=(f"a Lightning script ({where}) started by the batch shell on {nodes} nodes: it runs "
                             "on the first node only, and Lightning, seeing Slurm, waits for ranks srun never "
                             "starts"),
                    fix="srun python ... with #SBATCH --ntasks-per-node equal to Trainer(devices=...)"))
            continue
        tasks = step_tasks(ctx, launch)
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


def _resolve(ctx: Ctx, program: str) -> Path | None:
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
