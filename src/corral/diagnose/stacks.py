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

A rank that only waits for Python processes it started itself (``mp.spawn``,
as detectron2's ``launch`` does; ``subprocess.run([sys.executable, ...])``)
is shown by those processes instead, labelled ``rank 0 workers 0-3`` (in
the order they started): that is where its training is.
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


#: A rank, or (rank, n): the n-th Python process that rank started itself.
StackKey = int | tuple[int, int]


def parse_key(text: str) -> StackKey:
    """The agent's keys: ``"3"`` for rank 3, ``"3/4711"`` for pid 4711 started by rank 3."""
    rank, _, pid = str(text).partition("/")
    return (int(rank), int(pid)) if pid else int(rank)


def key_rank(key: StackKey) -> int:
    return key[0] if isinstance(key, tuple) else key


def stack_order(key: StackKey) -> tuple[int, int]:
    """Sort key: each rank, then the processes it started."""
    return key if isinstance(key, tuple) else (key, -1)


def stack_key_text(key: StackKey) -> str:
    """The wire form ``parse_key`` reads."""
    return f"{key[0]}/{key[1]}" if isinstance(key, tuple) else str(key)


def dump_title(key: StackKey) -> str:
    """``rank 3`` / ``rank 3, pid 4711`` over a raw dump."""
    return f"rank {key[0]}, pid {key[1]}" if isinstance(key, tuple) else f"rank {key}"


@dataclass
class Node:
    frame: Frame | None
    ranks: set[StackKey] = field(default_factory=set)
    children: dict[Frame, Node] = field(default_factory=dict)


def merge(stacks: dict[StackKey, list[Frame]]) -> Node:
    root = Node(frame=None)
    for rank, frames in sorted(stacks.items(), key=lambda kv: stack_order(kv[0])):
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


def fold_keys(keys: set[StackKey]) -> str:
    """Ranks folded as ``fold_ranks``, then each rank's workers:
    ``ranks 2-3, rank 0 workers 0-1``."""
    parts = []
    ranks = {k for k in keys if not isinstance(k, tuple)}
    if ranks:
        parts.append(fold_ranks(ranks))
    by_rank: dict[int, set[int]] = {}
    for k in keys:
        if isinstance(k, tuple):
            by_rank.setdefault(k[0], set()).add(k[1])
    for rank, workers in sorted(by_rank.items()):
        folded = fold_ranks(workers)  # "rank 1" / "ranks 0-3", reworded below
        parts.append(f"rank {rank} " + folded.replace("ranks ", "workers ").replace("rank ", "worker "))
    return ", ".join(parts)


def render(root: Node, *, missing: set[int] = frozenset(),  # type: ignore[assignment]
           unanswered: dict[int, str] | None = None) -> list[str]:
    """Lines of the merged tree (rank sets right-aligned after each frame)."""
    rows: list[tuple[str, str]] = []

    def walk(node: Node, prefix: str, last: bool, depth: int) -> None:
        if node.frame is not None:
            branch = "" if depth == 1 else ("└─ " if last else "├─ ")
            rows.append((prefix + branch + node.frame.label(), fold_keys(node.ranks)))
            prefix = prefix + ("" if depth == 1 else ("   " if last else "│  "))
        kids = sorted(node.children.values(), key=lambda n: (-len(n.ranks), min(map(stack_order, n.ranks))))
        # A single chain shared by every rank is printed flat, not ever deeper.
        for i, child in enumerate(kids):
            walk(child, prefix, i == len(kids) - 1, depth + 1)

    walk(root, "", True, 0)
    width = max((len(a) for a, _ in rows), default=0)
    lines = [f"{a.ljust(width)}   {b}" for a, b in rows]
    unanswered = {r: h for r, h in (unanswered or {}).items() if r in missing}
    by_host: dict[str, set[int]] = {}
    for rank, host in unanswered.items():
        by_host.setdefault(host, set()).add(rank)
    for host, ranks in sorted(by_host.items()):
        lines.append(f"(no stack from {fold_ranks(ranks)}: its node {host} did not answer)")
    rest = set(missing) - set(unanswered)
    if rest:
        lines.append(f"(no stack from {fold_ranks(rest)}: not a Python rank, or exited)")
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


def odd_ones_out(root: Node) -> set[StackKey]:
    """Ranks on a branch the others did not take: the likely culprits.

    Where some ranks wait in a collective and others are outside any (a loop
    waiting for a file only node 0 has, a data loader), the ones outside are
    what the others wait for, however many they are.  Otherwise (all in
    collectives, or none) it is the ranks on a smaller branch."""
    odd: set[StackKey] = set()

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


#: Python processes multiprocessing starts for itself, not the user's.
_MP_HELPERS = ("multiprocessing/resource_tracker.py", "multiprocessing/forkserver.py")


def numbered(dumps: dict[StackKey, str]) -> dict[StackKey, str]:
    """(rank, pid) keys -> (rank, n), n counting each rank's processes in
    the order they started (mp.spawn's process index); multiprocessing's own
    helpers (its resource tracker) are dropped."""
    out: dict[StackKey, str] = {k: v for k, v in dumps.items() if not isinstance(k, tuple)}
    count: dict[int, int] = {}
    for key in sorted((k for k in dumps if isinstance(k, tuple)), key=stack_order):
        if any(helper in dumps[key] for helper in _MP_HELPERS):
            continue
        out[(key[0], count.get(key[0], 0))] = dumps[key]
        count[key[0]] = count.get(key[0], 0) + 1
    return out


#: Where a process waits for the Python processes it started.
_CHILD_WAITS = (("/torch/multiprocessing/spawn.py", None), ("/multiprocessing/process.py", "join"),
                ("/multiprocessing/pool.py", None), ("/subprocess.py", "wait"),
                ("/subprocess.py", "communicate"), ("/subprocess.py", "_wait"))


def _waits_for_children(frames: list[Frame]) -> bool:
    return any(fr.file.endswith(path) and (func is None or fr.func == func)
               for fr in frames for path, func in _CHILD_WAITS)


#: How a multiprocessing child reaches the user's function: not the user's frames.
_BOOTSTRAP = ("/multiprocessing/spawn.py", "/multiprocessing/process.py", "/torch/multiprocessing/spawn.py")


def _without_bootstrap(frames: list[Frame]) -> list[Frame]:
    """A spawned worker's stack from the user's function down (mp.spawn's
    ``fn``), as a rank's starts at the script's ``<module>``."""
    start = 0
    while start < len(frames) - 1 and (frames[start].file == "<string>"
                                       or frames[start].file.endswith(_BOOTSTRAP)):
        start += 1
    return frames[start:]


def stack_report(dumps: dict[StackKey, str], world_size: int, *,
                 unanswered: dict[int, str] | None = None) -> tuple[list[str], set[StackKey]]:
    """The merged tree of every rank's main thread, and the odd ones out.

    A rank waiting for the Python processes it started is replaced by them
    (numbered in the order they started); otherwise those are left out: a
    rank's helper process is not a peer of the ranks."""
    stacks = {k: main_stack(text) for k, text in numbered(dumps).items()}
    stacks = {k: st for k, st in stacks.items() if st}
    workers: dict[int, dict[StackKey, list[Frame]]] = {}
    for key in [k for k in stacks if isinstance(k, tuple)]:
        workers.setdefault(key[0], {})[key] = stacks.pop(key)
    for rank, procs in workers.items():
        if rank in stacks and _waits_for_children(stacks[rank]):
            del stacks[rank]
            stacks.update({k: _without_bootstrap(frames) for k, frames in procs.items()})
    missing = set(range(world_size)) - {key_rank(k) for k in stacks}
    root = merge(stacks)
    return render(root, missing=missing, unanswered=unanswered), odd_ones_out(root)


#: Frames of torch.distributed still connecting to its rendezvous store.
_RENDEZVOUS_FRAMES = ("_create_c10d_store", "_env_rendezvous_handler", "_tcp_rendezvous_handler",
                      "_create_tcp_store", "TCPStore")


def rendezvous_note(dumps: dict[StackKey, str], master_addr: str, master_port: int) -> str | None:
    """A hang with ranks still connecting to the store is almost always a
    script that picks its own rendezvous (``os.environ["MASTER_PORT"] = ...``,
    ``init_method="tcp://..."``): the store it waits for is never started."""
    waiting = {k for k, text in numbered(dumps).items() if any(f in text for f in _RENDEZVOUS_FRAMES)}
    if not waiting:
        return None
    return (f"{fold_keys(waiting)} still connecting to a rendezvous store: corral's is "
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


def never_met_note(dumps: dict[StackKey, str], world_size: int) -> str | None:
    """For a live hang: every rank answered from inside init_process_group."""
    stacks = {r: st for r, st in ((r, main_stack(t)) for r, t in dumps.items() if isinstance(r, int)) if st}
    if set(stacks) != set(range(world_size)) or not in_init(stacks):
        return None
    return NEVER_MET[:1].upper() + NEVER_MET[1:]

