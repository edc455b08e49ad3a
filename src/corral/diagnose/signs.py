"""Does a log show a failure at all?

When no rule matches, two different things can be true: the log shows an
error corral does not know (then the report should say so, and how to get a
more telling one), or the log shows no failure at all: a healthy run, or
only benign warnings (then it should say that, and nothing about NCCL
debugging).  This module finds the lines that look like a failure: a
traceback, an ``...Error:`` line, a non-zero exit, a fatal signal; warnings
and NCCL's INFO chatter do not count.  Files are searched with grep like the
rules (:mod:`corral.diagnose.prefilter`), so a huge healthy log costs one
more pass at grep's speed.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path

from corral.diagnose import prefilter
from corral.diagnose.logtext import MAX_LINE, open_log, parse

#: Literals one of which every failure-looking line holds (the grep pass).
_LITERALS = (
    "Traceback (most recent call last)", "Error", "ERROR", "error", "Exception", "FAILED", "Killed",
    "core dumped", "Segmentation fault", "exitcode", "exit code", "exit status", "fatal", "Fatal",
    "FATAL", "terminate called", "Aborted", "CANCELLED", "NCCL WARN", "failed", "Failed",
)
_SIGN = re.compile(
    r"Traceback \(most recent call last\)"
    r"|\b[A-Za-z_.]*(?:Error|Exception)\b(?::|$)"  # KeyError: ..., torch.distributed.DistBackendError
    r"|\bERROR\b|\b[Ee]rror:|\bFAILED\b|\bKilled\b|core dumped|Segmentation fault"
    r"|exitcode\s*:\s*-?[1-9]|exit (?:code|status):? -?[1-9]|returned non-zero exit status"
    r"|\b(?:fatal|Fatal|FATAL)\b|terminate called|\bAborted\b|\bCANCELLED\b|NCCL WARN"
    r"|\b(?:failed|Failed)\b"
)
# Lines that say "error"/"failed" without a failure: NCCL's INFO chatter, warnings,
# counters and progress summaries that report none.
_BENIGN = re.compile(
    r"NCCL INFO|\b\w*Warning\b|\[W[ \d]|\bW\d{4} |(?<!NCCL )\bWARN(?:ING)?\b|\b0 (?:errors?|failed|failures)\b"
    r"|\bno errors?\b|\berrors?=0\b|\bfailed=0\b"
)
#: Failure-looking lines kept as evidence.
_KEEP = 3


def _sign(text: str) -> bool:
    return bool(_SIGN.search(text)) and not _BENIGN.search(text)


def _lines(candidates: Iterator[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    found: list[tuple[int, str]] = []
    for number, raw in candidates:
        for line in parse(raw, number):
            if _sign(line.text):
                found.append((line.number, line.shown))
                if len(found) >= _KEEP:
                    return tuple(found)
    return tuple(found)


def failure_lines_in_file(path: str | Path) -> tuple[tuple[int, str], ...]:
    """(line number, line) of the first lines of a log file that look like a failure."""
    with open_log(path) as stream:
        grep = prefilter.grep_path(stream.encoding, _LITERALS)
        if grep is None:
            return _lines(prefilter.scan(stream, list(_LITERALS), MAX_LINE))
    scan = prefilter.grep_scan(grep, path, _LITERALS, MAX_LINE)
    try:
        return _lines(scan)
    finally:
        scan.close()  # grep stops as soon as enough lines are found


def failure_lines_in_text(text: str) -> tuple[tuple[int, str], ...]:
    """Like :func:`failure_lines_in_file`, for text already read (standard input)."""
    return _lines(prefilter.scan(io.StringIO(text), list(_LITERALS), MAX_LINE))
