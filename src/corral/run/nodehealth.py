"""GPU and node health of a run's nodes at a failure or a hang.

Each node's agent reads its kernel's Xid messages since the run began,
``nvidia-smi -q`` and NCCL's RAS status (``agent/health.py``); the head
explains them (``diagnose/gpuhealth.py``).  Nodes without NVIDIA GPUs say
nothing.  The run loop calls ``health_lines`` once, where it already stops
to explain a hang or a failure.
"""

from __future__ import annotations

import asyncio

from corral.agent.session import AgentPool
from corral.diagnose.gpuhealth import NodeHealth, node_health

#: How long a node may take to read its kernel log, nvidia-smi and NCCL's RAS (seconds).
HEALTH_TIMEOUT_S = 45.0


async def gather_health(pool: AgentPool, since: float | None, skip: frozenset[str] = frozenset()) -> list[NodeHealth]:
    """Every reachable GPU node's health; a node that does not answer is left out."""

    async def one(s) -> NodeHealth | None:
        try:
            return node_health(s.name, await s.call("health.health", timeout=HEALTH_TIMEOUT_S, since=since))
        except Exception:  # noqa: BLE001 - a lost node is already named by the failure itself
            return None

    found = await asyncio.gather(*(one(s) for s in pool.sessions if not s.closed and s.name not in skip))
    return [h for h in found if h is not None]


async def health_lines(pool: AgentPool, since: float | None, skip: frozenset[str] = frozenset()) -> list[str]:
    """What the GPU nodes' kernels, GPUs and NCCL say, one finding a line;
    what could not be read is said too (a permission, a missing tool)."""
    out: list[str] = []
    for node in await gather_health(pool, since, skip):
        out += ["node health: " + line for line in node.lines()]
        out += [f"node health: {node.host}: {why}" for why in node.unread]
    return out
