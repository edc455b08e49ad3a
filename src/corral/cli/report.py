"""`corral report`: one self-contained HTML page about a run."""

from __future__ import annotations

import os
from pathlib import Path

import click
from rich.markup import escape

from corral import ui
from corral.errors import UsageError
from corral.run.history import default_root, find_run
from corral.run.report import build


@click.command(name="report")
@click.argument("run", required=False)
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where run directories are. Default: $CORRAL_RUNS_DIR, else ./runs.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the page. Default: report.html in the run directory.")
def report(run: str | None, runs_dir: Path | None, output: Path | None) -> None:
    """Write one HTML page about RUN: timeline, telemetry plots, failure, diagnosis.

    RUN is a run id (or its prefix) or a run directory; default: the newest
    run.  The page is self-contained (inline SVG, no script, nothing
    loaded from the network): open it in any browser, attach it to a bug
    report.  Per node and rank: when it started, first wrote, how fast it
    went, where it failed; per node: GPU utilisation and memory, network
    throughput, CPU per rank (from the telemetry `corral run` records);
    the stragglers, idle GPUs and saturated links seen; the failure and its
    diagnosis (as `corral diagnose`); the flight-recorder analysis when the
    run has one.
    """
    root = runs_dir or default_root(Path.cwd()).path
    record = _newest(root) if run is None else find_run(root, run)
    page = build(record.dir)
    target = output or record.dir / "report.html"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write the report to {target}: {e.strerror or e}",
                         hint="give another place with -o FILE") from None
    ui.console().print(escape(f"report of run {record.run_id}: {target}"), highlight=False)


def _newest(root: Path):
    from corral.run.history import list_runs

    runs = list_runs(root)
    if not runs:
        raise UsageError(f"no run in {root}", hint="give a run id or run directory; `corral runs` lists them")
    return runs[0]
