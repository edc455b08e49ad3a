"""`corral run`: run a training script on every node of the cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shlex
import sys
from pathlib import Path

import click
from rich.markup import escape

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options, emit_json
from corral.cli.run_dry import show_plan
from corral.diagnose.stacks import fold_ranks
from corral.errors import UsageError
from corral.hostrange import fold
from corral.model import parse_gpus
from corral.run.console import RunConsole, parse_ranks
from corral.run.history import default_root, unwritable
from corral.run.imports import apply_imports
from corral.run.launchers import PLANNERS, owned_option_hint, refuse_owned_options
from corral.run.options import RunOptions
from corral.run.plan import (
    RunSpec,
    ds_config_notes,
    known_world_size,
    new_run_id,
    parse_env_flags,
)
from corral.run.recovery import RecoveryOptions, check_checkpoint_dir
from corral.run.result import RunResult
from corral.run.runner import Runner
from corral.run.scriptcheck import (
    module_for,
    relative_import_line,
    script_and_args,
)

RECOVERY_DEFAULTS = RecoveryOptions()


@click.command(
    name="run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@cluster_options
@click.option("--launcher", type=click.Choice(list(PLANNERS)), default="torchrun", show_default=True,
              help="Per-node launcher: torchrun (default), accelerate, deepspeed, lightning, or command "
                   "(one process per node).")
@click.option("-n", "--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Processes per node. Default: the hosts' slots, else one per GPU, else 1 "
                   "(lightning: the script's Trainer(devices=...)).")
@click.option("-m", "--module", is_flag=True, help="PROGRAM is a Python module (like python -m).")
@click.option("-e", "--env", "env_flags", multiple=True, metavar="K=V|K",
              help="Set a variable on every node (K=V), or copy this machine's value (K). Repeatable. "
                   "Only these and an allow-list (NCCL_*, GLOO_*, TORCH_*, CUDA_*, OMP_NUM_THREADS, ...) "
                   "travel; see docs/run.md.")
@click.option("--workdir", default=None, metavar="DIR",
              help="Working directory on every node. Default: the cluster file's, else this directory's path.")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="Rendezvous port on the first node. Default: a free port corral picks there, one no "
                   "other corral job holds.")
@click.option("--gpus", "gpus_spec", default=None, metavar="LIST",
              help="Run on these GPUs of every node (nvidia-smi's numbers: '0-3', '4,5'), one process per "
                   "GPU; default: the cluster file's `gpus` for the host, else all. GPUs another corral job "
                   "holds are refused, naming it; see 'Sharing nodes between jobs' in docs/run.md.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart the whole job this many times after a failure that a restart can get past (a lost "
                   "node, a killed rank, a timeout; not an error in the program, nor the same exception at the "
                   "same place twice); scripts resume from their checkpoints. A restart that cannot reconnect "
                   "counts, and is tried again after 2, 4, ... 30 s.")
@click.option("--min-nodes", type=click.IntRange(min=1), default=None, metavar="M",
              help="With --max-restarts: a node lost and not back within --rejoin-timeout is replaced by a "
                   "spare host (spare = true in the cluster file), else the job restarts without it, re-planned "
                   "on the nodes left, as long as at least M remain.  [default: every node it started on]")
@click.option("--rejoin-timeout", type=click.FloatRange(min=0), default=RECOVERY_DEFAULTS.rejoin_timeout,
              show_default=True, metavar="SECONDS",
              help="Seconds a lost node gets to answer again before the restart goes on without it "
                   "(--min-nodes) or with a spare host.")
@click.option("--checkpoint-dir", default=None, metavar="DIR",
              help="Where the script writes its checkpoints (absolute, or relative to the work dir): every rank "
                   "gets it as CORRAL_CHECKPOINT_DIR, and after a restart as CORRAL_RESUME_DIR; corral warns when "
                   "it is on each node's own disk, where a restart on other nodes cannot read it.")
@click.option("--ranks", "ranks_spec", default="0", show_default=True, metavar="SPEC",
              help="Ranks whose progress bars are shown as live status lines: '0', '0,4', '0-7' or 'all'.")
@click.option("--node-timeout", type=click.FloatRange(min=2), default=10.0, show_default=True,
              help="Seconds without a heartbeat before a node is declared lost and the job torn down.")
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Seconds the job's processes get to exit after the signal that stops them, "
                   "before SIGKILL  [default: 3 after a failure; 7 after Ctrl-C or SIGTERM of "
                   "corral, for a last checkpoint; torchrun waits 30]")
@click.option("--hang-timeout", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="If no rank writes anything for this long, dump every rank's Python stack "
                   "(merged into one tree) and flight recorder (the collective where they disagree), "
                   "and stop the job. Without it, 2 minutes of silence only "
                   "get a notice (with the tree when some ranks are apart). See also `corral stacks`.")
@click.option("--no-flight-recorder", "no_flight_recorder", is_flag=True,
              help="Leave PyTorch's collective flight recorder off. By default every rank records its last "
                   "2000 collectives, and on a hang, a failure or `corral stacks` corral gathers them into "
                   "runs/<id>/flightrec/ and names the first collective where the ranks disagree "
                   "(docs/diagnose.md).")
@click.option("--launcher-arg", "launcher_args", multiple=True, metavar="ARG",
              help="Extra argument for the launcher itself (e.g. --launcher-arg=--mixed_precision=bf16). Repeatable.")
@click.option("--config-file", default=None, metavar="FILE",
              help="accelerate's config file (--launcher accelerate; as `accelerate launch --config_file`): "
                   "read here and checked against the cluster (num_machines, num_processes as a total, "
                   "main_process_ip/port, gpu_ids, ...), then used by accelerate on every node. See docs/interop.md.")
@click.option("--fresh-ranks", is_flag=True,
              help="Start every rank as a new Python interpreter, as plain torchrun does. By default "
                   "(torchrun, accelerate) ranks are forked from one that has already imported torch, when "
                   "nothing they start with would differ; see docs/run.md, 'Preloaded ranks'.")
@click.option("--no-telemetry", is_flag=True,
              help="Do not sample GPUs, ranks and links once a second (for `corral top` and `corral report`; "
                   "docs/telemetry.md).")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where run directories go. Default: $CORRAL_RUNS_DIR, else ./runs, else (./runs not "
                   "writable) $XDG_STATE_HOME/corral/runs, with a line saying so.")
@click.option("--sync", "sync_first", is_flag=True,
              help="Sync the project to every node first, verified (as `corral sync`; docs/sync.md).")
@click.option("--dry-run", is_flag=True, help="Print every node's command and environment; start nothing.")
@click.option("--detach", is_flag=True,
              help="Hand the job to a supervisor on the first node (this machine for the default cluster) and "
                   "return once every rank is in user code; the job outlives this terminal. Follow it with "
                   "`corral attach RUN`, `corral logs RUN --follow`, `corral stop RUN`, `corral ps`.")
@click.option("--json", "as_json", is_flag=True, help="Print the result (or, with --dry-run, the plan) as JSON.")
@click.argument("program")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    cluster_opts: ClusterOptions,
    launcher: str,
    nproc_per_node: int | None,
    module: bool,
    env_flags: tuple[str, ...],
    workdir: str | None,
    master_port: int | None,
    gpus_spec: str | None,
    max_restarts: int,
    min_nodes: int | None,
    rejoin_timeout: float,
    checkpoint_dir: str | None,
    ranks_spec: str,
    node_timeout: float,
    grace: float | None,
    hang_timeout: float | None,
    no_flight_recorder: bool,
    launcher_args: tuple[str, ...],
    config_file: str | None,
    fresh_ranks: bool,
    no_telemetry: bool,
    runs_dir: Path | None,
    sync_first: bool,
    dry_run: bool,
    detach: bool,
    as_json: bool,
    program: str,
    args: tuple[str, ...],
) -> None:
    """Run PROGRAM (a training script) with ARGS on every node of the cluster.

    \b
    Examples:
      corral run examples/train_ddp.py --epochs 3       # this machine
      corral run -c hostfile train.py                   # every host in a DeepSpeed hostfile
      corral run -H gpu1:8,gpu2:8 --launcher accelerate train.py
      corral run -c hostfile --launcher accelerate --config-file acc.yaml train.py
      corral run -c hostfile --launcher deepspeed train.py --deepspeed_config ds.json
      corral run --dry-run -c corral.toml train.py      # show each node's command
      salloc -N4 corral run train.py                    # a Slurm allocation: nodes reached with srun

    corral's options go before PROGRAM; everything after it is passed to the
    script unchanged.  Every line is prefixed with its rank; full per-rank
    logs go to runs/<run-id>/<host>/rank<N>.log.  The exit code is the
    workload's (130 after Ctrl-C, 124 after --hang-timeout); 3 when a node is
    unreachable, fails its checks before launch or is lost; 2 for bad input.

    Other tools' files are read and checked first (docs/interop.md): with
    --launcher deepspeed, ~/.deepspeed_env and ./.deepspeed_env (or
    $DS_ENV_FILE) are applied to every node as DeepSpeed's runner does; an
    accelerate config (--config-file) is checked against the cluster; a
    DeepSpeed JSON config the script is given is checked for unknown keys
    and batch-size arithmetic.
    """
    if program.startswith("-"):
        _refuse_unknown_option(program)
    try:
        status_ranks = parse_ranks(ranks_spec)
    except ValueError as e:
        raise UsageError(f"--ranks {ranks_spec!r}: {e}", hint="use e.g. --ranks 0 or --ranks 0-3,8") from None
    if launcher != "command" and not module:
        _refuse_launcher_as_program(program, args)
        _refuse_relative_imports_run_as_file(program, tuple(args), workdir)
    if workdir is not None and not workdir.startswith(("/", "~")):
        raise UsageError(
            f"--workdir {workdir!r} is relative: on a node it would be taken from the ssh login directory",
            hint=f"give an absolute path, e.g. --workdir {Path(workdir).absolute()}")
    refuse_owned_options(launcher, tuple(launcher_args))
    recovery = _recovery_options(max_restarts, min_nodes, rejoin_timeout, checkpoint_dir)
    env = parse_env_flags(env_flags, os.environ)  # an unset --env NAME before any connection
    try:
        gpus = parse_gpus(gpus_spec) if gpus_spec is not None else None
    except ValueError as e:
        raise UsageError(f"--gpus {gpus_spec!r}: {e}", hint="use e.g. --gpus 0-3 or --gpus 4,5") from None
    spec = RunSpec(  # checks its flags (an --env corral sets itself) before anything is read or sent
        program=program, args=tuple(args), module=module, launcher=launcher,
        nproc_per_node=nproc_per_node, env=env,
        workdir=workdir, master_port=master_port, launcher_args=launcher_args,
        preload=not fresh_ranks, gpus=gpus,
    )
    if not dry_run:
        runs_dir = _writable_runs_dir(runs_dir)
    cluster = cluster_opts.load()
    if not module:
        _refuse_missing_script(cluster, launcher, program, tuple(args), workdir, dry_run=dry_run)
    # other tools' files (.deepspeed_env, an accelerate config), one line each; then a
    # DeepSpeed config's misspelled key, before connecting (the run says its notes)
    spec, imported = apply_imports(spec, cluster, config_file=config_file, cwd=os.getcwd(), environ=os.environ,
                                   home=Path.home())
    for line in imported:
        ui.notice(line)
    ds_notes = ds_config_notes(spec, os.getcwd(), known_world_size(cluster, spec))
    if sync_first:
        script = None if module else script_and_args(launcher, program, tuple(args))[0]
        _sync_project(cluster, program=script, workdir=workdir, dry_run=dry_run)
    if dry_run:
        for note in ds_notes:
            ui.notice(note)
        show_plan(cluster, spec, as_json)
        return
    assert runs_dir is not None
    for _ in range(5):  # a leftover directory (or a clock set back): draw again
        if not (runs_dir / spec.run_id).exists():
            break
        spec = dataclasses.replace(spec, run_id=new_run_id())
    options = RunOptions(
        runs_dir=runs_dir, max_restarts=max_restarts,
        node_timeout=node_timeout, hang_timeout=hang_timeout, flight_recorder=not no_flight_recorder,
        **({} if grace is None else {"grace": grace, "interrupt_grace": grace}),
        shown_ranks=None if status_ranks is None else frozenset(status_ranks), recovery=recovery,
        telemetry=not no_telemetry,
    )
    if detach:
        from corral.cli.detached import run_detached

        run_detached(cluster, spec, options, as_json=as_json)
        return
    # --json: stdout is the result object alone; the ranks' output goes to stderr
    view = RunConsole(multi_host=len(cluster.without_spares().hosts) > 1, status_ranks=status_ranks,
                      out=sys.stderr if as_json else None)
    view.logs_hint = f"{runs_dir / spec.run_id}"
    runner = Runner(cluster, spec, options, view=view, head_env=os.environ, head_cwd=os.getcwd())
    spares = f" (+{len(cluster.spares)} spare)" if cluster.spares else ""
    ui.notice(f"run {spec.run_id}: {spec.launcher} on {len(cluster.without_spares().hosts)} node(s){spares}; "
              "connecting...")
    try:
        result = asyncio.run(runner.run())
    finally:
        view.close()
    _summary(result, as_json)
    sys.exit(result.exit_code)


def _recovery_options(max_restarts: int, min_nodes: int | None, rejoin_timeout: float,
                      checkpoint_dir: str | None) -> RecoveryOptions:
    """--min-nodes acts through restarts: without --max-restarts it would do nothing."""
    if min_nodes is not None and not max_restarts:
        raise UsageError("--min-nodes needs --max-restarts N: a job goes on without a lost node by restarting",
                         hint="add --max-restarts 1 (or more)")
    check_checkpoint_dir(checkpoint_dir)
    return RecoveryOptions(min_nodes=min_nodes, rejoin_timeout=rejoin_timeout, checkpoint_dir=checkpoint_dir)


def _writable_runs_dir(given: Path | None) -> Path:
    """Where this run's directory goes: --runs-dir, $CORRAL_RUNS_DIR, ./runs,
    or (./runs not writable) the per-user state directory, with a line saying
    so.  One that cannot be written is bad input named before anything starts
    (it was a PermissionError traceback, and with --json empty stdout)."""
    if given is not None:
        why = unwritable(given)
        if why:
            raise UsageError(f"--runs-dir {given}: run directories cannot be written there ({why})",
                             hint="give a directory you can write with --runs-dir DIR")
        return given
    root = default_root(Path.cwd())
    if root.note:
        ui.notice(root.note)
    why = unwritable(root.path)
    if why:
        said = "$CORRAL_RUNS_DIR" if os.environ.get("CORRAL_RUNS_DIR") else "the per-user fallback"
        raise UsageError(f"run directories cannot be written in {root.path} ({said}: {why})",
                         hint="give a directory you can write with --runs-dir DIR or $CORRAL_RUNS_DIR")
    return root.path


def _sync_project(cluster, *, program: str | None, workdir: str | None, dry_run: bool) -> None:
    """``--sync``: the project, to --workdir when given (else the cluster file's
    workdir, else the same path), and the script itself even when the project's
    ignore rules leave it out (it is named on the command line, as a path named
    to `corral sync` is sent even if ignored)."""
    import dataclasses

    from corral.cli.sync import sync_cluster, with_cluster_workdir
    from corral.sync import SyncOptions
    from corral.sync.filelist import left_out, project_root

    cwd = Path.cwd()
    options = with_cluster_workdir(
        cluster, SyncOptions(dry_run=dry_run, to=workdir))  # `~/proj`: each node's home, as the run reads it
    rel = left_out(cwd, program) if program else None
    if rel is not None:
        root, _ = project_root(cwd)
        ui.notice(f"sync: {rel} is left out of the project by its ignore rules (.gitignore, "
                  f".corralignore); sending it too, as the script to run (files it imports from "
                  f"there are not sent: name them to `corral sync`)")
        options = dataclasses.replace(options, paths=(str(root), str(root / rel)))
    sync_cluster(cluster, options, cwd=cwd, brief=True)


#: What people type before their script out of habit; corral runs these itself.
_LAUNCHER_HINTS = {
    "torchrun": "corral runs torchrun on every node for you: `corral run [-n N] SCRIPT ARGS`; other torchrun "
                "options go in --launcher-arg",
    "accelerate": "`corral run --launcher accelerate SCRIPT ARGS` runs `accelerate launch` on every node "
                  "with the machine rank and main process address set",
    "deepspeed": "`corral run --launcher deepspeed SCRIPT ARGS` runs DeepSpeed's per-node launcher "
                 "(no pdsh, no hostfile needed)",
    "python": "corral starts the script with each node's Python itself: `corral run SCRIPT ARGS` "
              "(`corral run -m PKG.MODULE` for `python -m`; the interpreter is set per host in the cluster file)",
}


def _refuse_unknown_option(program: str) -> None:
    """``corral run --nproc_per_node 2 train.py``: an option corral does not
    have would otherwise be taken as the program, and fail only after
    connecting to every node ("--nproc_per_node not found")."""
    import difflib

    name = program.split("=", 1)[0]
    ctx = click.get_current_context()
    known = sorted({o for p in ctx.command.params for o in getattr(p, "opts", []) if o.startswith("-")})
    hint = owned_option_hint(name)  # torchrun's and others' names for what corral takes another way
    if hint is None:
        close = difflib.get_close_matches(name.replace("_", "-"), known, n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}?" if close else None
    raise UsageError(f"no such option: {name} (corral's options go before the script; "
                     "`corral run --help` lists them)", hint=hint)


def _refuse_missing_script(cluster, launcher: str, program: str, args: tuple[str, ...],
                           workdir: str | None, *, dry_run: bool) -> None:
    """``corral run trian.py``: a script missing here too, where the nodes would
    read it from this same directory, is a typo (exit 2, before connecting),
    not an infrastructure failure (3) with "sync the project" after it.

    Left to the nodes' preflight where they look elsewhere: a --workdir or a
    cluster file's workdir, or an absolute path on a cluster of other machines
    (a shared filesystem this machine may not mount)."""
    import difflib

    script, _ = script_and_args(launcher, program, args)
    if launcher == "command" and script == program:
        return  # a command, found on each node's PATH
    path = Path(script).expanduser()
    if workdir is not None or any(cluster.workdir_for(h) for h in cluster.hosts):
        return
    if path.is_absolute() and not cluster.is_local:
        return
    if (Path.cwd() / path).exists():
        return
    where = path.parent if path.is_absolute() else (Path.cwd() / path).parent
    try:
        names = sorted(p.name for p in where.iterdir())
    except OSError:  # no such directory either, or one this user cannot list
        names = []
    near = difflib.get_close_matches(path.name, names, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(str(path.parent / n) if str(path.parent) != '.' else n for n in near)}?" \
        if near else "check the path"
    if not cluster.is_local:
        hint += "; a script that is only on the nodes: give --workdir DIR, where it is there"
    if dry_run:  # shows the plan all the same
        ui.notice(f"{script}: no such file in {where} ({hint})")
        return
    raise UsageError(f"{script}: no such file in {where}", hint=hint)


def _refuse_launcher_as_program(program: str, args: tuple[str, ...]) -> None:
    """``corral run python train.py`` / ``corral run torchrun ... train.py``: say what to type.

    Without this the mistake shows up only after connecting to every node,
    as "python not found" with a hint to sync the project."""
    if "/" in program or Path(program).is_file():
        return  # a path (or a local file) is taken as given
    word = "python" if re.fullmatch(r"python[\d.]*", program) else program
    if word not in _LAUNCHER_HINTS:
        return
    script = next((a for a in args if a.endswith(".py")), None)
    example = f" (here: `corral run {script} ...`)" if script and word in ("python", "torchrun") else ""
    raise UsageError(f"PROGRAM is {program!r}: give the training script itself, not the launcher",
                     hint=_LAUNCHER_HINTS[word] + example +
                     "; to run an arbitrary command on every node use --launcher command")


def _refuse_relative_imports_run_as_file(program: str, args: tuple[str, ...], workdir: str | None) -> None:
    """``corral run pkg/train.py`` where train.py does ``from .data import X``:
    as a file every rank would fail with "attempted relative import with no
    known parent package"; say to run it as the module it is."""
    if not program.endswith(".py"):
        return
    base = Path(workdir).expanduser() if workdir else Path.cwd()
    path = Path(program).expanduser()
    if not path.is_absolute():
        # --workdir on the nodes only (--sync copies this directory there)
        base = base if (base / path).is_file() else Path.cwd()
        path = base / path
    try:
        source = path.read_text(errors="replace")
    except OSError:
        return  # not here: the nodes' copy is what runs, checked by preflight
    line = relative_import_line(source)
    found = None if line is None else module_for(path, base)
    if line is None or found is None:
        return
    name, where = found
    statement = source.splitlines()[line - 1].strip()
    rest = " ".join(shlex.quote(a) for a in args)
    chdir = "" if where.resolve() == base.resolve() else f"--workdir {shlex.quote(str(where))} "
    raise UsageError(
        f"{program}:{line} imports relative to its package ({statement}), which works only when Python "
        f"runs it as a module: run as a file, every rank would fail with \"attempted relative import with "
        "no known parent package\"",
        hint=f"run it as the module it is: `corral run {chdir}-m {name}{' ' + rest if rest else ''}` "
             "(as `torchrun -m` would)")


def _summary(result: RunResult, as_json: bool) -> None:
    if as_json:
        emit_json("run", _result_json(result))
    con = ui.err_console()
    where = f"logs: {result.run_dir}" if result.run_dir else ""
    plan = result.plan
    shape = (f"{plan.world_size} rank{'' if plan.world_size == 1 else 's'} on {len(plan.nodes)} node(s)"
             if plan else "")
    if result.status == "succeeded":
        again = ""
        if result.restarts:
            again = (f" after {len(result.restarts)} restart(s) [yellow](attempt 1: "
                     f"{escape(result.restarts[0])})[/]")
        con.print(f"[green]corral:[/] run {result.run_id} succeeded in {result.duration_s:.1f}s "
                  f"({shape}){again}; {escape(where)}")
        if result.caught:
            host, rank, exc, log = result.caught[0]
            more = f" (and {len(result.caught) - 1} more rank(s))" if len(result.caught) > 1 else ""
            con.print(f"  [yellow]note:[/] rank {rank} on {escape(host)} printed a traceback{more} and the run "
                      f"still exited 0: [bold]{escape(exc)}[/]. The script caught the error itself; check that "
                      f"it did the work ({escape(log)})",
                      soft_wrap=True)
        return
    if result.status == "interrupted":
        con.print(f"[yellow]corral:[/] run {result.run_id} interrupted after {result.duration_s:.1f}s; "
                  f"every process it started was stopped; {escape(where)}")
        return
    f = result.failure
    assert f is not None
    con.print(f"[bold red]corral: run {result.run_id} FAILED[/] after {result.duration_s:.1f}s "
              f"(attempt {result.attempts}): {escape(f.describe())} [dim](first failure)[/]")
    for hint in result.hints:
        con.print(f"  [yellow]{escape(hint)}[/]")
    if result.left_early:  # one sentence for all of them (`if rank != 0: sys.exit(0)` is every rank but 0)
        who = fold_ranks({r for _, r in result.left_early})
        hosts = fold(h for h, _ in result.left_early)
        con.print(f"  [yellow]{who} on {escape(hosts)} had already exited without an error[/] while the "
                  "others were still running: their next collective then lost a peer. Give every rank the "
                  "same work (the same number of steps and batches) or end every rank at the same barrier.")
    if result.stacks:
        con.print("  [bold]where every rank is:[/]")
        for line in result.stacks:
            con.print("  " + escape(line), soft_wrap=True)
    for line in result.flightrec:
        con.print("  " + escape(line), soft_wrap=True)
    if result.failure_tail:
        con.print(f"  [dim]--- last lines of {escape(str(result.failure_log))} ---[/]")
        for line in result.failure_tail:
            con.print("  " + escape(line), soft_wrap=True)
    for d in _causes(result)[:1]:
        con.print(f"  [bold yellow]Likely cause:[/] {escape(getattr(d, 'title', str(d)))}"
                  + (f" — {escape(d.cause)}" if getattr(d, "cause", None) else ""))
        for step in getattr(d, "fix", ()) or ():
            con.print(f"  [bold]Fix:[/] {escape(str(step))}")
    con.print(f"  {escape(where)}")


def _causes(result: RunResult) -> list:
    """Diagnoses worth calling the likely cause.  A symptom (a peer went away)
    is not, when the first failure has its own exception or a rank left early:
    those are the cause, and the symptom was quoted from a sibling's output."""
    f = result.failure
    causes = [d for d in result.diagnoses if not getattr(d, "symptom", False)]
    if causes or (f is not None and ((f.exc and not f.consequential) or result.left_early)):
        return causes
    return list(result.diagnoses)


def _result_json(result: RunResult) -> dict:
    f = result.failure
    return {
        "run_id": result.run_id, "status": result.status, "exit_code": result.exit_code,
        "run_dir": str(result.run_dir) if result.run_dir else None, "attempts": result.attempts,
        "restarts": list(result.restarts), "duration_s": round(result.duration_s, 3),
        "failure": None if f is None else {
            "host": f.host, "rank": f.rank, "kind": f.kind, "exit_code": f.code,
            "signal": f.signal_name, "exception": f.exc, "reason": f.reason,
            "description": f.describe(), "tail": list(result.failure_tail),
            "left_early": [{"host": h, "rank": r} for h, r in result.left_early],
            "hints": list(result.hints),
            "log": str(result.failure_log) if result.failure_log else None,
        },
        "stacks": list(result.stacks),
        "flightrec": list(result.flightrec),
        "caught": [{"host": h, "rank": r, "exception": e, "log": lg} for h, r, e, lg in result.caught],
        "diagnoses": [getattr(d, "id", str(d)) for d in result.diagnoses],
    }
