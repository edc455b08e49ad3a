"""The live console of a run: rank-prefixed lines and per-rank status lines.

Every output line is written with one ``write`` call, prefix included, so
two ranks' text never share a line.  Carriage-return redraws (tqdm) of the
selected ranks become a status footer that is redrawn in place on a
terminal; when stdout is not a terminal (CI, ``| tee``), a rank's status is
printed as a plain line at most every ``PLAIN_STATUS_EVERY_S`` seconds, so
logs stay readable instead of flooded.

This is UI: it prints.  The library hands it lines through the ``Sink``
interface of ``corral.run.watch``.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

from corral import ui
from corral.frames import terminal_safe

_COLORS = ["36", "32", "35", "33", "34", "96", "92", "95", "93", "94"]
PLAIN_STATUS_EVERY_S = 15.0
REDRAW_EVERY_S = 0.1


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
        self._write(self.prefix(host, rank) + terminal_safe(text) + "\n")

    def status(self, host: str, rank: int | None, text: str) -> None:
        if rank is None or (self.status_ranks is not None and rank not in self.status_ranks):
            return
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

    # -- footer ------------------------------------------------------------

    def _write(self, text: str) -> None:
        if not self.tty:
            self.out.write(text)
            self.out.flush()
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
        self.out.write("".join(parts))
        self.out.flush()
        self._last_draw = time.monotonic()

    def close(self) -> None:
        """Remove the footer (finished bars were already printed as lines)."""
        if self.tty and self._footer_lines:
            self.out.write(f"\x1b[{self._footer_lines}F\x1b[J")
            self.out.flush()
        self._footer.clear()
        self._footer_lines = 0
