"""The live console of a run: rank-prefixed lines and per-rank status lines.

Every output line is written with one ``write`` call, prefix included, so
two ranks' text never share a line.  Carriage-return redraws (tqdm) of the
selected ranks become a status footer that is redrawn in place on a
terminal; when stdout is not a terminal (CI, ``| tee``), a rank's status is
printed as a plain line at most every ``PLAIN_STATUS_EVERY_S`` seconds, so
logs stay readable instead of flooded.

Writing to a real stdout (a terminal, a pipe, a file) happens in a thread
of its own (``ConsoleWriter``): a terminal slower than the job, a frozen
one (Ctrl-S) or ``| less`` left unscrolled never stalls the run loop, which
must keep reading every node, pinging the agents (an agent that hears
nothing from the head for 10 s stops its job) and watching for lost nodes.
What is queued for the terminal is bounded (``BACKLOG_BYTES``): past it,
ranks' lines are counted instead of queued, and once the terminal has caught
up a marker says how many were not shown, followed by the last lines each
rank wrote meanwhile.  Every line is still in the run directory's rank logs:
only the terminal's copy is thinned.  corral's own lines are never dropped.

This is UI: it prints.  The library hands it lines through the ``Sink``
interface of ``corral.run.watch``.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections import deque
from typing import TextIO

from corral import ui
from corral.frames import has_control, terminal_safe

_COLORS = ["36", "32", "35", "33", "34", "96", "92", "95", "93", "94"]
PLAIN_STATUS_EVERY_S = 15.0
REDRAW_EVERY_S = 0.1
#: Text queued for the terminal past which ranks' lines are no longer shown
#: (they are counted); shown again once the queue is below a quarter of it.
BACKLOG_BYTES = 4 * 1024 * 1024
#: Lines kept per rank while lines are not shown, printed after the marker.
TAIL_LINES = 3
#: Ranks whose tail is kept (a bound on memory, whatever the nodes send).
TAIL_RANKS = 4096
#: Longest tail line kept (a rank's last lines, not its megabyte lines).
TAIL_CHARS = 2000


class ConsoleWriter:
    """Writes text to ``out`` from a thread of its own, in as few ``write``
    calls as the terminal allows (all that is queued, joined): the run loop
    queues and goes on.  ``backlog`` is what is queued and not yet written;
    the console bounds it.  A closed pipe (``| head``) ends the writing, not
    the job."""

    def __init__(self, out: TextIO):
        self.out = out
        self._pending: list[str] = []
        self._bytes = 0
        self._cv = threading.Condition()
        self._closing = False
        self.broken = False
        self._thread = threading.Thread(target=self._loop, name="corral-console", daemon=True)
        self._thread.start()

    @property
    def backlog(self) -> int:
        return self._bytes

    def put(self, text: str) -> None:
        if not text:
            return
        with self._cv:
            self._pending.append(text)
            self._bytes += len(text)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                if not self._pending:
                    return
                chunk = "".join(self._pending)
                self._pending.clear()
            if not self.broken:
                try:
                    self.out.write(chunk)
                    self.out.flush()
                except (OSError, ValueError):  # the reader went away (| head), or out was closed
                    self.broken = True
            with self._cv:
                self._bytes -= len(chunk)

    def close(self) -> None:
        """Write what is queued, then end the thread (waits for the terminal)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()


def _has_fd(out: TextIO) -> bool:
    """A real file (terminal, pipe, file) can block; an in-memory one cannot."""
    try:
        out.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def parse_ranks(spec: str) -> set[int] | None:
    """``"0"``, ``"0,3"``, ``"0-3,8"`` or ``"all"`` (None) for --ranks."""
    spec = spec.strip()
    if spec in ("all", "*"):
        return None
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a rank or a range like 0-3")
        if sep and int(hi) < int(lo):
            raise ValueError(f"{part!r} is an empty range (write the lower rank first)")
        out.update(range(int(lo), int(hi) + 1) if sep else {int(lo)})
    return out


class RunConsole:
    """Prints a run's output; implements ``corral.run.watch.Sink``."""

    def __init__(
        self,
        *,
        multi_host: bool,
        status_ranks: set[int] | None = frozenset({0}),  # type: ignore[assignment]
        out: TextIO | None = None,
        color: bool | None = None,
    ):
        self.out = out or sys.stdout
        self.multi_host = multi_host
        self.status_ranks = status_ranks
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.color = ui.color_enabled(self.out) if color is None else color
        self._host_color: dict[str, str] = {}
        self._footer: dict[tuple[str, int | None], str] = {}
        self._footer_lines = 0
        self._last_draw = 0.0
        self._last_plain: dict[tuple[str, int | None], float] = {}
        self._launcher_muted = False
        self._writer = ConsoleWriter(self.out) if _has_fd(self.out) else None
        #: Ranks' lines not shown since the terminal fell behind, and each rank's last ones.
        self._hidden = 0
        self._tails: dict[tuple[str, int | None], deque[str]] = {}
        #: Where every line is kept, for the marker (``corral logs RUN``, a directory).
        self.logs_hint = "the run directory's rank logs"

    # -- prefixes ----------------------------------------------------------

    def prefix(self, host: str, rank: int | None) -> str:
        if rank is None:
            label = f"[{host}]"
        elif self.multi_host:
            label = f"[{host}/r{rank}]"
        else:
            label = f"[r{rank}]"
        if not self.color:
            return label + " "
        code = self._host_color.setdefault(host, _COLORS[len(self._host_color) % len(_COLORS)])
        dim = "2;" if rank is None else ""
        return f"\x1b[{dim}{code}m{label}\x1b[0m "

    # -- Sink --------------------------------------------------------------

    def line(self, host: str, rank: int | None, stream: str, text: str) -> None:
        if rank is None and self._launcher_muted:
            return  # launchers narrating the teardown corral started: in launcher.log only
        self._footer.pop((host, rank), None)  # a finished line replaces a bar
        if self._behind():
            self._hide(host, rank, text)
            return
        self._write(self.prefix(host, rank) + terminal_safe(text) + "\n")

    def line_batch(self, host: str, rank: int | None, stream: str, texts: list[str]) -> None:
        """A batch of one rank's lines (``line`` for each, in one write)."""
        if not texts or (rank is None and self._launcher_muted):
            return
        self._footer.pop((host, rank), None)
        if self._behind():
            for text in texts[-TAIL_LINES:]:
                self._hide(host, rank, text)
            self._hidden += max(0, len(texts) - TAIL_LINES)
            return
        prefix = self.prefix(host, rank)
        if not has_control("".join(texts)):  # nearly always: nothing to clean
            self._write(prefix + ("\n" + prefix).join(texts) + "\n")
        else:
            self._write("".join(prefix + terminal_safe(t) + "\n" for t in texts))

    def status(self, host: str, rank: int | None, text: str) -> None:
        if rank is None or (self.status_ranks is not None and rank not in self.status_ranks):
            return
        if self._behind():
            return  # a bar's latest state is drawn again once the terminal has caught up
        text = terminal_safe(text)
        key = (host, rank)
        if self.tty:
            self._footer[key] = text
            now = time.monotonic()
            if now - self._last_draw >= REDRAW_EVERY_S:
                self._write("")
        else:
            now = time.monotonic()
            if now - self._last_plain.get(key, -PLAIN_STATUS_EVERY_S) >= PLAIN_STATUS_EVERY_S:
                self._last_plain[key] = now
                self._write(self.prefix(host, rank) + text.strip() + "\n")

    def message(self, text: str) -> None:
        """A corral line among the output (restarts, teardown)."""
        label = "\x1b[1mcorral:\x1b[0m " if self.color else "corral: "
        self._write(label + terminal_safe(text) + "\n")  # may quote a node (the names of its processes)

    def stopping(self) -> None:
        """corral is tearing the job down: launchers' own shutdown chatter goes to the logs only."""
        self._launcher_muted = True

    # -- a terminal slower than the job ---------------------------------------

    def _behind(self) -> bool:
        """Whether ranks' lines are not shown now; when the terminal has
        caught up after such a stretch, the marker and tails are written first."""
        if self._writer is None:
            return False
        backlog = self._writer.backlog
        if self._hidden:
            if backlog > BACKLOG_BYTES // 4:
                return True
            self._show_hidden()
            return False
        return backlog > BACKLOG_BYTES

    def _hide(self, host: str, rank: int | None, text: str) -> None:
        self._hidden += 1
        key = (host, rank)
        tail = self._tails.get(key)
        if tail is None:
            if len(self._tails) >= TAIL_RANKS:
                return
            tail = self._tails[key] = deque(maxlen=TAIL_LINES)
        tail.append(text[:TAIL_CHARS])

    def _show_hidden(self) -> None:
        hidden, tails = self._hidden, self._tails
        self._hidden, self._tails = 0, {}
        self.message(f"{hidden:,} line(s) of the ranks not shown here: the terminal was slower than the job "
                     f"(every line is in {self.logs_hint}); the last of each since:")
        for (host, rank), lines in sorted(tails.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])):
            for text in lines:
                self._write(self.prefix(host, rank) + terminal_safe(text) + "\n")

    # -- footer ------------------------------------------------------------

    def _write(self, text: str) -> None:
        if not self.tty:
            self._out(text)
            return
        width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
        parts = []
        if self._footer_lines:
            parts.append(f"\x1b[{self._footer_lines}F\x1b[J")
        parts.append(text)
        lines = [self.prefix(h, r) + t.strip()[: max(10, width - 12)] for (h, r), t in self._footer.items()]
        for line in lines:
            parts.append(line + "\n")
        self._footer_lines = len(lines)
        self._out("".join(parts))
        self._last_draw = time.monotonic()

    def _out(self, text: str) -> None:
        if self._writer is not None:
            self._writer.put(text)
        else:
            self.out.write(text)
            self.out.flush()

    def close(self) -> None:
        """Say what was not shown, remove the footer (finished bars were
        already printed as lines), and wait until the terminal has it all."""
        if self._hidden:
            self._show_hidden()
        if self.tty and self._footer_lines:
            self._out(f"\x1b[{self._footer_lines}F\x1b[J")
        self._footer.clear()
        self._footer_lines = 0
        if self._writer is not None:
            self._writer.close()
