"""What a job's environment and command get on the node (stdlib only, Python 3.8+).

Node-side, shipped with the agent: where torchrun's elastic agent writes its
files (inside the job's own temporary directory, so nothing is left behind),
and the configured interpreter first on ``PATH``.
"""

import os

#: torchrun's elastic agent (also inside ``accelerate launch``) writes its
#: workers' error files under ``--log-dir``; without one it takes a fresh
#: ``mkdtemp("torchelastic_")`` and never removes it.  The option each
#: launcher module takes:
ELASTIC_LOG_DIR_FLAGS = {
    "torch.distributed.run": "--log-dir",
    "accelerate.commands.launch": "--log_dir",
}


def _accelerate_has_log_dir() -> bool:
    """Whether this node's accelerate launch takes ``--log_dir`` (0.31+).

    Read from its source without importing it (that would import torch)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("accelerate")
        if spec is None or not spec.origin:
            return False
        with open(os.path.join(os.path.dirname(spec.origin), "commands", "launch.py")) as f:
            return '"--log_dir"' in f.read()
    except (ImportError, OSError, ValueError):
        return False


def elastic_log_dir(argv: list, env: dict, path: str) -> list:
    """``argv`` with torchrun's log directory in the job's temporary directory.

    The option goes right after the module, so a ``--log-dir`` the user gave
    (``--launcher-arg``) comes later and wins; a ``PET_LOG_DIR`` in the job's
    environment is kept too.  For an accelerate without ``--log_dir`` (older
    than 0.31, which passes torchrun's defaults through), ``PET_LOG_DIR``.
    """
    module = argv[2] if len(argv) > 2 and argv[1] == "-m" else None
    flag = ELASTIC_LOG_DIR_FLAGS.get(module)
    if flag is None or env.get("PET_LOG_DIR"):
        return argv
    if module == "accelerate.commands.launch" and not _accelerate_has_log_dir():
        env["PET_LOG_DIR"] = path
        return argv
    return argv[:3] + ["%s=%s" % (flag, path)] + argv[3:]


def activate_python(env: dict) -> None:
    """Put the configured interpreter's directory first on ``PATH``, as activating its venv would.

    ``CORRAL_PYTHON`` is the host's ``python`` from the cluster file; a bare
    name (``python3``) or a directory already on ``PATH`` changes nothing.
    """
    python = env.get("CORRAL_PYTHON") or ""
    if not os.path.isabs(python):
        return
    bindir = os.path.dirname(python)
    path = env.get("PATH") or os.defpath
    parts = [p.rstrip("/") or "/" for p in path.split(os.pathsep)]
    if bindir.rstrip("/") in parts:
        return
    env["PATH"] = bindir + os.pathsep + path


#: Variables that give a process its place in *another* launcher's job: a
#: Slurm step (srun), MPI, or an outer torchrun.  A node inherits them when
#: corral itself runs inside one (the head inside `sbatch`/`srun` is node 0
#: of its own run): left in, Lightning's SLURMEnvironment takes SLURM_NTASKS
#: and SLURM_PROCID over corral's ranks, and scripts that read SLURM_PROCID or
#: OMPI_COMM_WORLD_RANK first get another process's rank.  The job-level
#: SLURM_JOB_* variables stay.  A value the run itself sets (--env) wins.
FOREIGN_RANK_VARS = frozenset((
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_ID", "SLURM_STEPID",
    "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_LAUNCHER_PORT", "SLURM_TASK_PID", "SLURM_GTIDS",
    "SLURM_LAUNCH_NODE_IPADDR", "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT",
    # Inside corral's own agent step (the srun transport) these describe that
    # one-node step, not the job: SLURM_JOB_NODELIST/SLURM_JOB_NUM_NODES stay.
    "SLURM_NNODES", "SLURM_NODELIST", "SLURM_CPU_BIND", "SLURM_CPU_BIND_LIST", "SLURM_CPU_BIND_TYPE",
    "SLURM_CPU_BIND_VERBOSE", "SLURM_DISTRIBUTION", "SLURM_UMASK", "SLURM_PRIO_PROCESS",
    "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE", "PMIX_RANK",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK",
    "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
))


def job_environment(inherited: dict, job: dict) -> dict:
    """The node's own environment without another launcher's rank variables,
    then the job's (the plan's) on top."""
    env = {k: v for k, v in inherited.items() if k not in FOREIGN_RANK_VARS}
    env.update(job)
    return env


def fill_env_refs(env: dict, refs: list) -> None:
    """Variables whose value names this node's own (``.deepspeed_env``'s
    ``LD_LIBRARY_PATH=/opt/x:$LD_LIBRARY_PATH``), filled in as the node's shell
    fills in ``export NAME="..."`` for DeepSpeed's runner: in order, each
    seeing the ones before it; an unset variable is empty."""
    for name, parts in refs:
        env[name] = "".join(text if kind == "lit" else env.get(text, "") for kind, text in parts)
