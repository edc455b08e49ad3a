"""What other tools' files say about a run, applied to its ``RunSpec`` before
anything connects (docs/interop.md):

- ``.deepspeed_env`` for ``--launcher deepspeed`` (and for accelerate in
  DeepSpeed mode with its pdsh launcher, which goes through DeepSpeed's
  runner too);
- an accelerate config file (``--config-file F`` or ``--launcher-arg
  --config_file=F``), checked against the cluster; what corral follows from
  it (processes per node, port, rendezvous backend) goes into the spec;
- a DeepSpeed JSON config that config names, kept for ``ds_config_notes``.

Returns the spec and the lines the CLI prints; the library never prints.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, Sequence

from corral.errors import UsageError
from corral.interop import accelerate_config
from corral.interop.dsenv import load as load_ds_env
from corral.model import Cluster, Host
from corral.run.plan import CONTRACT, NodeFacts, RunSpec


def launcher_config_file(launcher_args: tuple[str, ...]) -> str | None:
    """The ``--config_file`` (or ``--config-file``) given to accelerate through --launcher-arg."""
    for i, arg in enumerate(launcher_args):
        name, eq, value = arg.partition("=")
        if name in ("--config_file", "--config-file"):
            return value if eq else (launcher_args[i + 1] if i + 1 < len(launcher_args) else None)
    return None


def _nproc_fixed(cluster: Cluster, spec: RunSpec) -> int | None:
    slots = {h.slots for h in cluster.hosts}
    return spec.nproc_per_node or (slots.pop() if len(slots) == 1 else None)


def apply_imports(spec: RunSpec, cluster: Cluster, *, config_file: str | None, cwd: str,
                  environ: Mapping[str, str], home: Path) -> tuple[RunSpec, list[str]]:
    """``spec`` with what the files say applied, and the lines to print (one per file)."""
    notes: list[str] = []
    fans_out = False
    given = launcher_config_file(spec.launcher_args)
    if config_file is not None:
        if spec.launcher != "accelerate":
            raise UsageError(f"--config-file {config_file}: that is accelerate's config file, for --launcher "
                             f"accelerate (this run's launcher is {spec.launcher})",
                             hint="add --launcher accelerate, or leave --config-file out")
        if given is not None:
            raise UsageError(f"--config-file {config_file} and --launcher-arg --config_file {given}: one file",
                             hint="keep --config-file")
        spec = dataclasses.replace(spec, launcher_args=(*spec.launcher_args, "--config_file", config_file))
        given = config_file
    cfg = None
    if spec.launcher == "accelerate" and given:
        cfg = accelerate_config.read(os.path.join(cwd, os.path.expanduser(given)), given)
        if cfg is None:
            notes.append(f"accelerate config {given}: not here, so not checked before launch (accelerate reads "
                         "it on every node, from its working directory)")
    if cfg is not None:
        followed = accelerate_config.follow(cfg, hosts=cluster.hosts, nproc_per_node=_nproc_fixed(cluster, spec),
                                            master_port=spec.master_port)
        spec = dataclasses.replace(
            spec, nproc_per_node=spec.nproc_per_node or followed.nproc_per_node,
            master_port=spec.master_port or followed.master_port)
        notes.append(accelerate_config.summary(cfg, followed))
        if followed.deepspeed_config_file:
            spec = dataclasses.replace(spec, ds_configs=(*spec.ds_configs, followed.deepspeed_config_file))
        fans_out = followed.fans_out
    if spec.launcher == "deepspeed" or fans_out:
        ds_env = load_ds_env(environ, home, Path(cwd))
        if ds_env:
            spec = dataclasses.replace(spec, ds_env=ds_env)
            notes.append(ds_env.summary())
            owned = [v for v in ds_env.values if v.name in CONTRACT]
            if owned:
                notes.append(", ".join(f"{v.name} ({v.source})" for v in owned) + ": set by corral for every "
                             "node, so not applied (DeepSpeed's launcher sets them over the file too); "
                             "--master-port chooses the port")
    return spec, notes


#: accelerate flags with which it does not read its default config.
_NO_DEFAULT_CONFIG = ("--cpu",)


def node_accelerate_notes(spec: RunSpec, hosts: Sequence[Host], facts: Mapping[str, NodeFacts],
                          nproc: int) -> list[str]:
    """Each node's own accelerate default config, which accelerate reads there
    when no --config_file is given, checked against the cluster: a multi-machine
    one must agree with it, and its ``machine_rank`` must be that node's rank
    (two nodes with ``machine_rank: 0``, copied from one machine, is the usual
    mistake).  A single-machine one is overruled by corral's flags: said."""
    if spec.launcher != "accelerate" or launcher_config_file(spec.launcher_args) is not None \
            or any(a in _NO_DEFAULT_CONFIG for a in spec.launcher_args):
        return []
    single, ranks = [], {}
    for index, host in enumerate(hosts):
        pair = facts.get(host.name, NodeFacts()).accelerate_config
        if pair is None:
            continue
        cfg = accelerate_config.parse(pair[1], f"{host.name}:{pair[0]}")
        if (cfg.get("num_machines") or 1) == 1:
            single.append(host.name)
            continue
        accelerate_config.follow(cfg, hosts=hosts, nproc_per_node=nproc, master_port=None)
        rank = cfg.get("machine_rank")
        if rank in ranks:
            other = ranks[rank]
            raise cfg.error("machine_rank", f"{rank}, and {other.path.split(':')[0]}'s is {rank} too: two nodes "
                                            "cannot have one rank (a config copied from one machine?)",
                            hint=f"set machine_rank: {index} on {host.name} (its place in the host order), or "
                                 "remove machine_rank from the nodes' configs: corral gives each node its rank")
        if rank is not None and rank != index:
            raise cfg.error("machine_rank", f"{rank}, but {host.name} is node {index} in the host order",
                            hint=f"set machine_rank: {index}, or list the hosts in the order of their "
                                 "machine_rank, or remove machine_rank: corral gives each node its rank")
        ranks[rank] = cfg
    if single:
        from corral.hostrange import fold

        return [f"the accelerate default config on {fold(single)} is for one machine: corral's --num_machines, "
                "--machine_rank, --num_processes and rendezvous win over it there; its other settings apply"]
    return []
