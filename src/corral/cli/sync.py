"""`corral sync`: copy the project (or paths) to every node, verified by tree hash."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options, emit_json, retired_short
from corral.errors import UsageError
from corral.hostrange import fold
from corral.model import Cluster
from corral.sync import SyncOptions, SyncReport
from corral.sync import sync as run_sync_async

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise UsageError(
            f"--pipeline-min {text!r}: expected a size like 64M or 1G",
            hint="e.g. --pipeline-min 256M",
        )
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


class ProgressView:
    """A rich progress bar on stderr: bytes sent, rate, time left (terminals only)."""

    def __init__(self, *, quiet: bool = False):
        con = ui.err_console()
        self.quiet = quiet
        self._progress = Progress(
            TextColumn("[dim]corral:[/] sync"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=con,
            transient=True,
            disable=quiet or not con.is_terminal,
        )
        self._task = None

    def note(self, text: str) -> None:
        ui.notice(text)  # stderr, so --json output stays clean

    def start(self, total_bytes: int) -> None:
        self._progress.start()
        self._task = self._progress.add_task("sync", total=max(total_bytes, 1))

    def advance(self, n: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, n)

    def done(self) -> None:
        self._progress.stop()


def _mb(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def sync_cluster(
    cluster: Cluster,
    options: SyncOptions,
    *,
    cwd: Path,
    as_json: bool = False,
    verbose: bool = False,
    brief: bool = False,
) -> SyncReport:
    """Run a sync with a progress bar and print its report.

    ``brief`` (for `corral run --sync`) prints one line on stderr instead, so
    the run's own output (and its --json) stays clean.
    """
    options = with_cluster_workdir(cluster, options)
    view = ProgressView(quiet=as_json)
    report = asyncio.run(_stoppable(run_sync_async(cluster, options, cwd=cwd, view=view)))
    if report is None:
        raise KeyboardInterrupt  # SIGTERM or SIGHUP: stopped as Ctrl-C stops it
    if brief:
        copied = sum(len(r.copy) for r in report.nodes.values())
        would = "would copy" if options.dry_run else "copied"
        ui.notice(
            f"sync: every node has tree {report.head_hash[:12]} "
            f"({sum(n for _, _, n in report.units)} file(s)); {would} {copied} file(s) in total"
            if not options.dry_run
            else f"sync (dry run): {would} {copied} file(s) in total"
        )
    elif as_json:
        emit_json("sync", report.to_json())
    else:
        render(report, dry_run=options.dry_run, verbose=verbose)
    return report


async def _stoppable(work: Coroutine[Any, Any, SyncReport]) -> SyncReport | None:
    """``work``, stopped by SIGTERM and SIGHUP as asyncio stops it on Ctrl-C:
    cancelled, so the sync stops its rsync and ssh (and waits for them) before
    corral exits; None when a signal stopped it."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    stopped: list[int] = []

    def stop(sig: int) -> None:
        stopped.append(sig)
        task.cancel()

    sigs = (signal.SIGTERM, signal.SIGHUP)
    for sig in sigs:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await work
    except asyncio.CancelledError:
        if stopped:
            return None
        raise
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)


def with_cluster_workdir(cluster: Cluster, options: SyncOptions) -> SyncOptions:
    """The project (or the parts of it named) goes where runs will look for
    it: the cluster file's ``workdir`` when it sets one (else the same path as
    here).  A sync copies to one place, so hosts with different work
    directories need ``--to``."""
    if options.to is not None:
        return options
    dirs = {h.name: cluster.workdir_for(h) for h in cluster.hosts}
    if not any(dirs.values()):
        return options
    distinct = set(dirs.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{name}: {d or '(same path as here)'}" for name, d in dirs.items())
        raise UsageError(f"the hosts have different work directories ({listing}); a sync copies to one place",
                         hint="sync each group of hosts with -H/--to (e.g. corral sync -H h2 --to /srv/other), "
                              "or give every host the same workdir in the cluster file")
    (workdir,) = distinct
    if options.paths:  # parts of the project go where runs look; other trees keep their path
        return replace(options, project_to=workdir)
    return replace(options, to=workdir)


def render(report: SyncReport, *, dry_run: bool, verbose: bool) -> None:
    con = ui.console()
    files = sum(n for _, _, n in report.units)
    for src, dest, n in report.units:
        where = dest if dest == src else f"{dest} (from {src})"
        con.print(f"[dim]tree:[/] {n} file(s) -> {escape(where)}")
    groups: dict[tuple, list[str]] = {}
    for name, r in report.nodes.items():
        key = (
            r.skipped,
            len(r.copy),
            r.bytes,
            len(r.delete),
            r.hash,
            tuple(r.copy) if verbose else (),
            tuple(r.delete) if verbose else (),
            tuple(sorted(r.shared.items())),
        )
        groups.setdefault(key, []).append(name)
    would = "would " if dry_run else ""
    for (skipped, ncopy, nbytes, ndel, thash, copies, deletes, shared), names in groups.items():
        label = f"[bold]{escape(fold(names))}[/]"
        same = "; ".join(f"{dest} is {node}'s (shared)" for dest, node in shared)
        if skipped:
            con.print(f"{label}: {escape(skipped)}")
        elif not ncopy and not ndel:
            con.print(f"{label}: " + escape(same or "up to date"))
        else:
            parts = [f"{would}copy {ncopy} file(s) ({_mb(nbytes)})"] if ncopy else []
            if ndel:
                parts.append(f"{would}delete {ndel}")
            con.print(f"{label}: " + escape(", ".join(parts + ([same] if same else []))))
        for p in copies:
            con.print(f"    [green]+[/] {escape(p)}")
        for p in deletes:
            con.print(f"    [red]-[/] {escape(p)}")
    if dry_run:
        con.print("[dim]dry run: nothing was changed[/]")
        return
    if report.mode == "check":
        con.print(
            f"[green]in sync[/]: every node has tree {report.head_hash[:12]} ({files} file(s))"
        )
        return
    rate = (
        f", {_mb(int(report.bytes_sent / report.duration_s))}/s"
        if report.bytes_sent and report.duration_s
        else ""
    )
    con.print(
        f"[green]verified[/]: every node has tree {report.head_hash[:12]} ({files} file(s)); "
        f"{report.mode}, {_mb(report.bytes_sent)} sent in {report.duration_s:.1f}s{rate}"
    )


@click.command(name="sync")
@cluster_options
@click.argument("paths", nargs=-1, type=click.Path(exists=False))
@click.option(
    "--to",
    "to",
    metavar="DIR",
    default=None,
    help="Destination on the nodes (absolute). Default: the cluster file's workdir, else the same "
         "path as here.",
)
@click.option(
    "--delete",
    is_flag=True,
    help="Delete files on the nodes that are not here (only inside the synced tree; files the "
    "ignore rules match, like runs/ or checkpoints, are kept). Refused in /, a home directory, "
    "or a non-empty directory corral has not synced to (see --force-delete).",
)
@click.option(
    "--force-delete",
    is_flag=True,
    help="Let --delete prune a directory it refuses: / , a home directory, or a non-empty "
    "directory corral has not synced to before (no .corral-sync marker there).",
)
@click.option("--dry-run", is_flag=True, help="Show what would be copied and deleted on each node.")
@retired_short("-n", now="--dry-run", why="-n is --nproc-per-node in run and bench")
@click.option(
    "--check", is_flag=True, help="Only compare: exit 3 and name the nodes and files that differ."
)
@click.option(
    "--no-pipeline",
    is_flag=True,
    help="Send large files from here to each node, never node to node.",
)
@click.option(
    "--pipeline-min",
    default="64M",
    show_default=True,
    metavar="SIZE",
    help="Files this large stream node to node when nodes can log in to each other.",
)
@click.option("--verbose", "-v", is_flag=True, help="List every file copied or deleted.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def sync(
    cluster_opts: ClusterOptions,
    paths: tuple[str, ...],
    to: str | None,
    delete: bool,
    force_delete: bool,
    dry_run: bool,
    check: bool,
    no_pipeline: bool,
    pipeline_min: str,
    verbose: bool,
    as_json: bool,
) -> None:
    """Copy the project (or PATHs) to the same place on every node, verified.

    \b
    Examples:
      corral sync -c hostfile                  # this git project, same path on every node
                                             # (or the cluster file's workdir)
      corral sync -c hostfile --delete -n      # what would change (and be deleted) on each node
      corral sync --to /srv/proj --force-delete  # --delete into a directory not synced before
      corral sync data/ ckpt/model.pt          # parts of the project (even if .gitignore'd)
      corral sync /datasets/wiki --to /srv     # a tree outside the project -> /srv/wiki
      corral sync --check                      # compare tree hashes only

    What is sent: in a git repository, what `git ls-files --cached --others
    --exclude-standard` lists (so .gitignore applies), minus .corralignore
    (gitignore syntax) and corral's defaults (.git, runs/, .venv, caches).
    Files of 64M or more stream node to node when the nodes can log in to
    each other (`corral ssh setup`).  Afterwards every node must report the
    same tree hash as this machine, or the node and files are named.
    """
    cluster = cluster_opts.load()
    options = SyncOptions(
        paths=paths,
        to=to,
        delete=delete or force_delete,
        force_delete=force_delete,
        dry_run=dry_run,
        check=check,
        pipeline="off" if no_pipeline else "auto",
        pipeline_min_bytes=parse_size(pipeline_min),
    )
    sync_cluster(cluster, options, cwd=Path.cwd(), as_json=as_json, verbose=verbose)
