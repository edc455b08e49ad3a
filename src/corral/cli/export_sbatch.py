"""`corral export sbatch`: a plain Slurm batch script that needs no corral on the cluster.

Its own module so that it joins whichever `corral export` group holds the
other formats (`export.add_command(sbatch)`).
"""

from __future__ import annotations

import click

from corral.slurm.sbatch import LAUNCHERS


@click.command(name="sbatch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-N", "--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes to ask for.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs per node (one rank per GPU).")
@click.option("--cpus-per-task", type=click.IntRange(min=1), default=None,
              help="CPUs per srun task (torchrun/accelerate: for all of a node's ranks; Lightning: per rank).")
@click.option("-t", "--time", "time_", default=None, help="Time limit, as sbatch takes it (24:00:00, 2-00:00:00).")
@click.option("-p", "--partition", default=None, help="Partition.")
@click.option("-A", "--account", default=None, help="Account to charge.")
@click.option("-J", "--job-name", default=None, help="Job name (default: the script's name).")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="torchrun", show_default=True,
              help="torchrun or accelerate: one per node under srun; lightning: one srun task per GPU.")
@click.option("--signal-before", "signal_seconds", type=click.IntRange(min=1), default=120, show_default=True,
              help="Seconds before the time limit the ranks are signalled (SIGTERM; Lightning: SIGUSR1) to save "
                   "a checkpoint.")
@click.option("--requeue", is_flag=True, help="Requeue the job when the time limit ends it, to resume from the "
                                              "checkpoint.")
@click.option("--sbatch", "sbatch_options", multiple=True, metavar="OPTION",
              help="A further #SBATCH option, e.g. --sbatch --constraint=a100 (repeatable).")
@click.option("--python", default="python", show_default=True, help="The nodes' Python (Lightning).")
@click.argument("program")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sbatch(nodes: int, gpus_per_node: int, cpus_per_task: int | None, time_: str | None, partition: str | None,
           account: str | None, job_name: str | None, launcher: str, signal_seconds: int, requeue: bool,
           sbatch_options: tuple[str, ...], python: str, program: str, args: tuple[str, ...]) -> None:
    """Print a plain sbatch script that runs PROGRAM ARGS on Slurm without corral.

    srun starts one torchrun (or accelerate launch) per node, or for
    Lightning one task per GPU; the script avoids every mistake `corral
    check` names (per-task variables in single quotes, the first host as
    MASTER_ADDR, a port of the job's own, --kill-on-bad-exit,
    SRUN_CPUS_PER_TASK, --gpus-per-node, a signal before the time limit) and
    says why, line by line.  Save it and submit it: `corral export sbatch -N 4
    --gpus-per-node 8 -t 24:00:00 train.py --lr 3e-4 > job.sbatch && sbatch job.sbatch`.
    """
    from corral.slurm.sbatch import SbatchSpec, render

    spec = SbatchSpec(program=program, args=args, launcher=launcher, nodes=nodes, gpus_per_node=gpus_per_node,
                      cpus_per_task=cpus_per_task, time=time_, partition=partition, account=account,
                      job_name=job_name, signal_seconds=signal_seconds, requeue=requeue,
                      sbatch_options=sbatch_options, python=python)
    click.echo(render(spec), nl=False)
