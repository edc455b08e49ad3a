"""Past and running runs, from their run directories (``runs/<run-id>/run.json``)."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from corral.errors import UsageError
from corral.logs import RUN_FILE


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
