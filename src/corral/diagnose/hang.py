"""A hung run: which ranks were somewhere else, and where.

``corral run --hang-timeout`` ends a job whose ranks all stopped writing,
records the failure as kind "hang" (exit 124) in run.json, and writes every
rank's Python stack to ``stacks-HHMMSS.txt`` in the run directory: the merged
tree first, then ``===== rank N =====`` and that rank's faulthandler dump.
A hang prints no error to match, so this reads those instead: the ranks on a
branch most ranks did not take are the likely culprits, and the innermost
frame of each group says what it was doing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.diagnose.pyexc import is_library
from corral.diagnose.stacks import fold_ranks, in_init, main_stack, merge, odd_ones_out

_RANK_HEADER = re.compile(r"^===== rank (\d+) =====\s*$", re.MULTILINE)
_ELSEWHERE = re.compile(r"(ranks? [\d,-]+) elsewhere than the others")
_STACKS_IN_REASON = re.compile(r"\(stacks: (?P<path>[^)]+)\)")
_NO_PROGRESS = re.compile(r"no progress for [\d.]+\s*s")


@dataclass(frozen=True, kw_only=True)
class StackGroup:
    """Ranks that stood at the same place."""

    ranks: tuple[int, ...]
    #: ``all_reduce distributed_c10d.py:3252``: the innermost frame.
    frame: str
    #: The innermost frame in the program's own code, when it is not ``frame``.
    user_frame: str | None = None
    #: The group is on a branch most ranks did not take.
    odd: bool = False
    hosts: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return fold_ranks(set(self.ranks))

    def to_dict(self) -> dict:
        return {"ranks": list(self.ranks), "frame": self.frame, "user_frame": self.user_frame,
                "odd": self.odd, "hosts": list(self.hosts)}


@dataclass(frozen=True, kw_only=True)
class Hang:
    """What a hung run's record and stacks file say."""

    #: run.json's reason: "no progress for 20s; rank 4 elsewhere than the others (stacks: ...)".
    reason: str | None
    #: Ranks elsewhere than the others (from the stacks, else from the reason).
    odd_ranks: tuple[int, ...]
    #: Where the ranks were, the odd ones first; empty without a stacks file.
    groups: tuple[StackGroup, ...] = ()
    #: Ranks that left no stack (not a Python rank, or already exited).
    missing: tuple[int, ...] = ()
    #: The stacks file (in the run directory when it is there), if any.
    stacks_file: str | None = None
    #: Every rank that answered was still inside init_process_group: the ranks
    #: never met (a file:// init_method on each node's own disk, a tcp:// address
    #: that is not node 0's, a world size the launch does not match).
    in_init: bool = False

    @property
    def summary(self) -> str:
        """One line: the job hung, and which ranks were where."""
        m = _NO_PROGRESS.search(self.reason or "")
        head = f"the job hung ({m.group(0)})" if m else "the job hung"
        odd = [g for g in self.groups if g.odd]
        if odd:
            where = "; ".join(f"{g.label}{_on(g.hosts)} at {g.frame}"
                              + (f" (in {g.user_frame})" if g.user_frame else "") for g in odd)
            return f"{head}: {where}, elsewhere than the others"
        if self.odd_ranks:
            return f"{head}: {fold_ranks(set(self.odd_ranks))} elsewhere than the others"
        if len(self.groups) == 1:
            g = self.groups[0]
            return f"{head}: every rank that answered at {g.frame}"
        return head

    def to_dict(self) -> dict:
        return {"summary": self.summary, "reason": self.reason, "odd_ranks": list(self.odd_ranks),
                "groups": [g.to_dict() for g in self.groups], "missing": list(self.missing),
                "stacks_file": self.stacks_file, "in_init": self.in_init}


def _on(hosts: tuple[str, ...]) -> str:
    return f" on {', '.join(hosts)}" if hosts else ""


def parse_stacks_file(text: str) -> dict[int, str]:
    """``stacks-*.txt`` -> {rank: that rank's faulthandler dump}."""
    parts = _RANK_HEADER.split(text)
    # parts: [tree, rank, dump, rank, dump, ...]
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _stacks_path(root: Path, reason: str | None) -> Path | None:
    """The stacks file of the run: the one run.json names if it is in the run
    directory (which may have been moved or copied), else the newest there."""
    named = None
    m = _STACKS_IN_REASON.search(reason or "")
    if m:
        named = Path(m.group("path").strip())
        local = root / named.name
        if local.is_file():
            return local
    files = sorted(root.glob("stacks-*.txt"))
    if files:
        return files[-1]
    if named is not None and named.is_file():
        return named
    return None


def read_hang(root: Path, record: Mapping[str, Any], rank_hosts: Mapping[int, str]) -> Hang | None:
    """The hang a run directory records, or None when the run did not hang."""
    failure = record.get("failure") if isinstance(record.get("failure"), dict) else {}
    reason = failure.get("reason") if isinstance(failure.get("reason"), str) else None
    hung = failure.get("kind") == "hang" or (
        record.get("exit_code") == 124 and record.get("status") == "failed"
        and any(root.glob("stacks-*.txt")))
    if not hung:
        return None
    path = _stacks_path(root, reason)
    odd_from_reason: tuple[int, ...] = ()
    m = _ELSEWHERE.search(reason or "")
    if m:
        odd_from_reason = tuple(sorted(_unfold(m.group(1))))
    if path is None:
        return Hang(reason=reason, odd_ranks=odd_from_reason)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return Hang(reason=reason, odd_ranks=odd_from_reason, stacks_file=str(path))
    stacks = {r: st for r, st in ((r, main_stack(t)) for r, t in parse_stacks_file(text).items()) if st}
    world = record.get("world_size")
    missing = tuple(sorted(set(range(world)) - set(stacks))) if isinstance(world, int) else ()
    odd = odd_ones_out(merge(stacks)) if stacks else set()
    by_place: dict[tuple[str, str | None], list[int]] = {}
    for rank, frames in sorted(stacks.items()):
        inner = frames[-1]
        user = next((f for f in reversed(frames) if not is_library(f.file)), None)
        key = (inner.label(), user.label() if user is not None and user != inner else None)
        by_place.setdefault(key, []).append(rank)
    groups = [
        StackGroup(ranks=tuple(ranks), frame=frame, user_frame=user_frame,
                   odd=bool(odd) and set(ranks) <= odd,
                   hosts=tuple(dict.fromkeys(rank_hosts[r] for r in ranks if r in rank_hosts)))
        for (frame, user_frame), ranks in by_place.items()
    ]
    groups.sort(key=lambda g: (not g.odd, -len(g.ranks), g.ranks))
    return Hang(reason=reason, odd_ranks=tuple(sorted(odd)) or odd_from_reason, groups=tuple(groups),
                missing=missing, stacks_file=str(path), in_init=in_init(stacks))


def _unfold(label: str) -> set[int]:
    """``ranks 0-2,4`` / ``rank 3`` -> {0, 1, 2, 4} / {3}."""
    out: set[int] = set()
    for part in label.split(" ", 1)[-1].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.update(range(int(lo), int(hi or lo) + 1))
    return out
