"""torchrun (torch.distributed.run), the default per-node process manager.

Static rendezvous with explicit node ranks: every node is told its rank and
the master address, so there is no c10d rendezvous race between nodes and no
etcd.  Job-level restarts are corral's (``--max-restarts``), so torchrun's own
are off.

On nodes without GPUs, ``ACCELERATE_USE_CPU=1`` (as the accelerate launcher
sets): Hugging Face Accelerate, and the transformers ``Trainer`` built on it,
join torchrun's ranks into one gloo group only when told the node is a CPU
one; without it every rank trains a copy of its own, silently.
"""

from __future__ import annotations

from corral.launchers.base import NodeCommand, NodeContext, node_env, program_argv


def plan(ctx: NodeContext) -> NodeCommand:
    argv = [
        ctx.python, "-m", "torch.distributed.run",
        f"--nnodes={ctx.nnodes}",
        f"--node-rank={ctx.node_rank}",
        f"--nproc-per-node={ctx.nproc}",
        f"--master-addr={ctx.master_addr}",
        f"--master-port={ctx.master_port}",
        "--max-restarts=0",
        *ctx.launcher_args,
    ]
    argv += program_argv(ctx)
    env = node_env(ctx)
    if ctx.world_size > 1 and not ctx.gpus:
        env["ACCELERATE_USE_CPU"] = "1"
    return NodeCommand(argv=tuple(argv), env=env)
