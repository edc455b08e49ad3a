"""The run directory: every rank's full output and the record of the run.

Layout (documented in docs/run.md; ``corral diagnose RUN_DIR`` reads it)::

    runs/<run-id>/
      run.json                  what ran where, how it ended, the first failure
      <host>/rank<N>.log        everything global rank N wrote (stdout + stderr)
      <host>/launcher.log       the node's launcher's own output (torchrun's...)

Progress-bar redraws are kept as written (terminated by ``\\r``) so the log is
the full text; the console shows them as one live status line instead.
Files are opened on first use and flushed as lines arrive, so a run that is
killed still leaves complete logs up to that point.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

RUN_FILE = "run.json"


def _safe(name: str) -> str:
    """A host name as a directory name (no path separators, no dots only)."""
    cleaned = "".join(c if c.isalnum() or c in "-_.@" else "_" for c in name)
    return cleaned.strip(".") or "_"


class RunLogs:
    """Writes one run's directory."""

    def __init__(self, root: Path, run_id: str):
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=False)
        self._files: dict[tuple[str, int | None], IO[str]] = {}
        self._last_flush = 0.0

    def path_for(self, host: str, rank: int | None) -> Path:
        name = "launcher.log" if rank is None else f"rank{rank}.log"
        return self.dir / _safe(host) / name

    def _file(self, host: str, rank: int | None) -> IO[str]:
        key = (host, rank)
        f = self._files.get(key)
        if f is None:
            path = self.path_for(host, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "a", encoding="utf-8", errors="replace")
            self._files[key] = f
        return f

    def line(self, host: str, rank: int | None, text: str) -> None:
        self._file(host, rank).write(text + "\n")
        self._maybe_flush()

    def status(self, host: str, rank: int | None, text: str) -> None:
        self._file(host, rank).write(text + "\r")
        self._maybe_flush()

    def marker(self, text: str) -> None:
        """A line in every open log (e.g. the start of a restart attempt)."""
        for f in self._files.values():
            f.write(f"----- corral: {text} -----\n")
        self.flush()

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._last_flush > 0.5:
            self.flush()

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()
        self._last_flush = time.monotonic()

    def write_record(self, record: dict[str, Any]) -> None:
        """run.json, written atomically (never a half-written file)."""
        tmp = self.dir / (RUN_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
        os.replace(tmp, self.dir / RUN_FILE)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def default_runs_dir(cwd: Path) -> Path:
    """``$CORRAL_RUNS_DIR`` or ``./runs``."""
    env = os.environ.get("CORRAL_RUNS_DIR")
    return Path(env) if env else cwd / "runs"
