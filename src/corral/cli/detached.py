"""What `run --detach`, `attach`, `logs`, `stop` and `ps` share: starting a
detached job, finding one again, printing what its node sends."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from corral import ui
from corral.cli.common import ClusterOptions, emit_json
from corral.errors import EXIT_INTERRUPTED, CorralError, HostError
from corral.frames import has_control, terminal_safe
from corral.run import detach
from corral.run.history import default_root
from corral.run.options import RunOptions
from corral.run.plan import RunSpec


def run_detached(cluster, spec: RunSpec, options: RunOptions, *, as_json: bool) -> None:
    """`corral run --detach`: start the supervisor, return once every rank is in user code."""
    import os

    started = time.time()
    where = cluster.hosts[0].name if not cluster.is_local else "this machine"
    ui.notice(f"run {spec.run_id}: {spec.launcher} on {len(cluster.hosts)} node(s), detached: its supervisor "
              f"runs on {where}; starting...")
    stub = detach.write_stub(options.runs_dir, cluster, spec, started)
    said_error = []

    def on_line(text: str) -> None:
        # the supervisor's last words when the job cannot start are the error,
        # which this command reports itself (once)
        said_error.extend([True] if text.startswith("corral: error: ") else [])
        if not said_error:
            print_line(text, out=sys.stderr)

    try:
        ev = detach.start(cluster, spec, options, head_env=os.environ, head_cwd=os.getcwd(), on_line=on_line)
    except CorralError as e:
        d = detach.from_stub(stub)
        if d is None or detach.refresh(d) is None:
            detach.mark_failed(stub, str(e))  # never started there: not "running" for ever here
        raise
    except KeyboardInterrupt:
        _stop_while_starting(stub)
    d = detach.from_stub(stub)
    assert d is not None
    if ev["ev"] == "end":
        detach.refresh(d)
        with _quiet_errors():
            detach.sync(d, stub)
        status = str(ev.get("status"))
        error = ev.get("error") or ev.get("failure")
        code = ev.get("exit_code") if isinstance(ev.get("exit_code"), int) else 3
        if as_json:
            emit_json("run.detached", {"run_id": spec.run_id, "detached": True, "status": status,
                                       "exit_code": code, "failure": error, "run_dir": str(stub)})
        if status == "succeeded":
            ui.notice(f"run {spec.run_id} ended before this command returned: succeeded; logs: {stub}")
            sys.exit(0)
        raise detach.DetachError(f"run {spec.run_id} {status} before every rank was in user code: "
                                 f"{terminal_safe(str(error or 'see its console'))}",
                                 hint=terminal_safe(str(ev.get("hint"))) if ev.get("hint") else
                                 f"`corral logs {spec.run_id}` shows what the ranks wrote",
                                 exit_code=code or 3)
    detach.refresh(d)
    if as_json:
        emit_json("run.detached", {"run_id": spec.run_id, "detached": True, "status": "running",
                                   "supervisor": cluster.hosts[0].name, "run_dir": str(stub)})
    short = spec.run_id
    con = ui.err_console()
    con.print(f"[green]corral:[/] run {short} is running, detached (every rank is in user code; took "
              f"{time.time() - started:.1f}s); this terminal can close.")
    con.print(f"  corral attach {short}      # live output (Ctrl-C detaches)\n"
              f"  corral logs {short} --follow  # per-rank logs (--rank R, --node N, --sync)\n"
              f"  corral stop {short}        # stop it, as Ctrl-C would\n"
              f"  corral ps{_cluster_flag(cluster)}              # the jobs on these nodes")


def _stop_while_starting(stub: Path) -> None:
    """Ctrl-C before the job was handed over: stop it, as Ctrl-C of an attended run would."""
    d = detach.from_stub(stub)
    assert d is not None
    ui.notice(f"interrupted while run {d.run_id} was starting: stopping it on every node...")
    try:
        for ev in detach.node_events(d.cluster, d.host, "stop", d.run_id):
            if ev["ev"] == "line":
                print_line(ev["t"], out=sys.stderr)
    except (HostError, KeyboardInterrupt):
        ui.notice(f"could not be sure it stopped: `corral stop {d.run_id}`")
    detach.refresh(d)
    sys.exit(EXIT_INTERRUPTED)


def _cluster_flag(cluster) -> str:
    return f" -c {cluster.path}" if cluster.path else ""


class _quiet_errors:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, CorralError)


def print_line(text: str, *, out=None) -> None:
    """A line of a node's console or log: its text is untrusted (controls removed)."""
    (out or sys.stdout).write(terminal_safe(text) + "\n")
    (out or sys.stdout).flush()


def print_lines(lines: list[str], label: str = "", *, out=None) -> None:
    """A batch of a node's lines (a ``lines`` event), each after ``label``, in
    one write: untrusted text, cleaned as ``print_line`` cleans it, in one
    scan of the batch when (as almost always) it has nothing to clean."""
    if not lines:
        return
    text = "\n".join(lines)
    if has_control(text):  # line by line: an unended OSC string must not swallow the next lines
        text = "\n".join(terminal_safe(line) for line in lines)
    if label:
        text = label + text.replace("\n", "\n" + label)
    (out or sys.stdout).write(text + "\n")
    (out or sys.stdout).flush()


def find(run: str, cluster_opts: ClusterOptions, runs_dir: Path | None) -> detach.Detached:
    root = runs_dir or default_root(Path.cwd()).path
    given = cluster_opts.cluster is not None or cluster_opts.hosts is not None
    d = detach.find(run, root, (lambda: cluster_opts.load(notice=False)) if given else None)
    if d.stub is None:
        try:
            d = detach.adopt(root, d)
        except OSError as e:
            ui.notice(f"{root}: cannot keep a record of run {d.run_id} here ({e.strerror}); going on")
    return d


def unreachable(d: detach.Detached, err: HostError, what: str) -> CorralError:
    """Node 0 cannot be reached: named, with what that means for the job."""
    return detach.DetachError(
        f"{d.host.name}, where run {d.run_id}'s supervisor and logs are, cannot be reached: {err.message}",
        hint=(err.hint + "; " if err.hint else "") +
        f"if {d.host.name} is down, the job's other nodes stop it by themselves within about 10 s "
        f"(their agents hear no supervisor); {what}")


def end_line(ev: dict, run_id: str) -> tuple[str, int]:
    """The closing line of a job that ended, and the exit code to leave with."""
    status = str(ev.get("status") or "unknown")
    failure = ev.get("failure")
    code = ev.get("exit_code") if isinstance(ev.get("exit_code"), int) else 0
    if status in ("running", "starting", "None", "unknown"):
        said = (f"run {run_id}'s supervisor is gone without recording an end (killed): the nodes stopped the "
                "job by themselves; its logs are as far as it got")
        return said, 3
    text = f"run {run_id} {status}" + (f": {terminal_safe(str(failure))}" if failure else "")
    return text, (EXIT_INTERRUPTED if status == "interrupted" else code)
