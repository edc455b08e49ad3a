"""A plain command, one process per node, with the rendezvous contract set.

For scripts that do their own process management (or none): RANK is the
node rank, WORLD_SIZE the number of nodes, LOCAL_RANK 0.  A ``.py`` program
runs with the node's interpreter; anything else is executed as is.
"""

from __future__ import annotations

from corral.launchers.base import NodeCommand, NodeContext, program_argv


def plan(ctx: NodeContext) -> NodeCommand:
    if ctx.module or ctx.program.endswith(".py"):
        argv = [ctx.python, *program_argv(ctx)]
    else:
        argv = [ctx.program, *ctx.args]
    env = {
        "RANK": str(ctx.node_rank),
        "WORLD_SIZE": str(ctx.nnodes),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    return NodeCommand(argv=tuple(argv), env=env, pipe_rank=ctx.node_rank)
