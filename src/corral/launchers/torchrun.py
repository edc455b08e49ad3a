"""torchrun (torch.distributed.run), the default per-node process manager.

Static rendezvous with explicit node ranks: every node is told its rank and
the master address, so there is no c10d rendezvous race between nodes and no
etcd.  Job-level restarts are corral's (``--max-restarts``), so torchrun's own
are off.
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
    return NodeCommand(argv=tuple(argv), env=node_env(ctx))
