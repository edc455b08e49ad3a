"""Launcher planners: one module per launcher, each ``plan(NodeContext) -> NodeCommand``."""

from __future__ import annotations

from typing import Callable

from corral.launchers import accelerate, command, deepspeed, lightning, torchrun
from corral.launchers.base import NodeCommand, NodeContext

PLANNERS: dict[str, Callable[[NodeContext], NodeCommand]] = {
    "torchrun": torchrun.plan,
    "accelerate": accelerate.plan,
    "deepspeed": deepspeed.plan,
    "lightning": lightning.plan,
    "command": command.plan,
}

#: The Python module a node must import for each launcher (preflight checks it).
REQUIRES: dict[str, str | None] = {
    "torchrun": "torch",
    "accelerate": "accelerate",
    "deepspeed": "deepspeed",
    "lightning": "lightning",
    "command": None,
}

#: Launchers whose processes per node are ``--nproc-per-node`` (``command`` is always 1).
MULTI_PROCESS = {"torchrun", "accelerate", "deepspeed", "lightning"}

__all__ = ["PLANNERS", "MULTI_PROCESS", "REQUIRES", "NodeCommand", "NodeContext"]
