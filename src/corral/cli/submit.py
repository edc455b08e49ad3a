"""`corral submit`: run a script as a Slurm batch job through `corral run`, and follow it."""

from __future__ import annotations

import signal
import sys

import click

from corral import ui
from corral.errors import EXIT_INTERRUPTED
from corral.slurm.submit import (
    DEFAULT_SIGNAL,
    SubmitSpec,
    batch_script,
    cancel,
    check_signal,
    exit_code,
    follow,
    split_leading_options,
)
from corral.slurm.submit import (
    submit as sbatch_submit,
)


@click.command(name="submit", context_settings={"ignore_unknown_options": True,
                                                "allow_interspersed_args": False})
@click.option("-N", "--nodes", type=click.IntRange(min=1), help="Nodes to allocate (sbatch --nodes).")
@click.option("--gpus-per-node", metavar="[TYPE:]G", help="GPUs per node (sbatch --gpus-per-node); "
              "corral starts one rank per GPU.")
@click.option("-t", "--time", "time_limit", metavar="TIME", help="Time limit (sbatch --time: 30, 1:00:00, 1-0).")
@click.option("-p", "--partition", help="Partition (sbatch --partition).")
@click.option("-J", "--job-name", help="Job name [default: corral-SCRIPT].")
@click.option("--signal", "signal_", default=DEFAULT_SIGNAL, show_default=True, metavar="SIG@SECONDS",
              help="Signal sent SECONDS before the time limit, forwarded by corral to every rank so "
                   "the script can checkpoint (USR1 or USR2).")
@click.option("--no-signal", is_flag=True, help="Send no signal before the time limit.")
@click.option("--requeue", is_flag=True, help="After the time-limit signal, requeue the job: the script runs "
              "again and resumes from its own checkpoint (SLURM_RESTART_COUNT says which run it is).")
@click.option("--launcher", help="corral run's --launcher (torchrun, accelerate, deepspeed, lightning, command).")
@click.option("-n", "--nproc-per-node", help="corral run's --nproc-per-node.")
@click.option("--max-restarts", type=int, help="corral run's --max-restarts.")
@click.option("--run-arg", "run_args", multiple=True, metavar="OPTION",
              help="Any other corral run option, one word each (--run-arg=--hang-timeout=600). Repeatable.")
@click.option("-o", "--output", default="slurm-%j.out", show_default=True,
              help="The job's output file (sbatch --output; %j is the job id), on a file system "
                   "this machine shares with the nodes.")
@click.option("--print", "print_only", is_flag=True, help="Print the batch script and submit nothing.")
@click.option("--no-follow", is_flag=True, help="Submit, print the job id and return.")
@click.option("--cancel-on-interrupt", "on_interrupt", flag_value="cancel",
              help="Ctrl-C cancels the job (default when stdin is not a terminal).")
@click.option("--leave-on-interrupt", "on_interrupt", flag_value="leave",
              help="Ctrl-C stops following and leaves the job running.")
@click.argument("words", nargs=-1, type=click.UNPROCESSED, metavar="[SBATCH_OPTIONS...] SCRIPT [ARGS...]")
def submit(nodes: int | None, gpus_per_node: str | None, time_limit: str | None, partition: str | None,
           job_name: str | None, signal_: str, no_signal: bool, requeue: bool, launcher: str | None,
           nproc_per_node: str | None, max_restarts: int | None, run_args: tuple[str, ...], output: str,
           print_only: bool, no_follow: bool, on_interrupt: str | None, words: tuple[str, ...]) -> None:
    """Submit SCRIPT as a Slurm batch job that runs `corral run SCRIPT ARGS`, and follow it.

    The batch script asks for one task per node (corral's agent, started as
    an srun job step: no ssh keys needed) and runs `corral run` inside the
    allocation: per-rank output and logs, first-failure teardown, a lost node
    named, --max-restarts, as anywhere else.  corral follows the job: queued
    (and why), running (on which nodes), its output, and exits with the
    job's exit code.  Ctrl-C asks whether to cancel the job or leave it
    running (--cancel-on-interrupt / --leave-on-interrupt for scripts).

    Other sbatch options go before SCRIPT, one word each (--account=proj,
    --mem=0, --exclusive). corral must be installed at the same path on the
    nodes (a shared file system, as usual on Slurm clusters).

    \b
      corral submit --nodes 4 --gpus-per-node 8 --time 2:00:00 train.py --lr 3e-4
      corral submit --print -N 2 --account=proj train.py     # the script, not submitted
      corral submit -N 4 -t 4:00:00 --requeue train.py --ckpt ck.pt --resume
    """
    sbatch_options, script, args = split_leading_options(words)
    run_options: list[str] = []
    if launcher:
        run_options += ["--launcher", launcher]
    if nproc_per_node:
        run_options += ["--nproc-per-node", nproc_per_node]
    if max_restarts is not None:
        run_options += ["--max-restarts", str(max_restarts)]
    run_options += list(run_args)
    spec = SubmitSpec(script=script, args=args, nodes=nodes, gpus_per_node=gpus_per_node, time=time_limit,
                      partition=partition, job_name=job_name, sbatch_options=sbatch_options,
                      run_options=tuple(run_options), signal=None if no_signal else check_signal(signal_),
                      requeue=requeue, output=output)
    text = batch_script(spec)
    if print_only:
        click.echo(text, nl=False)
        return
    job = sbatch_submit(text)
    con = ui.err_console()
    if no_follow:
        click.echo(job)
        return
    con.print(f"corral: submitted job {job}")
    sys.exit(_follow(job, on_interrupt))


def _follow(job: str, on_interrupt: str | None) -> int:
    """Print the job's states and output until it ends; its exit code."""
    con = ui.err_console()
    info = None

    def stop_following(signum, frame):  # noqa: ANN001, ARG001 - SIGTERM/SIGHUP: as Ctrl-C
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_following)
    try:
        for update in follow(job):
            if update.info is not None:
                info = update.info
                con.print(f"corral: job {job} {_describe(info)}")
            if update.output:
                sys.stdout.write(update.output)
                sys.stdout.flush()
    except KeyboardInterrupt:
        return _interrupted(job, on_interrupt)
    assert info is not None
    return exit_code(info)


def _describe(info) -> str:  # noqa: ANN001 - JobInfo
    state = info.state.lower()
    if info.state == "PENDING":
        return f"queued ({info.reason})" if info.reason and info.reason != "None" else "queued"
    if info.state == "RUNNING":
        again = f", run {info.restarts + 1}" if info.restarts else ""
        return f"running on {info.nodes}{again}"
    if info.final:
        code = f" (exit code {info.exit_code}" + (f", signal {info.exit_signal})" if info.exit_signal else ")")
        return f"{state}{code}"
    return state


def _interrupted(job: str, on_interrupt: str | None) -> int:
    con = ui.err_console()
    choice = on_interrupt
    if choice is None:
        if sys.stdin.isatty():
            try:
                choice = "cancel" if click.confirm(f"\ncancel job {job}? (no: leave it running)",
                                                   default=True) else "leave"
            except (KeyboardInterrupt, click.Abort):
                choice = "cancel"
        else:
            choice = "cancel"  # nobody to ask: leave nothing behind
    if choice == "cancel":
        cancel(job)
        con.print(f"corral: job {job} cancelled")
        return EXIT_INTERRUPTED
    con.print(f"corral: job {job} left running; follow it with `squeue -j {job}` and its output file")
    return 0
