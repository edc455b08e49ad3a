"""Where frames from a node's agent enter the head: read bounded, checked, or dropped.

Everything a node sends is untrusted input.  Any process of the job's user
on a node can write into its agent's channel (``/proc/<agent>/fd/N``), and a
compromised node can send whatever it likes.  So the head reads the channel
in bounded pieces (``FrameReader``: a frame longer than ``MAX_FRAME`` is
dropped as it arrives, never buffered whole), and every frame is checked
against the schema of its event type (``check_frame``) before anything on
the head sees it: the types and bounds of every field; a rank is an int in
the range the head's own plan gave that node; unknown fields are removed
and unknown event types rejected.  A frame that fails is a protocol error:
it is dropped, counted, and named with the node (the host is the head's own
name for it, never a field of a frame).  No field of a frame ever names a
file, a host, or an allocation the head has not bounded.

The limits are documented in docs/run.md ("Limits on what nodes send").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

#: Longest frame (one JSON line) the head reads; a longer one is dropped as
#: it arrives.  Results of calls (stacks of every rank) are the largest.
MAX_FRAME = 4 * 1024 * 1024
#: Longest output line kept (characters); the rest of a longer line is cut
#: and replaced by a marker saying how much (node side and head side alike).
MAX_LINE = 1024 * 1024
#: Most lines in one ``lines`` event (the complete lines one read of a rank's
#: output gave: a flood is then a frame per read, not a frame per line).
MAX_BATCH = 1024
#: Longest text field other than output (an exception, an error message).
MAX_TEXT = 64 * 1024
#: Longest short name field (a Python version, a log level, a host name).
MAX_NAME = 4096
#: The output streams a line can come from.
STREAMS = ("out", "err", "log")

Event = dict[str, Any]
Check = Callable[[Any, "range | None"], bool]


#: Terminal control a rank's (or a node's) text may carry: CSI sequences
#: (7- and 8-bit), OSC/DCS/SOS/PM/APC strings up to their terminator (or the
#: end of the text), other escape sequences and a bare ESC, C0 controls but
#: tab, newline and carriage return, DEL and C1 controls.
_CONTROL = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x9b[0-?]*[ -/]*[@-~]"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
    r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"
)
#: The one kind that passes: colours and text attributes (SGR, ``ESC[...m``).
_SGR = re.compile(r"\x1b\[[0-9;:]*m")


def terminal_safe(text: str) -> str:
    """``text`` from a node, with every terminal control removed but colours
    (SGR), tab and carriage return.  A rank's output must not set the
    window title (OSC 0), write the clipboard (OSC 52), move the cursor over
    corral's own lines, or send the terminal anything else it would act on."""
    return _CONTROL.sub(_keep_sgr, text)


#: A character that can start something ``terminal_safe`` removes.
_ANY_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def has_control(text: str) -> bool:
    """Whether ``terminal_safe`` could change ``text`` (one scan: a batch of
    lines, joined, is checked at once and most have nothing to clean)."""
    return _ANY_CONTROL.search(text) is not None


def _keep_sgr(m: re.Match) -> str:
    return m.group(0) if _SGR.fullmatch(m.group(0)) else ""


class FrameError(ValueError):
    """A frame that breaks the protocol (the message says what)."""


def cut_marker(dropped: int) -> str:
    """What replaces the part of a line that was cut (``dropped`` bytes)."""
    return f"\u2026[cut {dropped} bytes]"


# -- field checks ------------------------------------------------------------


def _int(v: Any, _: range | None) -> bool:
    return type(v) is int and -(2**63) <= v < 2**63


def _opt_int(v: Any, r: range | None) -> bool:
    return v is None or _int(v, r)


def _bool(v: Any, _: range | None) -> bool:
    return type(v) is bool or (type(v) is int and v in (0, 1))


def _num(v: Any, _: range | None) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and abs(v) < 1e12


def _text(limit: int) -> Check:
    def check(v: Any, _: range | None) -> bool:
        return type(v) is str and len(v) <= limit
    return check


def _opt_text(limit: int) -> Check:
    inner = _text(limit)
    return lambda v, r: v is None or inner(v, r)


def _one_of(*values: str) -> Check:
    return lambda v, _: type(v) is str and v in values


def _names(v: Any, _: range | None) -> bool:
    return type(v) is list and len(v) <= 64 and all(type(n) is str and len(n) <= MAX_NAME for n in v)


def _texts(v: Any, _: range | None) -> bool:
    """A batch of output lines: 1 to ``MAX_BATCH`` strings, each at most
    ``MAX_LINE`` (the frame's own bound holds their total)."""
    return (type(v) is list and 0 < len(v) <= MAX_BATCH and set(map(type, v)) == {str}
            and max(map(len, v)) <= MAX_LINE)


def _any(v: Any, _: range | None) -> bool:
    return True  # a call's value: any JSON, bounded by MAX_FRAME


def _rank(v: Any, ranks: range | None) -> bool:
    """A global rank of this node's plan (no plan: no job, so no rank)."""
    return type(v) is int and ranks is not None and v in ranks


def _opt_rank(v: Any, ranks: range | None) -> bool:
    return v is None or _rank(v, ranks)


def _opt_num(v: Any, _: range | None) -> bool:
    return v is None or _num(v, None)


#: A telemetry sample's rows (``corral.agent.telemetry``): per GPU [index,
#: util %, memory MiB, memory total MiB, power W, temperature C, SM MHz,
#: throttle bits]; per rank [rank, CPU %, RSS MiB, lines/s, bar rate, bar
#: unit]; per interface [name, received B/s, sent B/s, link Mbit/s].
MAX_TM_GPUS = 64
MAX_TM_RANKS = 1024
MAX_TM_NICS = 16
_NIC_NAME = re.compile(r"[A-Za-z0-9_.:@/-]{1,64}")
_UNIT = re.compile(r"[A-Za-z]{1,12}")


def _rows(limit: int, row: Callable[[Any, range | None], bool]) -> Check:
    return lambda v, r: type(v) is list and len(v) <= limit and all(type(x) is list and row(x, r) for x in v)


def _gpu_row(x: list, _: range | None) -> bool:
    return (len(x) == 8 and _int(x[0], None) and 0 <= x[0] < MAX_TM_GPUS and all(_opt_num(v, None) for v in x[1:7])
            and (x[7] is None or _int(x[7], None)))


def _rank_row(x: list, ranks: range | None) -> bool:
    return (len(x) == 6 and _rank(x[0], ranks) and all(_opt_num(v, None) for v in x[1:5])
            and (x[5] is None or (type(x[5]) is str and _UNIT.fullmatch(x[5]) is not None)))


def _nic_row(x: list, _: range | None) -> bool:
    return (len(x) == 4 and type(x[0]) is str and _NIC_NAME.fullmatch(x[0]) is not None
            and all(_opt_num(v, None) for v in x[1:]))


#: Per event type: field -> (check, required).  ``ev`` itself is implied.
#: ``closed`` is not here: the head makes it itself when a channel ends, and a
#: node that sends one (to have itself declared lost) breaks the protocol.
SCHEMA: dict[str, dict[str, tuple[Check, bool]]] = {
    "hb": {},
    "hello": {"proto": (_int, True), "pid": (_int, False), "python": (_text(MAX_NAME), False),
              "executable": (_text(MAX_NAME), False), "hostname": (_text(MAX_NAME), False),
              "subreaper": (_bool, False), "uid": (_int, False)},
    "line": {"r": (_opt_rank, True), "s": (_one_of(*STREAMS), False), "t": (_text(MAX_LINE), True),
             "more": (_bool, False)},
    "lines": {"r": (_opt_rank, True), "s": (_one_of(*STREAMS), False), "ts": (_texts, True)},
    "status": {"r": (_opt_rank, True), "s": (_one_of(*STREAMS), False), "t": (_text(MAX_LINE), True)},
    "started": {"pid": (_int, True)},
    "rank_start": {"r": (_rank, True)},
    "rank_exit": {"r": (_rank, True), "code": (_opt_int, False), "sig": (_opt_int, False),
                  "exc": (_opt_text(MAX_TEXT), False)},
    "exit": {"code": (_opt_int, False), "sig": (_opt_int, False), "error": (_opt_text(MAX_TEXT), False)},
    "result": {"id": (_int, True), "value": (_any, False), "error": (_text(MAX_TEXT), False)},
    "log": {"level": (_text(16), False), "t": (_text(MAX_TEXT), True)},
    "fatal": {"t": (_text(MAX_TEXT), True), "kind": (_text(64), False)},
    "killed": {"n": (_int, True), "names": (_names, False), "grace": (_num, False)},
    "leftover": {"n": (_int, True), "names": (_names, False)},
    # A rank's flight recorder dump (``agent/flightrec.py``): parsed on the head
    # as untrusted data (``diagnose/flightrec.py``), never unpickled freely.
    "flightrec": {"r": (_rank, True), "pid": (_opt_int, False), "name": (_text(MAX_NAME), True),
                  "fmt": (_one_of("json", "pickle"), True), "data": (_text(MAX_FRAME), True)},
    "tm": {"t": (_num, True), "gpu": (_rows(MAX_TM_GPUS, _gpu_row), False),
           "rank": (_rows(MAX_TM_RANKS, _rank_row), False), "nic": (_rows(MAX_TM_NICS, _nic_row), False)},
}


def _describe(v: Any) -> str:
    """A bad value for a message: its repr, short (it is the node's text)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_frame(raw: bytes, ranks: range | None) -> Event:
    """The event in one frame, with only the fields its schema knows.

    ``ranks`` is the range of global ranks the head's plan gave this node
    (None while no job is planned).  Raises ``FrameError`` saying what is
    wrong; the caller names the node."""
    try:
        ev = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the stack
        raise FrameError("not a JSON object") from None
    if type(ev) is not dict:
        raise FrameError("not a JSON object")
    kind = ev.get("ev")
    schema = SCHEMA.get(kind) if type(kind) is str else None
    if schema is None:
        raise FrameError(f"unknown event type {_describe(kind)}")
    fast = _fast_output(kind, ev, ranks)
    if fast is not None:
        return fast
    out: Event = {"ev": kind}
    for name, (check, required) in schema.items():
        if name not in ev:
            if required:
                raise FrameError(f"{kind} event without its {name!r} field")
            continue
        value = ev[name]
        if not check(value, ranks):
            if name == "r":
                where = f"{ranks.start}-{ranks.stop - 1}" if ranks else "none: no job planned"
                raise FrameError(f"{kind} event for rank {_describe(value)}, not one of this node's ranks "
                                 f"({where})")
            raise FrameError(f"{kind} event with a bad {name!r} field: {_describe(value)}")
        out[name] = value
    return out


def _fast_output(kind: str, ev: dict, ranks: range | None) -> Event | None:
    """A well-formed ``line``/``lines``/``status``/``hb`` (nearly every frame), checked
    without the per-field calls; None for anything else (the full check then
    decides, and words the error)."""
    if kind == "hb":
        return {"ev": "hb"}
    if kind not in ("line", "status", "lines"):
        return None
    r, t, s = ev.get("r", ""), ev.get("t"), ev.get("s", "out")
    if not (r is None or (type(r) is int and ranks is not None and r in ranks)):
        return None
    if kind == "lines":
        ts = ev.get("ts")
        if not _texts(ts, None) or type(s) is not str or s not in STREAMS:
            return None
        return {"ev": kind, "r": r, "s": s, "ts": ts}
    if type(t) is not str or len(t) > MAX_LINE or type(s) is not str or s not in STREAMS:
        return None
    out: Event = {"ev": kind, "r": r, "s": s, "t": t}
    if kind == "line" and "more" in ev:
        more = ev["more"]
        if not _bool(more, None):
            return None
        out["more"] = more
    return out


class FrameReader:
    """Splits a channel's bytes into frames, never holding more than
    ``limit`` bytes of one: the rest of a longer frame is dropped as it
    arrives, and the frame is reported by its size instead."""

    def __init__(self, limit: int = MAX_FRAME):
        self.limit = limit
        self._buf = bytearray()
        #: Bytes dropped of the frame now arriving (0: not over the limit).
        self._over = 0

    def feed(self, data: bytes) -> list[bytes | int]:
        """Whole frames in ``data`` (bytes, without the newline), or for a
        frame over the limit the number of bytes it had (an int)."""
        out: list[bytes | int] = []
        if not self._buf and not self._over:
            # The common case, no frame half read: whole frames are slices.
            *whole, last = data.split(b"\n")
            if all(len(f) <= self.limit for f in whole) and len(last) <= self.limit:
                self._buf += last
                return list(whole)
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            if self._over:
                self._over += len(piece)
            elif len(self._buf) + len(piece) > self.limit:
                self._over = len(self._buf) + len(piece)
                self._buf.clear()
            else:
                self._buf += piece
            if end < 0:
                break
            if self._over:
                out.append(self._over)
                self._over = 0
            else:
                out.append(bytes(self._buf))
                self._buf.clear()
            start = end + 1
        return out

    def rest(self) -> list[bytes | int]:
        """What was left without a newline at the end of the channel."""
        out: list[bytes | int] = [self._over] if self._over else ([bytes(self._buf)] if self._buf else [])
        self._buf.clear()
        self._over = 0
        return out


@dataclass
class ProtocolErrors:
    """The protocol errors of one node: the first is said at once, the rest
    counted and summarised (a node that floods bad frames gets one warning,
    not one per frame)."""

    host: str
    count: int = 0
    first: str | None = None

    def add(self, why: str) -> str | None:
        """Count one dropped frame; the message to say now, if any."""
        self.count += 1
        if self.first is None:
            self.first = why
            return (f"{self.host}: protocol error: {why}; the frame was dropped (a bug in corral, or "
                    "something on that node writing into its agent's channel; further ones are counted)")
        return None

    def summary(self) -> str | None:
        """The closing count, when more than the first one was dropped."""
        if self.count <= 1:
            return None
        return (f"{self.host}: {self.count} frames were dropped as protocol errors in all "
                f"(the first: {self.first})")
