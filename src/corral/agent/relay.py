"""The agent's output relay: lines and status updates from ranks and launchers (stdlib only).

Shipped to nodes as ``corral_agent_relay``.  Ranks write to node-local files
(see ``hook/sitecustomize.py``) that ``RankTailer`` tails, so a slow head never
blocks a training step; launcher pipes are pumped by ``pump_pipe``.  Every
event is one JSON line on the agent's protocol channel; the complete lines one
read gave are one ``lines`` event (a flood of 100,000 lines/s is then a few
thousand frames, not one per line).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import threading
import time

try:  # on a node, modules are installed under their wire names
    from corral_agent_proctree import _zombie_status, descendants
except ImportError:  # imported as part of the corral package (tests, head)
    from corral.agent.proctree import _zombie_status, descendants

#: How often rank log files are polled.
TAIL_INTERVAL_S = 0.02
#: Longest partial line kept before it is sent anyway.
MAX_PARTIAL = 64 * 1024
#: Longest line sent (bytes); the rest is dropped as it arrives, never
#: buffered, and the line ends with a marker saying how much.  The head holds
#: lines to the same bound (``corral.frames.MAX_LINE``; a test keeps the two equal).
MAX_LINE = 1024 * 1024
#: Most lines in one ``lines`` event, and most characters of text in one
#: (a longer line goes alone); the head refuses a batch past ``MAX_BATCH``
#: (``corral.frames.MAX_BATCH``; a test keeps the two equal).
MAX_BATCH = 1024
BATCH_CHARS = 64 * 1024
#: Cursor-up escapes at the end of a segment (tqdm moving back from a bar it
#: drew lower down), and one of them.
_CURSOR_UPS = re.compile(rb"(?:\x1b\[\d*A)+$")
_CURSOR_UP = re.compile(rb"\x1b\[(\d*)A")


class Channel:
    """Writes events to the head; thread-safe; never raises into callers."""

    def __init__(self, fd: int):
        self._f = os.fdopen(fd, "wb", buffering=0)
        self._lock = threading.Lock()
        self.broken = False

    def send(self, **event: object) -> None:
        data = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self.broken:
                return
            try:
                self._f.write(data)
            except (BrokenPipeError, OSError):
                self.broken = True


class LineSplitter:
    """Split a byte stream into newline lines and carriage-return updates.

    A ``\\r`` not followed by ``\\n`` ends a *status* segment (tqdm redraws);
    only the latest status per read is kept, so a progress bar becomes one
    live status line instead of a flood.

    A bar drawn below the cursor (tqdm's ``position=N``, one bar per rank,
    or an inner bar) moves down with N newlines, draws, and moves back up
    with N cursor-ups (``ESC[A``): such a segment is a status too, and the
    newlines its cursor-ups take back are movement, not lines.  Empty lines
    are held until the next text for that reason (a bar's cursor-ups come
    after the newlines they cancel), and sent in order before it.
    """

    def __init__(self) -> None:
        self.buf = b""
        #: Empty lines held back (see the class docstring).
        self.blank = 0
        #: Bytes of the current line sent already in pieces, and dropped past ``MAX_LINE``.
        self.sent = 0
        self.cut = 0

    def _bounded(self, seg: bytes, more: bool) -> list:
        """``seg`` as the next piece of the current line (or its end), within
        ``MAX_LINE``: what is past it only counted; the end of a cut line
        carries the marker."""
        room = MAX_LINE - self.sent
        if len(seg) > room:
            keep = _char_boundary(seg, room) if room > 0 else 0
            self.cut += len(seg) - keep
            seg = seg[:keep]
        self.sent += len(seg)
        if more:
            return [(seg, True)] if seg else []
        if self.cut:
            seg += ("\u2026[cut %d bytes]" % self.cut).encode("utf-8")
        self.sent = self.cut = 0
        return [(seg, False)]

    def _take_up(self, seg: bytes) -> tuple:
        """``seg`` without the cursor-ups it ends with, and whether it had any;
        those cancel as many held empty lines."""
        m = _CURSOR_UPS.search(seg)
        if not m:
            return seg, False
        ups = sum(int(n or b"1") for n in _CURSOR_UP.findall(m.group(0)))
        self.blank -= min(self.blank, ups)
        return seg[: m.start()], True

    def _blanks(self) -> list:
        out, self.blank = [(b"", False)] * self.blank, 0
        return out

    def feed(self, data: bytes) -> tuple:
        """Return (lines, last_status) for this chunk.

        A line longer than ``MAX_PARTIAL`` without its newline yet is sent in
        pieces, each ``(piece, True)`` ("more follows"), cut between UTF-8
        characters; the head joins them back into one line."""
        self.buf += data.replace(b"\r\n", b"\n")
        lines = []
        status = None
        while True:
            i_n = self.buf.find(b"\n")
            i_r = self.buf.find(b"\r")
            if i_n < 0 and i_r < 0:
                break
            if i_r >= 0 and (i_n < 0 or i_r < i_n):
                if i_r == len(self.buf) - 1:
                    break  # a '\r' at the end may be the start of '\r\n'
                seg, self.buf = self.buf[:i_r], self.buf[i_r + 1 :]
                seg, _ = self._take_up(seg)
                if seg.strip():
                    status = seg
                continue
            seg, self.buf = self.buf[:i_n], self.buf[i_n + 1 :]
            seg, moved = self._take_up(seg)
            if moved:
                # a bar drawn lower down: a redraw, and this newline is the
                # next draw's move down
                if seg.strip():
                    status = seg
                self.blank += 1
                continue
            if not seg:
                self.blank += 1
                continue
            lines += self._blanks()
            lines += self._bounded(seg, False)
            status = None
        if len(self.buf) > MAX_PARTIAL:
            cut = _char_boundary(self.buf, len(self.buf) - 1)  # keep a trailing '\r' for '\r\n'
            lines += self._blanks()
            lines += self._bounded(self.buf[:cut], True)
            self.buf = self.buf[cut:]
        return lines, status

    def flush(self) -> list:
        rest, self.buf = self.buf, b""
        rest, _ = self._take_up(rest.rstrip(b"\r"))
        return self._blanks() + (self._bounded(rest, False) if rest or self.sent else [])


def _char_boundary(b: bytes, end: int) -> int:
    """The largest cut <= ``end`` that does not split a UTF-8 character."""
    cut = end
    while cut > end - 4 and cut > 0 and (b[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut if cut > end - 4 else end


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


class Relay:
    """Emit line/status events for one source (a rank file or a pipe).

    Status updates (``\r`` redraws) are throttled to ``STATUS_EVERY_S``;
    ``tick`` sends the latest one when it is due, so the final state of a bar
    is never lost and a fast bar never floods the channel.
    """

    STATUS_EVERY_S = 0.1

    def __init__(self, chan: Channel, rank, stream: str, label: str = ""):
        self.chan = chan
        self.rank = rank
        self.stream = stream
        #: Put before each line (a rank outside the plan, relayed as its node's own output).
        self.label = label
        #: The last line sent was a piece: the next one continues it (no label).
        self.cont = False
        self.splitter = LineSplitter()
        self.lock = threading.Lock()
        self.pending = None
        self.last_status = 0.0

    def _lines(self, lines: list) -> None:
        """Send ``lines`` ((bytes, more) in order) in as few events as the
        bounds allow: complete lines batched, a piece of a cut line alone."""
        batch: list = []
        size = 0
        for line, more in lines:
            text = _text(line) if self.cont else self.label + _text(line)
            self.cont = more
            if more:
                self._send(batch)
                batch, size = [], 0
                self.chan.send(ev="line", r=self.rank, s=self.stream, t=text, more=1)
                continue
            if batch and (len(batch) >= MAX_BATCH or size + len(text) > BATCH_CHARS):
                self._send(batch)
                batch, size = [], 0
            batch.append(text)
            size += len(text)
        self._send(batch)

    def _send(self, batch: list) -> None:
        if len(batch) == 1:
            self.chan.send(ev="line", r=self.rank, s=self.stream, t=batch[0])
        elif batch:
            self.chan.send(ev="lines", r=self.rank, s=self.stream, ts=batch)

    def feed(self, data: bytes) -> None:
        with self.lock:
            lines, status = self.splitter.feed(data)
            if lines:
                self.pending = None  # a finished line supersedes a half-drawn bar
                self._lines(lines)
            if status is not None:
                self.pending = status
        self.tick()

    def tick(self) -> None:
        with self.lock:
            now = time.monotonic()
            if self.pending is not None and now - self.last_status >= self.STATUS_EVERY_S:
                self.chan.send(ev="status", r=self.rank, s=self.stream, t=self.label + _text(self.pending))
                self.pending = None
                self.last_status = now

    def close(self) -> None:
        with self.lock:
            self._lines([(line, False) for line, _ in self.splitter.flush()])


def pump_pipe(pipe, relay: Relay) -> None:
    """Relay a launcher pipe until EOF (runs in its own thread)."""
    fd = pipe.fileno()
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        relay.feed(data)
    relay.close()


def _open_own(path: str) -> int:
    """A rank file, read-only: a regular file of ours, not a symbolic link
    (which would relay or parse whatever it points to)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not a regular file of this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _environ(pid: int) -> dict:
    """The environment ``pid`` was started with ({} when unreadable)."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return {}
    out = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def _span(ranks) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return "%d-%d" % (ranks[0], ranks[-1]) if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))


class RankTailer(threading.Thread):
    """Tail ``rank<N>.log`` (stdout and stderr, in write order) of the rank hook.

    Also watches each rank's main pid (``rank<N>.pid``) and reports its exit
    with the status the hook recorded (``rank<N>.status``), so the head learns
    which rank failed first even when the launcher reports it late or not at
    all.

    The head takes only the ranks its plan gave this node (``ranks``, first
    and last + 1): a rank outside them (a launcher the job starts itself,
    ``torchrun`` under ``--launcher command``) is relayed as the node's own
    output, each line labelled ``[rank N]``, and its exit is not reported.
    """

    def __init__(self, chan: Channel, log_dir: str, ranks=None):
        super().__init__(name="tail", daemon=True)
        self.chan = chan
        self.log_dir = log_dir
        #: This node's planned ranks (None: any); other ranks' pid and status
        #: files are ignored, their logs relayed as the node's own output.
        self.ranks = ranks
        self.files: dict = {}  # name -> [fd, Relay]
        self.pids: dict = {}  # rank -> pid
        self.exited: set = set()
        #: Files refused (said once each).
        self.refused: set = set()
        self.stop_evt = threading.Event()

    def run(self) -> None:
        while not self.stop_evt.is_set():
            self.poll()
            self.stop_evt.wait(TAIL_INTERVAL_S)
        self.poll()
        for fd, relay in self.files.values():
            relay.close()
            os.close(fd)
        self.files.clear()

    def poll(self) -> None:
        try:
            names = sorted(os.listdir(self.log_dir))
        except OSError:
            return
        for name in names:
            base, _, ext = name.partition(".")
            if not base.startswith("rank") or not base[4:].isdigit() or ext not in ("log", "pid"):
                continue
            rank = int(base[4:])
            if name in self.files or name in self.refused or (ext == "pid" and rank in self.pids):
                continue  # (a refused pid file is read again: the rank's own may replace it)
            planned = self.ranks is None or rank in self.ranks
            if not planned and ext == "pid":
                self.refuse(name, "rank %d is not one of this node's ranks (%s)" % (rank, _span(self.ranks)))
                continue
            try:
                fd = _open_own(os.path.join(self.log_dir, name))
            except OSError as e:
                if not isinstance(e, FileNotFoundError):  # a pid file between its write and rename
                    self.refuse(name, e.strerror or str(e))
                continue
            if ext == "log":
                # A rank outside the plan (a torchrun of the job's own under
                # --launcher command) is the node's output, labelled, never
                # a rank of the job's.
                relay = Relay(self.chan, rank, "log") if planned else Relay(self.chan, None, "log", "[rank %d] " % rank)
                self.files[name] = [fd, relay]
                continue
            try:
                pid = int(os.read(fd, 64).strip() or 0)
            except ValueError:
                pid = 0
            finally:
                os.close(fd)
            if (name, pid) in self.refused:
                continue
            why = self._pid_doubt(rank, pid)
            if why is None:
                self.pids[rank] = pid
                # the hook wrote it before any user code: the rank is starting it now
                self.chan.send(ev="rank_start", r=rank)
            elif pid > 0 and not os.path.exists("/proc/%d" % pid):
                # Exited (and reaped) before the agent looked: nothing left to
                # verify it by; its launcher's report names it.
                self.refused.add((name, pid))
            else:
                self.refuse((name, pid), why)
        for name in sorted(self.files):
            fd, relay = self.files[name]
            while True:
                data = os.read(fd, 65536)
                if not data:
                    break
                relay.feed(data)
            relay.tick()
        for rank, pid in list(self.pids.items()):
            if rank in self.exited or pid <= 0:
                continue
            status = _zombie_status(pid)
            if status is not None or not os.path.exists("/proc/%d" % pid):
                self.exited.add(rank)
                event = {"code": None, "sig": None, "exc": self._exception(rank)}
                if status is not None:
                    # waitpid(2) encoding, read while the launcher has not reaped it yet.
                    if status & 0x7F:
                        event["sig"] = status & 0x7F
                    else:
                        event["code"] = (status >> 8) & 0xFF
                self.chan.send(ev="rank_exit", r=rank, **event)

    def refuse(self, key, why: str) -> None:
        """A rank file (``key``: its name, or a pid file's (name, pid)) the
        agent does not trust: ignored, and said once."""
        self.refused.add(key)
        name = key[0] if isinstance(key, tuple) else key
        self.chan.send(ev="log", level="warning", t="ignored %s in the job's log directory: %s" % (name, why))

    def _pid_doubt(self, rank: int, pid: int):
        """Why ``pid`` cannot be rank ``rank``'s process; None if it can.

        Only a live process of this agent's own tree, not another rank's,
        and (for a freshly started interpreter of this job) one whose
        environment gives it this rank: a rank that wrote another's pid file
        is not believed, and no process outside the job is watched or
        signalled."""
        if pid <= 0:
            return "not a process id"
        if pid in self.pids.values():
            return "process %d is already another rank's" % pid
        if pid not in descendants(os.getpid()):
            return "process %d is not one of this job's" % pid
        env = _environ(pid)
        if env.get("CORRAL_LOG_DIR") == self.log_dir and env.get("RANK", "").isdigit() \
                and int(env["RANK"]) != rank:
            return "process %d is rank %s" % (pid, env["RANK"])
        return None

    def _exception(self, rank: int):
        """The exception the hook recorded for ``rank``: only from a status
        that names this rank and its registered process."""
        try:
            fd = _open_own(os.path.join(self.log_dir, "rank%d.status" % rank))
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                status = json.loads(f.read(65536).decode("utf-8", "replace"))
        except (OSError, ValueError):
            return None
        pid = self.pids.get(rank)
        if not isinstance(status, dict) or status.get("rank") != rank or status.get("pid") != pid:
            self.refuse("rank%d.status" % rank, "it does not name rank %d's process %s" % (rank, pid))
            return None
        exc = status.get("exc")
        return exc if isinstance(exc, str) else None

    def workers(self) -> list:
        """The Python processes live ranks started themselves (mp.spawn
        workers), as the hook registered them in ``rank<N>.w<pid>.pid``: only
        a rank's own children still in this agent's tree; [(rank, pid)]."""
        mine = set(descendants(os.getpid()))
        found = []
        try:
            names = sorted(os.listdir(self.log_dir))
        except OSError:
            return found
        for name in names:
            parts = name.split(".")
            if len(parts) != 3 or parts[2] != "pid" or not parts[0].startswith("rank") or not parts[1].startswith("w"):
                continue
            try:
                rank = int(parts[0][4:])
                with os.fdopen(_open_own(os.path.join(self.log_dir, name)), "rb") as f:
                    pid, ppid = (int(x) for x in f.read(64).split())
            except (OSError, ValueError):
                continue
            if pid in mine and self.pids.get(rank) == ppid and rank not in self.exited:
                found.append((rank, pid))
        return found

    def signal_ranks(self, sig: int) -> list:
        """Signal each rank's main process (only pids the hook registered)."""
        mine = set(descendants(os.getpid()))
        done = []
        for rank, pid in self.pids.items():
            if pid in mine and rank not in self.exited:
                try:
                    os.kill(pid, sig)
                    done.append(rank)
                except OSError:
                    pass
        return done
