"""Options every cluster-facing command shares: ``-c/--cluster`` and ``-H/--hosts``.

Usage in a command module::

    @click.command()
    @cluster_options
    def doctor(cluster_opts: ClusterOptions) -> None:
        cluster = cluster_opts.load()          # prints "corral: cluster: ..." on stderr

The cluster is loaded only when the command asks for it, so ``--help`` and
argument errors never read files or run ``ssh -G``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from corral import ui
from corral.inventory import load_cluster
from corral.model import Cluster

F = TypeVar("F", bound=Callable[..., Any])

CLUSTER_HELP = (
    "Cluster file: a corral.toml, or a DeepSpeed/OpenMPI hostfile ('gpu01 slots=8', "
    "'gpu[01-04] slots=8', 'user@host:8'). Default: $CORRAL_CLUSTER, then ./corral.toml, "
    "then the Slurm allocation, then this machine."
)
HOSTS_HELP = (
    "Hosts as a list: 'gpu1:8,gpu2:8', 'gpu[01-04]:8', 'alice@gpu1' (':N' = processes; "
    "without it, one per GPU). Names may be ~/.ssh/config aliases."
)


@dataclass(frozen=True, kw_only=True)
class ClusterOptions:
    """What the user passed as -c/-H; ``load()`` turns it into a Cluster."""

    cluster: str | None = None
    hosts: str | None = None

    def load(self, *, resolve: bool = True, notice: bool = True) -> Cluster:
        """Load the cluster by corral's precedence; print where it came from.

        ``resolve`` fills addresses, ports and users from ssh_config
        (``ssh -G``); ``notice`` prints the one-line "cluster: ..." note on
        stderr (commands that print the source themselves turn it off).
        """
        return load_from_options(self.cluster, self.hosts, resolve=resolve, notice=notice)


def load_from_options(
    cluster: str | None, hosts: str | None, *, resolve: bool = True, notice: bool = True
) -> Cluster:
    found, message = load_cluster(
        cluster=cluster, hosts=hosts, cwd=Path.cwd(), environ=os.environ
    )
    if notice:
        ui.notice(message)
    if not resolve:
        return found
    from corral.inventory.sshconfig import resolve_ssh  # runs `ssh -G`: not for exec

    return resolve_ssh(found)


def cluster_options(func: F) -> F:
    """Add ``-c/--cluster`` and ``-H/--hosts``; pass them as ``cluster_opts``."""

    @functools.wraps(func)
    def wrapper(*args: Any, cluster_file: str | None, hosts_list: str | None, **kwargs: Any) -> Any:
        opts = ClusterOptions(cluster=cluster_file, hosts=hosts_list)
        return func(*args, cluster_opts=opts, **kwargs)

    wrapper = click.option(
        "-H", "--hosts", "hosts_list", metavar="LIST", default=None, help=HOSTS_HELP
    )(wrapper)
    wrapper = click.option(
        "-c", "--cluster", "cluster_file", metavar="FILE", default=None, help=CLUSTER_HELP
    )(wrapper)
    return wrapper  # type: ignore[return-value]


def retired_short(flag: str, *, now: str, why: str) -> Callable[[F], F]:
    """A short flag that used to mean something here and no longer does.

    ``-n`` means ``--nproc-per-node`` in ``run`` and ``bench``; it meant
    ``--dry-run`` in ``sync`` and ``--limit`` in ``runs``.  Dropped there, it
    is refused with the long name to type, instead of click's bare "No such
    option" (or, worse, a meaning that changes from one command to the next).
    Hidden: ``--help`` does not offer it.
    """

    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            raise click.UsageError(f"{flag} is not an option here any more: say {now} ({why})", ctx=ctx)

    return click.option(flag, "retired_" + flag.strip("-"), hidden=True, default=None, expose_value=False,
                        is_flag=False, flag_value="", callback=refuse, metavar="", help="(retired)")


#: The version of every ``--json`` document (docs/json.md describes each):
#: a document's ``schema`` field is ``corral.<name>/<version>``.  Raise the
#: version when a field is removed or changes meaning; adding one does not.
JSON_SCHEMAS: dict[str, int] = {
    "error": 1,
    "hosts": 1,
    "run": 1,
    "run.plan": 1,
    "exec": 1,
    "runs": 1,
    "doctor": 1,
    "bench": 1,
    "diagnose": 1,
    "stacks": 1,
    "ssh.setup": 1,
    "ssh.teardown": 1,
    "ssh.check": 1,
    "sync": 1,
    "sandbox.status": 1,
    "sandbox.down": 1,
    "sandbox.list": 1,
    "export": 1,
    "check": 1,
    "run.detached": 1,
    "ps": 1,
    "top": 1,
}


def schema_id(document: str) -> str:
    """``corral.hosts/1``: what a ``--json`` document's ``schema`` field says."""
    return f"corral.{document}/{JSON_SCHEMAS[document]}"


def json_document(document: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its ``schema`` first."""
    return {"schema": schema_id(document), **data}


def emit_json(document: str, data: dict[str, Any], **dumps: Any) -> None:
    """Print one ``--json`` document on stdout: every one goes through here,
    so none can leave out its ``schema`` (a test checks there is no other
    ``json.dumps`` to stdout in the CLI)."""
    import json

    click.echo(json.dumps(json_document(document, data), indent=2, **dumps))
