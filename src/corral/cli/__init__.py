"""The ``corral`` command line.

One file per subcommand in this package; this module only wires them into a
lazily-loaded click group (so ``corral --help`` stays fast and a subcommand's
heavy imports never slow another one down) and formats ``CorralError`` in
exactly one place.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from corral import __version__
from corral.errors import EXIT_INTERRUPTED, CorralError

# name -> (module, attribute, one-line help shown by ``corral --help``)
COMMANDS: dict[str, tuple[str, str, str]] = {
    # running a job
    "run": ("corral.cli.run", "run", "Run a training script on every node of the cluster."),
    "attach": ("corral.cli.attach", "attach", "Follow a detached job's live output (Ctrl-C detaches)."),
    "logs": ("corral.cli.logs", "logs", "Read a detached job's per-rank logs from its nodes (-f, --sync)."),
    "stop": ("corral.cli.stop", "stop", "Stop a detached job, as Ctrl-C stops an attended one."),
    "ps": ("corral.cli.ps", "ps", "List the detached jobs on a cluster's nodes."),
    "top": ("corral.cli.top", "top", "Live GPUs, ranks and links of a run on every node; stragglers flagged."),
    "stacks": ("corral.cli.stacks", "stacks", "Dump the Python stack of every rank of a running job."),
    "runs": ("corral.cli.runs", "runs", "List past runs and where their logs are."),
    "diagnose": ("corral.cli.diagnose", "diagnose", "Explain a failed run's log: likely cause and fix."),
    "report": ("corral.cli.report", "report", "Write a run's report: one HTML page with timeline and plots."),
    "submit": ("corral.cli.submit", "submit", "Run a script as a Slurm batch job through corral run, and follow it."),
    # the cluster
    "exec": ("corral.cli.exec_", "exec_", "Run a shell command on every node; identical output is folded."),
    "hosts": ("corral.cli.hosts", "hosts", "Show the resolved cluster: hosts, ports, users, slots."),
    "doctor": ("corral.cli.doctor", "doctor", "Check every node for what would break or slow a job."),
    "bench": ("corral.cli.bench", "bench", "Measure link bandwidth and all-reduce bus bandwidth."),
    "ssh": ("corral.cli.ssh", "ssh", "Set up (or tear down) passwordless SSH between all nodes."),
    "sync": ("corral.cli.sync", "sync", "Copy the project (or paths) to every node, verified."),
    # other tools
    "export": ("corral.cli.export", "export",
               "Write the cluster as accelerate, DeepSpeed, torchrun, mpirun, pdsh, ssh or sbatch files."),
    "check": ("corral.cli.check", "check", "Check a Slurm batch script for known mistakes, by line, with the fix."),
    "sandbox": ("corral.cli.sandbox", "sandbox", "A simulated multi-node cluster on this machine."),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported only when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return None
        module_name, attr, _ = spec
        module = importlib.import_module(module_name)
        command = getattr(module, attr)
        _note_json_flag(command)
        return command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Kept for a usage error in a subcommand's own arguments: click raises
        # it before any option callback could note --json.
        ctx.meta[_ARGV_META] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        """Report CorralError in one place, for CliRunner and the console script alike."""
        try:
            return super().invoke(ctx)
        except CorralError as err:
            if (ctx.obj or {}).get("debug"):
                raise
            _report(err)
            if ctx.meta.get(_JSON_META):
                _report_json(err)
            ctx.exit(err.exit_code)
        except click.ClickException as err:
            # click's own parsing (a missing PROGRAM, an option without its
            # value): the text still goes to stderr as click writes it; under
            # --json the same reason is JSON on stdout, as for every error.
            if ctx.meta.get(_JSON_META) or _json_asked(ctx.meta.get(_ARGV_META, [])):
                _report_json(_as_corral_error(err, ctx))
            raise

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Use the static one-liners: listing commands must not import them all.
        rows = [(name, help_) for name, (_, _, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="corral")
@click.option("--debug", is_flag=True, envvar="CORRAL_DEBUG", help="Show tracebacks and debug logs.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """corral: run an unchanged PyTorch training script on every machine you
    can SSH into (or a Slurm allocation), checked, fast, and diagnosed.

    With no cluster given, the cluster is this machine.  Start with
    `corral run train.py`, `corral hosts -c hostfile` or `corral sandbox up 4`.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


_JSON_META = "corral.json"
_ARGV_META = "corral.argv"


def _json_asked(argv: list[str]) -> bool:
    """``--json`` among corral's own words (before a ``--``): the arguments
    could not be parsed, so this is as far as anyone can tell."""
    own = argv[:argv.index("--")] if "--" in argv else argv
    return "--json" in own


def _as_corral_error(err: click.ClickException, group: click.Context) -> CorralError:
    """A click error as the one error shape of ``--json`` (``category`` user)."""
    ctx = getattr(err, "ctx", None)
    path = ctx.command_path if ctx is not None else " ".join(
        filter(None, (group.command_path, group.invoked_subcommand)))
    return CorralError(err.format_message(), hint=f"`{path} --help` lists the arguments and options",
                       exit_code=err.exit_code)


def _note_json_flag(command: click.Command) -> None:
    """Have ``--json`` leave a mark in the context's meta (shared by the
    whole context chain), so an error can be reported as JSON on stdout too:
    a script piping ``corral ... --json`` into jq gets the reason, not a
    parse error on empty input."""
    for param in command.params:
        if param.name == "as_json" and not getattr(param, "_corral_noted", False):
            chained = param.callback

            def note(ctx: click.Context, p: click.Parameter, value, chained=chained):
                if value:
                    ctx.meta[_JSON_META] = True
                return chained(ctx, p, value) if chained else value

            param.callback = note
            param._corral_noted = True  # type: ignore[attr-defined]
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _note_json_flag(sub)


def _report_json(err: CorralError) -> None:
    from corral.cli.common import emit_json

    out: dict = {"message": err.message, "hint": err.hint, "category": err.category, "exit_code": err.exit_code}
    problems = getattr(err, "problems", None)
    if problems:  # a preflight's per-host problems
        out["problems"] = [{"host": p.host, "message": p.message, "hint": p.hint, "kind": p.kind} for p in problems]
    host = getattr(err, "host", None)
    if host:
        out["host"] = host
    emit_json("error", {"error": out})


def _report(err: CorralError) -> None:
    from corral.ui import print_error

    print_error(err)


def _tolerant_stdio() -> None:
    """Ranks print what they like (emoji, CJK, a latin-1 byte); a terminal in
    a non-UTF-8 locale (ISO-8859-1, PYTHONIOENCODING=ascii) cannot show all
    of it.  Say it with escapes rather than fail: `corral exec` ended in a
    UnicodeEncodeError traceback, and `corral run` dropped the ranks' lines."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI, turn CorralError into exit codes."""
    _tolerant_stdio()
    try:
        rv = cli.main(args=argv, prog_name="corral", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(rv if isinstance(rv, int) else 0)
