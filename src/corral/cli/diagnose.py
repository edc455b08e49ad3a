"""`corral diagnose`: explain a failed run's log, ranked likely causes and fixes."""

from __future__ import annotations

import signal

import sys
from pathlib import Path

import click
from rich.markup import escape

from corral import ui
from corral.cli.common import emit_json
from corral.diagnose import (
    Diagnosis,
    RunReport,
    diagnose_run,
    diagnose_text,
    load_facts,
    load_rules,
)
from corral.diagnose.logtext import sniff_encoding
from corral.diagnose.lost import NODE_LOST
from corral.diagnose.pyexc import basename
from corral.diagnose.rundir import resolve_target
from corral.diagnose.signs import failure_lines_in_text
from corral.diagnose.stacks import NEVER_MET
from corral.errors import UsageError
from corral.run.history import default_root

#: Causes shown without --all.
_DEFAULT_SHOWN = 3
_SHOWN_LINE = 160

_NOTHING = (
    "no known failure signature matched; the error may be in another file (read the log of "
    "the first rank that failed), or this failure is not in corral's knowledge base yet. "
    "Rerun with NCCL_DEBUG=WARN and TORCH_DISTRIBUTED_DEBUG=DETAIL for more telling errors."
)
_NO_FAILURE = (
    "No failure found: this log shows no traceback, error line, non-zero exit or fatal signal, "
    "so there is nothing to diagnose. If the run did fail, its error is in another log: the "
    "first failing rank's, or the launcher's (`corral diagnose <run-dir>` reads them all)."
)


@click.command(name="diagnose")
@click.argument("target", metavar="[LOGFILE|RUN_DIR|RUN_ID|-]", required=False)
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON (every match, with lines, fix steps and confidence) instead of the report.")
@click.option("--all", "show_all", is_flag=True,
              help=f"Show every cause that matched, not only the {_DEFAULT_SHOWN} most likely.")
@click.option("--facts", "facts_file", type=click.Path(dir_okay=False), default=None,
              help="Doctor facts per host (JSON) that make fixes host-specific. "
                   "A run directory's facts.json is used without this flag.")
@click.option("--rules", "rules_files", type=click.Path(dir_okay=False), multiple=True,
              help="An extra rules file (same format as corral's rules.toml). Repeatable.")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where RUN_ID is looked up. "
                   "Default: $CORRAL_RUNS_DIR, else ./runs (where `corral run` could not write it: "
                   "$XDG_STATE_HOME/corral/runs).")
def diagnose(target: str | None, as_json: bool, show_all: bool, facts_file: str | None,
             rules_files: tuple[str, ...], runs_dir: Path | None) -> None:
    """Explain why a run failed: likely causes, the lines that show them, and the fix.

    LOGFILE is any log (torchrun, accelerate, DeepSpeed, Lightning, pdsh, a paste
    from a colleague); RUN_DIR is a run directory written by `corral run`
    (runs/<run-id>), where matches are attributed to hosts and ranks, the first
    failing rank's own exception comes first and the errors it caused on other
    ranks are marked as consequences, and a hung run's stacks say which rank was
    elsewhere; RUN_ID is a run id or a unique prefix of one, looked up in ./runs
    (or --runs-dir, $CORRAL_RUNS_DIR), as `corral runs` lists them; `-` reads standard input.
    With none, the newest run there that did not succeed.

    \b
    Examples:
      corral diagnose runs/20260101-120000-ab12
      corral diagnose 20260101-1200
      corral diagnose slurm-4242.out --all
      pbpaste | corral diagnose - --json

    A log that shows no failure at all (no traceback, error line or non-zero
    exit) is reported as such; notices that are no failure (NCCL using TCP
    sockets instead of InfiniBand) are listed after the causes.

    Exit status: 0 when a cause was found (a known failure, the first failing
    rank's exception, or a hang), 1 when nothing was, 2 on bad input.
    """
    rules = load_rules(rules_files)
    facts = load_facts(facts_file) if facts_file else None
    if target == "-":
        text = _read_stdin()
        diags = diagnose_text(text, origin="<stdin>", facts=facts, rules=rules, notices=True)
        signs = failure_lines_in_text(text) if all(d.notice for d in diags) else None
        report = RunReport(path="<stdin>", kind="file", files=("<stdin>",), failure=None,
                           facts_hosts=tuple(sorted(facts or {})), diagnoses=tuple(diags),
                           failure_lines=signs)
    else:
        root = runs_dir or default_root(Path()).path
        path = resolve_target(target, root) if target is not None else _latest_unsuccessful(root)
        report = diagnose_run(path, facts=facts, rules=rules)
    if as_json:
        emit_json("diagnose", _as_json(report))
    else:
        _print_report(report, show_all=show_all)
    if not report.found:
        sys.exit(1)


def _latest_unsuccessful(root: Path) -> Path:
    from corral.run.history import list_runs

    for record in list_runs(root) if root.is_dir() else ():
        if record.status not in ("succeeded", "running"):
            ui.notice(f"diagnosing the newest run that did not succeed: {record.run_id} ({record.status})")
            return record.dir
    raise UsageError(f"no failed run in {root}",
                     hint="give a log file, a run directory or a run id (`corral runs` lists them)")


def _as_json(report: RunReport) -> dict:
    failure = report.failure
    return {
        "path": report.path,
        "kind": report.kind,
        "files": list(report.files),
        "failure": None if failure is None else {
            "host": failure.host, "rank": failure.rank, "kind": failure.kind,
            "exit_code": failure.exit_code, "signal": failure.signal,
            "exception": failure.exception, "reason": failure.reason,
            "left_early": [{"host": h, "rank": r} for h, r in failure.left_early],
        },
        "facts_hosts": list(report.facts_hosts),
        "status": report.status,
        "matched": bool(report.diagnoses),
        "found": report.found,
        "first_error": None if report.first_error is None else report.first_error.to_dict(),
        "hang": None if report.hang is None else report.hang.to_dict(),
        "flightrec": None if report.flightrec is None else report.flightrec.to_dict(),
        "exception": None if report.exception is None else {
            "exception": report.exception.text, "type": report.exception.type,
            "message": report.exception.message, "line": report.exception.line,
            "where": None if report.exception.user_frame is None else
            f"{basename(report.exception.user_frame.file)}:{report.exception.user_frame.line}",
            "rank": report.exception.rank, "launcher": report.exception.launcher or None,
            "summary": dict(report.exception.summary) or None,
        },
        "diagnoses": [d.to_dict() for d in report.diagnoses],
        "failure_lines": None if report.failure_lines is None else [
            {"line": n, "text": t} for n, t in report.failure_lines],
    }


def _read_stdin() -> str:
    """Standard input as text in the encoding it was written in (a log pasted
    from Windows PowerShell is UTF-16), not in the terminal's locale."""
    data = sys.stdin.buffer.read()
    return data.decode(sniff_encoding(data[:4096]), errors="replace")


def _where(d: Diagnosis) -> str:
    parts = []
    if d.host:
        parts.append(d.host)
    if d.rank is not None:
        parts.append(f"rank {d.rank}")
    where = " ".join(parts)
    others = [h for h in d.hosts if h != d.host]
    if others:
        listed = f"{', '.join(others[:6])}{' ...' if len(others) > 6 else ''}"
        where += f" (also seen on {listed})" if where else f"seen on {listed}"
    elif len(d.ranks) > 1:
        where += f" (ranks {', '.join(str(r) for r in d.ranks[:12])})"
    return where.strip()


def _print_report(report: RunReport, *, show_all: bool) -> None:
    con = ui.console()
    head = f"[bold]corral diagnose[/] {escape(report.path)}"
    if report.kind != "file":
        head += f" [dim]({len(report.files)} log file(s)"
        if report.failure and report.failure.host:
            f = report.failure
            rank = f" rank {f.rank}" if f.rank is not None else ""
            code = f", exit {f.exit_code}" if f.exit_code is not None else ""
            if f.signal is not None:
                code = f", {f.signal}" if f.signal.startswith("SIG") else f", signal {f.signal}"
            head += escape(f"; first failure: {f.host}{rank}{code}")
        head += ")[/]"
    con.print(head)
    if report.status == "interrupted":
        con.print("[yellow]run.json records that this run was interrupted (Ctrl-C or SIGTERM to corral run): "
                  "errors from the stop are marked as its consequences.[/]")
    if report.facts_hosts:
        con.print(f"[dim]using doctor facts for {escape(', '.join(report.facts_hosts))}[/]")
    if not report.found:
        if report.status == "succeeded":
            con.print("\n[green]run.json records that this run succeeded: nothing to diagnose.[/]")
        elif report.exception is not None:
            _print_exception(con, report.exception)
        elif report.status == "interrupted":
            con.print("\n[green]No rank had failed before the interruption: nothing to diagnose "
                      "(the logs show how far the run got).[/]")
        elif report.failure_lines == ():
            con.print(f"\n[green]{escape(_NO_FAILURE)}[/]")
        else:
            if report.failure_lines:
                con.print("\n[bold]Lines that look like the failure:[/]")
                for number, line in report.failure_lines:
                    text = line if len(line) <= _SHOWN_LINE else line[:_SHOWN_LINE] + " ..."
                    con.print(f"     [dim]line {number}[/]  {escape(text)}")
            con.print(f"\n[yellow]{escape(_NOTHING)}[/]")
        for i, d in enumerate(report.diagnoses, start=1):  # notices: worth knowing, no failure
            _print_one(con, i, d, "Worth knowing (not a failure)", multi_file=report.kind != "file")
        return
    n = 0
    if report.hang is not None:
        n += 1
        _print_hang(con, n, report)
    if report.flightrec is not None and report.flightrec.culprits:
        n += 1
        _print_flightrec(con, n, report)
    if report.failure is not None and report.failure.left_early:
        n += 1
        who = ", ".join(f"rank {r} on {h}" for h, r in report.failure.left_early[:3])
        con.print(f"\n[bold]{n}. {escape(who)} had already exited without an error while the others were "
                  "still running[/]")
        con.print("   [dim]The failures below followed: a rank that leaves early makes its peers' next "
                  "collective lose it. Give every rank the same work (the same number of steps and "
                  "batches: DistributedSampler(drop_last=True), or DDP's join()), or end every rank at "
                  "the same barrier.[/]")
    if report.first_error is not None:
        n += 1
        _print_first_error(con, n, report)
    shown = report.diagnoses if show_all else report.diagnoses[:_DEFAULT_SHOWN]
    causes = 0
    for d in shown:
        n += 1
        if d.notice:
            label = "Worth knowing (not a failure)"
        elif d.consequence:
            label = ("Consequence of the interruption (Ctrl-C or SIGTERM)" if report.status == "interrupted"
                     else "Consequence of the first failure")
        else:
            causes += 1
            label = "Likely cause" if causes == 1 else "Also possible"
        _print_one(con, n, d, label, multi_file=report.kind != "file")
    hidden = len(report.diagnoses) - len(shown)
    if hidden:
        con.print(f"\n[dim]{hidden} less likely cause(s) not shown: rerun with --all.[/]")


def _print_exception(con, exc) -> None:
    """A single log that ends with a Python exception no rule knows: name it
    instead of suggesting NCCL debug settings that would not change it."""
    if exc.summary and not exc.launcher:
        _print_launcher_summary(con, exc)
        return
    frame = exc.user_frame
    where = f" ({basename(frame.file)}:{frame.line})" if frame else ""
    text = exc.text if len(exc.text) <= _SHOWN_LINE else exc.text[:_SHOWN_LINE] + " ..."
    if exc.launcher:
        launcher = exc.launcher.split(":", 1)[0].rsplit(".", 1)[-1]
        on = f"rank {exc.rank}'s" if exc.rank is not None else "the program's"
        con.print(f"\n[bold]The log ends with the launcher's {escape(launcher)}; before it, {on} own "
                  f"exception: {escape(text + where)}[/]")
    else:
        con.print(f"\n[bold]The log ends with a Python exception: {escape(text + where)}[/]")
    con.print(f"   [cyan]log:[/] line {exc.line}")
    con.print("   [cyan]traceback:[/]" + (" [dim](end)[/]" if len(exc.shown) > 6 else ""))
    for line in exc.shown[-6:]:
        shown = line if len(line) <= _SHOWN_LINE else line[:_SHOWN_LINE] + " ..."
        con.print(f"     {escape(shown)}")
    at = f" at {basename(frame.file)}:{frame.line}" if frame else ""
    con.print(f"   [dim]{escape(f'No known failure signature matches it: the program raised it{at}; the traceback shows why. If this is one rank of a multi-node run, `corral diagnose <run-dir>` compares it with the other ranks and nodes (a file missing on some nodes only, say).')}[/]")


def _print_launcher_summary(con, exc) -> None:
    """torchrun's ChildFailedError with no rank traceback before it: its
    "Root Cause" block (rank, host, exit code) is the failure."""
    got = dict(exc.summary)
    code = got.get("exitcode", "?")
    who = f"rank {got.get('rank', '?')}" + (f" on {got['host']}" if got.get("host") else "")
    if code.lstrip("-").isdigit() and int(code) < 0:
        sig = -int(code)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        how, why = (f"was killed by {name}",
                    "Something outside the program stopped it: the kernel's OOM killer (`dmesg` on that "
                    "host), a scheduler's limit, or a user; its last lines show how far it got.")
    elif code == "?":
        how, why = ("failed", "Its exit code is not in the summary; the rank's last lines say how far it got.")
    else:
        how, why = (f"exited with code {code}",
                    "sys.exit(N) and os._exit(N) print nothing, argparse prints `error: ...` and exits "
                    "with 2: the rank's last lines say why.")
    con.print(f"\n[bold]{escape(who)} {escape(how)} (torchrun's summary at the log's end, line "
              f"{exc.line}); it printed no Python traceback here[/]")
    con.print(f"   [dim]{escape(why + ' With its own output in separate files, `corral diagnose <run-dir>` shows them side by side.')}[/]")


def _print_first_error(con, n: int, report: RunReport) -> None:
    fe = report.first_error
    assert fe is not None
    exc = fe.exception if len(fe.exception) <= _SHOWN_LINE else fe.exception[:_SHOWN_LINE] + " ..."
    on = f" on {fe.host}" if fe.host else ""
    where = f" ({fe.where})" if fe.where else ""
    con.print(f"\n[bold]{n}. {escape(f'rank {fe.rank}{on} failed first: {exc}{where}')}[/]")
    con.print(f"   [cyan]log:[/] {escape(f'{fe.log_path}:{fe.log_line}')}")
    if fe.explained_by:
        con.print(f"   [dim]explained below by rule {escape(', '.join(fe.explained_by))}[/]")
    if not fe.explained_by or fe.kind == "exit":  # with no traceback, its last words are the context
        tail = fe.traceback[-6:]
        label = "traceback:" if fe.kind == "exception" else "last lines it wrote:"
        con.print(f"   [cyan]{label}[/]" + (" [dim](end)[/]" if len(tail) < len(fe.traceback) else ""))
        for line in tail:
            text = line if len(line) <= _SHOWN_LINE else line[:_SHOWN_LINE] + " ..."
            con.print(f"     {escape(text)}")
        if not tail:
            con.print("     [dim](nothing)[/]")
    if not fe.explained_by:
        con.print(f"   [dim]{escape(_unexplained(fe))}[/]")
    if any(d.consequence for d in report.diagnoses):
        con.print("   [dim]The errors below on other ranks follow from this failure.[/]")


def _unexplained(fe) -> str:
    """What to make of a first failure no rule explains."""
    if fe.kind == "exception":
        where = f" at {fe.where}" if fe.where else ""
        return (f"No known failure signature matches this exception: it was raised by the program{where}; "
                "the traceback in the log shows why.")
    on = fe.host or "the node"
    if fe.exception == "killed by SIGKILL":
        return ("It left no traceback. SIGKILL from outside the program is most often the kernel's "
                f"out-of-memory killer (`dmesg -T | grep -i -e oom -e killed` on {on}) or a scheduler's "
                "memory or time limit.")
    if fe.exception in ("killed by SIGSEGV", "killed by SIGBUS", "killed by SIGFPE", "killed by SIGILL",
                        "killed by SIGABRT"):
        at = f" at {fe.where}" if fe.where else ""
        return (f"It crashed in native code (a C/C++/CUDA extension, ctypes, or the interpreter itself): "
                f"the stack above shows the Python line that called into it{at}. Usual causes: an "
                "extension built against another torch or CUDA version, a bug or bad input in a custom op, "
                "a truncated or corrupted file read through mmap; SIGABRT also follows a C++ exception "
                "(`terminate called after throwing ...` just before it).")
    if fe.exception.startswith("killed by"):
        return ("It left no traceback: something outside the program sent the signal (a scheduler, "
                "a user, a watchdog); the lines above are the last it wrote.")
    return ("It exited without a Python traceback: the lines above usually say why (argparse prints "
            "`error: ...` and exits with 2; sys.exit(N) and os._exit(N) print nothing).")


def _print_flightrec(con, n: int, report: RunReport) -> None:
    """The collective where the ranks stopped agreeing, from their flight recorder dumps."""
    fr = report.flightrec
    assert fr is not None
    lines = fr.lines(report.rank_stacks)
    head = lines[0].removeprefix("flight recorder: ")
    con.print(f"\n[bold]{n}. Flight recorder: {escape(head)}[/]")
    for line in lines[1:]:
        con.print(f"   {escape(line.strip() if not line.startswith('      ') else '  ' + line.strip())}")
    con.print(f"   [cyan]dumps:[/] {escape(report.path)}/flightrec/ [dim](torch's own format, one per rank)[/]")


def _print_hang(con, n: int, report: RunReport) -> None:
    hang = report.hang
    assert hang is not None
    con.print(f"\n[bold]{n}. {escape(hang.summary[:1].upper() + hang.summary[1:])}[/]")
    if hang.reason:
        con.print(f"   [dim]{escape('run.json: ' + hang.reason)}[/]")
    if hang.groups:
        con.print("   [cyan]where the ranks were:[/]")
        width = max(len(g.label) for g in hang.groups)
        for g in hang.groups:
            on = f" ({', '.join(g.hosts)})" if g.hosts else ""
            inner = f" in {g.user_frame}" if g.user_frame else ""
            mark = "  <- elsewhere" if g.odd else ""
            con.print(f"     {escape(g.label.ljust(width))}  {escape(g.frame + inner + on)}{mark}")
    if hang.missing:
        con.print(f"   [dim]no stack from {escape(', '.join(map(str, hang.missing)))}: not a Python rank, or exited[/]")
    if hang.stacks_file:
        con.print(f"   [cyan]stacks:[/] {escape(hang.stacks_file)}")
    odd = [g for g in hang.groups if g.odd]
    if odd:
        g = odd[0]
        at = g.user_frame or g.frame
        what = "it does" if len(g.ranks) == 1 else "they do"
        only = "only it takes" if len(g.ranks) == 1 else "only they take"
        con.print(f"   [cyan]next:[/] {escape(f'the other ranks wait for {g.label}: look at what {what} at {at} (I/O, a lock, a loop, a code path {only}).')}")
    elif len(hang.groups) > 1:  # split evenly (e.g. 1 and 1): none is the odd one out
        con.print("   [cyan]next:[/] the ranks are in different places and none is the odd one out: "
                  "the group outside the collective (its inner frame above) is the one to look at.")
    elif hang.in_init and not hang.missing:
        con.print(f"   [cyan]next:[/] {escape(NEVER_MET)}")
    elif hang.groups:
        con.print("   [cyan]next:[/] every rank that answered is at the same place; a rank that left no "
                  "stack, or a peer they all wait for, is the one to look at.")


def _print_one(con, n: int, d: Diagnosis, label: str, *, multi_file: bool) -> None:
    con.print(f"\n[bold]{n}. {label}: {escape(d.title)}[/]")
    meta = f"{d.category_label} · confidence {d.confidence:.2f} · rule {d.rule_id}"
    where = _where(d)
    if where:
        meta += f" · {where}"
    con.print(f"   [dim]{escape(meta)}[/]")
    con.print("   [cyan]last lines it wrote:[/]" if d.rule_id == NODE_LOST else "   [cyan]matched:[/]")
    for m in d.lines:
        loc = f"{m.origin}:{m.line}" if multi_file and m.origin else f"line {m.line}"
        text = m.text if len(m.text) <= _SHOWN_LINE else m.text[:_SHOWN_LINE] + " ..."
        con.print(f"     [dim]{escape(loc)}[/]  {escape(text)}")
    con.print(f"   [cyan]cause:[/] {escape(d.cause)}")
    con.print("   [cyan]fix:[/]")
    for i, step in enumerate(d.fix, start=1):
        con.print(f"     {i}. {escape(step)}")
