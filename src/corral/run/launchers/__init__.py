"""Launcher planners: one module per launcher, each ``plan(NodeContext) -> NodeCommand``."""

from __future__ import annotations

from typing import Callable

from corral.errors import UsageError
from corral.run.launchers import accelerate, command, deepspeed, lightning, torchrun
from corral.run.launchers.base import NodeCommand, NodeContext

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

_NODES = "the nodes are the cluster's hosts (-c FILE or -H h1,h2), in order; corral gives each its rank"
_RENDEZVOUS = ("corral picks the rendezvous address (node 0) and a free port itself (--master-port to "
               "choose the port)")
_RDZV = ("corral starts torchrun on every node with a static rendezvous at node 0 and explicit node "
         "ranks; a torchrun rendezvous of its own would ignore them (and --standalone waits for "
         "nodes that never join)")
_PROCS = "use -n / --nproc-per-node (processes per node)"
_RESTARTS = "use corral's --max-restarts N: it restarts the job on every node"
_DS_FANOUT = ("corral starts accelerate on every node and passes --deepspeed_multinode_launcher standard "
              "itself (each node starts its own processes); pdsh, openmpi, slurm or nossh would start every "
              "node's processes from each node. Leave it out; the config file's other DeepSpeed settings apply")

#: Launcher options corral sets itself, or that would undo what it sets, with
#: what to do instead.  Written with underscores; ``--a-b`` is matched as ``--a_b``.
OWNED_OPTIONS: dict[str, dict[str, str]] = {
    "torchrun": {
        "--nnodes": _NODES, "--node_rank": _NODES, "--master_addr": _RENDEZVOUS,
        "--master_port": _RENDEZVOUS, "--nproc_per_node": _PROCS, "--max_restarts": _RESTARTS,
        "--standalone": _RDZV, "--rdzv_backend": _RDZV, "--rdzv_endpoint": _RDZV, "--rdzv_id": _RDZV,
        "--rdzv_conf": _RDZV,
    },
    "accelerate": {
        "--num_machines": _NODES, "--machine_rank": _NODES, "--main_process_ip": _RENDEZVOUS,
        "--main_process_port": _RENDEZVOUS, "--num_processes": _PROCS, "--max_restarts": _RESTARTS,
        "--rdzv_backend": _RDZV, "--deepspeed_multinode_launcher": _DS_FANOUT,
        "--deepspeed_hostfile": _NODES, "--deepspeed_inclusion_filter": _NODES,
        "--deepspeed_exclusion_filter": _NODES,
    },
    "deepspeed": {
        "--world_info": _NODES, "--node_rank": _NODES, "--master_addr": _RENDEZVOUS,
        "--master_port": _RENDEZVOUS, "--hostfile": _NODES, "--include": _NODES, "--exclude": _NODES,
        "--num_nodes": _NODES, "--num_gpus": _PROCS,
    },
}


def _key(option: str) -> str:
    """``--node-rank=1`` -> ``--node_rank``: how OWNED_OPTIONS spells it."""
    return "--" + option.split("=", 1)[0][2:].replace("-", "_")


def owned_option_hint(option: str) -> str | None:
    """What to use instead of a launcher's option corral sets itself (any launcher's)."""
    return next((owned[_key(option)] for owned in OWNED_OPTIONS.values() if _key(option) in owned), None)


def refuse_owned_options(launcher: str, launcher_args: tuple[str, ...]) -> None:
    """A ``--launcher-arg`` that corral sets itself is refused before anything
    connects: ``--standalone`` on a multi-node cluster, for one, waited ten
    minutes for nodes that never came and then failed."""
    owned = OWNED_OPTIONS.get(launcher, {})
    for arg in launcher_args:
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        why = owned.get(_key(name))
        if why is not None:
            raise UsageError(f"--launcher-arg {arg} conflicts with what corral sets up for {launcher}", hint=why)


__all__ = ["MULTI_PROCESS", "OWNED_OPTIONS", "PLANNERS", "REQUIRES", "NodeCommand", "NodeContext",
           "owned_option_hint", "refuse_owned_options"]
