"""`corral stacks`: where every rank of a running job is, as one merged tree."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from corral import ui
from corral.cli.common import emit_json
from corral.diagnose.stacks import (
    fold_keys,
    never_met_note,
    numbered,
    parse_key,
    rendezvous_note,
    stack_report,
)
from corral.errors import CorralError, UsageError
from corral.run.control import live_controls, request
from corral.run.history import default_root, find_run


@click.command(name="stacks")
@click.argument("run", required=False)
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where run directories are. "
                   "Default: $CORRAL_RUNS_DIR, else ./runs (where `corral run` could not write it: "
                   "$XDG_STATE_HOME/corral/runs).")
@click.option("--json", "as_json", is_flag=True, help="Raw per-rank dumps as JSON.")
def stacks(run: str | None, runs_dir: Path | None, as_json: bool) -> None:
    """Dump the Python stack of every rank of a running job, merged into a tree.

    RUN is a run id (or its prefix) or a run directory; default: the newest
    running run in ./runs, else your one running run started from another
    directory (found by its control socket).  Ranks with the same stack share a branch labelled
    with their rank set, so the rank that is somewhere else stands out.  Works
    without root or py-spy: the ranks dump themselves (faulthandler), even
    while blocked in a collective.  A rank that only waits for the Python
    processes it started (mp.spawn) is shown by them: `rank 0 workers 0-3`.
    With the flight recorder on (the default of `corral run`), every rank's
    last collectives are gathered into runs/<id>/flightrec/ too, and the
    first collective where the ranks disagree is named.
    """
    run_id, control = _find_live(runs_dir or default_root(Path.cwd()).path, run, anywhere=runs_dir is None)
    answer = request(control, "stacks")
    if "error" in answer:
        raise CorralError(f"run {run_id}: {answer['error']}")
    dumps = {parse_key(k): v for k, v in answer.get("stacks", {}).items()}
    if as_json:
        emit_json("stacks", {"run_id": run_id, "stacks": answer.get("stacks", {}),
                             "flightrec": answer.get("flightrec") or []})
        return
    unanswered = {int(r): h for r, h in (answer.get("unanswered") or {}).items()}
    lines, odd = stack_report(dumps, int(answer.get("world_size") or len(dumps)), unanswered=unanswered)
    con = ui.console()
    ranks = sum(1 for k in dumps if not isinstance(k, tuple))
    started = len(numbered(dumps)) - ranks  # not multiprocessing's own helpers
    more = f" (and {started} Python process(es) they started)" if started else ""
    con.print(f"[bold]run {run_id}[/]: {ranks} rank(s) answered{more}")
    if answer.get("master_addr"):
        note = (rendezvous_note(dumps, answer["master_addr"], int(answer.get("master_port") or 0))
                or never_met_note(dumps, int(answer.get("world_size") or 0)))
        if note:
            lines.append(note)
    for line in lines:
        con.print(escape(line), soft_wrap=True)
    if odd:
        con.print(f"[yellow]{fold_keys(odd)} not where the others are[/]")
    for line in answer.get("flightrec") or []:  # the run's own head wrote these (docs/diagnose.md)
        if isinstance(line, str):
            con.print(escape(line), soft_wrap=True)


def _find_live(root: Path, run: str | None, *, anywhere: bool = True) -> tuple[str, str]:
    """The run to ask: from the runs directory, else (a run started from
    another directory; not when --runs-dir names one) the one live run of
    this user, found by its control socket."""
    try:
        rec = find_run(root, run)
    except UsageError:
        if not anywhere:
            raise
        live = live_controls()
        picked = [r for r in live if run is None or r.startswith(run)]
        if len(picked) == 1:
            ui.notice(f"run {picked[0]} is not in {root}: found it by its control socket")
            return picked[0], str(live[picked[0]])
        if len(picked) > 1:
            raise UsageError(f"no running run in {root}, and {len(picked)} runs of yours are running "
                             f"elsewhere: {', '.join(picked)}", hint="give one: `corral stacks RUN_ID`") from None
        raise
    if rec.status != "running" or not rec.data.get("control"):
        raise CorralError(f"run {rec.run_id} is not running (status: {rec.status})",
                          hint="stacks come from live ranks; for a finished run see `corral diagnose`")
    return rec.run_id, rec.data["control"]

