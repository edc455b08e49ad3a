"""`accelerate launch`, for scripts written with Hugging Face Accelerate.

Each node runs `accelerate launch` with its machine rank, the number of
machines and the main process address; accelerate then starts the local
processes (through torch.distributed.run).  ``--num_processes`` is the total
across all machines, as accelerate expects.  On nodes without GPUs the
launch is ``--multi_gpu`` with ``ACCELERATE_USE_CPU=1`` (multi-process CPU over
gloo); with GPUs it is ``--multi_gpu``.
Anything else (mixed precision, a DeepSpeed/FSDP config file) goes through
``--launcher-arg`` or the user's accelerate config, untouched.
"""

from __future__ import annotations

import os
import re

from corral.launchers.base import NodeCommand, NodeContext, node_env

#: accelerate's flags that pick the distributed mode themselves.
_MODE_FLAGS = {"--multi_gpu", "--cpu", "--tpu", "--use_fsdp", "--use_deepspeed", "--use_megatron_lm"}
#: distributed_type values a config file sets that --multi_gpu would override.
_CONFIG_MODES = {"FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"}
_DISTRIBUTED_TYPE = re.compile(r'(?:^|[{,])\s*"?distributed_type"?\s*:\s*["\']?(\w+)', re.MULTILINE)


def plan(ctx: NodeContext) -> NodeCommand:
    argv = [
        ctx.python, "-m", "accelerate.commands.launch",
        "--num_machines", str(ctx.nnodes),
        "--machine_rank", str(ctx.node_rank),
        "--num_processes", str(ctx.world_size),
        "--main_process_ip", ctx.master_addr,
        "--main_process_port", str(ctx.master_port),
    ]
    env = node_env(ctx)
    if ctx.world_size > 1:
        # --multi_gpu is accelerate's multi-process mode (it starts the local
        # ranks through torchrun); on CPU-only nodes ACCELERATE_USE_CPU makes
        # those processes train together over gloo.  (`--cpu` alone would
        # start a single process.)  Not when the user chose the mode: any of
        # these flags, or a config file whose distributed_type is FSDP,
        # DeepSpeed, Megatron-LM or XLA, would be overridden by --multi_gpu.
        if user_mode(ctx.launcher_args, ctx.local_dir) is None and not _default_config_picks_mode(ctx):
            argv.append("--multi_gpu")
        if not ctx.gpus:
            env["ACCELERATE_USE_CPU"] = "1"
    argv += list(ctx.launcher_args)
    if ctx.module:
        argv.append("--module")
    argv += [ctx.program, *ctx.args]
    return NodeCommand(argv=tuple(argv), env=env)


def user_mode(launcher_args: tuple[str, ...], local_dir: str | None) -> str | None:
    """The distributed mode the user chose in --launcher-arg, if any: a mode
    flag, or a ``--config_file`` whose ``distributed_type`` is FSDP, DeepSpeed,
    Megatron-LM or XLA (read here, where corral runs: the project is the same
    on every node)."""
    for i, arg in enumerate(launcher_args):
        name, eq, value = arg.partition("=")
        name = "--" + name[2:].replace("-", "_") if name.startswith("--") else name
        if name in _MODE_FLAGS:
            return name
        if name == "--config_file":
            path = value if eq else (launcher_args[i + 1] if i + 1 < len(launcher_args) else "")
            mode = _config_mode(os.path.join(local_dir or ".", os.path.expanduser(path)))
            if mode in _CONFIG_MODES:
                return mode
    return None


def _config_mode(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            m = _DISTRIBUTED_TYPE.search(f.read(1 << 20))
    except OSError:
        return None
    return m.group(1).upper() if m else None


def _default_config_picks_mode(ctx: NodeContext) -> bool:
    """The node's default_config.yaml says FSDP/DeepSpeed/...; accelerate applies it
    when no --config_file and no mode flag are given."""
    has_config = any(a.partition("=")[0].replace("-", "_") == "__config_file" for a in ctx.launcher_args)
    return not has_config and ctx.accelerate_mode in _CONFIG_MODES
