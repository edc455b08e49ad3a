"""``corral doctor --fix-env``: write the recommended per-host environment into the cluster file.

``corral run`` applies a cluster file's ``[cluster.env]`` and each
``[[hosts]]`` table's ``env`` to every process it starts, so writing the
recommendation there makes every later run use it.  The variables written
are the ones doctor recommends (``MANAGED``); nothing else in the file
changes, comments included (tomlkit).

Where it goes:

- a ``corral.toml`` with ``[[hosts]]`` tables: one value for every host goes
  to ``[cluster.env]``; values that differ between hosts (``eth0`` here,
  ``ens5`` there) go to each ``[[hosts]]`` table's ``env`` (a folded range
  whose hosts need different values must be split first: it says which);
- a ``corral.toml`` with ``[cluster] hostfile = ...``: ``[cluster.env]``;
  per-host values need ``[[hosts]]`` tables instead of the hostfile (it says so);
- a hostfile, or ``-H``: a new ``corral.toml`` next to the hostfile (or in the
  current directory for ``-H``) that keeps using the hostfile
  (``hostfile = "..."`` plus ``[cluster.env]``) when one value fits every
  host, and lists the hosts as ``[[hosts]]`` tables when they differ.  An
  existing ``corral.toml`` there is never overwritten.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.items import AoT, Table

from corral.errors import UsageError
from corral.hostrange import expand, fold
from corral.model import Cluster

#: The variables --fix-env manages (set to the recommendation, or removed).
MANAGED = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE")


@dataclass(frozen=True, kw_only=True)
class FixResult:
    path: Path
    created: bool
    #: "cluster" ([cluster.env]) or "hosts" (each [[hosts]] table's env).
    layout: str
    #: Human-readable lines: ``node[1-4]: NCCL_SOCKET_IFNAME=eth0``.
    changes: tuple[str, ...]


def write_env(cluster: Cluster, recommended: Mapping[str, Mapping[str, str]], *, cwd: Path) -> FixResult:
    """Write ``recommended`` (host -> variables) into ``cluster``'s file (see module docstring)."""
    missing = [h for h in cluster.names if h not in recommended]
    if missing:
        raise UsageError(f"no recommendation for {fold(missing)} (not reachable?)",
                         hint="fix the connection problems first, then run --fix-env again")
    values = {h: {k: recommended[h][k] for k in MANAGED if k in recommended[h]} for h in cluster.names}
    uniform = len({tuple(sorted(v.items())) for v in values.values()}) == 1
    changes = tuple(_describe(values))
    if cluster.source.startswith("cluster file") and cluster.path:
        path = Path(cluster.path)
        doc = tomlkit.parse(path.read_text())
        layout = _update(doc, values, uniform, path)
        path.write_text(tomlkit.dumps(doc))
        return FixResult(path=path, created=False, layout=layout, changes=changes)
    if cluster.source.startswith("hostfile") and cluster.path:
        hostfile = Path(cluster.path)
        target = hostfile.parent / "corral.toml"
        doc = _new_doc(cluster, values, uniform, hostfile=os.path.relpath(hostfile, target.parent))
    elif cluster.source.startswith("--hosts"):
        target = cwd / "corral.toml"
        doc = _new_doc(cluster, values, False, hostfile=None)
        uniform = False
    else:
        lines = "; ".join(changes)
        raise UsageError(
            f"--fix-env needs a cluster file to write to, and this cluster comes from {cluster.source}",
            hint=f"write a corral.toml (see examples/corral.toml) and run again with -c, or pass the "
                 f"variables with `corral run --env`: {lines}",
        )
    if target.exists():
        raise UsageError(f"{target} already exists; --fix-env does not overwrite it",
                         hint=f"run `corral doctor -c {target} --fix-env` to update that file instead")
    target.write_text(tomlkit.dumps(doc))
    return FixResult(path=target, created=True, layout="cluster" if uniform else "hosts",
                     changes=changes)


def _describe(values: Mapping[str, Mapping[str, str]]) -> list[str]:
    groups: dict[tuple, list[str]] = {}
    for host, env in values.items():
        groups.setdefault(tuple(sorted(env.items())), []).append(host)
    return [f"{fold(hosts)}: " + (" ".join(f"{k}={v}" for k, v in env) or "(nothing)")
            for env, hosts in groups.items()]


def _update(doc: Any, values: Mapping[str, Mapping[str, str]], uniform: bool, path: Path) -> str:
    cluster = doc.get("cluster")
    if cluster is None:
        cluster = tomlkit.table()
        doc["cluster"] = cluster
    hosts = doc.get("hosts")
    if uniform:
        _set(_env_table(cluster), next(iter(values.values())))
        for entry in hosts or []:
            if "env" in entry:
                _set(entry["env"], {})
        return "cluster"
    if not isinstance(hosts, AoT) or len(hosts) == 0:
        raise UsageError(
            f"{path}: the hosts need different values ({'; '.join(_describe(values))}), which "
            "needs one [[hosts]] table per host, but the hosts come from `[cluster] hostfile`",
            hint="replace `hostfile = ...` with [[hosts]] tables (see examples/corral.toml), "
                 "then run --fix-env again",
        )
    if "env" in cluster:
        _set(cluster["env"], {})
    for index, entry in enumerate(hosts):
        names = expand(str(entry["name"]))
        wanted = {tuple(sorted(values[n].items())) for n in names if n in values}
        if len(wanted) > 1:
            raise UsageError(
                f"{path}: [[hosts]] #{index + 1} ({entry['name']}) covers hosts that need different "
                f"values ({'; '.join(_describe({n: values[n] for n in names if n in values}))})",
                hint="split that table into one per group of hosts, then run --fix-env again",
            )
        if wanted:
            _set(_env_table(entry), dict(next(iter(wanted))))
    return "hosts"


def _env_table(table: Any) -> Table:
    if "env" not in table:
        table["env"] = tomlkit.table()
    return table["env"]


def _set(env: Any, values: Mapping[str, str]) -> None:
    """Set the managed variables of ``env`` to exactly ``values``; leave the others alone."""
    for key in MANAGED:
        if key in values:
            env[key] = values[key]
        elif key in env:
            del env[key]


def _new_doc(cluster: Cluster, values: Mapping[str, Mapping[str, str]], uniform: bool,
             *, hostfile: str | None) -> Any:
    doc = tomlkit.document()
    doc.add(tomlkit.comment("Written by `corral doctor --fix-env`: the network settings it "
                            "recommends for each host."))
    doc.add(tomlkit.comment("`corral run` picks this file up from this directory (or -c it)."))
    table = tomlkit.table()
    if uniform and hostfile is not None:
        table["hostfile"] = hostfile
        env = tomlkit.table()
        _set(env, next(iter(values.values())))
        table["env"] = env
        doc["cluster"] = table
        return doc
    if cluster.ssh_options:
        table["ssh_options"] = list(cluster.ssh_options)
    if len(table):
        doc["cluster"] = table
    hosts = tomlkit.aot()
    for host in cluster.hosts:
        entry = tomlkit.table()
        entry["name"] = host.name
        for key in ("address", "port", "user", "slots"):
            value = getattr(host, key)
            if value is not None:
                entry[key] = value
        if host.python != "python3":
            entry["python"] = host.python
        env = tomlkit.table()
        _set(env, values[host.name])
        entry["env"] = env
        hosts.append(entry)
    doc["hosts"] = hosts
    return doc
