"""`corral doctor`: check every node for what would break or slow a job, and say how to fix it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options, emit_json, load_from_options
from corral.doctor.checks import ERROR, FAMILIES, OK, WARNING, Finding
from corral.doctor.examine import DoctorOptions, DoctorReport, examine
from corral.doctor.fixenv import FixResult, write_env
from corral.errors import EXIT_INFRA
from corral.hostrange import HostSet
from corral.model import Cluster

#: Exit status when doctor found at least one error (2 and 3 keep their corral meanings:
#: bad input; no node could be reached at all).
EXIT_FOUND_ERRORS = 1
_ICON = {ERROR: "[bold red]✗[/]", WARNING: "[yellow]![/]", OK: "[green]✓[/]"}


@click.command(name="doctor")
@cluster_options
@click.option("--fix-env", is_flag=True,
              help="Write the recommended per-host NCCL/gloo variables into the cluster file "
                   "(a corral.toml; created next to a hostfile). `corral run` then uses them.")
@click.option("--smoke/--no-smoke", default=True, show_default=True,
              help="Run a short all-reduce on every node through corral run's launch path "
                   "(gloo on CPU, NCCL on GPUs).")
@click.option("--ssh/--no-ssh", "ssh", default=True, show_default=True,
              help="Test passwordless SSH between every pair of nodes (DeepSpeed/pdsh, MPI).")
@click.option("--links/--no-links", default=True, show_default=True,
              help="Measure node-to-node throughput briefly to find a slow link.")
@click.option("--torch/--no-torch", "import_torch", default=True, show_default=True,
              help="Import torch on every node (CUDA build, NCCL version, and that it imports).")
@click.option("--port", "ports", type=click.IntRange(1, 65535), multiple=True, metavar="PORT",
              help="Also test this TCP port between every pair (e.g. a fixed --master-port). Repeatable.")
@click.option("--workdir", default=None, metavar="DIR",
              help="Working directory to check on every node. Default: the cluster file's, else this "
                   "directory's path.")
@click.option("--smoke-timeout", type=click.FloatRange(min=10), default=180.0, show_default=True,
              help="Seconds before a hanging smoke test is stopped and reported.")
@click.option("--smoke-nproc", type=click.IntRange(min=1), default=None,
              help="Processes per node in the smoke test. Default: one per GPU, else 1.")
@click.option("-q", "--quiet", is_flag=True, help="Show only errors and warnings.")
@click.option("--json", "as_json", is_flag=True, help="Print findings, recommendations and all facts as JSON.")
def doctor(cluster_opts: ClusterOptions, fix_env: bool, smoke: bool, ssh: bool, links: bool,
           import_torch: bool, ports: tuple[int, ...], workdir: str | None, smoke_timeout: float,
           smoke_nproc: int | None, quiet: bool, as_json: bool) -> None:
    """Check every node of the cluster for what would break or slow a job.

    \b
    Examples:
      corral doctor -c hostfile             # everything, with a smoke all-reduce
      corral doctor -c corral.toml --fix-env
      corral doctor --no-smoke --json > doctor.json

    Gathers facts from every node at once (Python, torch/CUDA/NCCL, GPUs,
    interfaces, InfiniBand, /dev/shm, clocks...), tests TCP ports and SSH
    between every pair of nodes, picks the network interface each node should
    use, then runs a short all-reduce through the same path as `corral run`.
    Every problem names its hosts and the fix.  Exit status: 0 when there is
    no error (warnings allowed), 1 when there is one, 3 when no node could be
    reached at all, 2 for bad input.
    """
    cluster = cluster_opts.load()
    options = DoctorOptions(workdir=workdir, ports=ports, ssh=ssh, links=links, torch=import_torch,
                            smoke_timeout=smoke_timeout, smoke_nproc=smoke_nproc)
    report = asyncio.run(examine(cluster, options, head_env=os.environ, head_cwd=os.getcwd(),
                                 progress=ui.notice))
    fixed: FixResult | None = None
    if fix_env:
        fixed = _fix(cluster_opts, report)
        cluster = load_from_options(str(fixed.path), None, notice=False)
    if smoke:
        report = report.with_smoke(_smoke(cluster, report, options))
    if as_json:
        data = report.to_json()
        data["fix_env"] = None if fixed is None else {
            "path": str(fixed.path), "created": fixed.created, "layout": fixed.layout,
            "changes": list(fixed.changes)}
        emit_json("doctor", data, default=str)
    else:
        render(report, quiet=quiet, fixed=fixed)
    sys.exit(exit_code(report))


def exit_code(report: DoctorReport) -> int:
    """0 no error; 1 errors found on nodes it could examine; 3 (as for every
    command) when not one node could be reached: there is nothing it examined."""
    if report.cluster.names and set(report.cluster.names) <= set(report.evidence.unreachable):
        return EXIT_INFRA
    return EXIT_FOUND_ERRORS if report.errors else 0


def _fix(cluster_opts: ClusterOptions, report: DoctorReport) -> FixResult:
    # Write what the user wrote (not ssh -G's expansion of it).
    raw = cluster_opts.load(resolve=False, notice=False)
    return write_env(raw, report.recommended_env, cwd=Path.cwd())


def _smoke(cluster: Cluster, report: DoctorReport, options: DoctorOptions):
    from corral.doctor.smoke import blockers, skipped, smoke_test

    blocking = blockers(report.findings)
    if blocking:
        return skipped("errors above would make it fail: "
                       + "; ".join(sorted({f.check for f in blocking})))
    ui.notice("smoke test: an all-reduce on every node through corral run's launch path...")
    return asyncio.run(smoke_test(cluster, report.evidence, head_env=os.environ, head_cwd=os.getcwd(),
                                  timeout=options.smoke_timeout, nproc=options.smoke_nproc))


# ---------------------------------------------------------------------------
# rendering


#: The widest the host column gets (a folded host list: ``gpu[001-064,...]``).
HOSTS_WIDTH = 32


def render(report: DoctorReport, *, quiet: bool = False, fixed: FixResult | None = None) -> None:
    con = ui.console()
    by_family: dict[str, list[Finding]] = {}
    for f in report.findings:
        by_family.setdefault(f.family, []).append(f)
    for family, title in FAMILIES.items():
        shown = [f for f in by_family.get(family, []) if not (quiet and f.severity == OK)]
        if not shown:
            continue
        con.print(f"\n[bold]{title}[/]")
        table = Table(box=None, show_header=False, padding=(0, 1, 0, 2))
        table.add_column(width=1)
        # a host set of hundreds of nodes folds over lines, never over the message
        table.add_column(style="bold", max_width=HOSTS_WIDTH, overflow="fold")
        table.add_column(overflow="fold", min_width=30)
        for f in sorted(shown, key=lambda f: (f.severity != ERROR, f.severity != WARNING)):
            table.add_row(_ICON[f.severity], escape(str(f.hosts)), ui.shown(f.message))
            if f.hint and f.severity != OK:
                table.add_row("", "", f"[dim]hint:[/] {ui.shown(f.hint)}")
        con.print(table)
    _render_env(report, fixed)
    errors, warnings = len(report.errors), len(report.warnings)
    hosts = HostSet.of(report.cluster.names)
    if errors:
        con.print(f"\n[bold red]{errors} error(s)[/], {warnings} warning(s) on {len(hosts)} node(s) "
                  f"{escape(str(hosts))}")
    else:
        con.print(f"\n[bold green]no errors[/], {warnings} warning(s) on {len(hosts)} node(s) "
                  f"{escape(str(hosts))}")


def _render_env(report: DoctorReport, fixed: FixResult | None) -> None:
    if not report.recommended_env:
        return
    con = ui.console()
    if fixed is not None:
        what = "created" if fixed.created else "updated"
        con.print(f"\n[bold]Environment[/] written to {escape(str(fixed.path))} ({what}; "
                  f"{'[cluster.env]' if fixed.layout == 'cluster' else 'each [[hosts]] env'}):")
    elif all(all(report.evidence.env_of(h).get(k) == v for k, v in env.items())
             for h, env in report.recommended_env.items()):
        con.print("\n[bold]Environment[/]: the recommended variables are already set:")
    else:
        con.print("\n[bold]Recommended environment[/] (`corral doctor --fix-env` writes it into "
                  "the cluster file):")
    groups: dict[tuple, list[str]] = {}
    for host, env in report.recommended_env.items():
        groups.setdefault(tuple(sorted(env.items())), []).append(host)
    table = Table(box=None, show_header=False, padding=(0, 1, 0, 2))
    table.add_column(max_width=HOSTS_WIDTH, overflow="fold")
    table.add_column(overflow="fold", min_width=30)
    for env, hosts in groups.items():
        table.add_row(escape(str(HostSet.of(hosts))),
                      escape(" ".join(f"{k}={v}" for k, v in env) or "(nothing to set)"))
    con.print(table)
