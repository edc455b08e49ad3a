"""`corral stop RUN`: stop a detached job the way Ctrl-C stops an attended one."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options
from corral.cli.detached import end_line, find, print_line, unreachable
from corral.errors import HostError, UsageError
from corral.run import detach


@click.command(name="stop")
@cluster_options
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where this machine keeps run directories (as for `corral runs`).")
@click.argument("run")
def stop(cluster_opts: ClusterOptions, runs_dir: Path | None, run: str) -> None:
    """Stop RUN (a detached run's id or prefix) and wait until nothing of it is left.

    \b
    Its supervisor gets SIGINT, as an attended `corral run` gets Ctrl-C: the
    ranks get SIGINT (KeyboardInterrupt; a last checkpoint), then SIGKILL
    after the grace (7 s, or the run's --grace), on every node.  Exit code
    130 once stopped; 0 when the job had already ended.
    """
    d = find(run, cluster_opts, runs_dir)
    code, ran = 0, True
    try:
        for ev in detach.node_events(d.cluster, d.host, "stop", d.run_id):
            detach.raise_node_error(d.host, ev)
            kind = ev["ev"]
            if kind == "missing":
                raise UsageError(f"{d.host.name} has no detached run {d.run_id} (removed?)",
                                 hint="`corral ps` lists the jobs on the nodes")
            if kind == "not_running":
                ran = False
                ui.notice(f"run {d.run_id} is not running (its supervisor has ended)")
            elif kind == "stopping":
                ui.notice(f"stopping run {d.run_id} (its supervisor on {d.host.name} tears it down)...")
            elif kind == "line":
                print_line(ev["t"], out=sys.stderr)
            elif kind == "end":
                text, code = end_line(ev, d.run_id)
                ui.notice(text)
    except HostError as e:
        raise unreachable(d, e, "nothing more can be done from here") from None
    detach.refresh(d)
    sys.exit(code if ran else 0)
