"""`corral runs`: list runs and where their logs are."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from corral import ui
from corral.cli.common import retired_short
from corral.logs import default_runs_dir
from corral.runs import list_runs


@click.command(name="runs")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where run directories are. Default: $CORRAL_RUNS_DIR or ./runs.")
@retired_short("-n", now="--limit N", why="-n is --nproc-per-node in run and bench")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Show at most this many runs, newest first.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable list.")
def runs(runs_dir: Path | None, limit: int, as_json: bool) -> None:
    """List the newest runs: status, launcher, ranks, duration, first failure."""
    root = runs_dir or default_runs_dir(Path.cwd())
    records = list_runs(root)[:limit]
    if as_json:
        click.echo(json.dumps([{"run_id": r.run_id, "dir": str(r.dir), **r.data, "status": r.status}
                               for r in records], indent=2))
        return
    if not records:
        ui.notice(f"no runs in {root}")
        return
    table = Table(box=None)
    table.add_column("run", no_wrap=True)
    for col in ("status", "launcher", "ranks", "took", "program"):
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    table.add_column("first failure", no_wrap=True, overflow="ellipsis")  # cut, never one word a line
    for r in records:
        d = r.data
        took = f"{d['ended'] - d['started']:.0f}s" if d.get("ended") and d.get("started") else "-"
        if r.status == "running" and d.get("started"):
            took = f"{time.time() - d['started']:.0f}s…"
        color = {"succeeded": "green", "failed": "red", "died": "red", "running": "cyan"}.get(r.status, "yellow")
        fail = (d.get("failure") or {}).get("description") or ""
        if not fail and d.get("restarts"):  # succeeded (or not) after restarts: say what failed
            first = d["restarts"][0]
            fail = f"restarted {len(d['restarts'])}x; attempt {first.get('attempt')}: {first.get('failure')}"
        table.add_row(r.run_id, f"[{color}]{r.status}[/]", str(d.get("launcher", "")),
                      str(d.get("world_size", "")), took, escape(_program(d)), escape(fail[:160]))
    con = ui.console()
    if not con.is_terminal:  # piped (grep, less): rows whole, not cut to 80 columns
        from rich.console import Console

        con = Console(file=sys.stdout, highlight=False, width=max(con.width, 240), color_system=None)
    con.print(table)
    ui.notice(f"logs: {root}/<run>/<host>/rank<N>.log")


def _program(d: dict) -> str:
    """The script; for ``--launcher command`` the command and its first word
    after the interpreter (``python det_train.py``), not ``python`` alone."""
    program = str(d.get("program", ""))
    args = d.get("args") if isinstance(d.get("args"), list) else []
    if d.get("launcher") == "command" and args:
        return f"{program} {args[0]}"
    return program
