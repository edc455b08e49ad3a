"""PyTorch Lightning's own launch contract.

One process per node is started with MASTER_ADDR, MASTER_PORT, NODE_RANK and
WORLD_SIZE; Lightning's Trainer (with ``num_nodes`` and ``devices`` set by the
script) spawns the other local ranks itself.  That first process is local
rank 0, so its own output is that rank's output.
"""

from __future__ import annotations

from corral.run.launchers.base import NodeCommand, NodeContext, node_env, program_argv


def plan(ctx: NodeContext) -> NodeCommand:
    argv = [ctx.python, *ctx.launcher_args, *program_argv(ctx)]
    env = node_env(ctx, WORLD_SIZE=str(ctx.world_size))
    return NodeCommand(argv=tuple(argv), env=env, pipe_rank=ctx.first_rank)
