"""The Python exception a rank's log ends with: its last traceback.

A plain exception in user code (``KeyError: 'batch_size'``) is no failure
signature, and corral does not guess a cause for it; but in a run directory
it is the first thing to show when the rank that failed first raised it: the
other ranks' errors ("connection closed by peer") are only its echo.

Only the last traceback counts (a chained exception's last part is the one
that ended the process), read from the log's tail, so a huge log costs one
pass of substring checks and bounded memory.  A launcher's own traceback at
the end (torchrun's ``ChildFailedError``, accelerate's ``CalledProcessError``)
is not the program's: the rank's exception before it is (the one torchrun's
"Root Cause" block names, when ranks are prefixed), and without one that
block's rank, host and exit code are the facts to show.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
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
#: Tracebacks kept from the log's end: the ranks' come before their launcher's
#: (the one that failed first, then every other rank's echo of it).
_KEPT_TRACEBACKS = 64
#: Lines kept of a traceback that another one followed (its exception line is
#: near its start; only the last one needs the lines after it: the summary).
_MAX_EARLIER_LINES = 300
#: Files of launchers whose CalledProcessError only relays a child's exit.
_LAUNCHER_FILE = re.compile(r"accelerate[/\\]commands[/\\]|deepspeed[/\\]launcher[/\\]|torch[/\\]distributed[/\\]")
# torchrun's summary: "Root Cause (first observed failure):" then "host : n1", "rank : 3 (local_rank: 1)", "exitcode : -9 (pid: 12)"
_SUMMARY_FIELD = re.compile(r"^(host|rank|exitcode)\s*:\s*(\S+)(?:\s*\(local_rank:\s*(\d+)\))?")
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
    #: The rank its lines were prefixed with (``[rank3]:``), if any, and the
    #: local rank (torchrun's ``--tee``: ``[default3]:``).
    rank: int | None = None
    local_rank: int | None = None
    #: The launcher's exception that followed it (``...ChildFailedError:``), when
    #: this one is the rank's exception found before the launcher's.
    launcher: str = ""
    #: What the launcher's summary says of the first failure (``host``,
    #: ``rank``, ``exitcode``: torchrun's "Root Cause" block), if it has one.
    summary: tuple[tuple[str, str], ...] = ()

    @property
    def is_launcher(self) -> bool:
        """torchrun's ChildFailedError or a launcher's CalledProcessError: a
        child's exit relayed, not the program's own exception."""
        kind = self.type.rsplit(".", 1)[-1]
        if kind == "ChildFailedError":
            return True
        return kind == "CalledProcessError" and any(_LAUNCHER_FILE.search(f.file) for f in self.frames)

    @property
    def failed_first(self) -> bool:
        """A rank's exception that the launcher's summary names as the first failure."""
        return bool(self.launcher) and _named_by(self, self.summary)

    @property
    def summary_rank(self) -> int | None:
        """The global rank the launcher's summary names."""
        rank = dict(self.summary).get("rank", "")
        return int(rank) if rank.isdigit() else None

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
                frames=tuple(frames), shown=(*shown, ln.shown), rank=ln.rank, local_rank=ln.local_rank,
            )
        base = None
    return found


def last_exception(path: str | Path) -> PyException | None:
    """The last Python exception a log file shows (its last traceback), if any;
    for a launcher's exception, the rank's before it (see the module docstring).

    The file is read in large blocks and only searched (``str.find``, in C)
    for traceback headers: lines are split only from a header on, so a
    multi-gigabyte log costs a pass at memory speed, not a Python loop per line.
    """
    found = []
    for tail in _tails(path):
        exc = parse_traceback(ln for number, raw in tail for ln in parse(raw, number))
        if exc is not None:
            found.append((exc, tail))
    if not found:
        return None
    last, tail = found[-1]
    if not last.is_launcher:
        return last
    summary = _summary(tail, last.line)
    ranks = [e for e, _ in found[:-1] if not e.is_launcher]
    named = [e for e in ranks if _named_by(e, summary)]
    if named or ranks:
        return replace((named or ranks)[-1], launcher=last.text, summary=summary)
    return replace(last, summary=summary)


def _named_by(exc: PyException, summary: tuple[tuple[str, str], ...]) -> bool:
    """Whether torchrun's summary names the rank of ``exc`` as the first failure
    (by its rank, or by its local rank where lines carry only that)."""
    got = dict(summary)
    if not got.get("rank", "").isdigit():
        return False
    if exc.rank is not None:
        return got["rank"] == str(exc.rank)
    return exc.local_rank is not None and got.get("local_rank") == str(exc.local_rank)


def _tails(path: str | Path) -> list[list[tuple[int, str]]]:
    """The lines from each of the log's last tracebacks on (at most
    ``_MAX_TB_LINES`` each), oldest first."""
    tails: deque[list[tuple[int, str]]] = deque(maxlen=_KEPT_TRACEBACKS)

    def add(tail: list[tuple[int, str]], number: int, text: str) -> None:
        room = _MAX_TB_LINES - len(tail)
        if room <= 0 or not text:
            return
        lines = text.split("\n", room)[:room]
        if lines and lines[-1] == "":
            lines.pop()
        tail += [(number + i, raw[:MAX_LINE]) for i, raw in enumerate(lines)]

    with open_log(path) as stream:
        for number, text in blocks(stream, MAX_LINE):
            starts: list[int] = []
            at = text.find(_HEADER)
            while at >= 0:
                start = text.rfind("\n", 0, at) + 1
                if not starts or start != starts[-1]:
                    starts.append(start)
                at = text.find(_HEADER, at + len(_HEADER))
            if tails:
                add(tails[-1], number, text[: starts[0]] if starts else text)
            counted = 0
            for a, b in zip(starts, [*starts[1:], len(text)]):
                number += text.count("\n", counted, a)
                counted = a
                if tails:
                    del tails[-1][_MAX_EARLIER_LINES:]
                tails.append([])
                add(tails[-1], number, text[a:b])
    return list(tails)


def _summary(tail: list[tuple[int, str]], after: int) -> tuple[tuple[str, str], ...]:
    """``host``, ``rank`` and ``exitcode`` of torchrun's "Root Cause" block."""
    fields: dict[str, str] = {}
    seen = False
    for number, raw in tail:
        if number <= after:
            continue
        for ln in parse(raw, number):
            if "Root Cause (first observed failure)" in ln.text:
                seen = True
            elif seen:
                m = _SUMMARY_FIELD.match(ln.text)
                if m:
                    fields.setdefault(m[1], m[2])
                    if m[3]:
                        fields.setdefault("local_rank", m[3])
        if seen and ("=" * 20 in raw or len(fields) >= 4):
            break
    return tuple(fields.items()) if seen else ()
