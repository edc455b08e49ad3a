"""Conditions on a pattern's match that a regular expression cannot state.

Some signatures are only telling when numbers in the line compare a certain
way: an out-of-memory report that lists other processes on the GPU means
"several ranks share one GPU" only if those processes hold a real share of
it, and a store-based barrier that timed out with *more* workers than the
world size has another cause than one that timed out with fewer.  A pattern
names a check (``{ re = '...', check = "name" }``); its match counts only
when the check holds.  Checks are looked up at load time, so a misspelt name
or a pattern without the groups a check reads is a rules error, not a silent
miss.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "BYTES": 1}
_SIZE = r"(\d+(?:\.\d+)?) ?([KMGT]i?B|B|bytes)\b"

_TRIED = re.compile(r"Tried to allocate " + _SIZE)
_CAPACITY = re.compile(r"total capac\w* of " + _SIZE)
_OTHER = re.compile(r"Process \d+ has " + _SIZE + " memory in use")

#: Share of the GPU other processes must hold for it to count as shared, when
#: the failed allocation alone does not settle it.
_SHARED_FRACTION = 0.10


@dataclass(frozen=True)
class Check:
    """A named condition on one regex match."""

    name: str
    #: Named groups the pattern must capture for the check to read.
    needs: frozenset[str]
    test: Callable[[re.Match[str]], bool]


def size_bytes(number: str, unit: str) -> float:
    """``("4.35", "GiB")`` -> bytes."""
    return float(number) * _UNITS[unit.upper()]


def _sizes(rx: re.Pattern[str], text: str) -> list[float]:
    return [size_bytes(n, u) for n, u in rx.findall(text)]


def _others_hold_gpu_memory(m: re.Match[str]) -> bool:
    """Other processes on the GPU hold more than the failed request, or >10% of the GPU.

    A handful of 300-500 MiB CUDA contexts next to a process that holds the
    whole GPU itself is not why it ran out of memory.
    """
    line = m.string
    others = sum(_sizes(_OTHER, line))
    tried = _sizes(_TRIED, line)
    capacity = _sizes(_CAPACITY, line)
    if not tried and not capacity:
        return others > 0  # an older report without the numbers: no evidence against
    if tried and others > tried[0]:
        return True
    return bool(capacity) and others > _SHARED_FRACTION * capacity[0]


def _int_compare(op: Callable[[int, int], bool]) -> Callable[[re.Match[str]], bool]:
    def test(m: re.Match[str]) -> bool:
        try:
            return op(int(m.group("joined")), int(m.group("expected")))
        except (TypeError, ValueError):
            return False

    return test


def _last_attempt(m: re.Match[str]) -> bool:
    try:
        return int(m.group("attempt")) >= int(m.group("attempts")) > 0
    except (TypeError, ValueError):
        return False


CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("others_hold_gpu_memory", frozenset(), _others_hold_gpu_memory),
        Check("joined_below_expected", frozenset({"joined", "expected"}),
              _int_compare(lambda joined, expected: joined < expected)),
        Check("joined_above_expected", frozenset({"joined", "expected"}),
              _int_compare(lambda joined, expected: joined > expected)),
        # "retrying (34/34)": the last of a bounded series of retries, after which it gives up
        Check("last_attempt", frozenset({"attempt", "attempts"}), _last_attempt),
    )
}
