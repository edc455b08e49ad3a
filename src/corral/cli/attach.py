"""`corral attach RUN`: the live output of a detached job, from where it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options
from corral.cli.detached import end_line, find, print_lines, unreachable
from corral.errors import HostError, UsageError
from corral.run import detach


@click.command(name="attach")
@cluster_options
@click.option("--tail", type=click.IntRange(min=0), default=40, show_default=True,
              help="Start with this many of the console's last lines.")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where this machine keeps run directories (as for `corral runs`).")
@click.argument("run")
def attach(cluster_opts: ClusterOptions, tail: int, runs_dir: Path | None, run: str) -> None:
    """Follow RUN (a detached run's id or its prefix) as its terminal would show it.

    \b
    The console lives on the job's first node, where its supervisor runs;
    status lines and corral's own messages included.  Ctrl-C detaches: the
    job goes on (`corral stop RUN` stops it).  When the job ends, its run
    directory is copied back into this machine's runs directory.  From a
    machine that did not start it: `corral attach -c CLUSTER RUN-ID`.
    """
    d = find(run, cluster_opts, runs_dir)
    code = 0
    try:
        for ev in detach.node_events(d.cluster, d.host, "attach", d.run_id, str(tail), batches=True):
            detach.raise_node_error(d.host, ev)
            kind = ev["ev"]
            if kind == "missing":
                raise UsageError(f"{d.host.name} has no detached run {d.run_id} (removed?)",
                                 hint="`corral ps` lists the jobs on the nodes")
            if kind == "state" and ev.get("alive") is False:
                ui.notice(f"run {d.run_id} has ended; its last lines:")
            elif kind == "lines":
                print_lines(ev["t"])
            elif kind == "end":
                text, code = end_line(ev, d.run_id)
                ui.notice(text)
    except KeyboardInterrupt:
        ui.notice(f"detached from run {d.run_id}; it goes on (`corral stop {d.run_id}` stops it, "
                  f"`corral attach {d.run_id}` follows it again)")
        return
    except HostError as e:
        raise unreachable(d, e, f"`corral attach {d.run_id}` again once it is back") from None
    if d.stub is not None:
        detach.refresh(d)
        try:
            detach.sync(d, d.stub)
            detach.refresh(d)
            ui.notice(f"run directory: {d.stub}")
        except HostError as e:
            ui.notice(f"its run directory could not be copied back: {e.message}")
    sys.exit(code)
