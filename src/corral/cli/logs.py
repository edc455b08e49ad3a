"""`corral logs RUN`: a detached job's per-rank logs, read where they live."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options
from corral.cli.detached import end_line, find, print_line, print_lines, unreachable
from corral.errors import HostError, UsageError
from corral.frames import terminal_safe
from corral.run import detach


@click.command(name="logs")
@cluster_options
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Only this global rank's log.")
@click.option("--node", default=None, metavar="HOST", help="Only the logs of this host's ranks (and its launcher).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the ranks write, until the job ends (as tail -f).")
@click.option("--tail", type=click.IntRange(min=0), default=None, metavar="N",
              help="Start with the last N lines of each log (default: all of it).")
@click.option("--sync", "sync_dir", is_flag=True,
              help="Copy the job's run directory (run.json, every rank's log, the console) back into this "
                   "machine's runs directory, complete, and print where.")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where this machine keeps run directories (as for `corral runs`).")
@click.argument("run")
def logs(cluster_opts: ClusterOptions, rank: int | None, node: str | None, follow: bool, tail: int | None,
         sync_dir: bool, runs_dir: Path | None, run: str) -> None:
    """Print the logs of RUN, a detached run (running or finished), from its nodes.

    \b
    Every rank's output is kept on the job's first node, where its
    supervisor runs (runs/<id>/<host>/rank<N>.log there).  Lines are
    prefixed [host/rN] when several logs are shown.  From a machine that did
    not start the job: `corral logs -c CLUSTER RUN-ID`.
    """
    d = find(run, cluster_opts, runs_dir)
    if node is not None and node not in d.cluster.names:
        raise UsageError(f"--node {node}: not a host of run {d.run_id} ({', '.join(d.cluster.names)})")
    if sync_dir:
        if d.stub is None:
            raise UsageError("no runs directory here to copy into", hint="give --runs-dir DIR")
        try:
            detach.sync(d, d.stub)
        except HostError as e:
            raise unreachable(d, e, f"its run directory stays there; what an earlier sync copied is in {d.stub}") \
                from None
        detach.refresh(d)
        ui.notice(f"run {d.run_id}: run directory copied to {d.stub}")
        return
    opts = {"rank": rank, "node": node, "tail": tail, "follow": follow}
    import json

    code = 0
    try:
        files: set[tuple[str, object]] = set()
        events = detach.node_events(d.cluster, d.host, "logs", d.run_id, json.dumps(opts), batches=True)
        for ev in events:
            detach.raise_node_error(d.host, ev)
            kind = ev["ev"]
            if kind == "missing":
                raise UsageError(f"{d.host.name} has no detached run {d.run_id} (removed?)",
                                 hint="`corral ps` lists the jobs on the nodes")
            if kind == "no_rank":
                world = ev.get("world") if isinstance(ev.get("world"), int) else 0
                ranks = f"0-{world - 1}" if world > 1 else "0"
                raise UsageError(f"--rank {rank}: run {d.run_id} has no rank {rank} (its ranks are {ranks})",
                                 hint="give one of those, or --node HOST for one host's ranks")
            if kind == "lines":
                host, r = str(ev.get("h", "?")), ev.get("r")
                files.add((host, r))
                label = f"[{host}/r{r}] " if isinstance(r, int) else f"[{host}] "
                print_lines(ev["t"], terminal_safe(label) if rank is None else "")
            elif kind == "end":
                text, code = end_line(ev, d.run_id)
                ui.notice(text)
    except KeyboardInterrupt:
        return
    except HostError as e:
        _local_copy(d, rank, node)
        raise unreachable(d, e, "the logs shown above (if any) are what an earlier `corral logs --sync` or "
                                "`corral attach` copied here") from None
    sys.exit(code if follow else 0)


def _local_copy(d: detach.Detached, rank: int | None, node: str | None) -> None:
    """Node 0 is down: what this machine copied earlier, said as such."""
    if d.stub is None:
        return
    shown = False
    for path in sorted(d.stub.glob("*/rank*.log")):
        m = re.fullmatch(r"rank(\d+)\.log", path.name)
        if not m or (rank is not None and int(m.group(1)) != rank) or (node and path.parent.name != node):
            continue
        if not shown:
            ui.notice(f"from the copy in {d.stub} (as far as it was synced):")
            shown = True
        for line in path.read_text(errors="replace").splitlines():
            print_line(f"[{path.parent.name}/r{m.group(1)}] {line}")
