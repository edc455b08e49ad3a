"""The corral node agent: the one program corral runs on every node.

It is sent over the SSH channel (or a local pipe) by the head, so a node needs
nothing installed but Python 3.8+.  Stdlib only.  It speaks JSON lines: ops
from the head on stdin, events to the head on stdout.

What it is for:

- start the workload in its own session, as a *child subreaper*, so every
  process the workload ever creates stays in the agent's tree even when its
  parent dies or it calls setsid (torchrun starts workers in new sessions);
- relay every output line with its rank and stream, without ever blocking the
  workload on a slow head: ranks write to node-local files (the rank hook, see
  ``hook/sitecustomize.py``), the agent tails them;
- send heartbeats, and kill exactly its own process tree (never by name or
  pattern) when the head says stop, when the head has been silent too long,
  or when the channel closes;
- answer small calls (probes, facts) for preflight and doctor.

Protocol, one JSON object per line.  Head -> agent: ``{"op": ...}`` with ops
``start``, ``stop``, ``signal``, ``call``, ``ping``, ``bye``.  Agent -> head:
``{"ev": ...}`` with events ``hello``, ``hb``, ``line``, ``status``,
``started``, ``rank_exit``, ``exit``, ``result``, ``log``, ``fatal``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

PROTOCOL = 1

#: How often the agent says it is alive, and how long it tolerates a silent head.
HEARTBEAT_S = 1.0
DEFAULT_HEAD_TIMEOUT_S = 10.0
#: How often rank log files are polled.
TAIL_INTERVAL_S = 0.02
#: Longest partial line kept before it is sent anyway.
MAX_PARTIAL = 64 * 1024


# --------------------------------------------------------------------------
# Output channel to the head


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


# --------------------------------------------------------------------------
# Process tree: subreaper, descendants, kill


def become_subreaper() -> bool:
    """Make orphaned descendants reparent to us (Linux >= 3.4).

    Without it, a worker whose launcher died would be reparented to init and
    escape both our tree walk and our cleanup.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:
        return False


def _ppid_map() -> dict:
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: split after the last ')'.
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) > 1:
            parents[int(name)] = int(rest[1])
    return parents


def descendants(root: int) -> list:
    """All live descendants of ``root`` (by parent links in /proc)."""
    if not os.path.isdir("/proc"):
        return []
    parents = _ppid_map()
    children: dict = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def _is_zombie(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2 :].split()[0] == b"Z"
    except OSError:
        return True


def _zombie_status(pid: int):
    """Exit status of a zombie (``/proc/<pid>/stat`` field 52), else None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2 :].split()
    if not rest or rest[0] != b"Z" or len(rest) < 50:
        return None
    return int(rest[49])


def signal_tree(sig: int) -> int:
    """Send ``sig`` to every live descendant of this agent; return how many."""
    n = 0
    for pid in descendants(os.getpid()):
        if _is_zombie(pid):
            continue
        try:
            os.kill(pid, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def _stat_fields(pid: int):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def reap_orphans(keep: set) -> None:
    """Reap zombie children that the workload's tree left to us (we are its subreaper).

    Only children outside the agent's own session: processes the agent itself
    starts (``subprocess.run`` in a ``call`` function) are reaped by their
    Popen, which would otherwise see a vanished child and report exit code 0.
    ``keep`` (the launcher's Popen) is left alone too.
    """
    me = os.getpid()
    my_session = os.getsid(0)
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in keep:
            continue
        fields = _stat_fields(pid)
        # fields: 0 state, 1 ppid, 2 pgrp, 3 session
        if not fields or fields[0] != b"Z" or int(fields[1]) != me or int(fields[3]) == my_session:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def kill_tree(grace: float, keep: set) -> None:
    """SIGTERM everything we started, then SIGKILL what is left after ``grace``."""
    if signal_tree(signal.SIGTERM) == 0:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        reap_orphans(keep)
        if not [p for p in descendants(os.getpid()) if not _is_zombie(p)]:
            return
        time.sleep(0.05)
    for _ in range(50):
        if signal_tree(signal.SIGKILL) == 0:
            return
        time.sleep(0.05)
        reap_orphans(keep)


# --------------------------------------------------------------------------
# Output relay


class LineSplitter:
    """Split a byte stream into newline lines and carriage-return updates.

    A ``\\r`` not followed by ``\\n`` ends a *status* segment (tqdm redraws);
    only the latest status per read is kept, so a progress bar becomes one
    live status line instead of a flood.
    """

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> tuple:
        """Return (lines, last_status) for this chunk."""
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
                if seg.strip():
                    status = seg
                continue
            seg, self.buf = self.buf[:i_n], self.buf[i_n + 1 :]
            lines.append(seg)
            status = None
        if len(self.buf) > MAX_PARTIAL:
            lines.append(self.buf)
            self.buf = b""
        return lines, status

    def flush(self) -> list:
        rest, self.buf = self.buf, b""
        rest = rest.rstrip(b"\r")
        return [rest] if rest else []


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


class Relay:
    """Emit line/status events for one source (a rank file or a pipe).

    Status updates (``\r`` redraws) are throttled to ``STATUS_EVERY_S``;
    ``tick`` sends the latest one when it is due, so the final state of a bar
    is never lost and a fast bar never floods the channel.
    """

    STATUS_EVERY_S = 0.1

    def __init__(self, chan: Channel, rank, stream: str):
        self.chan = chan
        self.rank = rank
        self.stream = stream
        self.splitter = LineSplitter()
        self.lock = threading.Lock()
        self.pending = None
        self.last_status = 0.0

    def feed(self, data: bytes) -> None:
        with self.lock:
            lines, status = self.splitter.feed(data)
            if lines:
                self.pending = None  # a finished line supersedes a half-drawn bar
            for line in lines:
                self.chan.send(ev="line", r=self.rank, s=self.stream, t=_text(line))
            if status is not None:
                self.pending = status
        self.tick()

    def tick(self) -> None:
        with self.lock:
            now = time.monotonic()
            if self.pending is not None and now - self.last_status >= self.STATUS_EVERY_S:
                self.chan.send(ev="status", r=self.rank, s=self.stream, t=_text(self.pending))
                self.pending = None
                self.last_status = now

    def close(self) -> None:
        with self.lock:
            for line in self.splitter.flush():
                self.chan.send(ev="line", r=self.rank, s=self.stream, t=_text(line))


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


class RankTailer(threading.Thread):
    """Tail ``rank<N>.log`` (stdout and stderr, in write order) of the rank hook.

    Also watches each rank's main pid (``rank<N>.pid``) and reports its exit
    with the status the hook recorded (``rank<N>.status``), so the head learns
    which rank failed first even when the launcher reports it late or not at
    all.
    """

    def __init__(self, chan: Channel, log_dir: str):
        super().__init__(name="tail", daemon=True)
        self.chan = chan
        self.log_dir = log_dir
        self.files: dict = {}  # name -> [fd, Relay]
        self.pids: dict = {}  # rank -> pid
        self.exited: set = set()
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
            if not base.startswith("rank") or not base[4:].isdigit():
                continue
            rank = int(base[4:])
            if ext == "log" and name not in self.files:
                try:
                    fd = os.open(os.path.join(self.log_dir, name), os.O_RDONLY)
                except OSError:
                    continue
                self.files[name] = [fd, Relay(self.chan, rank, "log")]
            elif ext == "pid" and rank not in self.pids:
                try:
                    with open(os.path.join(self.log_dir, name)) as f:
                        self.pids[rank] = int(f.read().strip() or 0)
                except (OSError, ValueError):
                    pass
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

    def _exception(self, rank: int):
        path = os.path.join(self.log_dir, "rank%d.status" % rank)
        try:
            with open(path) as f:
                return json.load(f).get("exc")
        except (OSError, ValueError):
            return None

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


# --------------------------------------------------------------------------
# The agent


class Agent:
    def __init__(self, chan: Channel, reader):
        self.chan = chan
        self.reader = reader
        self.inbox: queue.Queue = queue.Queue()
        self.last_heard = time.monotonic()
        self.head_timeout = DEFAULT_HEAD_TIMEOUT_S
        self.proc = None
        self.tailer = None
        self.pumps: list = []
        self.pipe_relays: list = []
        self.workdir_tmp = None
        self.keep_tmp = False
        self.stopping = False
        self.done = threading.Event()

    # -- plumbing ----------------------------------------------------------

    def read_loop(self) -> None:
        while True:
            try:
                line = self.reader.readline()
            except (OSError, ValueError):
                line = b""
            if not line:
                self.inbox.put({"op": "eof"})
                return
            self.last_heard = time.monotonic()
            try:
                msg = json.loads(line)
            except ValueError:
                self.chan.send(ev="log", level="warning", t="bad message from head")
                continue
            if msg.get("op") != "ping":
                self.inbox.put(msg)

    def heartbeat_loop(self) -> None:
        while not self.done.is_set():
            self.chan.send(ev="hb")
            if self.chan.broken:
                self.inbox.put({"op": "eof"})
                return
            if time.monotonic() - self.last_heard > self.head_timeout:
                self.inbox.put({"op": "stop", "grace": 2.0, "reason": "head silent"})
                self.inbox.put({"op": "eof"})
                return
            self.done.wait(HEARTBEAT_S)

    # -- ops ---------------------------------------------------------------

    def op_start(self, msg: dict) -> None:
        if self.proc is not None:
            self.chan.send(ev="fatal", t="a workload is already running on this agent")
            return
        spec = msg["spec"]
        self.stopping = False
        tmp = spec.get("tmp_dir") or os.path.join(
            tempfile.gettempdir(), "corral-%d" % os.getuid(), spec.get("tag", "run")
        )
        self.keep_tmp = bool(spec.get("keep_tmp"))
        log_dir = os.path.join(tmp, "logs")
        hook_dir = os.path.join(tmp, "hook")
        try:
            os.makedirs(log_dir, mode=0o700, exist_ok=True)
            os.makedirs(hook_dir, mode=0o700, exist_ok=True)
            with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
                f.write(spec["hook_source"])
        except OSError as e:
            self.chan.send(ev="fatal", t="cannot create %s: %s" % (tmp, e))
            return
        self.workdir_tmp = tmp
        env = dict(os.environ)
        env.update(spec.get("env", {}))
        old_pp = env.get("PYTHONPATH")
        env["PYTHONPATH"] = hook_dir + (os.pathsep + old_pp if old_pp else "")
        env["CORRAL_LOG_DIR"] = log_dir
        try:
            self.proc = subprocess.Popen(
                spec["argv"],
                cwd=spec.get("cwd") or None,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            self.chan.send(ev="exit", code=127, sig=None, error="cannot start %s: %s" % (spec["argv"][0], e))
            return
        pipe_rank = spec.get("pipe_rank")
        self.pipe_relays = []
        for pipe, stream in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            relay = Relay(self.chan, pipe_rank, stream)
            self.pipe_relays.append(relay)
            t = threading.Thread(target=pump_pipe, args=(pipe, relay), daemon=True)
            t.start()
            self.pumps.append(t)
        self.tailer = RankTailer(self.chan, log_dir)
        self.tailer.start()
        self.chan.send(ev="started", pid=self.proc.pid)

    def op_stop(self, msg: dict) -> None:
        if self.proc is None or self.stopping:
            return
        self.stopping = True
        grace = float(msg.get("grace", 5.0))
        self.chan.send(ev="log", level="info", t="stopping (%s)" % msg.get("reason", "asked by head"))
        kill_tree(grace, {self.proc.pid})

    def op_signal(self, msg: dict) -> None:
        sig = int(msg["sig"])
        ranks = self.tailer.signal_ranks(sig) if self.tailer else []
        self.chan.send(ev="result", id=msg.get("id"), value={"signalled": ranks})

    def op_call(self, msg: dict) -> None:
        """Run a registered function in a thread (probes may wait on peers)."""

        def work() -> None:
            try:
                modname, _, fname = msg["fn"].partition(".")
                mod = sys.modules["corral_agent_" + modname]
                value = getattr(mod, fname)(**msg.get("args", {}))
                self.chan.send(ev="result", id=msg.get("id"), value=value)
            except Exception as e:  # report, never die: the head decides
                self.chan.send(ev="result", id=msg.get("id"), error="%s: %s" % (type(e).__name__, e))

        threading.Thread(target=work, daemon=True).start()

    # -- lifecycle ---------------------------------------------------------

    def check_workload(self) -> None:
        if self.proc is None or self.proc.poll() is None:
            return
        # The launcher is gone: nothing of the run may outlive it.
        kill_tree(2.0, {self.proc.pid})
        for t in self.pumps:
            t.join(timeout=2.0)
        self.pumps = []
        if self.tailer is not None:
            self.tailer.stop_evt.set()
            self.tailer.join(timeout=5.0)
        rc = self.proc.returncode
        self.chan.send(ev="exit", code=rc if rc >= 0 else None, sig=-rc if rc < 0 else None)
        self.proc = None
        self.cleanup_tmp()

    def cleanup_tmp(self) -> None:
        if self.workdir_tmp and not self.keep_tmp:
            shutil.rmtree(self.workdir_tmp, ignore_errors=True)
        self.workdir_tmp = None

    def shutdown(self) -> None:
        if self.proc is not None:
            kill_tree(2.0, {self.proc.pid})
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if self.tailer is not None:
                self.tailer.stop_evt.set()
        else:
            kill_tree(2.0, set())
        reap_orphans(set())
        self.cleanup_tmp()
        self.done.set()

    def serve(self) -> int:
        threading.Thread(target=self.read_loop, name="read", daemon=True).start()
        threading.Thread(target=self.heartbeat_loop, name="hb", daemon=True).start()
        handlers = {
            "start": self.op_start,
            "stop": self.op_stop,
            "signal": self.op_signal,
            "call": self.op_call,
        }
        while True:
            try:
                msg = self.inbox.get(timeout=0.1)
            except queue.Empty:
                msg = None
            if msg is not None:
                op = msg.get("op")
                if op in ("eof", "bye"):
                    break
                if op == "config":
                    self.head_timeout = float(msg.get("head_timeout", self.head_timeout))
                elif op in handlers:
                    try:
                        handlers[op](msg)
                    except Exception as e:
                        self.chan.send(ev="fatal", t="agent error in %s: %s: %s" % (op, type(e).__name__, e))
            for relay in self.pipe_relays:
                relay.tick()
            self.check_workload()
            if _CHILD_EXITED.is_set():  # scanning /proc only when a child changed state
                _CHILD_EXITED.clear()
                reap_orphans({self.proc.pid} if self.proc is not None else set())
        self.shutdown()
        return 0


#: The running agent, for functions called through the ``call`` op.
AGENT = None


def stacks(sig: int, timeout: float = 3.0) -> dict:
    """Ask every rank on this node for its Python stacks; {rank: dump text}.

    Only the pids the rank hook registered are signalled (never by name),
    and only after the hook registered faulthandler on ``sig`` for them.
    """
    agent = AGENT
    if agent is None or agent.tailer is None:
        return {}
    tailer = agent.tailer
    log_dir = tailer.log_dir

    def size(rank: int) -> int:
        try:
            return os.path.getsize(os.path.join(log_dir, "rank%d.stacks" % rank))
        except OSError:
            return 0

    before = {rank: size(rank) for rank in tailer.pids}
    asked = tailer.signal_ranks(int(sig))
    deadline = time.monotonic() + float(timeout)
    last = {}
    while time.monotonic() < deadline:
        now = {r: size(r) for r in asked}
        if all(now[r] > before.get(r, 0) for r in asked) and now == last:
            break  # every dump started, and none grew since the last look
        last = now
        time.sleep(0.1)
    out = {}
    for rank in asked:
        try:
            with open(os.path.join(log_dir, "rank%d.stacks" % rank), "rb") as f:
                f.seek(before.get(rank, 0))
                out[str(rank)] = f.read().decode("utf-8", "replace")
        except OSError:
            pass
    return out


_CHILD_EXITED = threading.Event()


def _on_child(signum, frame):  # pragma: no cover - signal plumbing
    _CHILD_EXITED.set()


def _on_term(signum, frame):  # pragma: no cover - exercised by head-death tests
    raise SystemExit(128 + signum)


def main(reader=None) -> int:
    """Entry point; ``reader`` is the binary stdin the bootstrap read from."""
    if reader is None:
        reader = sys.stdin.buffer
    # The protocol owns the original stdout; anything else that prints in this
    # process (a library warning) must not corrupt it.
    proto_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    chan = Channel(proto_fd)
    subreaper = become_subreaper()
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGHUP, _on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, _on_child)
    import platform
    import socket

    chan.send(
        ev="hello",
        proto=PROTOCOL,
        pid=os.getpid(),
        python=platform.python_version(),
        executable=sys.executable,
        hostname=socket.gethostname(),
        subreaper=subreaper,
        uid=os.getuid(),
    )
    agent = Agent(chan, reader)
    global AGENT
    AGENT = agent
    code = 0
    try:
        code = agent.serve()
    except SystemExit as e:
        agent.shutdown()
        code = e.code if isinstance(e.code, int) else 1
    # os._exit: the stdin reader thread may be blocked in a read, and a normal
    # interpreter shutdown would abort on its buffer lock.
    os._exit(code)
