"""PyTorch's collective flight recorder, read from every rank and explained.

With the flight recorder on (``corral run`` turns it on; ``TORCH_FR_BUFFER_SIZE``),
every rank's process group keeps its last collectives in a ring buffer:
per collective its sequence number in the group, the operation
(``gloo:all_reduce``, ``nccl:all_gather``), the input and output sizes and
dtypes, whether it finished, and (in the pickle format) the Python stack
that called it.  corral gathers each rank's dump into
``runs/<id>/flightrec/`` (``index.json`` says which host and pid each came
from) and reads them here.

The question a hang asks is "where did the ranks stop agreeing": the first
sequence number of a group at which some rank never entered the collective
that the others entered, or entered it with another operation, sizes or
dtypes.  Those ranks are the odd ones out.

A dump is untrusted input (a file a rank process wrote in a shared temp
directory, sent by a node): JSON is read with ``json``; the pickle format
(torch's own files, older torch) with an unpickler that refuses every
global, so only plain containers, strings and numbers can come out of it,
and only within ``MAX_DUMP`` bytes.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.diagnose.stacks import Frame, fold_ranks, main_stack

#: Largest dump read (bytes); torch's 2000-entry buffer is about 1 MB as JSON.
MAX_DUMP = 16 * 1024 * 1024
#: Where the dumps of a run are kept, under its run directory.
DUMP_DIR = "flightrec"
INDEX = "index.json"
#: Operations whose inputs may differ in size between ranks (uneven splits).
_UNEVEN = ("all_to_all", "alltoall", "scatter", "gather")
_INT_LIST = re.compile(r"-?\d+")
#: Frames of torch's own collective wrappers, left out of a stack shown.
_TORCH_WRAPPERS = ("distributed_c10d.py", "c10d_logger.py")


class DumpError(ValueError):
    """A dump that is not a flight recorder dump (says why)."""


class _NoGlobals(pickle.Unpickler):
    """Unpickles plain data only: any class or function reference is refused,
    so a crafted dump cannot run code or build objects."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102
        raise DumpError(f"refused: the dump references {module}.{name} (a flight recorder dump holds plain data)")


def parse_dump(data: bytes) -> dict:
    """One rank's dump (JSON, or torch's pickle) -> its dict; raises DumpError."""
    if len(data) > MAX_DUMP:
        raise DumpError(f"{len(data)} bytes, over the {MAX_DUMP}-byte limit")
    if data[:1] == b"\x80":  # pickle protocol 2+
        try:
            value = _NoGlobals(io.BytesIO(data)).load()
        except DumpError:
            raise
        except Exception as e:  # noqa: BLE001 - any malformed pickle is the same answer
            raise DumpError(f"not a readable pickle: {type(e).__name__}: {e}") from None
    else:
        try:
            value = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise DumpError(f"neither JSON nor pickle: {e}") from None
    if not isinstance(value, dict) or not isinstance(value.get("entries", []), list):
        raise DumpError("not a flight recorder dump (no 'entries' list)")
    return value


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One entry of one rank's ring buffer."""

    group: str
    seq: int
    op: str
    in_sizes: tuple
    in_dtypes: tuple
    done: bool
    frames: tuple[Frame, ...] = ()

    @property
    def shape(self) -> str:
        sizes = ", ".join("x".join(str(d) for d in s) or "scalar" for s in self.in_sizes)
        types = ",".join(str(t) for t in dict.fromkeys(self.in_dtypes))
        return f"[{sizes}] {types}".strip() if self.in_sizes else "(no tensors)"

    def signature(self) -> tuple:
        sizes = None if any(u in self.op for u in _UNEVEN) else self.in_sizes
        return (self.op, sizes, self.in_dtypes)


def _tuple(v: Any) -> tuple:
    if isinstance(v, (list, tuple)):
        return tuple(_tuple(x) if isinstance(x, (list, tuple)) else x for x in v)
    return ()


def _frames(v: Any) -> tuple[Frame, ...]:
    """The pickle format's ``frames`` (innermost first) -> outermost first."""
    out = []
    for f in v if isinstance(v, list) else ():
        if isinstance(f, dict) and isinstance(f.get("filename"), str) and isinstance(f.get("line"), int):
            out.append(Frame(file=f["filename"], line=f["line"], func=str(f.get("name", "?"))))
    return tuple(reversed(out))


def collectives(dump: Mapping[str, Any]) -> list[Collective]:
    """The collectives (not point-to-point) a dump holds, oldest first.
    Entries that lack a field or have the wrong type are skipped."""
    out = []
    for e in dump.get("entries", []):
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        seq, op = e.get("collective_seq_id"), e.get("profiling_name")
        pg = e.get("process_group")
        if not isinstance(seq, int) or seq <= 0 or not isinstance(op, str):
            continue
        group = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", "0"))
        state = e.get("state")
        out.append(Collective(group=group, seq=seq, op=op.split(":", 1)[-1], in_sizes=_tuple(e.get("input_sizes")),
                              in_dtypes=_tuple(e.get("input_dtypes")),
                              done=state == "completed" or e.get("retired") is True,
                              frames=_frames(e.get("frames"))))
    return out


@dataclass(frozen=True, kw_only=True)
class RankDump:
    """One rank's dump and where it came from."""

    rank: int
    host: str = ""
    pid: int | None = None
    calls: tuple[Collective, ...] = ()

    def where(self) -> str:
        pid = f", pid {self.pid}" if self.pid else ""
        return f"rank {self.rank} ({self.host}{pid})" if self.host else f"rank {self.rank}{pid}"


@dataclass(frozen=True, kw_only=True)
class Odd:
    """A rank that did not do what the others did at the divergence."""

    rank: RankDump
    #: What it did there instead: None = it never entered that collective.
    entered: Collective | None
    #: Its last collective in the group, for one that never entered.
    last: Collective | None = None


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """The first collective of a group at which the ranks disagree."""

    group: str
    seq: int
    #: What most ranks entered there.
    expected: Collective
    agreeing: tuple[int, ...]
    odd: tuple[Odd, ...]
    #: The odd ranks entered a collective most ranks never reached (``expected``
    #: is then the last collective of the ranks that stayed behind).
    ahead: bool = False

    @property
    def never_entered(self) -> tuple[Odd, ...]:
        return tuple(o for o in self.odd if o.entered is None)

    @property
    def mismatched(self) -> tuple[Odd, ...]:
        return tuple(o for o in self.odd if o.entered is not None)


@dataclass(frozen=True, kw_only=True)
class FlightReport:
    """What the dumps of one run say."""

    divergences: tuple[Divergence, ...] = ()
    #: Per group, when every rank agrees: the last collective and whether every rank finished it.
    agreed: tuple[tuple[str, Collective, bool], ...] = ()
    #: Ranks of the run with no dump (exited, not a torch.distributed process, flight recorder off).
    without_dump: tuple[int, ...] = ()
    #: Dumps that could not be read: (rank, why).
    unreadable: tuple[tuple[int, str], ...] = ()
    ranks: Mapping[int, RankDump] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.divergences or self.agreed)

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(sorted({o.rank.rank for d in self.divergences for o in d.odd}))

    def lines(self, stacks: Mapping[int, str] | None = None) -> list[str]:
        """The report as text: the divergence, the odd ranks out with their
        stacks (from ``stacks``, faulthandler dumps per rank, when given;
        else the stack the flight recorder kept for the collective)."""
        out: list[str] = []
        for d in self.divergences:
            e = d.expected
            if d.ahead:
                out.append(f"flight recorder: group {d.group} diverges at collective #{d.seq}: "
                           f"{fold_ranks(set(d.agreeing))} never entered it (their last: #{e.seq} {e.op})")
                for o in d.odd:
                    assert o.entered is not None
                    out.append(f"  {o.rank.where()} entered #{d.seq} {o.entered.op} {o.entered.shape}, "
                               "which the others never reached")
                    out.extend(_stack_lines(o, stacks))
                continue
            out.append(f"flight recorder: group {d.group} diverges at collective #{d.seq}: "
                       f"{fold_ranks(set(d.agreeing))} entered {e.op} {e.shape}")
            for o in d.never_entered:
                last = f" (its last: #{o.last.seq} {o.last.op})" if o.last else ""
                out.append(f"  {o.rank.where()} never entered #{d.seq} {e.op}{last}")
                out.extend(_stack_lines(o, stacks))
            for o in d.mismatched:
                c = o.entered
                assert c is not None
                what = "sizes" if (c.op == e.op and c.in_dtypes == e.in_dtypes) else (
                    "dtypes" if c.op == e.op else "operation")
                out.append(f"  {o.rank.where()} entered #{d.seq} as {c.op} {c.shape}: "
                           f"mismatched {what} (the others: {e.op} {e.shape})")
                out.extend(_stack_lines(o, stacks))
        if not self.divergences:
            for group, c, finished in self.agreed:
                state = "and finished it" if finished else "and none of them finished it"
                out.append(f"flight recorder: every rank's last collective of group {group} is #{c.seq} "
                           f"{c.op} {c.shape}, {state}")
        if self.without_dump and out:
            out.append(f"  no flight recorder dump from {fold_ranks(set(self.without_dump))} "
                       "(exited, or not a torch.distributed process)")
        for rank, why in self.unreadable:
            out.append(f"  rank {rank}'s flight recorder dump was not read: {why}")
        return out

    def to_dict(self) -> dict:
        return {"culprits": list(self.culprits), "lines": self.lines(),
                "divergences": [{"group": d.group, "seq": d.seq, "op": d.expected.op,
                                 "agreeing": list(d.agreeing),
                                 "never_entered": [o.rank.rank for o in d.never_entered],
                                 "mismatched": [o.rank.rank for o in d.mismatched]} for d in self.divergences]}


def _stack_lines(odd: Odd, stacks: Mapping[int, str] | None) -> list[str]:
    frames: list[Frame] = []
    if stacks and stacks.get(odd.rank.rank):
        frames = main_stack(stacks[odd.rank.rank])
    if not frames and odd.entered is not None:
        frames = list(odd.entered.frames)
    frames = [f for f in frames if not f.file.endswith(_TORCH_WRAPPERS)] or frames
    return [f"      {f.func} ({f.file}:{f.line})" for f in frames[-6:]]


def _divergence(group: str, per_rank: dict[int, dict[int, Collective]], dumps: Mapping[int, RankDump]
                ) -> Divergence | None:
    """The first sequence number at which the ranks of ``group`` disagree.

    There, the ranks fall into sides: one per (operation, sizes, dtypes)
    entered, and the ranks that never got that far.  The largest side is
    what the job meant to do (a tie goes to a side that entered: ranks
    waiting in a collective are the ones held up); every other rank is odd.
    A rank whose ring buffer starts after ``seq`` dropped it: unknown, not
    missing."""
    last = {r: max(calls) for r, calls in per_rank.items()}
    for seq in sorted({s for calls in per_rank.values() for s in calls}):
        entered = {r: calls[seq] for r, calls in per_rank.items() if seq in calls}
        missing = sorted(r for r in per_rank if seq not in per_rank[r] and seq > last[r])
        sides: dict[Any, list[int]] = {}
        for r, c in sorted(entered.items()):
            sides.setdefault(c.signature(), []).append(r)
        if not missing and len(sides) <= 1:
            continue
        norm, agreeing = max(sides.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))
        if len(missing) > len(agreeing):
            # Most ranks never got here: the ones that did are ahead of the job.
            behind = missing[0]
            expected = per_rank[behind][last[behind]]
            odd = [Odd(rank=dumps[r], entered=c) for r, c in sorted(entered.items())]
            return Divergence(group=group, seq=seq, expected=expected, agreeing=tuple(missing),
                              odd=tuple(odd), ahead=True)
        odd = [Odd(rank=dumps[r], entered=None, last=per_rank[r][last[r]]) for r in missing]
        odd += [Odd(rank=dumps[r], entered=c) for r, c in sorted(entered.items()) if c.signature() != norm]
        return Divergence(group=group, seq=seq, expected=entered[agreeing[0]], agreeing=tuple(agreeing),
                          odd=tuple(odd))
    return None


def analyse(dumps: Mapping[int, RankDump], world_size: int | None = None,
            unreadable: tuple[tuple[int, str], ...] = ()) -> FlightReport:
    """The divergences of every process group the dumps show."""
    groups: dict[str, dict[int, dict[int, Collective]]] = {}
    for rank, dump in dumps.items():
        for c in dump.calls:
            groups.setdefault(c.group, {}).setdefault(rank, {})[c.seq] = c
    divergences, agreed = [], []
    for group, per_rank in sorted(groups.items()):
        d = _divergence(group, per_rank, dumps)
        if d is not None:
            divergences.append(d)
            continue
        lasts = [calls[max(calls)] for calls in per_rank.values()]
        top = max(lasts, key=lambda c: c.seq)
        agreed.append((group, top, all(c.done for c in lasts if c.seq == top.seq)))
    have = set(dumps) | {r for r, _ in unreadable}
    without = tuple(sorted(set(range(world_size)) - have)) if world_size else ()
    return FlightReport(divergences=tuple(divergences), agreed=tuple(agreed), without_dump=without,
                        unreadable=unreadable, ranks=dict(dumps))


def rank_dump(rank: int, data: bytes, *, host: str = "", pid: int | None = None) -> RankDump:
    """One rank's dump bytes -> its collectives; raises DumpError."""
    return RankDump(rank=rank, host=host, pid=pid, calls=tuple(collectives(parse_dump(data))))


def read_dir(root: Path, world_size: int | None = None) -> FlightReport | None:
    """The report of the dumps a run directory holds (``flightrec/``), or
    None when it has none.  ``index.json`` maps each file to its rank, host and pid."""
    folder = root / DUMP_DIR
    if not folder.is_dir() or folder.is_symlink():
        return None
    try:
        index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    dumps: dict[int, list[RankDump]] = {}
    bad: list[tuple[int, str]] = []
    for item in index.get("dumps", []) if isinstance(index, dict) else []:
        if not isinstance(item, dict) or not isinstance(item.get("rank"), int) or not isinstance(item.get("file"), str):
            continue
        path = folder / Path(item["file"]).name  # never outside the folder
        try:
            if path.is_symlink():
                raise DumpError("a symbolic link, not followed")
            with open(path, "rb") as f:
                data = f.read(MAX_DUMP + 1)
            d = rank_dump(item["rank"], data, host=str(item.get("host", "")),
                          pid=item.get("pid") if isinstance(item.get("pid"), int) else None)
        except (OSError, DumpError) as e:
            bad.append((item["rank"], f"{path.name}: {e}"))
            continue
        dumps.setdefault(d.rank, []).append(d)
    if not dumps and not bad:
        return None
    merged = {r: RankDump(rank=r, host=ds[0].host, pid=ds[0].pid, calls=tuple(c for d in ds for c in d.calls))
              for r, ds in dumps.items()}
    return analyse(merged, world_size, tuple(bad))
