"""`corral check job.sbatch`: the known mistakes of a Slurm batch script, by line, with the fix."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from corral import ui
from corral.cli.common import emit_json
from corral.errors import CorralError, UsageError

#: Exit status when the script has an error (a warning alone exits 0).
EXIT_FOUND = 1


@click.command(name="check")
@click.argument("script", type=click.Path(path_type=Path))
@click.option("--script", "training", type=click.Path(path_type=Path), default=None,
              help="The Python training script the batch script runs, when corral cannot find it from the "
                   "batch script (default: the .py that srun starts, read from the batch script's directory, "
                   "#SBATCH --chdir or its `cd`).")
@click.option("--json", "as_json", is_flag=True,
              help="Findings as JSON: path, errors, warnings, findings[] (line, code, severity, message, fix).")
def check(script: Path, training: Path | None, as_json: bool) -> None:
    """Check a Slurm batch script for the mistakes that cost days on a real cluster.

    Reads SCRIPT (its #SBATCH lines, srun/torchrun/accelerate/deepspeed/python
    lines, variables, quoting and heredocs) without running it, and names each
    mistake with its line, what happens on the cluster, and the fix:
    $SLURM_PROCID/LOCALID/NODEID expanded by the batch shell (every task gets 0),
    --ntasks-per-node not matching Lightning's Trainer(devices=...), srun not
    inheriting --cpus-per-task (Slurm 22.05-23.10), --gpus-per-task with NCCL
    ("invalid device ordinal"), a MASTER_ADDR that is not the first host,
    srun without --kill-on-bad-exit, job-level variables in a smaller step, no
    --signal before the time limit, torchrun/accelerate counts that disagree
    with the allocation, a hard-coded rendezvous port.

    Prints nothing on stdout for a script without a known mistake.  Exit
    status: 0 no error (warnings may be listed), 1 an error found, 2 the
    script cannot be read.  `corral export sbatch` writes a script that passes.
    """
    from corral.slurm.check import check_file

    if training is not None and not training.is_file():
        raise UsageError(f"--script {training}: no such file", hint="give the Python script the job runs")
    try:
        report = check_file(script, training_script=training)
    except IsADirectoryError:
        raise UsageError(f"{script} is a directory, not a batch script", hint="give the .sbatch/.sh file") from None
    except FileNotFoundError:
        raise UsageError(f"{script}: no such file", hint="give the path of the batch script (job.sbatch)") from None
    except ValueError as err:
        raise UsageError(str(err), hint="give the .sbatch/.sh file you submit") from None
    except OSError as err:
        raise CorralError(f"{script}: cannot be read: {err.strerror}") from None
    errors = report.errors
    warnings = len(report.findings) - errors
    if as_json:
        emit_json("check", {"path": report.path, "errors": errors, "warnings": warnings,
                            "read": list(report.read), "findings": [asdict(f) for f in report.findings]})
    else:
        con = ui.console()
        for f in report.findings:
            colour = "red" if f.severity == "error" else "yellow"
            con.print(f"[bold]{ui.shown(report.path)}:{f.line}:[/] [{colour}]{f.severity}:[/] {ui.shown(f.message)}")
            con.print(f"  [green]fix:[/] {ui.shown(f.fix)}")
        if report.findings:
            con.print(f"{ui.shown(report.path)}: {errors} error(s), {warnings} warning(s)")
        else:
            ui.notice(f"{report.path}: no known mistake found")
    if errors:
        raise SystemExit(EXIT_FOUND)
