"""`corral export FORMAT`: the cluster (and a job) as another tool's files.

The formats live in ``corral.export`` (one registry, ``FORMATS``);
this module parses the command line, builds the export, writes it (or
prints it) and says how to use it.
"""

from __future__ import annotations

import os
from pathlib import Path

import click
from rich.markup import escape

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options, emit_json
from corral.cli.export_sbatch import sbatch
from corral.errors import UsageError
from corral.export import FORMATS, Export, ExportRequest, Format
from corral.run.launchers import refuse_owned_options
from corral.run.plan import RunSpec, parse_env_flags

#: The rendezvous port the launch formats name when --master-port is not given
#: (torchrun's and DeepSpeed's own default).
DEFAULT_PORT = 29500


@click.group(name="export")
def export() -> None:
    """Write the cluster (and a job: PROGRAM ARGS) as FORMAT's own files.

    Each export, fed to its own tool, launches the same job `corral run`
    would: the same hosts in the same order, ranks, rendezvous and
    environment.  Files that hold the job's environment are written 0600;
    nothing is overwritten without --force.  `corral export FORMAT --help`
    shows a format's options.

    \b
    Examples:
      corral export ssh-config -c hostfile -o cluster.ssh   # ssh -F cluster.ssh gpu01
      corral export pdsh -c corral.toml -o pdsh/
      corral export deepspeed -c hostfile -o ds/ train.py --deepspeed_config ds.json
      corral export accelerate -H 'gpu[1-2]:8' -o acc/ train.py
      corral export torchrun -c corral.toml train.py --epochs 3
    """


def _format_command(name: str) -> click.Command:
    fmt = FORMATS[name]
    job = {"required": "PROGRAM ARGS (required): the job the command lines launch.",
           "optional": "PROGRAM ARGS (optional): the job the command lines launch (without it they "
                       "name train.py).",
           "none": "The hosts only: no PROGRAM."}[fmt.program]

    def command(**kwargs) -> None:
        _export(fmt, **{"program": None, "args": (), "nproc_per_node": None, "module": False, "env_flags": (),
                        "master_port": DEFAULT_PORT, "workdir": None, "cpu": False, "launcher_args": (),
                        **kwargs})

    # click applies decorators bottom-up: the last listed here is the first option
    decorators = [
        click.option("--json", "as_json", is_flag=True,
                     help="Print what was written (or, without -o, the files' text) as JSON."),
        click.option("--force", is_flag=True, help="Replace files that are already there."),
        click.option("-o", "--output", type=click.Path(path_type=Path), default=None, metavar="FILE|DIR",
                     help="Where to write: a directory (created 0700 when the files hold the job's "
                          "environment), or a file for a one-file format. Default: print to stdout."),
        cluster_options,
    ]
    if fmt.program != "none":
        decorators = [
            click.argument("args", nargs=-1, type=click.UNPROCESSED),
            click.argument("program", required=False),
            click.option("--launcher-arg", "launcher_args", multiple=True, metavar="ARG",
                         help="Extra argument for the launcher itself. Repeatable."),
            click.option("--cpu", is_flag=True, help="The nodes have no GPUs: processes train on CPU over gloo."),
            click.option("--workdir", default=None, metavar="DIR",
                         help="Working directory on every node (as `corral run`)."),
            click.option("--master-port", type=click.IntRange(1, 65535), default=DEFAULT_PORT,
                         show_default=True, help="Rendezvous port on the first node."),
            click.option("-e", "--env", "env_flags", multiple=True, metavar="K=V|K",
                         help="Set a variable for the job (K=V), or copy this machine's value (K); "
                              "as `corral run`."),
            click.option("-m", "--module", is_flag=True, help="PROGRAM is a Python module (like python -m)."),
            click.option("-n", "--nproc-per-node", type=click.IntRange(min=1), default=None,
                         help="Processes per node. Default: the hosts' slots."),
            *decorators,
        ]
    for decorate in decorators:
        command = decorate(command)
    return click.command(
        name=name, short_help=fmt.summary,
        help=f"{fmt.summary[0].upper()}{fmt.summary[1:]}.\n\n{job}\n\nFiles that hold the job's environment "
             "are written 0600; nothing is overwritten without --force. See docs/interop.md.",
        context_settings={"ignore_unknown_options": fmt.program != "none",
                          "allow_interspersed_args": fmt.program == "none"})(command)


for _name in FORMATS:  # one subcommand per registered format
    export.add_command(_format_command(_name))


def _export(fmt: Format, *, cluster_opts: ClusterOptions, output: Path | None, force: bool,
            nproc_per_node: int | None, module: bool, env_flags: tuple[str, ...], master_port: int,
            workdir: str | None, cpu: bool, launcher_args: tuple[str, ...], as_json: bool,
            program: str | None, args: tuple[str, ...]) -> None:
    if program is not None and program.startswith("-"):
        raise UsageError(f"no such option: {program} (corral's options go before the program)",
                         hint=f"`corral export {fmt.name} --help` lists them")
    if fmt.program == "required" and program is None:
        raise UsageError(f"corral export {fmt.name} needs the job: PROGRAM [ARGS]",
                         hint=f"e.g. corral export {fmt.name} -c hostfile train.py --epochs 3")
    if workdir is not None and not workdir.startswith(("/", "~")):
        raise UsageError(f"--workdir {workdir!r} is relative", hint="give an absolute path")
    refuse_owned_options("torchrun" if fmt.name == "mpi" else fmt.name, launcher_args)
    spec = RunSpec(program=program or "", args=tuple(args), module=module, launcher="torchrun",
                   nproc_per_node=nproc_per_node, env=parse_env_flags(env_flags, os.environ),
                   workdir=workdir, master_port=master_port, launcher_args=launcher_args, preload=False)
    cluster = cluster_opts.load()
    outdir = _outdir(output, one_file=fmt.one_file)
    single = None
    if output is not None and fmt.one_file and outdir != output.expanduser().absolute():
        single = output.expanduser().absolute()
    request = ExportRequest(cluster=cluster, spec=spec, has_program=program is not None,
                            master_port=master_port, cpu=cpu, outdir=outdir, head_env=os.environ,
                            head_cwd=os.getcwd(), single_file=single)
    result = fmt.build(request)
    if output is None:
        _print(result, as_json)
        return
    from corral.export.write import write_export

    written = write_export(result, output.expanduser(), force=force)
    if as_json:
        emit_json("export", _json(result, written))
        return
    for path in written:
        ui.notice(f"wrote {path}")
    _next_steps(result)


def _outdir(output: Path | None, *, one_file: bool) -> Path:
    """The absolute directory the files will be in: command lines name them there."""
    if output is None:
        return Path.cwd()
    path = output.expanduser().absolute()
    if path.is_dir() or str(output).endswith(os.sep) or not one_file:
        return path
    return path.parent


def _json(result: Export, written: list[Path] | None) -> dict:
    files = []
    for i, f in enumerate(result.files):
        entry: dict = {"name": f.name, "private": f.private}
        if written is not None:
            entry["path"] = str(written[i])
            entry["mode"] = f"{os.stat(written[i]).st_mode & 0o777:04o}"
        else:
            entry["text"] = f.text
        files.append(entry)
    return {"format": result.format, "files": files, "commands": list(result.commands),
            "notes": list(result.notes), **dict(result.data)}


def _print(result: Export, as_json: bool) -> None:
    """No -o: the files' text on stdout (one file as it is; several under
    ``# ==> NAME <==`` headers), the next steps on stderr."""
    if as_json:
        emit_json("export", _json(result, None))
        return
    several = len(result.files) > 1
    for f in result.files:
        if several:
            click.echo(f"# ==> {f.name} <==")
        click.echo(f.text, nl=False)
    _next_steps(result)


def _next_steps(result: Export) -> None:
    con = ui.err_console()
    for note in result.notes:
        con.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    if result.commands:
        con.print("[bold]then:[/]")
        for line in result.commands:
            con.print("  " + escape(line), soft_wrap=True)



# `corral export sbatch` (issue 19): a plain batch script, its own options.
export.add_command(sbatch)
