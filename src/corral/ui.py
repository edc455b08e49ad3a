"""Everything that prints for humans lives here and in ``corral.cli``.

The library never prints; it returns results and raises ``CorralError``.
``console()`` returns the shared rich consoles so tests can swap them for a
``StringIO`` one.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

# rich is imported on first use, not with this module: `corral exec --json`
# prints nothing through it, and every command starts faster.
if TYPE_CHECKING:
    from rich.console import Console

    from corral.errors import CorralError

_out: Console | None = None
_err: Console | None = None


def console() -> Console:
    """The stdout console (tables, reports)."""
    global _out
    if _out is None or _out.file is not sys.stdout:
        from rich.console import Console

        _out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    return _out


def err_console() -> Console:
    """The stderr console (errors, notices, progress)."""
    global _err
    if _err is None or _err.file is not sys.stderr:
        from rich.console import Console

        _err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
    return _err


def print_error(err: CorralError) -> None:
    """The one place a CorralError becomes text: message, then a HINT line.

    A message may quote a node (its fatal message, ssh's stderr, a name it
    reported): every terminal control but colours is removed here, so no
    node can set the title, write the clipboard or move the cursor through
    an error.  (rich itself drops only BEL, BS, VT, FF and CR, not ESC.)"""
    from rich.markup import escape

    from corral.frames import terminal_safe

    con = err_console()
    label = {"user": "error", "infrastructure": "error", "workload": "failed"}.get(
        err.category, "error"
    )
    con.print(f"[bold red]{label}:[/] {escape(terminal_safe(err.message))}")
    if err.hint:
        con.print(f"[yellow]HINT:[/] {escape(terminal_safe(err.hint))}")


def shown(text: str) -> str:
    """``text`` made safe for rich markup and for the terminal: what a node
    reported (a finding's message quoting a host) loses its terminal
    controls, and rich's markup characters are escaped."""
    from rich.markup import escape

    from corral.frames import terminal_safe

    return escape(terminal_safe(text))


def notice(message: str) -> None:
    """A one-line informational note on stderr (never on stdout, which scripts parse).

    Written without rich: commands print this before their real work starts
    (`corral exec` before its ssh processes), and importing rich there costs
    more than the line is worth.  A note may quote a node (a finding of
    `bench`, what rsync said): terminal controls but colours are removed."""
    from corral.frames import terminal_safe

    sys.stderr.write(f"{paint('corral:', 'dim', stream=sys.stderr)} {terminal_safe(message)}\n")
    sys.stderr.flush()


def color_enabled(stream: object) -> bool:
    """Whether to colour ``stream``: a terminal, and neither NO_COLOR nor TERM=dumb
    says otherwise (FORCE_COLOR forces it), the rules rich follows too."""
    import os

    if os.environ.get("FORCE_COLOR"):
        return True
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, *styles: str, stream: object = None) -> str:
    """``text`` in ``styles`` (``bold``, ``dim``, or a colour name) when ``stream``
    (default stdout) gets colour, else unchanged: click's ANSI styling, for the
    few fast paths (notices, `corral exec`'s output) that must not import rich."""
    if not styles or not color_enabled(sys.stdout if stream is None else stream):
        return text
    import click

    colour = next((s for s in styles if s not in ("bold", "dim")), None)
    return click.style(text, fg=colour, bold="bold" in styles or None, dim="dim" in styles or None)
