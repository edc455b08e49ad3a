"""A fast first pass: skip the lines no rule can match.

A training log is mostly loss lines; a real error line is rare.  Running
~400 regexes on every line costs hundreds of microseconds per line, so a
multi-gigabyte log would take hours.  Nearly every pattern contains a
literal that any match must include ("ncclSystemError", "Duplicate GPU"),
and only lines that contain one get the rules (and of the rules, only those
whose literals the line holds: :class:`LiteralIndex`).

Finding the lines that hold any of ~450 literals is a multi-string search:
``grep -E`` with their alternation does it with a DFA at hundreds of MB/s,
while one ``str.find`` per literal per block is ~5 MB/s and a regex
alternating them is slower still.  So a log file is searched by the system
``grep -E`` (:func:`grep_scan`), and Python reads only the lines it prints;
text that is not a plain UTF-8 file (standard input, a UTF-16 log, no grep)
takes the pure-Python block scan (:func:`scan`).

Literals are read from the parsed regex (Python's own parser), so they are
exact; a pattern that yields none (only character classes, a case-insensitive
flag, an unparsable construct) is simply checked on every line.  Of several
literals a match must contain, the most selective is kept, never a word that
every training line prints ("loss", "step") when another will do.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

from corral.diagnose.logtext import strip_ansi

try:  # Python 3.11+
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

#: Shorter literals would pass too many ordinary lines to be worth it.
MIN_LITERAL = 4
#: A literal this short is still usable when it is not an everyday word of training output.
MIN_RARE_LITERAL = 3
#: Characters read at a time when scanning a file.
CHUNK = 1 << 20
#: Words (any case) that ordinary training lines print: never the literal a line is picked by
#: when the pattern offers another one (a "loss: nan" pattern is picked by "nan", not "loss").
_EVERYDAY = frozenset({
    "loss", "step", "steps", "epoch", "iter", "train", "training", "lr", "grad", "rank", "batch",
    "info", "warning", "time", "eval", "valid", "samples", "tokens", "model", "data",
})


def _name(op: object) -> str:
    return getattr(op, "name", str(op))


def _everyday(lits: list[str]) -> bool:
    return any(s.strip().lower() in _EVERYDAY for s in lits)


def _best(options: list[list[str]]) -> list[str] | None:
    """Of several requirements (each: any one of these literals), the most selective."""
    usable = [o for o in options if o and min(len(s) for s in o) >= MIN_LITERAL]
    rare = [o for o in options if o and min(len(s) for s in o) >= MIN_RARE_LITERAL and not _everyday(o)]
    if usable and all(_everyday(o) for o in usable) and rare:
        usable = rare
    if not usable:
        return None
    return max(usable, key=lambda o: (not _everyday(o), min(len(s) for s in o), -len(o)))


def _required(items: Iterable[tuple[object, object]]) -> list[str] | None:
    """Literals of which every match of the sequence ``items`` contains one."""
    options: list[list[str]] = []
    run: list[str] = []

    def close() -> None:
        if run:
            options.append(["".join(run)])
            run.clear()

    for op, av in items:
        name = _name(op)
        if name == "LITERAL":
            run.append(chr(av))  # type: ignore[arg-type]
            continue
        close()
        if name == "SUBPATTERN":
            _group, add_flags, del_flags, sub = av  # type: ignore[misc]
            if not add_flags and not del_flags:
                options.append(_required(sub) or [])
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, _high, sub = av  # type: ignore[misc]
            if low >= 1:
                options.append(_required(sub) or [])
        elif name == "BRANCH":
            _none, branches = av  # type: ignore[misc]
            alternatives: list[str] = []
            for branch in branches:
                req = _required(branch)
                if req is None:
                    alternatives = []
                    break
                alternatives += req
            options.append(alternatives)
        elif name == "ATOMIC_GROUP":
            options.append(_required(av) or [])  # type: ignore[arg-type]
    close()
    return _best(options)


def literals(rx: re.Pattern[str]) -> list[str] | None:
    """Literals one of which every match of ``rx`` contains, or None if unknown."""
    found = _literals(rx)
    return None if found is None else list(found)


@functools.lru_cache(maxsize=8192)
def _literals(rx: re.Pattern[str]) -> tuple[str, ...] | None:
    """Cached: a run directory makes one matcher per log file, all with the same rules."""
    if rx.flags & re.IGNORECASE:
        return None
    try:
        found = _required(_sre_parse.parse(rx.pattern, rx.flags))
    except Exception:  # noqa: BLE001 - a construct the walker does not know: no shortcut
        return None
    return None if found is None else tuple(found)


def literal_set(patterns: Iterable[re.Pattern[str]]) -> list[str] | None:
    """Every pattern's literals, longest first; None if some pattern has none."""
    found: set[str] = set()
    for rx in patterns:
        lits = literals(rx)
        if lits is None:
            return None
        found.update(lits)
    return sorted(found, key=len, reverse=True)


def line_filter(lits: Iterable[str]) -> re.Pattern[str] | None:
    """One regex that finds any of ``lits`` in a single line (live feeding)."""
    lits = list(lits)
    return re.compile("|".join(re.escape(s) for s in lits)) if lits else None


class LiteralIndex:
    """Which rules a line can concern, from the literals it holds.

    A line holding "NCCL WARN" can only match the rules one of whose regexes
    needs that literal; running every rule's regexes on it (~400 searches)
    would cost ~10x more than the substring checks that rule them out.
    """

    def __init__(self, groups: Sequence[list[str] | None]) -> None:
        #: Rules with a regex that has no literal: they see every line.
        self.always = tuple(i for i, g in enumerate(groups) if g is None)
        by_literal: dict[str, list[int]] = {}
        for i, group in enumerate(groups):
            for lit in group or ():
                by_literal.setdefault(lit, []).append(i)
        self._table = tuple((lit, tuple(ids)) for lit, ids in by_literal.items())
        #: Literals one of which a line must hold to concern any rule; None: every line may.
        self.literals = None if self.always else sorted(by_literal, key=len, reverse=True)

    def candidates(self, text: str) -> list[int]:
        """Indexes of the rules that ``text`` may match, in rule order."""
        hit = set(self.always)
        for lit, ids in self._table:
            if lit in text:
                hit.update(ids)
        return sorted(hit)


def blocks(stream: IO[str], max_line: int) -> Iterator[tuple[int, str]]:
    """(number of its first line, text) of large blocks of whole lines, ANSI removed.

    str methods over a megabyte run in C at memory speed, so a caller that
    searches a block instead of each line costs almost nothing per ordinary
    line; line numbers stay exact (newlines are counted per block).  A runaway
    line without newlines keeps only its first ``max_line`` characters.
    """
    number = 1  # number of the first line of the next block
    carry = ""
    skipping = False
    while True:
        block = stream.read(CHUNK)
        if skipping and block:
            nl = block.find("\n")
            if nl < 0:
                continue
            block, skipping = block[nl:], False
        final = not block
        text = carry + block
        carry = ""
        if not final:
            cut = text.rfind("\n")
            if cut < 0:
                if len(text) > max_line:
                    carry, skipping = text[:max_line], True
                else:
                    carry = text
                continue
            text, carry = text[: cut + 1], text[cut + 1 :]
        if "\x1b" in text:
            text = strip_ansi(text)
        if text:
            yield number, text
        number += text.count("\n")
        if final:
            return


def _hits(text: str, first_number: int, lits: list[str]) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines of ``text`` that contain one of ``lits``."""
    starts: set[int] = set()
    for lit in lits:
        i = text.find(lit)
        while i >= 0:
            starts.add(text.rfind("\n", 0, i) + 1)
            end = text.find("\n", i)
            if end < 0:
                break
            i = text.find(lit, end)
    number, prev = first_number, 0
    for start in sorted(starts):
        number += text.count("\n", prev, start)
        prev = start
        end = text.find("\n", start)
        yield number, text[start:] if end < 0 else text[start:end]


def scan(stream: IO[str], lits: list[str], max_line: int) -> Iterator[tuple[int, str]]:
    """Read ``stream`` in large blocks, yielding only the lines that contain a literal.

    The pure-Python path (standard input, UTF-16 logs, no grep): one
    ``str.find`` pass per literal per block.
    """
    for number, text in blocks(stream, max_line):
        yield from _hits(text, number, lits)


#: Encodings (as :func:`corral.diagnose.logtext.sniff_encoding` names them) grep reads as is.
_GREP_ENCODINGS = frozenset({"utf-8", "utf-8-sig"})


#: Longest alternation passed to grep as one argument (Linux allows 128 KiB per argument).
_MAX_PATTERN = 100_000


def grep_path(encoding: str, lits: Sequence[str] = ()) -> str | None:
    """The system grep, if a file in ``encoding`` can be searched with it (as bytes)
    for ``lits`` (their alternation fits in one argument)."""
    if encoding.lower().replace("_", "-") not in _GREP_ENCODINGS:
        return None
    if sum(len(lit) * 2 + 1 for lit in lits) > _MAX_PATTERN:
        return None
    return shutil.which("grep")


class GrepError(OSError):
    """grep could not read the file (its own message says why)."""


_ERE_SPECIAL = re.compile(r"([\[.*+?(){|^$\\])")  # "]" and "}" alone are ordinary


def ere_alternation(lits: Iterable[str]) -> str:
    """One POSIX ERE matching any of ``lits`` (each escaped)."""
    return "|".join(_ERE_SPECIAL.sub(r"\\\1", lit) for lit in lits)


def grep_scan(grep: str, path: str | Path, lits: Sequence[str], max_line: int) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines of the UTF-8 file ``path`` holding one of ``lits``.

    ``grep -a -n -E`` searches the bytes (LC_ALL=C: no locale decoding) for
    one alternation of the escaped literals: GNU grep compiles it to a DFA and
    runs at ~500 MB/s, where the same literals as separate ``-F`` patterns run
    ~4x slower.  Lines with an ANSI escape are passed too and checked here
    once the colour codes are removed, since a code inside a literal hides it
    from grep.  Only the lines grep prints are read, each capped at
    ``max_line`` characters, so memory stays flat.  The grep process is
    killed if the caller stops early.
    """
    if any("\n" in lit or "\x00" in lit for lit in lits):
        raise ValueError("a literal holds a newline or NUL")
    pattern = ere_alternation((*lits, "\x1b"))
    proc = subprocess.Popen([grep, "-a", "-n", "-E", "-e", pattern, "--", str(path)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "LC_ALL": "C"})
    assert proc.stdout is not None and proc.stderr is not None
    limit = max_line * 4 + 24  # bytes: the line number, then up to max_line UTF-8 characters
    try:
        while True:
            raw = proc.stdout.readline(limit)
            if not raw:
                break
            if not raw.endswith(b"\n"):  # a runaway line: keep its head, skip the rest
                while (more := proc.stdout.readline(limit)) and not more.endswith(b"\n"):
                    pass
            head, _, body = raw.partition(b":")
            if not head.isdigit():  # not a "N:line" record: nothing of the log
                continue
            number = int(head)
            line = body.decode("utf-8", errors="replace").rstrip("\n")
            if number == 1:
                line = line.removeprefix("\ufeff")
            if "\x1b" in line:
                line = strip_ansi(line)
                if not any(lit in line for lit in lits):
                    continue
            yield number, line
        err = proc.stderr.read().decode("utf-8", errors="replace").strip()
        if proc.wait() > 1:
            raise GrepError(errno.EIO, f"grep: {err or f'exit status {proc.returncode}'}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
