"""`corral ps`: the detached jobs on a cluster, found on the nodes themselves."""

from __future__ import annotations

import sys
import time

import click
from rich.markup import escape
from rich.table import Table

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options, emit_json
from corral.errors import PreflightError
from corral.frames import terminal_safe
from corral.hostrange import fold
from corral.run import detach


@click.command(name="ps")
@cluster_options
@click.option("--all", "show_all", is_flag=True, help="Also the jobs that have ended (their directories stay "
                                                       "on the nodes).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable list.")
def ps(cluster_opts: ClusterOptions, show_all: bool, as_json: bool) -> None:
    """List the corral jobs on the cluster's nodes: id, user, launcher,
    nodes, GPUs held, ports, since, state.

    \b
    Asked of every node (over ssh, in parallel), so it works from any machine
    that reaches them.  Detached jobs come from their directories on node 0;
    attended ones (`corral run` in someone's terminal) from the GPUs and
    ports their agents hold on each node, while they run (state `attended`;
    no launcher known).  Shows your own jobs: other users' are private.
    Without --all, only jobs that run, and detached ones that ended in the
    last hour.
    """
    cluster = cluster_opts.load()
    jobs, holds, problems = detach.list_everywhere(cluster)
    now = time.time()
    rows = []
    for job in jobs:
        state = detach.job_state(job)
        rec = job.get("record") if isinstance(job.get("record"), dict) else {}
        sup = job.get("supervisor") if isinstance(job.get("supervisor"), dict) else {}
        ended = rec.get("ended") if isinstance(rec.get("ended"), (int, float)) else None
        if not show_all and state not in ("running", "starting", "stopping") and (ended or 0) < now - 3600 \
                and state != "died":
            continue
        hosts = [h.get("name") for h in rec.get("hosts", []) if isinstance(h, dict)]
        gpus = {h.get("name"): h.get("gpus") for h in rec.get("hosts", [])
                if isinstance(h, dict) and h.get("gpus") is not None}
        failure = (rec.get("failure") or {}).get("description") if isinstance(rec.get("failure"), dict) else None
        end = job.get("end") if isinstance(job.get("end"), dict) else {}
        rows.append({
            "run_id": job["run_id"], "user": str(sup.get("user", "")), "launcher": str(rec.get("launcher", "")),
            "nodes": [str(h) for h in hosts], "supervisor": job.get("node"),
            "gpus": gpus, "ports": [rec["master_port"]] if isinstance(rec.get("master_port"), int) else [],
            "since": sup.get("since") if isinstance(sup.get("since"), (int, float)) else rec.get("started"),
            "state": state, "failure": failure or end.get("error"), "head": None})
    rows += _attended(cluster.names, holds, {job["run_id"] for job in jobs})
    if as_json:
        emit_json("ps", {"jobs": rows, "unreachable": [{"host": p.host, "error": p.message} for p in problems]})
    else:
        _table(rows)
    if problems:
        err = PreflightError(problems, what="asking")
        ui.notice(f"{err}; jobs whose supervisor runs there are not listed")
        raise SystemExit(3)


def _attended(names: list[str], holds: list[dict], detached: set[str]) -> list[dict]:
    """Rows for the jobs that hold GPUs or ports on the nodes but have no
    detached directory: attended runs, started from a terminal (``head``)."""
    by_run: dict[str, list[dict]] = {}
    for h in holds:
        if h["run_id"] not in detached:
            by_run.setdefault(h["run_id"], []).append(h)
    rows = []
    for run_id in sorted(by_run, reverse=True):
        held = by_run[run_id]
        since = [h["since"] for h in held if h["since"]]
        rows.append({
            "run_id": run_id, "user": held[0]["user"], "launcher": "",
            "nodes": [n for n in names if any(h["host"] == n for h in held)], "supervisor": None,
            "gpus": {h["host"]: h["gpus"] for h in held if h["gpus"]},
            "ports": sorted({p for h in held for p in h["ports"].values()}),
            "since": min(since) if since else None, "state": "attended", "failure": None,
            "head": held[0]["head"]})
    return rows


def _text(value: object) -> str:
    """A node's text in a table cell: no terminal controls, no rich markup."""
    return escape(terminal_safe(str(value)))


def _table(rows: list[dict]) -> None:
    if not rows:
        ui.notice("no detached jobs on these nodes")
        return
    table = Table(box=None)
    for head in ("run", "user", "launcher", "nodes", "gpus", "ports", "since", "state", "failure"):
        table.add_column(head, no_wrap=head in ("run", "since"), overflow="fold")
    for r in rows:
        since = time.strftime("%m-%d %H:%M", time.localtime(r["since"])) if r["since"] else "-"
        gpus = "; ".join(f"{h}:{g}" for h, g in r["gpus"].items()) or "-"
        color = {"running": "cyan", "attended": "cyan", "succeeded": "green", "failed": "red",
                 "died": "red"}.get(r["state"], "yellow")
        state = f"attended from {r['head']}" if r["state"] == "attended" else r["state"]
        table.add_row(_text(r["run_id"]), _text(r["user"]), _text(r["launcher"] or "-"),
                      _text(fold(r["nodes"])) if r["nodes"] else "-", _text(gpus),
                      ",".join(map(str, r["ports"])) or "-", since, f"[{color}]{_text(state)}[/]",
                      _text(str(r["failure"] or "")[:160]))
    con = ui.console()
    if not con.is_terminal:  # piped (grep, less): rows whole, not cut to 80 columns
        from rich.console import Console

        con = Console(file=sys.stdout, highlight=False, width=max(con.width, 200), color_system=None)
    con.print(table)
