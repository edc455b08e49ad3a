"""`corral hosts`: show the cluster exactly as corral will use it.

The first thing to run on a new hostfile: it shows node ranks, what each
ssh alias resolves to, slots, interpreter and working directory, so a wrong
port or a missing ``slots=`` is seen before a job starts.
"""

from __future__ import annotations

import os
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options, emit_json
from corral.model import Cluster, Host


@click.command(name="hosts")
@cluster_options
@click.option(
    "--resolve/--no-resolve",
    default=True,
    show_default=True,
    help="Fill address, port and user from your ssh config (ssh -G; no network I/O).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (source + one object per host).")
@click.option(
    "--trust", "trust_file", is_flag=True,
    help="Trust ./corral.toml (or -c FILE) as it is now, so that its ssh options, ssh_config "
    "or python may run commands on this machine (remembered by sha256 in "
    "~/.config/corral/trusted; an edit needs --trust again).",
)
def hosts(cluster_opts: ClusterOptions, resolve: bool, as_json: bool, trust_file: bool) -> None:
    """Show the resolved cluster: node rank, host, address, port, user, slots.

    \b
    Examples:
      corral hosts                       # ./corral.toml, Slurm, or this machine
      corral hosts -c hostfile           # DeepSpeed/OpenMPI hostfile
      corral hosts -H 'gpu[01-04]:8'     # a list, folded ranges allowed
      corral hosts -c corral.toml --json
      corral hosts --trust               # a cloned ./corral.toml that runs commands here
    """
    if trust_file:
        _trust(cluster_opts)
    cluster = cluster_opts.load(resolve=resolve, notice=False)
    if as_json:
        emit_json("hosts", cluster_to_json(cluster))
        return
    con = ui.console()
    con.print(_table(cluster))
    con.print(f"[dim]source:[/] {escape(cluster.source)}")
    if cluster.ssh_config:
        con.print(f"[dim]ssh config:[/] {escape(cluster.ssh_config)}")


def _trust(cluster_opts: ClusterOptions) -> None:
    from pathlib import Path

    from corral.errors import UsageError
    from corral.inventory import DEFAULT_FILE
    from corral.inventory._common import read_bytes
    from corral.inventory.trust import trust

    if cluster_opts.hosts is not None:
        raise UsageError(
            "--trust is for a cluster file, not a -H list",
            hint="corral hosts --trust (./corral.toml) or corral hosts -c FILE --trust",
        )
    path = Path(cluster_opts.cluster or DEFAULT_FILE).expanduser()
    store = trust(path, read_bytes(path, label=str(path), what="cluster file"))
    ui.notice(f"trusted {path} as it is now (recorded in {store})")


def cluster_to_json(cluster: Cluster) -> dict[str, Any]:
    """The machine-readable view.  Environment *values* are left out: they
    may hold tokens, and this output ends up in bug reports."""
    return {
        "source": cluster.source,
        "name": cluster.name,
        "path": cluster.path,
        "ssh_config": cluster.ssh_config,
        "ssh_options": list(cluster.ssh_options),
        "env_keys": sorted(cluster.env),
        "hosts": [_host_json(cluster, rank, h) for rank, h in _ranked(cluster)],
    }


def _ranked(cluster: Cluster) -> list[tuple[int | None, Host]]:
    """Each host with its node rank at the start of a run (None: a spare, held back)."""
    active = {h.name: i for i, h in enumerate(cluster.without_spares().hosts)}
    return [(active.get(h.name), h) for h in cluster.hosts]


def _host_json(cluster: Cluster, rank: int | None, host: Host) -> dict[str, Any]:
    return {
        "node_rank": rank,
        "spare": host.spare,
        "name": host.name,
        "address": host.address,
        "port": host.port,
        "user": host.user,
        "slots": host.slots,
        "python": host.python,
        "workdir": cluster.workdir_for(host),
        "labels": list(host.labels),
        "env_keys": sorted(cluster.env_for(host)),
        "local": host.local,
        "ssh_options": list(host.ssh_options),
    }


def _table(cluster: Cluster) -> Table:
    """One row per node rank; columns with nothing to say are left out, so
    the table stays readable in an 80-column terminal."""
    cwd = os.getcwd()
    rows = [_row(cluster, rank, host, cwd) for rank, host in _ranked(cluster)]
    columns = ["rank", "host", "address", "port", "user", "slots", "python", "workdir",
               "labels", "env"]
    always = {"rank", "host", "slots", "python", "workdir"}
    keep = [i for i, c in enumerate(columns) if c in always or any(r[i] != "-" for r in rows)]
    table = Table(title=cluster.name or None, title_justify="left", show_edge=False,
                  pad_edge=False)
    widest = max(len(h.name) for h in cluster.hosts)
    for i in keep:
        name = columns[i]
        table.add_column(
            name,
            no_wrap=name in ("rank", "host", "port", "slots"),
            min_width=min(widest, 40) if name == "host" else None,
            overflow="fold",
        )
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    return table


def _row(cluster: Cluster, rank: int | None, host: Host, cwd: str) -> list[str]:
    workdir = cluster.workdir_for(host)
    if host.address:
        address = escape(host.address)
    else:
        address = "[dim]this machine[/]" if host.local else "-"
    return [
        "[dim]spare[/]" if rank is None else str(rank),
        escape(host.name),
        address,
        str(host.port) if host.port is not None else "-",
        escape(host.user or "-"),
        str(host.slots) if host.slots is not None else "[dim]1/GPU[/]",
        escape(host.python),
        escape(workdir) if workdir else f"[dim]{escape(cwd)}[/]",
        escape(",".join(host.labels)) or "-",
        escape(",".join(sorted(cluster.env_for(host)))) or "-",
    ]
