"""A plain command, one process per node, with the rendezvous contract set.

For scripts that do their own process management (or none): RANK is the
node rank, WORLD_SIZE the number of nodes, LOCAL_RANK 0.  A ``.py`` program
runs with the node's interpreter; anything else is executed as is, with that
interpreter as ``CORRAL_PYTHON`` and its directory first on ``PATH`` (the
agent puts it there), so ``bash -c 'python x.py'`` runs the configured one.
"""

from __future__ import annotations

from corral.run.launchers.base import NodeCommand, NodeContext, node_env, program_argv


def plan(ctx: NodeContext) -> NodeCommand:
    if ctx.module or ctx.program.endswith(".py"):
        argv = [ctx.python, *program_argv(ctx)]
    else:
        argv = [ctx.program, *ctx.args]
    env = node_env(
        ctx,
        RANK=str(ctx.node_rank),
        WORLD_SIZE=str(ctx.nnodes),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    return NodeCommand(argv=tuple(argv), env=env, pipe_rank=ctx.node_rank)
