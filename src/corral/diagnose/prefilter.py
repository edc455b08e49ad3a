"""A fast first pass: skip the lines no rule can match.

A training log is mostly loss lines; a real error line is rare.  Running
~150 regexes on every line costs tens of microseconds each, so a
multi-gigabyte log would take minutes.  Nearly every pattern contains a
literal that any match must include ("ncclSystemError", "Duplicate GPU");
one regex alternating those literals rejects an ordinary line in a couple of
microseconds, and only lines that contain one get the full rules.

Literals are read from the parsed regex (Python's own parser), so they are
exact; a pattern that yields none (only character classes, a case-insensitive
flag, an unparsable construct) is simply checked on every line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import IO

from corral.diagnose.logtext import strip_ansi

try:  # Python 3.11+
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

#: Shorter literals would pass too many ordinary lines to be worth it.
MIN_LITERAL = 4
#: Characters read at a time when scanning a file.
CHUNK = 1 << 20


def _name(op: object) -> str:
    return getattr(op, "name", str(op))


def _best(options: list[list[str]]) -> list[str] | None:
    """Of several requirements (each: any one of these literals), the most selective."""
    usable = [o for o in options if o and min(len(s) for s in o) >= MIN_LITERAL]
    if not usable:
        return None
    return max(usable, key=lambda o: (min(len(s) for s in o), -len(o)))


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
    if rx.flags & re.IGNORECASE:
        return None
    try:
        return _required(_sre_parse.parse(rx.pattern, rx.flags))
    except Exception:  # noqa: BLE001 - a construct the walker does not know: no shortcut
        return None


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

    str.find over a megabyte is done in C at memory speed, so ordinary lines
    cost almost nothing; line numbers stay exact (newlines are counted per
    block).  A runaway line without newlines keeps only its first
    ``max_line`` characters.
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
        yield from _hits(text, number, lits)
        number += text.count("\n")
        if final:
            return
