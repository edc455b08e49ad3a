"""Folded host notation: ``node[01-03,07]`` <-> ``node01 node02 node03 node07``.

HPC tools (pdsh, Slurm, ClusterShell) write host lists in this folded form,
and users paste them everywhere: hostfiles, ``-H`` lists, Slurm's
``SLURM_JOB_NODELIST``.  corral reads it wherever a host name is accepted and
prints it wherever a set of hosts is reported, so a 64-node failure reads
``gpu[01-64]`` instead of 64 lines.

Grammar (a subset of ClusterShell's NodeSet, the same one Slurm and pdsh use):

- a list is items separated by commas *outside* brackets: ``a,b[1-2]``;
- an item is text with zero or more bracket groups: ``rack[1-2]-gpu[1-4]``
  expands to the cartesian product, leftmost group varying slowest;
- a bracket group is a comma list of numbers ``N`` or ranges ``N-M``
  (``N <= M``); a leading zero fixes the width (``[08-10]`` ->
  ``08 09 10``).

``expand`` keeps the order written (and any duplicates, so readers can
report them with a line number); ``fold`` sorts numbers inside each bracket
and keeps groups in order of first appearance.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["MAX_HOSTS", "HostRangeError", "HostSet", "expand", "fold", "split_list"]

#: Largest expansion accepted: a typo like ``node[1-1000000]`` must fail fast,
#: not allocate a million names.
MAX_HOSTS = 65536
#: Longest name an expansion may produce (a DNS name's limit): 65,536 names of
#: 6,000 characters would be 400 MB before any name check could refuse them.
MAX_NAME = 253

_DIGITS = re.compile(r"\d+")


class HostRangeError(ValueError):
    """A malformed folded host expression; the message quotes the expression.

    Readers catch it and re-raise ``InventoryError`` with the file and line.
    """


# ---------------------------------------------------------------------------
# expand


def split_list(text: str) -> list[str]:
    """Split ``text`` on commas that are outside brackets.

    ``"a,b[1-2,5],c"`` -> ``["a", "b[1-2,5]", "c"]``.  Bracket balance is
    checked here so every caller gets the same error for ``node[1-``.
    """
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise HostRangeError(f"{_q(text)}: nested '[' at position {i + 1}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise HostRangeError(f"{_q(text)}: ']' without a matching '[' at position {i + 1}")
            depth = 0
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise HostRangeError(f"{_q(text)}: '[' is never closed")
    items.append(text[start:])
    return items


def expand(text: str) -> list[str]:
    """Expand a folded host list into names, in the order written.

    >>> expand("node[01-03,07]")
    ['node01', 'node02', 'node03', 'node07']
    >>> expand("a,b[1-2]")
    ['a', 'b1', 'b2']

    Raises ``HostRangeError`` for an empty list, an empty item, an unclosed
    or nested bracket, a non-numeric or reversed range, or more than
    ``MAX_HOSTS`` names.
    """
    if not text or not text.strip():
        raise HostRangeError("empty host list")
    names: list[str] = []
    for item in split_list(text):
        item = item.strip()
        if not item:
            raise HostRangeError(f"{_q(text)}: empty host name in the list (stray comma?)")
        names.extend(_expand_item(item, text))
        if len(names) > MAX_HOSTS:
            raise HostRangeError(f"{_q(text)} expands to more than {MAX_HOSTS} hosts")
    return names


def _expand_item(item: str, whole: str) -> list[str]:
    """Expand one comma-free item such as ``rack[1-2]-gpu[01-04]``."""
    parts = re.split(r"(\[[^\]]*\])", item)
    choices: list[list[str]] = []
    total = 1
    for part in parts:
        if part.startswith("["):
            values = _expand_group(part[1:-1], whole)
            total *= len(values)
            if total > MAX_HOSTS:
                raise HostRangeError(f"{_q(whole)} expands to more than {MAX_HOSTS} hosts")
            choices.append(values)
        elif part:
            if re.search(r"\s", part):
                raise HostRangeError(f"{_q(whole)}: host names cannot contain whitespace")
            choices.append([part])
    longest = sum(max(len(v) for v in values) for values in choices)
    if longest > MAX_NAME and total > 1:  # one name alone: the readers' name check says why
        raise HostRangeError(f"{_q(whole)}: a host name would be longer than {MAX_NAME} characters")
    return ["".join(combo) for combo in itertools.product(*choices)]


def _q(text: str, limit: int = 80) -> str:
    """``text`` quoted for a message; a megabyte of -H list is not echoed back."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _expand_group(body: str, whole: str) -> list[str]:
    """Expand the inside of one bracket: ``01-03,07`` -> ``01 02 03 07``."""
    if not body.strip():
        raise HostRangeError(f"{_q(whole)}: empty brackets '[]'")
    values: list[str] = []
    for rng in body.split(","):
        rng = rng.strip()
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or not lo.isascii() or not hi.isascii():
            raise HostRangeError(
                f"{_q(whole)}: bad range {rng!r} inside brackets (expected N or N-M, digits only)"
            )
        if not sep:
            values.append(lo)
            continue
        start, stop = int(lo), int(hi)
        if start > stop:
            raise HostRangeError(f"{_q(whole)}: range {rng!r} goes backwards ({start} > {stop})")
        if _padded(hi) and len(hi) != len(lo):
            raise HostRangeError(
                f"{_q(whole)}: range {rng!r} mixes zero-padding widths; write both ends "
                "with the same number of digits"
            )
        if stop - start >= MAX_HOSTS:
            raise HostRangeError(f"{_q(whole)} expands to more than {MAX_HOSTS} hosts")
        width = len(lo) if _padded(lo) else 0
        values.extend(str(n).zfill(width) for n in range(start, stop + 1))
    return values


def _padded(digits: str) -> bool:
    return len(digits) > 1 and digits[0] == "0"


# ---------------------------------------------------------------------------
# fold


def fold(names: Iterable[str]) -> str:
    """Fold names into the shortest readable folded form.

    >>> fold(["node1", "node2", "node3", "node5"])
    'node[1-3,5]'
    >>> fold(["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"])
    'rack[1-2]-gpu[1-2]'

    Names sharing the text around their numbers (and zero-padding width) are
    grouped; numbers inside a bracket are sorted and de-duplicated; groups
    keep the order in which they first appear; names without digits are
    listed as they are.  ``expand(fold(x))`` holds the same names as ``x``.
    """
    # key -> either a literal name or a list of digit-tuples of one "shape"
    shapes: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    seen: set[str] = set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        texts = tuple(_DIGITS.split(name))
        shapes.setdefault(texts, []).append(tuple(_DIGITS.findall(name)))
    out: list[str] = []
    for texts, rows in shapes.items():
        out.extend(_fold_shape(texts, rows))
    return ",".join(out)


def _fold_shape(texts: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Fold names of one shape (same text between the digit runs).

    One dimension at a time from the last: rows equal everywhere except in
    dimension ``d`` merge into one row whose field ``d`` is a bracket.  This
    is the greedy n-dimensional fold ClusterShell popularised; it is not
    always minimal but it is deterministic and always exact.
    """
    items: list[list[str]] = [list(r) for r in rows]
    for dim in reversed(range(len(texts) - 1)):
        groups: dict[tuple[str, ...], list[str]] = {}
        for it in items:
            key = tuple(it[:dim] + ["\0"] + it[dim + 1:])
            groups.setdefault(key, []).append(it[dim])
        items = []
        for key, digits in groups.items():
            for rendered in _render_digits(digits):
                row = list(key)
                row[dim] = rendered
                items.append(row)
    result = []
    for it in items:
        parts = [texts[0]]
        for field, text in zip(it, texts[1:]):
            parts.extend((field, text))
        result.append("".join(parts))
    return result


def _render_digits(digits: list[str]) -> list[str]:
    """Render digit strings as brackets, one per zero-padding width.

    ``08 09 10`` share width 2 (``10`` reads the same padded or not) and give
    ``[08-10]``; ``9`` and ``09`` differ as text, so they cannot share one.
    """
    padded_widths = {len(d) for d in digits if _padded(d)}
    classes: dict[int, set[int]] = {}
    for d in digits:
        width = len(d) if (_padded(d) or len(d) in padded_widths) else 0
        classes.setdefault(width, set()).add(int(d))
    out = []
    for width, values in classes.items():
        runs = _runs(sorted(values))
        body = ",".join(
            str(a).zfill(width) if a == b else f"{str(a).zfill(width)}-{str(b).zfill(width)}"
            for a, b in runs
        )
        single = len(runs) == 1 and runs[0][0] == runs[0][1]
        out.append(body if single else f"[{body}]")
    return out


def _runs(values: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


# ---------------------------------------------------------------------------
# HostSet


@dataclass(frozen=True, kw_only=True)
class HostSet:
    """An ordered, duplicate-free set of host names that prints folded.

    ``str(HostSet.parse("gpu[01-04]"))`` is ``gpu[01-04]``; iteration yields
    the names in order.  Reports use it so every host set is one short line.
    """

    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> HostSet:
        """Parse a folded expression; duplicates are dropped, order kept."""
        return cls.of(expand(text))

    @classmethod
    def of(cls, names: Iterable[str]) -> HostSet:
        return cls(names=tuple(dict.fromkeys(names)))

    def __str__(self) -> str:
        return fold(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __or__(self, other: HostSet) -> HostSet:
        return HostSet.of(self.names + other.names)

    def __sub__(self, other: HostSet) -> HostSet:
        drop = set(other.names)
        return HostSet(names=tuple(n for n in self.names if n not in drop))

    def __and__(self, other: HostSet) -> HostSet:
        keep = set(other.names)
        return HostSet(names=tuple(n for n in self.names if n in keep))
