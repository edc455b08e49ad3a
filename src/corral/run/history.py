"""Past and running runs, from their run directories (``runs/<run-id>/run.json``)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from corral.errors import UsageError
from corral.run.logs import RUN_FILE


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    run_id: str
    dir: Path
    data: dict

    @property
    def status(self) -> str:
        """As recorded; "died" for a "running" run whose head process on this
        machine is gone (killed with SIGKILL: it could not write its end)."""
        status = self.data.get("status", "unknown")
        if status == "running" and _head_gone(self.data.get("head")):
            return "died"
        return status


def _head_gone(head: object) -> bool:
    if not isinstance(head, dict) or head.get("host") != socket.gethostname():
        return False  # another machine's run (a shared runs/ directory): cannot tell
    pid = head.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    for attempt in range(3):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if cmdline:
            return b"corral" not in cmdline  # the pid was reused by something else
        if _state(pid) in ("Z", "X", None):
            return True  # a zombie (or gone by now): the head has exited
        # A live process with no command line is in the middle of execve (the
        # kernel fills it in after closing the exec'ing process's CLOEXEC fds, so
        # a parent can see it this early); look again before judging.
        time.sleep(0.02 * (attempt + 1))
    return False


def _state(pid: int) -> str | None:
    """The one-letter state in /proc/PID/stat (R, S, Z...), or None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[0].decode() if fields else None


def list_runs(root: Path) -> list[RunRecord]:
    """Every run under ``root``, newest first (ids sort by start time)."""
    out = []
    if root.is_dir():
        for d in root.iterdir():
            f = d / RUN_FILE
            if f.is_file():
                try:
                    data = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                out.append(RunRecord(run_id=d.name, dir=d, data=data))
    return sorted(out, key=lambda r: r.run_id, reverse=True)


def find_run(root: Path, which: str | None) -> RunRecord:
    """A run by id, id prefix, directory, or (None) the newest running one."""
    if which and Path(which, RUN_FILE).is_file():
        d = Path(which)
        return RunRecord(run_id=d.name, dir=d, data=json.loads((d / RUN_FILE).read_text()))
    runs = list_runs(root)
    if which is None:
        running = [r for r in runs if r.status == "running"]
        if not running:
            raise UsageError(f"no running run in {root}", hint="give a run id or run directory; `corral runs` lists them")
        return running[0]
    matches = [r for r in runs if r.run_id.startswith(which)]
    if not matches:
        raise UsageError(f"no run {which!r} in {root}", hint="`corral runs` lists the runs (or pass --runs-dir)")
    if len(matches) > 1:
        raise UsageError(f"{which!r} matches {len(matches)} runs", hint="give more of the run id")
    return matches[0]


@dataclass(frozen=True, kw_only=True)
class RunsRoot:
    """Where run directories go (and are looked up) when no --runs-dir is given."""

    path: Path
    #: Set when ./runs cannot be written and the per-user directory is used
    #: instead: the one line that says so.
    note: str | None = None


def state_runs_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_STATE_HOME/corral/runs`` (``~/.local/state/corral/runs``): this
    user's own place, next to the sandbox's state."""
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base, "corral", "runs")


def default_root(cwd: Path, environ: Mapping[str, str] = os.environ) -> RunsRoot:
    """``$CORRAL_RUNS_DIR``, else ``./runs`` where it can be written, else the
    per-user state directory, with a note naming both and how to choose.

    ``corral run`` in a directory it cannot write (a read-only checkout,
    another user's project) ended in a PermissionError traceback; ``runs``,
    ``stacks`` and ``diagnose`` take the same rule, so they look where the
    run wrote."""
    env = environ.get("CORRAL_RUNS_DIR")
    if env:
        return RunsRoot(path=Path(env))
    here = cwd / "runs"
    why = unwritable(here)
    if why is None:
        return RunsRoot(path=here)
    fallback = state_runs_dir(environ)
    return RunsRoot(path=fallback, note=f"{here.absolute()} cannot be written ({why}): run directories are in "
                                        f"{fallback} (--runs-dir DIR or $CORRAL_RUNS_DIR to choose another)")


def unwritable(path: Path) -> str | None:
    """Why run directories cannot be made under ``path``, or None when they can:
    judged on ``path`` or, where it does not exist yet, the directory that
    would hold it (nothing is created here: a run refused before it starts
    leaves no empty ``runs/`` behind)."""
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if os.access(probe, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    return f"permission denied on {probe}" if probe != path else "permission denied"
