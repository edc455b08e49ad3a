"""DeepSpeed's own per-node launcher (``deepspeed.launcher.launch``).

This is what the `deepspeed` command runs on every node after pdsh has
carried it there; corral carries it instead, so no pdsh, no passwordless
node-to-node SSH and no ``.deepspeed_env`` are needed.  The script receives
``--local_rank`` as DeepSpeed users expect.
"""

from __future__ import annotations

import base64
import json

from corral.run.launchers.base import NodeCommand, NodeContext, node_env


def world_info(hostnames: tuple[str, ...], nproc: int) -> str:
    """DeepSpeed's base64 ``{host: [local device ids]}``, in node-rank order."""
    info = {h: list(range(nproc)) for h in hostnames}
    return base64.urlsafe_b64encode(json.dumps(info).encode()).decode()


def plan(ctx: NodeContext) -> NodeCommand:
    argv = [
        ctx.python, "-u", "-m", "deepspeed.launcher.launch",
        f"--world_info={world_info(ctx.hostnames, ctx.nproc)}",
        f"--node_rank={ctx.node_rank}",
        f"--master_addr={ctx.master_addr}",
        f"--master_port={ctx.master_port}",
        *ctx.launcher_args,
    ]
    if ctx.module:
        argv.append("--module")
    argv += [ctx.program, *ctx.args]
    return NodeCommand(argv=tuple(argv), env=node_env(ctx))
