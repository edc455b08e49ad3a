"""Exports that launch the job: DeepSpeed, accelerate, torchrun and mpirun files.

Each starts from the plan ``corral run`` would make (``run.plan.build_plan``:
ranks, rendezvous, the environment that travels), so the other tool runs the
same job.  What corral adds for itself (``CORRAL_*``: its run id, stack
signal, interpreter) is left out; the rendezvous variables are left to the
tool, which sets them on every node.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path

from corral.errors import CorralError, UsageError
from corral.export import Export, ExportFile, ExportRequest
from corral.export.remote import SSH_CONFIG, single_user, ssh_args_append, ssh_config_file
from corral.run.plan import CONTRACT, LaunchPlan, NodeFacts, NodePlan, build_plan, is_secret_name

#: Stands for the script in launch lines when no PROGRAM was given.
PROGRAM_PLACEHOLDER = "train.py"


def job_plan(request: ExportRequest, launcher: str) -> LaunchPlan:
    """The plan ``corral run --launcher LAUNCHER`` would make, with the
    rendezvous on the first host and the port given (no node is asked)."""
    cluster = request.cluster
    spec = dataclasses.replace(request.spec, launcher=launcher)
    if spec.nproc_per_node is None:
        unknown = [h.name for h in cluster.hosts if h.slots is None]
        if unknown:
            raise UsageError(
                f"{unknown[0]} has no slots: corral counts its GPUs at launch, but a file for another "
                "tool must say how many processes each node starts",
                hint="give -n/--nproc-per-node N, or slots in the cluster file ('host slots=8', 'host:8')")
    # GPU nodes as one GPU per process; --cpu: none (ACCELERATE_USE_CPU, as corral sets it)
    facts = {h.name: NodeFacts(gpus=0 if request.cpu else (spec.nproc_per_node or h.slots))
             for h in cluster.hosts}
    master = "127.0.0.1" if len(cluster.hosts) == 1 else cluster.hosts[0].connect_address
    return build_plan(cluster, spec, facts, master_addr=master, master_port=request.master_port,
                      head_env=request.head_env, head_cwd=request.head_cwd)


def node_env(node: NodePlan) -> dict[str, str]:
    """What the job's processes get on this node, less corral's own
    variables and the rendezvous the tool sets itself."""
    return {k: v for k, v in node.env.items()
            if not k.startswith("CORRAL_") and k not in CONTRACT}


def shared_env(plan: LaunchPlan, tool: str) -> dict[str, str]:
    """The environment every node gets, for a tool that sends one to all
    (``.deepspeed_env``, ``mpirun -x``): a per-host value cannot go there."""
    envs = [node_env(n) for n in plan.nodes]
    first = envs[0]
    for node, env in zip(plan.nodes[1:], envs[1:]):
        for key in sorted(set(first) | set(env)):
            if first.get(key) != env.get(key):
                raise UsageError(
                    f"{key} differs between {plan.nodes[0].host.name} and {node.host.name}: {tool} sends "
                    "one environment to every node",
                    hint=f"set {key} for the whole cluster (the cluster file's [cluster] env, or --env), "
                         "or export torchrun, which has one line per node")
    return first


def _env_words(env: Mapping[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in sorted(env.items())]


def _line(node: NodePlan, argv: list[str], env: Mapping[str, str]) -> str:
    words = (["env", *_env_words(env)] if env else []) + argv
    return f"cd {shlex.quote(node.cwd)} && " + " ".join(shlex.quote(w) for w in words)


def _program(request: ExportRequest) -> list[str]:
    spec = request.spec
    program = spec.program if request.has_program else PROGRAM_PLACEHOLDER
    return (["-m", program] if spec.module else [program]) + list(spec.args)


def _placeholder_note(request: ExportRequest) -> tuple[str, ...]:
    if request.has_program:
        return ()
    return ((f"no PROGRAM given: the command lines name {PROGRAM_PLACEHOLDER} "
             "(`corral export FORMAT [options] SCRIPT ARGS` names yours)"),)


def masked(line: str, env: Mapping[str, str]) -> str:
    """A command line as shown on a terminal: secret-named values as ***."""
    for key, value in env.items():
        if is_secret_name(key) and value:
            line = line.replace(shlex.quote(f"{key}={value}"), f"{key}=***")
    return line


# ---------------------------------------------------------------------------
# torchrun


def torchrun(request: ExportRequest) -> Export:
    plan = job_plan(request, "torchrun")
    lines, shown = [], []
    for node in plan.nodes:
        env = {**node_env(node), "NODE_RANK": str(node.node_rank), "NNODES": str(len(plan.nodes))}
        line = _line(node, list(node.argv), env)
        lines += [f"# node {node.node_rank}: {node.host.name}", line]
        shown.append(masked(line, env))
    text = ("# Written by `corral export torchrun`: run each line on its node (node 0 first or not:\n"
            "# torchrun waits for the others).\n" + "\n".join(lines) + "\n")
    return Export(format="torchrun", files=(ExportFile(name="torchrun.sh", text=text, private=True),),
                  commands=tuple(shown), data={"master_addr": plan.master_addr, "master_port": plan.master_port})


# ---------------------------------------------------------------------------
# DeepSpeed

#: What DeepSpeed's runner keeps of a ``.deepspeed_env`` value as it is:
#: it strips blanks and wraps anything else in double quotes for the remote
#: shell, where ``$``, backquotes and backslashes would be expanded.
_DS_SAFE = re.compile(r"[^\s\"$`\\]*(?:[^\S\n][^\s\"$`\\]+)*")


def deepspeed_env_text(env: Mapping[str, str]) -> str:
    """``.deepspeed_env``: ``KEY=VALUE`` lines, refused where DeepSpeed's
    runner would not send the value unchanged."""
    for key, value in sorted(env.items()):
        if not _DS_SAFE.fullmatch(value):
            raise UsageError(
                f"{key}={value[:60]!r} cannot go into .deepspeed_env unchanged: DeepSpeed's runner strips "
                "blanks around a value and puts it in double quotes for the node's shell (a newline, quote, "
                "$, ` or \\ would change it)",
                hint=f"set {key} another way on the nodes (their shell profile), or drop it from the job")
    return "".join(f"{k}={v}\n" for k, v in sorted(env.items()))


def _deepspeed_env_notes(head_env: Mapping[str, str]) -> tuple[str, ...]:
    """What else DeepSpeed's runner would send, that the exported file does not say."""
    notes = []
    if head_env.get("DS_ENV_FILE"):
        notes.append(f"DS_ENV_FILE={head_env['DS_ENV_FILE']} is set here: DeepSpeed's runner reads that "
                     "instead of .deepspeed_env; unset it before running deepspeed")
    home = Path(head_env.get("HOME") or Path.home()) / ".deepspeed_env"
    if home.is_file():
        notes.append(f"DeepSpeed's runner also sends {home} to every node (corral does not); the exported "
                     ".deepspeed_env wins for the names it sets")
    return tuple(notes)


def hostfile_text(plan: LaunchPlan, tool: str) -> str:
    return (f"# Written by `corral export {tool}`: host slots=N, in node-rank order\n"
            + "".join(f"{n.host.name} slots={n.nproc}\n" for n in plan.nodes))


def deepspeed(request: ExportRequest) -> Export:
    plan = job_plan(request, "deepspeed")
    env = shared_env(plan, "DeepSpeed's runner")
    user = single_user(request.cluster, "DeepSpeed's runner (pdsh)")
    outdir = request.outdir
    words = ["deepspeed", "--hostfile", str(outdir / "hostfile"), "--no_ssh_check",
             f"--master_addr={plan.master_addr}", f"--master_port={plan.master_port}"]
    if user:
        words.append(f"--launcher_args=-l {user}")
    words += list(request.spec.launcher_args)
    if request.spec.module:
        words.append("--module")
    prog = _program(request)
    words += prog[1:] if request.spec.module else prog
    command = (f"cd {shlex.quote(str(outdir))} && PDSH_SSH_ARGS_APPEND={shlex.quote(ssh_args_append(outdir))} "
               + " ".join(shlex.quote(w) for w in words))
    notes = ((f"DeepSpeed's runner reads .deepspeed_env from the directory it starts in ({outdir}) and cds "
              "the nodes into that same path: the script must be there on every node"),
             *_deepspeed_env_notes(request.head_env), *_placeholder_note(request))
    files = (ExportFile(name="hostfile", text=hostfile_text(plan, "deepspeed")),
             ExportFile(name=".deepspeed_env", text=deepspeed_env_text(env), private=True),
             ssh_config_file(request))
    return Export(format="deepspeed", files=files, commands=(masked(command, env),), notes=notes,
                  data={"master_addr": plan.master_addr, "master_port": plan.master_port, "env_keys": sorted(env)})


# ---------------------------------------------------------------------------
# accelerate


def _yaml(config: Mapping[str, object]) -> str:
    """Flat YAML of scalars (JSON strings are YAML's double-quoted scalars)."""
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        return json.dumps(str(v))
    return "".join(f"{k}: {value(v)}\n" for k, v in config.items())


def accelerate_config(plan: LaunchPlan, node: NodePlan, *, cpu: bool) -> dict[str, object]:
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU" if plan.world_size > 1 else "NO",
        "use_cpu": cpu,
        "num_machines": len(plan.nodes),
        "machine_rank": node.node_rank,
        "num_processes": plan.world_size,
        "main_process_ip": plan.master_addr,
        "main_process_port": plan.master_port,
        "rdzv_backend": "static",
        "same_network": True,
        "gpu_ids": "all",
        "mixed_precision": "no",
        "main_training_function": "main",
        "downcast_bf16": "no",
    }


def check_with_accelerate(files: list[ExportFile]) -> str | None:
    """Load every config with the installed accelerate's own reader (None
    when accelerate is not installed here); its refusal is corral's bug, said so."""
    if importlib.util.find_spec("accelerate") is None:
        return None
    from accelerate.commands.config.config_args import load_config_from_file

    with tempfile.TemporaryDirectory(prefix="corral-export-") as tmp:
        for f in files:
            path = Path(tmp) / f.name
            path.write_text(f.text)
            try:
                load_config_from_file(str(path))
            except Exception as err:  # noqa: BLE001 - accelerate raises ValueError/TypeError/KeyError alike
                raise CorralError(f"the installed accelerate refuses the config corral wrote for it, {f.name} "
                                  f"({err})", hint="please report it with `accelerate env`'s output") from None
    import accelerate

    return accelerate.__version__


def accelerate(request: ExportRequest) -> Export:
    plan = job_plan(request, "accelerate")
    files, shown = [], []
    for node in plan.nodes:
        name = f"accelerate-node{node.node_rank}.yaml"
        text = (f"# Written by `corral export accelerate`: node {node.node_rank} ({node.host.name})\n"
                + _yaml(accelerate_config(plan, node, cpu=request.cpu)))
        files.append(ExportFile(name=name, text=text))
        env = {k: v for k, v in node_env(node).items() if k != "ACCELERATE_USE_CPU"}
        argv = [node.host.python, "-m", "accelerate.commands.launch", "--config_file",
                str(request.outdir / name), *request.spec.launcher_args, *_program(request)]
        shown.append(masked(_line(node, argv, env), env))
    checked = check_with_accelerate(files)
    notes = [("each node reads its own file: copy accelerate-nodeR.yaml to node R (or keep them on a "
              "shared filesystem)"), *_placeholder_note(request)]
    if checked:
        notes.append(f"checked with the installed accelerate {checked}")
    return Export(format="accelerate", files=tuple(files), commands=tuple(shown), notes=tuple(notes),
                  data={"accelerate_checked": checked})


# ---------------------------------------------------------------------------
# OpenMPI


def mpi(request: ExportRequest) -> Export:
    """mpirun starts one torchrun per node (``--map-by ppr:1:node``), which
    starts the node's ranks: an unchanged torch script needs torchrun's
    RANK/LOCAL_RANK, which plain mpirun ranks do not have."""
    plan = job_plan(request, "torchrun")
    env = shared_env(plan, "mpirun -x")
    outdir = request.outdir
    node = plan.nodes[0]
    torchrun_argv = [node.host.python, "-m", "torch.distributed.run", f"--nnodes={len(plan.nodes)}",
                     f"--nproc-per-node={node.nproc}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={plan.master_addr}:{plan.master_port}", f"--rdzv-id={plan.run_id}",
                     *request.spec.launcher_args, *_program(request)]
    words = ["mpirun", "--hostfile", str(outdir / "hostfile"), "-np", str(len(plan.nodes)),
             "--map-by", "ppr:1:node", "--mca", "plm_rsh_args", f"-F {outdir / SSH_CONFIG}",
             "--wdir", node.cwd]
    for word in _env_words(env):
        words += ["-x", word]
    command = " ".join(shlex.quote(w) for w in words + torchrun_argv)
    text = "#!/bin/sh\n# Written by `corral export mpi`: one torchrun per node, which starts its ranks\n" \
           + command + "\n"
    files = (ExportFile(name="hostfile", text=hostfile_text(plan, "mpi")),
             ExportFile(name="mpirun.sh", text=text, private=True), ssh_config_file(request))
    return Export(format="mpi", files=files, commands=(masked(command, env),),
                  notes=_placeholder_note(request), data={"master_addr": plan.master_addr,
                                                          "master_port": plan.master_port})
