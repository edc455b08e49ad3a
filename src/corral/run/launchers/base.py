"""What every launcher planner receives and returns.

Launchers are pure planners: given the shape of the job and one node's
place in it, they return the argv and environment that node runs.  Nothing
here touches the network, so ``--dry-run`` and snapshot tests see exactly
what a real launch would run.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class NodeContext:
    """One node's place in the job, as a launcher needs it."""

    #: Interpreter on this node (the host's ``python``).
    python: str
    #: Script path (or module name when ``module``), or a command for `command`.
    program: str
    args: tuple[str, ...]
    module: bool
    node_rank: int
    nnodes: int
    #: Processes on this node; every node runs the same number.
    nproc: int
    master_addr: str
    master_port: int
    #: Host names in node-rank order (DeepSpeed's world_info needs them).
    hostnames: tuple[str, ...]
    #: GPUs detected on this node (None: unknown / no nvidia-smi).
    gpus: int | None = None
    #: Extra arguments for the launcher itself (``--launcher-arg``).
    launcher_args: tuple[str, ...] = ()
    #: The directory corral was started in: a relative file named in
    #: ``launcher_args`` (accelerate's ``--config_file``) is read from here.
    local_dir: str | None = None
    #: distributed_type of the node's own accelerate default config, if it has one.
    accelerate_mode: str | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.nproc


@dataclass(frozen=True, kw_only=True)
class NodeCommand:
    """What one node runs."""

    argv: tuple[str, ...]
    #: Variables this launcher sets on top of the common contract.
    env: dict[str, str] = field(default_factory=dict)
    #: Variables this launcher sets only where the job's environment (the
    #: head's allow-listed variables, the cluster file, --env) does not.
    env_defaults: dict[str, str] = field(default_factory=dict)
    #: Global rank of the launcher process's own output, when the launcher
    #: process *is* a rank (Lightning's local rank 0, `command`); None when
    #: it is a process manager (torchrun, accelerate, deepspeed).
    pipe_rank: int | None = None


def node_env(ctx: NodeContext, **extra: str) -> dict[str, str]:
    """What every launcher sets on its node: ``CORRAL_PYTHON``, the host's
    configured interpreter (the agent also puts its directory first on
    ``PATH``, as activating its venv would), and the launcher's own ``extra``."""
    return {"CORRAL_PYTHON": ctx.python, **extra}


def program_argv(ctx: NodeContext) -> list[str]:
    """``script.py args`` or ``-m module args``, as launchers forward them."""
    if ctx.module:
        return ["-m", ctx.program, *ctx.args]
    return [ctx.program, *ctx.args]
