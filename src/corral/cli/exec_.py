"""`corral exec`: run a shell command on every node, folding identical output."""

from __future__ import annotations

import sys

import click

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options
from corral.errors import EXIT_INFRA, EXIT_INTERRUPTED, UsageError
from corral.frames import terminal_safe
from corral.transport.fanout import PROGRESS_HOSTS, TREE_MIN_HOSTS, command_line, run_everywhere
from corral.transport.gather import group_results
from corral.transport.ssh import SSH_ERROR


@click.command(name="exec", context_settings={"ignore_unknown_options": True,
                                              "allow_interspersed_args": False})
@cluster_options
@click.option("--timeout", type=click.FloatRange(min=0.1), default=None,
              help="Stop the command on hosts where it runs longer than this (seconds).")
@click.option("-f", "--fanout", type=click.IntRange(min=1), default=64, show_default=True,
              help="Hosts contacted at once.")
@click.option("--tree", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              envvar="CORRAL_EXEC_TREE",
              help=f"Reach the nodes through relay nodes: this machine logs in to about sqrt(N) of them, "
                   f"each runs the command on itself and on its share of the others with its own ssh "
                   f"(nodes must log in to each other: `corral ssh setup`).  auto: from {TREE_MIN_HOSTS} "
                   f"ssh hosts on.  A node a relay cannot reach is reached from here.  "
                   f"Default from $CORRAL_EXEC_TREE.")
@click.option("--no-fold", is_flag=True,
              help="Stream lines live as 'host: line' (like pdsh) instead of folding identical output.")
@click.option("--json", "as_json", is_flag=True, help="Per-host results as JSON.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(cluster_opts: ClusterOptions, timeout: float | None, fanout: int, tree: str, no_fold: bool,
          as_json: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND through each node's login shell ($SHELL -c, as ssh does), in parallel.

    \b
      corral exec -c hostfile -- nvidia-smi -L
      corral exec -H gpu[01-16] -- 'df -h /data | tail -1'

    Identical outputs are printed once under a folded host set
    (node[1-3,5]); hosts that answered differently are shown apart.  The
    exit code is the largest of all hosts' (3: a host could not be reached
    or logged in to; 124: --timeout; 130: interrupted).  Ctrl-C stops the
    command on every node.  The first MiB of each host's stdout and
    stderr are kept (the rest is dropped and counted: "[cut N bytes]").
    Every terminal control but colours is removed from what reaches the
    terminal (--json keeps the text as the node sent it, JSON-escaped).
    """
    text = command_line(command).strip()
    if not text:
        raise UsageError("no command given", hint="corral exec -- COMMAND")
    # No `ssh -G` pass: ssh resolves names itself, and exec is about speed.
    cluster = cluster_opts.load(resolve=False, notice=not as_json)

    def live(host: str, stream: str, line: str) -> None:
        target = sys.stdout if stream == "out" else sys.stderr
        target.write(f"{host}: {terminal_safe(line)}\n")
        target.flush()

    interrupted = False
    try:
        results = run_everywhere(cluster, text, timeout=timeout, fanout=fanout,
                                 on_line=live if no_fold and not as_json else None,
                                 on_progress=_progress if len(cluster.hosts) >= PROGRESS_HOSTS else None,
                                 tree={"auto": None, "on": True, "off": False}[tree],
                                 on_notice=None if as_json else ui.notice)
    except KeyboardInterrupt as stop:
        # Ctrl-C: every node has stopped; still show what they said before it.
        results = getattr(stop, "results", [])
        interrupted = True
    code = EXIT_INTERRUPTED if interrupted else max((_exit_code(r) for r in results), default=0)
    if as_json:
        from corral.cli.common import emit_json

        # The node's text as it sent it: JSON escapes every control character
        # (ESC is \u001b), so printing this reaches no terminal as a control.
        emit_json("exec", {"hosts": [
            {"host": r.host, "returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
             "stdout_cut": r.stdout_cut, "stderr_cut": r.stderr_cut, "via": r.via,
             "error": r.error.message if r.error else None, "hint": r.error.hint if r.error else None}
            for r in results
        ]})
        sys.exit(code)
    # Plain writes, not rich: importing it would add to every exec's wall time.
    # What a node said (output, an error quoting ssh or the node) is shown
    # with terminal controls removed but colours.
    paint = ui.paint
    safe = terminal_safe
    if not no_fold:
        for g in group_results(results):
            said = "ssh failed" if g.error and g.returncode == SSH_ERROR else f"exit {g.returncode}"
            rc = "" if g.returncode == 0 else " " + paint(f"({said})", "red")
            sys.stdout.write(paint(f"----- {g.label} ({len(g.hosts)})", "bold", "cyan") + rc
                             + paint(" -----", "bold", "cyan") + "\n")
            if g.error:
                sys.stdout.write(paint(safe(g.error), "red") + "\n")
            if g.stdout:
                out = safe(g.stdout)
                sys.stdout.write(out if out.endswith("\n") else out + "\n")
            if g.stderr:
                sys.stdout.write(paint(safe(g.stderr).rstrip("\n"), "dim") + "\n")
            sys.stdout.flush()
    from corral.hostrange import fold

    hints: dict[str, list[str]] = {}
    for r in results:
        if r.error is not None and r.error.hint:
            hints.setdefault(r.error.hint, []).append(r.host)
    for hint, hosts in list(hints.items())[:3]:  # the same hint once, for all its hosts
        sys.stderr.write(f"{paint('HINT', 'yellow', stream=sys.stderr)} {fold(hosts)}: {safe(hint)}\n")
    failed = [r.host for r in results if not r.ok]
    if interrupted:
        sys.stderr.write("corral: interrupted; the command was stopped on every node\n")
    elif failed:
        sys.stderr.write(f"corral: {len(failed)} of {len(results)} host(s) failed: {fold(failed)}\n")
    sys.stderr.flush()
    sys.exit(code)


def _progress(done: int, total: int) -> None:
    ui.notice(f"{done} of {total} hosts done...")


def _exit_code(result) -> int:
    """The host's command's own code, or 3 where ssh itself failed (ssh's
    255 is no command's answer: it is corral's "unreachable", as in every
    command); a timeout keeps its 124."""
    if result.error is not None and result.returncode == SSH_ERROR:
        return EXIT_INFRA
    return result.returncode
