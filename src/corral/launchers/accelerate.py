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

from corral.launchers.base import NodeCommand, NodeContext, node_env


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
        # start a single process.)
        argv.append("--multi_gpu")
        if not ctx.gpus:
            env["ACCELERATE_USE_CPU"] = "1"
    argv += list(ctx.launcher_args)
    if ctx.module:
        argv.append("--module")
    argv += [ctx.program, *ctx.args]
    return NodeCommand(argv=tuple(argv), env=env)
