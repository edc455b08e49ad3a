"""The Python exception a rank's log ends with: its last traceback.

A plain exception in user code (``KeyError: 'batch_size'``) is no failure
signature, and corral does not guess a cause for it; but in a run directory
it is the first thing to show when the rank that failed first raised it: the
other ranks' errors ("connection closed by peer") are only its echo.

Only the last traceback is kept (a chained exception's last part is the one
that ended the process), read from the log's tail, so a huge log costs one
pass of substring checks and bounded memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from corral.diagnose.logtext import MAX_LINE, LogLine, open_log, parse
from corral.diagnose.prefilter import blocks

_HEADER = "Traceback (most recent call last)"
_FRAME = re.compile(r'^File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+?))?\s*$')
# "KeyError: 'x'", "torch.distributed.DistBackendError: ...", "KeyboardInterrupt"
_EXC = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::\s?(?P<message>.*))?$")
#: Lines kept after the last traceback header: the exception line is near its start.
_MAX_TB_LINES = 2000
#: Frames kept of one traceback (the innermost ones).
_MAX_FRAMES = 64
# Library code: installed packages, the standard library, frozen and generated modules.
_LIBRARY = re.compile(
    r"[/\\](?:site|dist)-packages[/\\]|[/\\]lib[/\\]python\d+(?:\.\d+)?[/\\]|[/\\]Lib[/\\]|^<"
)


def is_library(path: str) -> bool:
    """A file of an installed package, the standard library, or generated code."""
    return bool(_LIBRARY.search(path))


def basename(path: str) -> str:
    return re.split(r"[/\\]", path)[-1]


@dataclass(frozen=True, kw_only=True)
class Frame:
    file: str
    line: int
    func: str | None = None

    @property
    def short(self) -> str:
        """``crash_rank3.py:9``: the file's name and the line."""
        return f"{basename(self.file)}:{self.line}"

    @property
    def is_user(self) -> bool:
        return not is_library(self.file)


@dataclass(frozen=True, kw_only=True)
class PyException:
    """The last Python exception in a log."""

    #: The exception line as printed: ``KeyError: 'batch_size'``.
    text: str
    type: str
    message: str
    #: Line number of the exception line in the log.
    line: int
    #: Frames, outermost first (the innermost ones when there were many).
    frames: tuple[Frame, ...]
    #: The traceback as printed (prefixes kept), from its header to the exception line.
    shown: tuple[str, ...] = ()

    @property
    def user_frame(self) -> Frame | None:
        """The innermost frame in the program's own code (else the innermost frame)."""
        for fr in reversed(self.frames):
            if fr.is_user:
                return fr
        return self.frames[-1] if self.frames else None


def _indent(ln: LogLine) -> int:
    """Whitespace between a line's launcher prefix and its message.

    ``LogLine.text`` is stripped; tracebacks are structured by indentation
    (frames two spaces in from the header, the exception line level with it),
    which is still in ``shown`` right before the text."""
    shown = ln.shown
    if not ln.text or not shown.endswith(ln.text):
        return 0
    before = shown[: len(shown) - len(ln.text)]
    return len(before) - len(before.rstrip())


def parse_traceback(lines: Iterable[LogLine]) -> PyException | None:
    """The last complete traceback in ``lines`` (exception line found), else None."""
    found: PyException | None = None
    base: int | None = None  # indentation of the current traceback's header
    frames: list[Frame] = []
    shown: list[str] = []
    for ln in lines:
        text = ln.text
        if text.startswith(_HEADER) or text.endswith(_HEADER + ":"):
            # also after a partial line: print("loading ...", end="") then a crash
            base, frames, shown = _indent(ln), [], [ln.shown]
            continue
        if base is None or not text:
            continue
        indent = _indent(ln)
        if indent > base:
            m = _FRAME.match(text)
            if m:
                frames.append(Frame(file=m["file"], line=int(m["line"]), func=m["func"]))
                del frames[:-_MAX_FRAMES]
            if len(shown) < 200:
                shown.append(ln.shown)
            continue
        m = _EXC.match(text)
        if m and frames:
            found = PyException(
                text=text, type=m["type"], message=(m["message"] or "").strip(), line=ln.number,
                frames=tuple(frames), shown=(*shown, ln.shown),
            )
        base = None
    return found


def last_exception(path: str | Path) -> PyException | None:
    """The last Python exception a log file shows (its last traceback), if any.

    The file is read in large blocks and only searched (``str.rfind``, in C)
    for the last traceback header: lines are split only from there on, so a
    multi-gigabyte log costs a pass at memory speed, not a Python loop per line.
    """
    tail: list[tuple[int, str]] = []
    with open_log(path) as stream:
        for number, text in blocks(stream, MAX_LINE):
            at = text.rfind(_HEADER)
            if at >= 0:
                start = text.rfind("\n", 0, at) + 1
                number += text.count("\n", 0, start)
                tail = []
                text = text[start:]
            elif not tail or len(tail) >= _MAX_TB_LINES:
                continue
            lines = text.split("\n")
            if lines and lines[-1] == "":
                lines.pop()
            room = _MAX_TB_LINES - len(tail)
            tail += [(number + i, raw[:MAX_LINE]) for i, raw in enumerate(lines[:room])]
    return parse_traceback(ln for number, raw in tail for ln in parse(raw, number))
