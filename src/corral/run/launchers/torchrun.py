"""torchrun (torch.distributed.run), the default per-node process manager.

Static rendezvous with explicit node ranks: every node is told its rank and
the master address, so there is no c10d rendezvous race between nodes and no
etcd.  Job-level restarts are corral's (``--max-restarts``), so torchrun's own
are off.

On nodes without GPUs, ``ACCELERATE_USE_CPU=1`` (as the accelerate launcher
sets): Hugging Face Accelerate, and the transformers ``Trainer`` built on it,
join torchrun's ranks into one gloo group only when told the node is a CPU
one; without it every rank trains a copy of its own, silently.

With several processes per node, ``OMP_NUM_THREADS=1`` unless the job sets
it: the value torchrun picks itself, but torchrun then prints a five-line
banner on every node of every run ("Setting OMP_NUM_THREADS environment
variable for each process to be 1 in default...").  ``--dry-run`` lists it.
"""

from __future__ import annotations

from corral.run.launchers.base import NodeCommand, NodeContext, node_env, program_argv


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
    defaults = {"OMP_NUM_THREADS": "1"} if ctx.nproc > 1 else {}
    return NodeCommand(argv=tuple(argv), env=env, env_defaults=defaults)
