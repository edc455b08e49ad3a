"""`accelerate launch`, for scripts written with Hugging Face Accelerate.

Each node runs `accelerate launch` with its machine rank, the number of
machines and the main process address; accelerate then starts the local
processes (through torch.distributed.run).  ``--num_processes`` is the total
across all machines, as accelerate expects.  On nodes without GPUs the
launch is ``--multi_gpu`` with ``ACCELERATE_USE_CPU=1`` (multi-process CPU over
gloo); with GPUs it is ``--multi_gpu``.
Anything else (mixed precision, a DeepSpeed/FSDP config file) goes through
``--launcher-arg`` or the user's accelerate config, untouched, with one
exception: in DeepSpeed mode on several nodes accelerate starts the whole
job from the node it runs on, with ``deepspeed --launcher pdsh`` (its default,
or the config's ``deepspeed_multinode_launcher``) and a ``.deepspeed_env``
written into the working directory.  Started on every node by corral, that
is one fan-out per node (nine launches for three nodes, then EADDRINUSE).
So corral passes ``--deepspeed_multinode_launcher standard``: each node's
accelerate starts its own processes through torchrun, writes no file, and
the config's other DeepSpeed settings apply as they are.
"""

from __future__ import annotations

import os

from corral.agent.probes import accelerate_config_mode
from corral.run.launchers.base import NodeCommand, NodeContext, node_env

#: accelerate's flags that pick the distributed mode themselves.
_MODE_FLAGS = {"--multi_gpu", "--cpu", "--tpu", "--use_fsdp", "--use_deepspeed", "--use_megatron_lm"}
#: distributed_type values a config file sets that --multi_gpu would override.
_CONFIG_MODES = {"FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"}
#: The chosen modes in which accelerate hands the job to DeepSpeed's launcher.
_DEEPSPEED_MODES = {"--use_deepspeed", "DEEPSPEED"}
#: accelerate's DeepSpeed launcher that starts one node's processes (torchrun);
#: the others (pdsh, its default, openmpi, slurm, nossh...) start every node's.
PER_NODE_DEEPSPEED = ("--deepspeed_multinode_launcher", "standard")
#: accelerate's default, said on several nodes so that a config file cannot change it.
STATIC_RENDEZVOUS = ("--rdzv_backend", "static")


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
    mode = chosen_mode(ctx)
    if ctx.nnodes > 1 and mode in _DEEPSPEED_MODES:
        argv += PER_NODE_DEEPSPEED
    if ctx.nnodes > 1:
        # node ranks are corral's (host order): a config's rdzv_backend c10d
        # would let the rendezvous give them out in order of arrival
        argv += STATIC_RENDEZVOUS
    if ctx.world_size > 1:
        # --multi_gpu is accelerate's multi-process mode (it starts the local
        # ranks through torchrun); on CPU-only nodes ACCELERATE_USE_CPU makes
        # those processes train together over gloo.  (`--cpu` alone would
        # start a single process.)  Not when the user chose the mode: any of
        # these flags, or a config file whose distributed_type is FSDP,
        # DeepSpeed, Megatron-LM or XLA, would be overridden by --multi_gpu.
        if mode is None:
            argv.append("--multi_gpu")
        if not ctx.gpus:
            env["ACCELERATE_USE_CPU"] = "1"
    argv += list(ctx.launcher_args)
    if ctx.module:
        argv.append("--module")
    argv += [ctx.program, *ctx.args]
    # accelerate starts its processes through torchrun's code, which prints
    # the OMP_NUM_THREADS banner on every node: the same default as torchrun's.
    defaults = {"OMP_NUM_THREADS": "1"} if ctx.nproc > 1 else {}
    return NodeCommand(argv=tuple(argv), env=env, env_defaults=defaults)


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
