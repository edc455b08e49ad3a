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

from corral.agent.probes import accelerate_config_mode
from corral.launchers.base import NodeCommand, NodeContext, node_env

#: accelerate's flags that pick the distributed mode themselves.
_MODE_FLAGS = {"--multi_gpu", "--cpu", "--tpu", "--use_fsdp", "--use_deepspeed", "--use_megatron_lm"}
#: distributed_type values a config file sets that --multi_gpu would override.
_CONFIG_MODES = {"FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"}


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
        if chosen_mode(ctx) is None:
            argv.append("--multi_gpu")
        if not ctx.gpus:
            env["ACCELERATE_USE_CPU"] = "1"
    argv += list(ctx.launcher_args)
    if ctx.module:
        argv.append("--module")
    argv += [ctx.program, *ctx.args]
    return NodeCommand(argv=tuple(argv), env=env)


def chosen_mode(ctx: NodeContext) -> str | None:
    """The distributed mode the user chose, if any: a mode flag in
    --launcher-arg, else the ``distributed_type`` (FSDP, DeepSpeed, Megatron-LM,
    XLA) of the ``--config_file`` given there (read here, where corral runs: the
    project is the same on every node), else of the node's own default config,
    which accelerate reads when neither is given."""
    config = None
    for i, arg in enumerate(ctx.launcher_args):
        name, eq, value = arg.partition("=")
        name = "--" + name[2:].replace("-", "_") if name.startswith("--") else name
        if name in _MODE_FLAGS:
            return name
        if name == "--config_file":
            config = value if eq else (ctx.launcher_args[i + 1] if i + 1 < len(ctx.launcher_args) else "")
    if config is not None:
        mode = accelerate_config_mode(os.path.join(ctx.local_dir or ".", os.path.expanduser(config)))
    else:
        mode = ctx.accelerate_mode
    return mode if mode in _CONFIG_MODES else None
