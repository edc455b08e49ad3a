"""Python stacks of every rank, merged into one tree.

The rank hook registers ``faulthandler`` on a signal, so any rank can be
asked where it is without ptrace, py-spy or special privileges; the dump is
written by C code, so it works while the rank is blocked inside a
collective.  Here the dumps of all ranks are parsed and merged: ranks with
the same stack share a branch, labelled with their folded rank set, so the
one rank that is somewhere else (still loading data, in another collective)
stands out::

    <module> train.py:88                          ranks 0-7
    └─ train_step train.py:61                     ranks 0-7
       ├─ all_reduce distributed_c10d.py:2501     ranks 0-2,4-7
       └─ __next__ dataloader.py:631              rank 3
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.IGNORECASE)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+?)\s*$')


@dataclass(frozen=True, kw_only=True)
class Frame:
    file: str
    line: int
    func: str

    def label(self) -> str:
        short = self.file.rsplit("/", 1)[-1]
        return f"{self.func} {short}:{self.line}"


def parse_dump(text: str) -> list[list[Frame]]:
    """faulthandler output -> threads, each a list of frames outermost first."""
    threads: list[list[Frame]] = []
    current: list[Frame] | None = None
    for line in text.splitlines():
        if _THREAD.match(line.strip()):
            current = []
            threads.append(current)
            continue
        m = _FRAME.match(line)
        if m and current is not None:
            current.append(Frame(file=m["file"], line=int(m["line"]), func=m["func"]))
    # faulthandler prints the most recent call first.
    return [list(reversed(t)) for t in threads if t]


def main_stack(text: str) -> list[Frame]:
    """The thread running the script (its outermost frame is ``<module>``).

    A preloaded rank runs the script from the zygote's code (``<string>``):
    those outermost frames are corral's, not the user's, and are dropped, so
    a preloaded and a fresh rank show the same stack."""
    threads = parse_dump(text)
    stack = next((t for t in threads if t and t[0].func == "<module>"), None)
    if stack is None:
        stack = max(threads, key=len) if threads else []
    start = 0
    while start < len(stack) and stack[start].file == "<string>":
        start += 1
    if 0 < start < len(stack) and stack[start].func == "<module>":
        return stack[start:]  # the script's own top level, under the zygote's frames
    return stack


@dataclass
class Node:
    frame: Frame | None
    ranks: set[int] = field(default_factory=set)
    children: dict[Frame, Node] = field(default_factory=dict)


def merge(stacks: dict[int, list[Frame]]) -> Node:
    root = Node(frame=None)
    for rank, frames in sorted(stacks.items()):
        node = root
        node.ranks.add(rank)
        for fr in frames:
            node = node.children.setdefault(fr, Node(frame=fr))
            node.ranks.add(rank)
    return root


def fold_ranks(ranks: set[int]) -> str:
    """``{0,1,2,4}`` -> ``ranks 0-2,4``; one rank -> ``rank 3``."""
    if len(ranks) == 1:
        return f"rank {next(iter(ranks))}"
    parts, run = [], []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return "ranks " + ",".join(parts)


def render(root: Node, *, missing: set[int] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Lines of the merged tree (rank sets right-aligned after each frame)."""
    rows: list[tuple[str, str]] = []

    def walk(node: Node, prefix: str, last: bool, depth: int) -> None:
        if node.frame is not None:
            branch = "" if depth == 1 else ("└─ " if last else "├─ ")
            rows.append((prefix + branch + node.frame.label(), fold_ranks(node.ranks)))
            prefix = prefix + ("" if depth == 1 else ("   " if last else "│  "))
        kids = sorted(node.children.values(), key=lambda n: (-len(n.ranks), min(n.ranks)))
        # A single chain shared by every rank is printed flat, not ever deeper.
        for i, child in enumerate(kids):
            walk(child, prefix, i == len(kids) - 1, depth + 1)

    walk(root, "", True, 0)
    width = max((len(a) for a, _ in rows), default=0)
    lines = [f"{a.ljust(width)}   {b}" for a, b in rows]
    if missing:
        lines.append(f"(no stack from {fold_ranks(missing)}: not a Python rank, or exited)")
    return lines


#: Where a rank waits for its peers: torch.distributed (collectives, the store,
#: DDP's own syncs) and autograd's backward, in which DDP's gradient
#: all-reduce runs.
_WAITING_FILES = ("/torch/distributed/", "/torch/nn/parallel/distributed.py", "/torch/autograd/")
_WAITING_FUNCS = frozenset({"_engine_run_backward", "run_backward"})


def _waits_for_peers(node: Node) -> bool:
    """Whether every stack under ``node`` is inside a collective (or backward)."""
    if node.frame is not None and (any(w in node.frame.file for w in _WAITING_FILES)
                                   or node.frame.func in _WAITING_FUNCS):
        return True
    return bool(node.children) and all(_waits_for_peers(k) for k in node.children.values())


def odd_ones_out(root: Node) -> set[int]:
    """Ranks on a branch the others did not take: the likely culprits.

    Where some ranks wait in a collective and others are outside any (a loop
    waiting for a file only node 0 has, a data loader), the ones outside are
    what the others wait for, however many they are.  Otherwise (all in
    collectives, or none) it is the ranks on a smaller branch."""
    odd: set[int] = set()

    def walk(node: Node) -> None:
        kids = list(node.children.values())
        if len(kids) > 1:
            waiting = [k for k in kids if _waits_for_peers(k)]
            if waiting and len(waiting) < len(kids):
                for k in kids:
                    if k not in waiting:
                        odd.update(k.ranks)
                return  # the ranks in collectives only wait; what is under them is no culprit
            biggest = max(kids, key=lambda n: len(n.ranks))
            for k in kids:
                if k is not biggest and len(k.ranks) < len(biggest.ranks):
                    odd.update(k.ranks)
        for k in kids:
            walk(k)

    walk(root)
    return odd


def stack_report(dumps: dict[int, str], world_size: int) -> tuple[list[str], set[int]]:
    """The merged tree of every rank's main thread, and the odd ranks out."""
    stacks = {rank: main_stack(text) for rank, text in dumps.items()}
    stacks = {r: st for r, st in stacks.items() if st}
    missing = set(range(world_size)) - set(stacks)
    root = merge(stacks)
    return render(root, missing=missing), odd_ones_out(root)


#: Frames of torch.distributed still connecting to its rendezvous store.
_RENDEZVOUS_FRAMES = ("_create_c10d_store", "_env_rendezvous_handler", "_tcp_rendezvous_handler",
                      "_create_tcp_store", "TCPStore")


def rendezvous_note(dumps: dict[int, str], master_addr: str, master_port: int) -> str | None:
    """A hang with ranks still connecting to the store is almost always a
    script that picks its own rendezvous (``os.environ["MASTER_PORT"] = ...``,
    ``init_method="tcp://..."``): the store it waits for is never started."""
    waiting = sorted(r for r, text in dumps.items() if any(f in text for f in _RENDEZVOUS_FRAMES))
    if not waiting:
        return None
    return (f"{fold_ranks(set(waiting))} still connecting to a rendezvous store: corral's is "
            f"{master_addr}:{master_port} (MASTER_ADDR:MASTER_PORT); a script that sets MASTER_ADDR, "
            "MASTER_PORT or init_method='tcp://...' itself waits for a store nobody starts: "
            "use init_method='env://' (the default) and leave those variables to corral")


#: What a hang with every rank inside init_process_group (and none still
#: connecting to a TCP store) means: the ranks never met.
NEVER_MET = ("every rank is still inside init_process_group: the ranks never met. The rendezvous the "
             "script gives it is not one they all share: an init_method='file://...' on each node's own "
             "disk (every node gets its own file: use a path on a filesystem all nodes share, or env:// "
             "with the MASTER_ADDR and MASTER_PORT the launcher sets), a tcp:// address that is not "
             "node 0's, or a world_size or rank that does not match the launch (take them from "
             "WORLD_SIZE and RANK).")


def in_init(stacks: dict[int, list[Frame]]) -> bool:
    """Every rank's main thread is inside init_process_group."""
    return bool(stacks) and all(any(f.func == "init_process_group" for f in frames)
                                for frames in stacks.values())


def never_met_note(dumps: dict[int, str], world_size: int) -> str | None:
    """For a live hang: every rank answered from inside init_process_group."""
    stacks = {r: st for r, st in ((r, main_stack(t)) for r, t in dumps.items()) if st}
    if set(stacks) != set(range(world_size)) or not in_init(stacks):
        return None
    return NEVER_MET[:1].upper() + NEVER_MET[1:]

