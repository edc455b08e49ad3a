"""A Slurm allocation as a cluster, from the variables Slurm sets.

Inside ``salloc`` or an ``sbatch`` script, Slurm exports the node list in
folded form (``SLURM_JOB_NODELIST=gpu-[01-03,05]``) and the task layout in
its own compressed form (``SLURM_TASKS_PER_NODE=2(x3),1``).  corral reads
them so ``corral run train.py`` inside an allocation needs no hostfile.

Processes per node ("slots"), in order:

1. the tasks Slurm gave the node, when more than one (``--ntasks-per-node=8``
   says how many processes the user asked for);
2. else the GPUs per node (``SLURM_GPUS_PER_NODE`` from ``--gpus-per-node``,
   else ``SLURM_GPUS_ON_NODE``, which describes the node this runs on and is
   taken to hold for all nodes);
3. else unset: one per GPU, detected on each node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from corral.errors import InventoryError
from corral.inventory._common import expand_names, make_host
from corral.model import Cluster

NODELIST_VARS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")


def in_slurm_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_NODELIST"))


def read_slurm(environ: Mapping[str, str]) -> Cluster:
    """The current Slurm allocation as a Cluster (hosts in Slurm's order)."""
    var = next((v for v in NODELIST_VARS if environ.get(v)), None)
    if var is None:
        raise InventoryError(
            "not inside a Slurm allocation (SLURM_JOB_NODELIST is not set)",
            hint="run corral inside salloc/sbatch, or give the hosts with -c or -H",
        )
    names = expand_names(environ[var], path=var, line=None)
    tasks = _tasks_per_node(environ.get("SLURM_TASKS_PER_NODE"), len(names))
    gpus = _gpus_per_node(environ)
    hosts = []
    for name, ntasks in zip(names, tasks):
        slots = ntasks if ntasks and ntasks > 1 else gpus
        hosts.append(make_host(name, slots=slots))
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "(job id unknown)"
    return Cluster(
        hosts=tuple(hosts),
        source=f"Slurm allocation {job}",
        name=environ.get("SLURM_CLUSTER_NAME") or None,
        # Inside the allocation (SLURM_JOB_ID set: salloc, sbatch) nodes are
        # job steps; a node list alone (copied into another shell) means ssh.
        transport="srun" if environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") else "ssh",
    )


def _tasks_per_node(value: str | None, nodes: int) -> list[int | None]:
    """``2(x3),1`` -> [2, 2, 2, 1]; must cover exactly the allocation's nodes."""
    if not value:
        return [None] * nodes
    counts: list[int | None] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise InventoryError(
                f"cannot read {value!r}: {part!r} is not N or N(xK)", path="SLURM_TASKS_PER_NODE"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if len(counts) != nodes:
        raise InventoryError(
            f"{value!r} describes {len(counts)} nodes but the node list has {nodes}",
            path="SLURM_TASKS_PER_NODE",
            hint="this environment mixes two allocations; start corral from a fresh salloc/sbatch",
        )
    return counts


def _gpus_per_node(environ: Mapping[str, str]) -> int | None:
    """GPUs per node from ``--gpus-per-node`` (``4``, ``a100:4``, ``a100:2,v100:2``)."""
    per_node = environ.get("SLURM_GPUS_PER_NODE")
    if per_node:
        total = 0
        for part in per_node.split(","):
            count = part.rsplit(":", 1)[-1].strip()
            if not count.isdigit():
                raise InventoryError(
                    f"cannot read {per_node!r}: expected [TYPE:]COUNT", path="SLURM_GPUS_PER_NODE"
                )
            total += int(count)
        return total or None
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node:
        if not on_node.isdigit():
            raise InventoryError(
                f"cannot read {on_node!r}: expected a count", path="SLURM_GPUS_ON_NODE"
            )
        return int(on_node) or None
    return None
