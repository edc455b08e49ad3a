"""The run directory: every rank's full output and the record of the run.

Layout (documented in docs/run.md; ``corral diagnose RUN_DIR`` reads it)::

    runs/<run-id>/
      run.json                  what ran where, how it ended, the first failure
      <host>/rank<N>.log        everything global rank N wrote (stdout + stderr)
      <host>/launcher.log       the node's launcher's own output (torchrun's...), if any

Progress-bar redraws are kept as written (terminated by ``\\r``) so the log is
the full text; the console shows them as one live status line instead.
Files are opened on first use and flushed as lines arrive, so a run that is
killed still leaves complete logs up to that point.  The run directory is
0700 and its files 0600, whatever the umask: a log holds whatever a rank
printed, tokens included.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

RUN_FILE = "run.json"


def _safe(name: str) -> str:
    """A host name as a directory name (no path separators, no dots only)."""
    cleaned = "".join(c if c.isalnum() or c in "-_.@" else "_" for c in name)
    return cleaned.strip(".") or "_"


class RunLogs:
    """Writes one run's directory."""

    def __init__(self, root: Path, run_id: str, on_error: Callable[[str], None] | None = None):
        self.dir = Path(root) / run_id
        Path(root).mkdir(parents=True, exist_ok=True)
        # 0700 and 0600 whatever the umask: logs hold whatever a rank printed
        # (tokens, paths, data), not for the other users of the machine.
        self.dir.mkdir(mode=0o700)
        os.chmod(self.dir, 0o700)
        self._files: dict[tuple[str, int | None], IO[str]] = {}
        self._last_flush = 0.0
        #: Why the logs stopped being written (a full disk), once that happened.
        self.error: str | None = None
        self._on_error = on_error

    def _failed(self, err: OSError) -> None:
        """The disk under the run directory failed (full, read-only, gone):
        the logs stop, said once; the job is not the logs' to stop, and an
        exception here would end the reading of a node's events (which then
        looks like a lost node)."""
        if self.error is not None:
            return
        self.error = f"cannot write the run's logs in {self.dir}: {err.strerror or err}"
        for f in self._files.values():
            try:
                f.close()
            except OSError:
                pass
        self._files.clear()
        if self._on_error is not None:
            self._on_error(self.error)

    def path_for(self, host: str, rank: int | None) -> Path:
        if rank is not None and type(rank) is not int:
            # Ranks come checked from the head's reader (corral.frames); a
            # file name is never made of anything else a node sent.
            raise TypeError(f"a rank is an int, not {type(rank).__name__}")
        name = "launcher.log" if rank is None else f"rank{rank}.log"
        return self.dir / _safe(host) / name

    def _file(self, host: str, rank: int | None) -> IO[str]:
        key = (host, rank)
        f = self._files.get(key)
        if f is None:
            path = self.path_for(host, rank)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            f = open(fd, "a", encoding="utf-8", errors="replace")
            self._files[key] = f
        return f

    def line(self, host: str, rank: int | None, text: str) -> None:
        self._write(host, rank, text + "\n")

    def lines(self, host: str, rank: int | None, texts: list[str]) -> None:
        """A batch of one rank's lines, in one write."""
        if texts:
            self._write(host, rank, "\n".join(texts) + "\n")

    def status(self, host: str, rank: int | None, text: str) -> None:
        self._write(host, rank, text + "\r")

    def _write(self, host: str, rank: int | None, text: str) -> None:
        if self.error is not None:
            return
        try:
            self._file(host, rank).write(text)
            self._maybe_flush()
        except OSError as e:
            self._failed(e)

    def marker(self, text: str) -> None:
        """A line in every open log (e.g. the start of a restart attempt)."""
        if self.error is not None:
            return
        try:
            for f in self._files.values():
                f.write(f"----- corral: {text} -----\n")
        except OSError as e:
            self._failed(e)
        self.flush()

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._last_flush > 0.5:
            self.flush()

    def flush(self) -> None:
        try:
            for f in self._files.values():
                f.flush()
        except OSError as e:
            self._failed(e)
        self._last_flush = time.monotonic()

    def write_record(self, record: dict[str, Any]) -> None:
        """run.json, written atomically (never a half-written file)."""
        tmp = self.dir / (RUN_FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
            os.chmod(tmp, 0o600)  # in the 0700 run directory: never readable by others meanwhile
            os.replace(tmp, self.dir / RUN_FILE)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            self._failed(e)

    def close(self) -> None:
        for f in list(self._files.values()):
            try:
                f.close()
            except OSError as e:
                self._failed(e)
        self._files.clear()


def default_runs_dir(cwd: Path) -> Path:
    """``$CORRAL_RUNS_DIR`` or ``./runs``."""
    env = os.environ.get("CORRAL_RUNS_DIR")
    return Path(env) if env else cwd / "runs"
