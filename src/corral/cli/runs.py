"""`corral runs`: list runs and where their logs are."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from corral import ui
from corral.cli.common import emit_json, retired_short
from corral.run.history import default_root, list_runs


@click.command(name="runs")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where run directories are. "
                   "Default: $CORRAL_RUNS_DIR, else ./runs (where `corral run` could not write it: "
                   "$XDG_STATE_HOME/corral/runs).")
@retired_short("-n", now="--limit N", why="-n is --nproc-per-node in run and bench")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Show at most this many runs, newest first.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable list.")
def runs(runs_dir: Path | None, limit: int, as_json: bool) -> None:
    """List the newest runs: status, launcher, ranks, duration, first failure."""
    root = runs_dir or default_root(Path.cwd()).path
    from corral.run.detach import refresh_stubs

    refresh_stubs(root)  # detached runs last seen running: asked on their node 0
    records = list_runs(root)[:limit]
    if as_json:
        emit_json("runs", {"runs": [{"run_id": r.run_id, "dir": str(r.dir), **r.data, "status": r.status}
                                    for r in records]})
        return
    if not records:
        ui.notice(f"no runs in {root}")
        return
    rows = []
    for r in records:
        d = r.data
        took = f"{d['ended'] - d['started']:.0f}s" if d.get("ended") and d.get("started") else "-"
        if r.status == "running" and d.get("started"):
            took = f"{time.time() - d['started']:.0f}s…"
        fail = (d.get("failure") or {}).get("description") or ""
        if not fail and d.get("restarts"):  # succeeded (or not) after restarts: say what failed
            first = d["restarts"][0]
            fail = f"restarted {len(d['restarts'])}x; attempt {first.get('attempt')}: {first.get('failure')}"
        rows.append((r.run_id, r.status, str(d.get("launcher", "")), str(d.get("world_size", "")), took,
                     _program(d), fail[:160]))
    con = ui.console()
    # piped (grep, less): rows whole, not cut to 80 columns
    table, width = _table(rows, con.width if con.is_terminal else max(con.width, 240))
    if width != con.width:
        from rich.console import Console

        con = Console(file=sys.stdout, highlight=False, width=width,
                      color_system=con.color_system if con.is_terminal else None)
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


_HEADS = ("run", "status", "launcher", "ranks", "took", "program", "failure")


def _table(rows: list[tuple[str, ...]], width: int) -> tuple[Table, int]:
    """The table, and the width to print it at.

    The run id (what `diagnose` and `stacks` take) and the short columns keep
    their whole width on any terminal (rich shrank every column to fit 80 or
    120 columns, the id to `20261127-16…`); the program and the failure share
    what is left, cut with an ellipsis (never one word a line).  Where even
    that does not fit, the table is printed wider than the terminal, which
    wraps the rows: the id stays whole."""
    from rich.cells import cell_len  # terminal cells: a CJK program name is two a character

    widths = [max(len(head), *(cell_len(row[i]) for row in rows)) for i, head in enumerate(_HEADS)]
    room = width - sum(w + 2 for w in widths[:5]) - 4  # box=None: one space each side of a column
    widths[5] = min(widths[5], max(len(_HEADS[5]), room * 2 // 5))
    widths[6] = min(widths[6], max(len(_HEADS[6]), room - widths[5]))
    table = Table(box=None)
    for head, w in zip(_HEADS, widths):
        table.add_column(head, no_wrap=True, overflow="ellipsis", width=w)
    for run_id, status, launcher, ranks, took, program, fail in rows:
        color = {"succeeded": "green", "failed": "red", "died": "red", "running": "cyan"}.get(status, "yellow")
        table.add_row(escape(run_id), f"[{color}]{status}[/]", escape(launcher), ranks, took, escape(program),
                      escape(fail))
    return table, max(width, sum(w + 2 for w in widths))
