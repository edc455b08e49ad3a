"""The head's view of a running job: who is alive, and what failed first.

``JobWatch`` consumes agent events (lines, status updates, rank exits, node
exits, channel closes) and keeps the state the run loop decides on.  It
knows nothing about ssh or asyncio: tests can feed it events directly.

Which failure is the *root cause* is decided the way an engineer reads the
logs: a rank that died of its own error comes before ranks that merely saw
their peer disappear ("Connection closed by peer", NCCL aborts, store
timeouts) or were terminated by a launcher; among equals, the first observed
wins.
"""

from __future__ import annotations

import collections
import itertools
import re
import signal as _signal
import time
from dataclasses import dataclass, field
from typing import Protocol

from corral.frames import MAX_LINE, cut_marker, terminal_safe
from corral.run.plan import LaunchPlan, NodePlan

#: Lines kept in memory per rank for the failure summary and diagnosis.
TAIL_LINES = 400
#: Characters kept of each of those lines (an exception line is far shorter;
#: a rank printing megabyte lines must not hold TAIL_LINES of them).
TAIL_LINE_CHARS = 4096

#: Errors that mean "my peer went away", not "I broke".
_PEER_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|DistNetworkError|"
    r"NCCL communicator was aborted|remote process exited|RendezvousClosedError|"
    r"RendezvousConnectionError|ncclRemoteError|Socket Timeout|recvValue|recvBytes|"
    r"failed to recv|Connection refused|ECONNRESET|EPIPE",
    re.IGNORECASE,
)
#: Exceptions a process raises because it was told to stop (Lightning turns
#: SIGTERM into SIGTERMException), not because it failed.
_STOPPED = re.compile(r"SIGTERMException|KeyboardInterrupt|SystemExit|Terminated\b")
_TERMINATED = {int(_signal.SIGTERM), int(_signal.SIGINT), int(_signal.SIGHUP)}


#: The prefix torch >= 2.2 puts on a rank's error lines.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
#: The first line of a Python traceback.
_TRACEBACK = "Traceback (most recent call last):"

class Sink(Protocol):
    def line(self, host: str, rank: int | None, stream: str, text: str) -> None: ...
    # A sink may also have ``lines(host, rank, stream, texts)``: a batch of one
    # rank's lines in order, handled at once (``line`` is called per line otherwise).
    def status(self, host: str, rank: int | None, text: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One failed rank, node or connection, as observed by the head."""

    host: str
    rank: int | None
    #: "exit" (non-zero code), "signal", "lost" (node stopped answering), "start".
    kind: str
    code: int | None = None
    signal: int | None = None
    #: Last line of the uncaught exception, when the rank hook saw one.
    exc: str | None = None
    #: Why the node was declared lost / could not start.
    reason: str | None = None
    #: Order of observation on the head.
    seq: int = 0
    #: True when this looks like a consequence of another failure.
    consequential: bool = False

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return _signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def describe(self) -> str:
        """One line for the summary; what the node said in it cannot drive the terminal."""
        return terminal_safe(self._describe())

    def _describe(self) -> str:
        where = f"rank {self.rank} on {self.host}" if self.rank is not None else self.host
        if self.kind == "lost":
            return f"{self.host} was lost: {self.reason}"
        if self.kind == "start":
            return f"{where} could not start: {self.reason}"
        if self.kind == "hang":
            return f"the job hung: {self.reason}"
        how = None
        if self.signal is not None:
            how = f"killed by {self.signal_name}"
        elif self.code is not None:
            how = f"exited with code {self.code}"
        if self.exc:
            return f"{where} failed: {short_exc(self.exc)}" + (f" ({how})" if how else "")
        return f"{where} {how}" if how else f"{where} failed"

    @property
    def exit_code(self) -> int:
        """The code corral itself exits with for this failure."""
        if self.code:
            return self.code
        if self.signal:
            return 128 + self.signal
        return 1


_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_root_cause(lines: list[str]) -> tuple[int, int] | None:
    """(global rank, exit code; negative: signal) from torchrun's ChildFailedError summary."""
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if "Root Cause (first observed failure)" in lines[i]:
            start = i
            break
    if start is None:
        return None
    rank = code = None
    for line in lines[start + 1:start + 12]:
        m = _ROOT_RANK.match(line)
        if m and rank is None:
            rank = int(m.group(1))
        m = _ROOT_CODE.match(line)
        if m and code is None:
            code = int(m.group(1))
    if rank is None or not code:
        return None
    return rank, code


def _exception_line(lines: list[str]) -> str | None:
    """The exception a Python traceback in ``lines`` ends with (its last one).

    Parsed as ``corral diagnose`` parses rank logs (torch's ``[rankN]: ``
    prefix stripped); imported here, on a failure, not at start-up."""
    from corral.diagnose.logtext import iter_text
    from corral.diagnose.pyexc import parse_traceback

    exc = parse_traceback(iter_text("\n".join(lines)))
    return exc.text if exc else None


def short_exc(text: str, limit: int = 240) -> str:
    """An exception for a one-line summary: its first line, cut at ``limit``
    (a CheckpointException or a multi-line RuntimeError carries pages)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    first = lines[0].strip() if lines else text.strip()
    if len(first) > limit:
        return first[:limit].rstrip() + " ..."
    return first + (" ..." if len(lines) > 1 else "")


#: Room for the cut marker the node's relay already put on a line it cut.
MARKER_ROOM = 64


def _tail() -> collections.deque:
    return collections.deque(maxlen=TAIL_LINES)


@dataclass
class _Pieces:
    """A line arriving in pieces (the agent marks them ``more``): at most
    ``MAX_LINE`` characters of it are kept, the rest only counted."""

    parts: list[str] = field(default_factory=list)
    size: int = 0
    #: Bytes (UTF-8) dropped past the limit.
    cut: int = 0

    def add(self, text: str) -> None:
        room = MAX_LINE + MARKER_ROOM - self.size
        if len(text) > room:
            self.cut += len(text[max(room, 0):].encode("utf-8", "surrogatepass"))
            text = text[:max(room, 0)]
        if text:
            self.parts.append(text)
            self.size += len(text)

    def text(self) -> str:
        return "".join(self.parts) + (cut_marker(self.cut) if self.cut else "")


@dataclass
class NodeState:
    plan: NodePlan
    exit_code: int | None = None
    exit_signal: int | None = None
    exited: bool = False
    lost: str | None = None
    launcher_tail: collections.deque = field(default_factory=_tail)

    @property
    def done(self) -> bool:
        return self.exited or self.lost is not None


class JobWatch:
    """State of one attempt of a job, fed by agent events."""

    def __init__(self, plan: LaunchPlan, sinks: list[Sink]):
        self.plan = plan
        self.sinks = sinks
        self.nodes: dict[str, NodeState] = {n.host.name: NodeState(plan=n) for n in plan.nodes}
        self.tails: dict[int, collections.deque] = collections.defaultdict(_tail)
        self.failures: list[Failure] = []
        #: Ranks terminated by a signal, held until their node's exit says whether it failed.
        self.soft: dict[str, list[Failure]] = {}
        self.stopping = False
        #: When a rank last wrote anything (for --hang-timeout).
        self.last_progress = time.monotonic()
        self._seq = itertools.count()
        #: Ranks that exited with code 0 while the job still ran: (seq, host, rank).
        self.clean_exits: list[tuple[int, str, int]] = []
        #: Pieces of a line too long for one event (the agent marks them ``more``).
        self._pieces: dict[tuple[str, int | None, str], _Pieces] = {}
        #: The first traceback each rank printed: (host, rank) -> its exception
        #: line.  A run can succeed with one (the script caught the error and
        #: went on, or exited 0): the summary says so.
        self.tracebacks: dict[tuple[str, int], str] = {}
        self._in_traceback: set[tuple[str, int]] = set()

    def _note_traceback(self, host: str, rank: int, text: str) -> None:
        """Keep the exception line of a rank's first Python traceback: the
        first unindented line after ``Traceback (most recent call last):``."""
        key = (host, rank)
        if key in self.tracebacks:
            return
        line = _RANK_PREFIX.sub("", text.rstrip(), count=1)  # torch's own "[rank1]: " prefix
        if line.endswith(_TRACEBACK):
            self._in_traceback.add(key)
        elif key in self._in_traceback and line and not line[0].isspace():
            self._in_traceback.discard(key)
            self.tracebacks[key] = line[:300]

    def _note_tracebacks(self, host: str, rank: int, texts: list[str]) -> None:
        """``_note_traceback`` for a batch of lines: outside a traceback only
        its first line changes anything, so the rest are skipped unread."""
        key, i = (host, rank), 0
        while key not in self.tracebacks and i < len(texts):
            if key not in self._in_traceback:
                i = next((j for j in range(i, len(texts)) if _TRACEBACK in texts[j]), len(texts))
                if i == len(texts):
                    return
            self._note_traceback(host, rank, texts[i])
            i += 1

    # -- events ------------------------------------------------------------

    def event(self, host: str, ev: dict) -> None:
        kind = ev.get("ev")
        node = self.nodes.get(host)
        if node is None:
            return
        if kind in ("line", "lines", "status") and ev.get("r") is not None:
            self.last_progress = time.monotonic()
        if kind == "line":
            rank = ev.get("r")
            text = self._join(host, rank, ev.get("s", "out"), ev.get("t", ""), bool(ev.get("more")))
            if text is not None:
                self._lines(host, node, rank, ev.get("s", "out"), [text])
        elif kind == "lines":
            rank, stream = ev.get("r"), ev.get("s", "out")
            self._lines(host, node, rank, stream, self._join_all(host, rank, stream, ev.get("ts", [])))
        elif kind == "status":
            for s in self.sinks:
                s.status(host, ev.get("r"), ev.get("t", ""))
        elif kind == "rank_exit":
            self._rank_exit(host, ev)
        elif kind == "exit":
            node.exited = True
            node.exit_code = ev.get("code")
            node.exit_signal = ev.get("sig")
            if ev.get("error"):
                self._fail(Failure(host=host, rank=None, kind="start", reason=ev["error"], code=127))
            elif (node.exit_code or node.exit_signal) and not self.stopping:
                for soft in self.soft.pop(host, []):
                    self._fail(soft)
                if node.plan.pipe_rank is not None:
                    self._rank_from_node_exit(host, node)
                else:
                    self._rank_from_launcher(host, node)
                self._fail(Failure(host=host, rank=None, kind="signal" if node.exit_signal else "exit",
                                   code=node.exit_code, signal=node.exit_signal,
                                   consequential=True))  # the rank that caused it is reported separately
            elif (node.exit_code or node.exit_signal) and node.plan.pipe_rank is not None:
                # Stopping already, because a rank reported first (a Lightning
                # child that lost its peer): this node's own rank may be the
                # one that failed, its exit only arriving after its children's.
                self._rank_from_node_exit(host, node)
            elif node.exit_code or node.exit_signal:
                # Stopping already because another node's rank saw its peer
                # vanish: this node, given the grace to report, may hold the
                # rank that went first -- one whose status torchrun reaped
                # before the agent looked and that wrote no exception (a full
                # disk, ``sys.exit(1)``).  torchrun's summary names it.
                cause = self.root_cause()
                if cause is not None and cause.consequential:
                    self._rank_from_launcher(host, node, stopping=True)
        elif kind == "closed":
            if not node.exited:
                self.lose(host, ev.get("error") or "the connection to its agent closed")
        elif kind == "fatal" and not node.exited:  # one failure per node, however many it sends
            self._fail(Failure(host=host, rank=None, kind="start", reason=str(ev.get("t"))))
            node.exited = True

    def _lines(self, host: str, node: NodeState, rank: int | None, stream: str, texts: list[str]) -> None:
        """Complete lines of one rank (or launcher), in order: into its tail
        and every sink, a batch at once where the sink takes one (``line_batch``)."""
        (self.tails[rank] if rank is not None else node.launcher_tail).extend(t[:TAIL_LINE_CHARS] for t in texts)
        if rank is not None:
            self._note_tracebacks(host, rank, texts)
        for s in self.sinks:
            # A method of its own name: a sink's data may be called "lines" (doctor's capture is).
            batch = getattr(s, "line_batch", None)
            if callable(batch):
                batch(host, rank, stream, texts)
            else:
                for text in texts:
                    s.line(host, rank, stream, text)

    def _join_all(self, host: str, rank: int | None, stream: str, texts: list[str]) -> list[str]:
        """A batch of complete lines: only its first can end a line sent in
        pieces before it; each is held to ``MAX_LINE`` as ``_join`` does."""
        if not texts:
            return []
        if (host, rank, stream) not in self._pieces and max(map(len, texts)) <= MAX_LINE + MARKER_ROOM:
            return texts
        joined = (self._join(host, rank, stream, t, False) for t in texts)
        return [t for t in joined if t is not None]

    def _join(self, host: str, rank: int | None, stream: str, text: str, more: bool) -> str | None:
        """The whole line once its last piece arrives (None while more follow);
        a line is cut at ``MAX_LINE`` characters, with a marker saying how
        much was dropped (the node's relay cuts first; a node that does not
        is held to the same bound here)."""
        key = (host, rank, stream)
        pieces = self._pieces.get(key)
        if pieces is None and not more and len(text) <= MAX_LINE + MARKER_ROOM:
            return text
        if pieces is None:
            pieces = self._pieces[key] = _Pieces()
        pieces.add(text)
        if more:
            return None
        del self._pieces[key]
        return pieces.text()

    def _rank_exit(self, host: str, ev: dict) -> None:
        code, sig, exc = ev.get("code"), ev.get("sig"), ev.get("exc")
        if not code and not sig and not exc and not self.stopping and ev.get("r") is not None:
            # code 0, or None: reaped by its launcher before the agent read the
            # status (a failed one is then named by the launcher's own report)
            self.clean_exits.append((next(self._seq), host, int(ev["r"])))
        if not code and not sig and not exc:
            # A clean exit, or one whose status the launcher reaped before the
            # agent looked: the node's own exit code says which.
            return
        if self.stopping and (sig in _TERMINATED or sig == int(_signal.SIGKILL) or code in (143, 137)):
            return  # our own teardown
        if sig in _TERMINATED and not exc:
            # Terminated by someone (its launcher tearing down, Lightning's main
            # process exiting first): a failure only if its node then fails.
            self.soft.setdefault(host, []).append(
                Failure(host=host, rank=ev.get("r"), kind="signal", signal=sig, consequential=True))
            return
        if not exc and code and not sig and ev.get("r") is not None:
            # No uncaught exception, but an exit code: a script that prints its
            # traceback itself and exits (traceback.print_exc(); os._exit(1), as
            # NVIDIA's torchrun_main decorator does) names its error that way.
            exc = _exception_line(list(self.tails[ev.get("r")])[-30:])
        consequential = bool(exc and (_PEER_FAILURE.search(exc) or _STOPPED.search(exc)))
        if not consequential and not exc:
            # No exception line recorded: look at what the rank last wrote.
            tail = "\n".join(list(self.tails[ev.get("r")])[-30:])
            consequential = bool(_PEER_FAILURE.search(tail))
        self._fail(Failure(host=host, rank=ev.get("r"), kind="signal" if sig else "exit",
                           code=code, signal=sig, exc=exc, consequential=consequential))

    def _rank_from_launcher(self, host: str, node: NodeState, stopping: bool = False) -> None:
        """The failed rank as torchrun's own summary names it, when the agent saw no rank fail.

        The agent reads a rank's exit status from /proc while the launcher has
        not reaped it yet; a rank that exits (``sys.exit(7)``, no exception)
        and is reaped at once leaves only torchrun's "Root Cause" block.
        """
        if any(f.host == host and f.rank is not None and not f.consequential for f in self.failures):
            return
        found = _torchrun_root_cause(list(node.launcher_tail))
        if found is None:
            return
        rank, code = found
        if stopping and code < 0 and (-code in _TERMINATED or -code == int(_signal.SIGKILL)):
            return  # our own teardown reached it
        tail = "\n".join(list(self.tails[rank])[-30:])
        self._fail(Failure(host=host, rank=rank, kind="signal" if code < 0 else "exit",
                           code=code if code > 0 else None, signal=-code if code < 0 else None,
                           consequential=bool(_PEER_FAILURE.search(tail))))

    def _rank_from_node_exit(self, host: str, node: NodeState) -> None:
        """The node's process is itself a rank (Lightning's main process is
        local rank 0 and spawns the others; the command launcher's one process
        per node): its exit is that rank's failure, with the exception its
        output ends with.  Without this, a Lightning child that was only told
        to stop (SIGTERM, "Connection closed by peer") would be blamed."""
        rank = node.plan.pipe_rank
        if any(f.host == host and f.rank == rank and not f.consequential for f in self.failures):
            return
        code, sig = node.exit_code, node.exit_signal
        if self.stopping and (sig in _TERMINATED or sig == int(_signal.SIGKILL) or code in (143, 137)):
            return  # our own teardown
        tail = list(self.tails[rank])[-TAIL_LINES:]
        exc = _exception_line(tail)
        if exc is not None:
            consequential = bool(_PEER_FAILURE.search(exc) or _STOPPED.search(exc))
        else:
            consequential = (self.stopping or sig in _TERMINATED
                             or bool(_PEER_FAILURE.search("\n".join(tail[-30:]))))
        self._fail(Failure(host=host, rank=rank, kind="signal" if sig else "exit",
                           code=code or None, signal=sig or None, exc=exc, consequential=consequential))

    def lose(self, host: str, reason: str, *, closed_by_us: bool = False) -> None:
        """``host`` is gone; ``closed_by_us``: its channel was dropped by the
        head's own teardown (a second Ctrl-C, a node that did not stop in
        time), which never makes it the job's cause."""
        node = self.nodes[host]
        if node.done:
            return
        node.lost = reason
        cause = self.root_cause() if self.stopping and not closed_by_us else None
        if not self.stopping or (cause is not None and cause.consequential):
            # While stopping on a rank that only saw its peer vanish, a node
            # that then stays silent is that vanished peer: the cause.  (Over
            # srun a dead node's channel stays open until Slurm gives up on it;
            # the other ranks' "connection closed by peer" comes first.)
            self._fail(Failure(host=host, rank=None, kind="lost", reason=reason))

    def hang(self, host: str, rank: int | None, reason: str) -> None:
        """No rank progressed for --hang-timeout (exit code 124, like timeout(1))."""
        self._fail(Failure(host=host, rank=rank, kind="hang", code=124, reason=reason))

    def _fail(self, f: Failure) -> None:
        self.failures.append(Failure(**{**f.__dict__, "seq": next(self._seq)}))

    # -- decisions ---------------------------------------------------------

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    @property
    def all_done(self) -> bool:
        return all(n.done for n in self.nodes.values())

    def left_early(self, failure: Failure) -> list[tuple[str, int]]:
        """Ranks that had exited cleanly before ``failure``, when it is the echo
        of a vanished peer: their leaving is the likely cause (uneven work per
        rank, an early ``return`` on one rank)."""
        if not failure.consequential:
            return []
        failed = {(f.host, f.rank) for f in self.failures}
        return [(host, rank) for seq, host, rank in self.clean_exits
                if seq < failure.seq and (host, rank) not in failed]

    def root_cause(self) -> Failure | None:
        if not self.failures:
            return None
        return min(self.failures, key=lambda f: (f.consequential, f.rank is None and f.kind != "lost", f.seq))

    def tail_for(self, failure: Failure, n: int = 30) -> list[str]:
        """The lines that explain a failure: its traceback if there is one."""
        if failure.rank is not None:
            lines = list(self.tails[failure.rank])
        else:
            lines = list(self.nodes[failure.host].launcher_tail)
        start = None
        for i in range(len(lines) - 1, -1, -1):
            if "Traceback (most recent call last)" in lines[i]:
                start = i
                break
        shown = lines[start:][-n:] if start is not None else lines[-n:]
        return [terminal_safe(line) for line in shown]  # printed in the summary

    def text_for_diagnosis(self, failure: Failure) -> str:
        """Everything the head kept of the failed rank and its node's launcher."""
        parts = []
        if failure.rank is not None:
            parts.append("\n".join(self.tails[failure.rank]))
        parts.append("\n".join(self.nodes[failure.host].launcher_tail))
        return "\n".join(p for p in parts if p)


def node_notice(host: str, ev: dict, *, interrupted: bool) -> str | None:
    """What a node's agent did on its own that the user should hear of: it
    killed processes still running when a stop's grace ran out (said after an
    interrupt, where the user may want more time), or processes the job's
    launcher left behind when it ended."""
    names = ", ".join(str(n) for n in ev.get("names") or ())
    if ev.get("ev") == "killed" and interrupted:
        grace = float(ev.get("grace") or 0)
        return (f"{host}: {ev.get('n')} process(es) still running {grace:g} s after the stop signal were "
                f"killed ({names}); a script that saves a checkpoint when stopped may need more time: "
                "--grace SECONDS (torchrun waits 30); or a handler ignores the signal or waits on ranks "
                "already stopped (Lightning's SIGTERM handler can)")
    if ev.get("ev") == "leftover":
        return (f"{host}: the job's launcher ended; stopping {ev.get('n')} process(es) it left running "
                f"({names}): corral leaves nothing behind on a node")
    return None
