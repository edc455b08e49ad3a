"""`corral ssh setup | teardown | check`: passwordless SSH between all nodes, both ways."""

from __future__ import annotations

import asyncio
import getpass
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options, emit_json
from corral.errors import EXIT_INFRA, UsageError
from corral.hostrange import fold
from corral.model import Host
from corral.sshsetup import Matrix, SetupOptions, SetupReport, default_cluster_id
from corral.sshsetup import check as check_mesh
from corral.sshsetup import setup as run_setup
from corral.sshsetup import teardown as run_teardown
from corral.sshsetup.hostkeys import HostKeys
from corral.sshsetup.verify import hint_for

#: Above this many nodes the matrix is summarised (failures listed) instead of drawn.
MAX_DRAWN = 16


class CliAsker:
    """Prompts on the terminal; ``--password-stdin`` reads one password from stdin."""

    def __init__(self, *, same_password: bool, password_stdin: bool, yes: bool, quiet: bool):
        self.same_password = same_password
        self.password_stdin = password_stdin
        self.yes = yes
        self.quiet = quiet
        self.interactive = sys.stdin.isatty() and not password_stdin
        self._stdin_password: str | None = None

    def step(self, text: str) -> None:
        if not self.quiet:
            ui.notice(text)

    def trust(self, new: list[HostKeys]) -> bool:
        con = ui.err_console()
        table = Table(
            title="first contact: host keys not known to this machine", title_justify="left"
        )
        table.add_column("host")
        table.add_column("address")
        table.add_column("fingerprint (ssh-keygen -l)")
        for v in new:
            t = v.target
            table.add_row(
                escape(t.host.name),
                escape(f"{t.hostname}:{t.port}"),
                escape("\n".join(v.fingerprints)),
            )
        con.print(table)
        if not self.interactive:
            return False
        return click.confirm(
            "Are these the right machines (trust these keys)?", default=False, err=True
        )

    def passwords(self, hosts: list[Host], *, retry: bool) -> dict[str, str]:
        names = [h.name for h in hosts]
        if self.password_stdin:
            if retry:
                return {}
            if self._stdin_password is None:
                line = sys.stdin.readline()
                if not line:
                    raise UsageError(
                        "--password-stdin: stdin is empty", hint='echo "$PW" | corral ssh setup ...'
                    )
                self._stdin_password = line.rstrip("\r\n")
            return {n: self._stdin_password for n in names}
        if not self.interactive:
            raise UsageError(
                f"{fold(names)} need(s) a password for the first login, "
                "and stdin is not a terminal",
                hint="run it in a terminal, or pipe the password with --password-stdin",
            )
        who = _user(hosts[0])
        again = "again: " if retry else ""
        if len(hosts) == 1:
            return {
                names[0]: click.prompt(
                    f"{again}password for {who}@{names[0]}", hide_input=True, err=True
                )
            }
        if self.same_password:
            pw = click.prompt(
                f"{again}password for {who} on {fold(names)}", hide_input=True, err=True
            )
            return {n: pw for n in names}
        first = click.prompt(f"{again}password for {who}@{names[0]}", hide_input=True, err=True)
        if click.confirm(f"use the same password for {fold(names[1:])}?", default=True, err=True):
            return {n: first for n in names}
        out = {names[0]: first}
        for h in hosts[1:]:
            out[h.name] = click.prompt(
                f"password for {_user(h)}@{h.name}", hide_input=True, err=True
            )
        return out

    def make_key(self, path: Path) -> bool:
        if self.yes:
            return True
        if not self.interactive:
            return False
        return click.confirm(f"this machine has no SSH key; create {path}?", default=True, err=True)


def _user(host: Host) -> str:
    return host.user or getpass.getuser()


def _common(*, identity_help: str, passwords: bool = True) -> Callable[[Callable], Callable]:
    """The options setup, teardown and check share, each described as that
    command uses it (check never logs in by password: no password options)."""

    def decorate(func: Callable) -> Callable:
        options = [
            click.option(
                "--id",
                "cluster_id",
                metavar="NAME",
                default=None,
                help="Name of corral's marked blocks on the nodes. Default: the cluster's name, "
                "else a hash of its host names.",
            ),
            click.option(
                "--identity",
                "-i",
                type=click.Path(dir_okay=False, path_type=Path),
                default=None,
                help=identity_help,
            ),
            click.option(
                "--accept-new",
                is_flag=True,
                help="Trust host keys seen for the first time without asking (a CHANGED key is "
                "still an error).",
            ),
        ]
        if passwords:
            options += [
                click.option("--same-password", is_flag=True, help="Ask one password for every node."),
                click.option(
                    "--password-stdin",
                    is_flag=True,
                    help="Read the password (one line, used for every node) from stdin, for scripts.",
                ),
            ]
        options.append(click.option("--json", "as_json", is_flag=True, help="Print the report as JSON."))
        for opt in reversed(options):
            func = opt(func)
        return func

    return decorate


#: --identity, as each command uses it.
_INSTALL_KEY = ("This machine's private key to install on the nodes. Default: the first of ssh's "
                "IdentityFile candidates that exists, else a new ~/.ssh/id_ed25519.")
_LOGIN_KEY = ("This machine's private key to log in to the nodes with. Default: the first of ssh's "
              "IdentityFile candidates that exists.")


def _options(
    cluster: Any, cluster_id: str | None, identity: Path | None, accept_new: bool, **kw: Any
) -> SetupOptions:
    return SetupOptions(
        cluster_id=cluster_id or default_cluster_id(cluster),
        identity=identity,
        accept_new=accept_new,
        **kw,
    )


@click.group(name="ssh")
def ssh() -> None:
    """Passwordless SSH between this machine and every node, and between all nodes.

    \b
      corral ssh setup -c hostfile              # ask the password once, set up the full mesh
      corral ssh setup -c corral.toml --ssh-config --etc-hosts
      corral ssh check -c hostfile              # the all-to-all login matrix only
      corral ssh teardown -c hostfile           # remove exactly what setup added

    See docs/ssh.md.
    """


@ssh.command()
@cluster_options
@_common(identity_help=_INSTALL_KEY)
@click.option(
    "--ssh-config",
    "ssh_config",
    is_flag=True,
    help="Also write Host entries (address, port, user) to ~/.ssh/config on every node.",
)
@click.option(
    "--etc-hosts",
    is_flag=True,
    help="Also write every node's name to /etc/hosts on every node (root).",
)
@click.option(
    "--dry-run", is_flag=True, help="Show what would change on every node; change nothing."
)
@click.option(
    "--yes", "-y", is_flag=True, help="Create this machine's key without asking if it has none."
)
def setup(
    cluster_opts: ClusterOptions,
    cluster_id: str | None,
    identity: Path | None,
    accept_new: bool,
    same_password: bool,
    password_stdin: bool,
    as_json: bool,
    ssh_config: bool,
    etc_hosts: bool,
    dry_run: bool,
    yes: bool,
) -> None:
    """Key login from here to every node and from every node to every node.

    Each node gets its own key (generated there; private keys never move),
    every node's authorized_keys gets every node's public key and this
    machine's, every node's known_hosts gets every node's host key (as
    verified here) under its name, address and host name.  Changes live in
    marked blocks; a second run changes nothing; `teardown` undoes it.  It
    ends with the all-to-all login matrix.
    """
    cluster = cluster_opts.load()
    asker = CliAsker(
        same_password=same_password, password_stdin=password_stdin, yes=yes, quiet=as_json
    )
    options = _options(
        cluster,
        cluster_id,
        identity,
        accept_new,
        ssh_config=ssh_config,
        etc_hosts=etc_hosts,
        dry_run=dry_run,
    )
    report = asyncio.run(run_setup(cluster, options, asker))
    _finish(report, as_json, verb="setup")


@ssh.command()
@cluster_options
@_common(identity_help=_LOGIN_KEY + " A node that refuses it is asked for its password.")
@click.option("--dry-run", is_flag=True, help="Show what would be removed; change nothing.")
def teardown(
    cluster_opts: ClusterOptions,
    cluster_id: str | None,
    identity: Path | None,
    accept_new: bool,
    same_password: bool,
    password_stdin: bool,
    as_json: bool,
    dry_run: bool,
) -> None:
    """Remove what `corral ssh setup` added: its blocks on every node and here,
    and the keys, files and directories it created (nothing else)."""
    cluster = cluster_opts.load()
    asker = CliAsker(
        same_password=same_password, password_stdin=password_stdin, yes=False, quiet=as_json
    )
    options = _options(cluster, cluster_id, identity, accept_new, dry_run=dry_run)
    report = asyncio.run(run_teardown(cluster, options, asker))
    _finish(report, as_json, verb="teardown")


@ssh.command()
@cluster_options
@_common(identity_help=_LOGIN_KEY, passwords=False)
def check(
    cluster_opts: ClusterOptions,
    cluster_id: str | None,
    identity: Path | None,
    accept_new: bool,
    as_json: bool,
) -> None:
    """Print the all-to-all login matrix (every node logs in to every node by key).

    Read-only, and by key only: a node that wants a password is reported,
    never asked (`corral ssh setup` installs the keys)."""
    cluster = cluster_opts.load()
    asker = CliAsker(same_password=False, password_stdin=False, yes=False, quiet=as_json)
    matrix = asyncio.run(
        check_mesh(cluster, _options(cluster, cluster_id, identity, accept_new), asker)
    )
    if as_json:
        emit_json("ssh.check", matrix.to_json())
    else:
        render_matrix(matrix)
    if not matrix.ok:
        sys.exit(EXIT_INFRA)


# ---------------------------------------------------------------------------
# output


def _finish(report: SetupReport, as_json: bool, *, verb: str) -> None:
    if as_json:
        emit_json(f"ssh.{verb}", report.to_json())
    else:
        render_report(report, verb=verb)
    if report.matrix is not None and not report.matrix.ok:
        sys.exit(EXIT_INFRA)


def render_report(report: SetupReport, *, verb: str) -> None:
    con = ui.console()
    would = "(dry run, not done) " if report.dry_run else ""
    for change in report.head:
        con.print(f"[bold]this machine[/]: {would}{escape(change)}")
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, changes in report.nodes.items():
        groups.setdefault(changes, []).append(name)
    for changes, names in groups.items():
        if not changes:
            continue
        con.print(
            f"[bold]{escape(fold(names))}[/]: {would}" + "; ".join(escape(c) for c in changes)
        )
    if report.by_password:
        why = (
            "to install this machine's key"
            if verb == "setup" and not report.dry_run
            else "no key login"
        )
        con.print(f"[dim]password used on {escape(fold(report.by_password))} ({why})[/]")
    if not report.changed:
        what = "set up" if verb == "setup" else "removed"
        con.print(
            f"[green]nothing to do[/]: ssh is already {what} on {len(report.nodes)} node(s) "
            f"(blocks '{escape(report.cluster_id)}')"
        )
    elif report.dry_run:
        con.print("[dim]dry run: nothing was changed[/]")
    for w in report.warnings:
        con.print(f"[yellow]warning:[/] {escape(w)}")
    if report.matrix is not None:
        render_matrix(report.matrix)


def render_matrix(matrix: Matrix) -> None:
    con = ui.console()
    if len(matrix.hosts) <= MAX_DRAWN:
        table = Table(title="login matrix (row logs in to column, by key)", title_justify="left")
        table.add_column("from \\ to")
        for h in matrix.hosts:
            table.add_column(escape(h), justify="center")
        for src in matrix.hosts:
            if src in matrix.unreachable:
                table.add_row(escape(src), *(["[red]?[/]"] * len(matrix.hosts)))
                continue
            cells = [
                "[green]ok[/]" if matrix.cells.get((src, d)) == "ok" else "[red]FAIL[/]"
                for d in matrix.hosts
            ]
            table.add_row(escape(src), *cells)
        con.print(table)
    color = "green" if matrix.ok else "red"
    con.print(f"[{color}]{escape(matrix.summary())}[/]")
    for src, err in matrix.unreachable.items():
        con.print(f"  [red]{escape(src)}[/]: could not be asked: {escape(err)}")
    for src, dst, why in matrix.failures()[:20]:
        con.print(f"  [red]{escape(src)} -> {escape(dst)}[/]: {escape(why)}")
        con.print(f"    [yellow]HINT:[/] {escape(hint_for(why))}")
