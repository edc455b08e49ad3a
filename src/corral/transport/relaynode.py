"""A relay node's end of ``corral exec``'s tree (stdlib only, Python 3.8+).

Past a few hundred nodes, the head's own CPU goes into one ssh handshake
per node.  In the tree, the head logs in to a few relay nodes only; each
relay runs the command on itself and logs in to its share of the other
nodes with its own ssh (its own keys and known_hosts, as ``corral ssh
setup`` or a shared home leave them), then sends every node's output back
up its one connection.  Nothing is installed on the relay: this module
travels on ssh's stdin (``corral.sshsetup.remote.payload``), with
``corral.agent.private`` before it.

What the relay writes to stdout, after a ``READY`` line (a chatty login
shell's lines before it are the head's to drop), is frames::

    o I N\\n<N bytes>   member I's stdout        e I N\\n<N bytes>  its stderr
    O I N\\n            N stdout bytes dropped   E I N\\n           N stderr bytes dropped
    x I RC\\n           member I ended (RC: its ssh's exit code, 128+signal)
    u I N\\n<N bytes>   member I was not reached (this relay could not log in:
                       the head reaches it itself); the bytes say why
    z 0 0\\n            every member has ended

A member's stderr is held back until it has printed to stdout, ended, or
been running for ``HOLD_S``: a refused login must not show up as the
command's output before the head retries the node itself.

When the head goes away (its channel closes: Ctrl-C, ``--timeout``, a crash)
the relay closes every member's channel, so each node's wrapper stops the
command there, and kills what is left after ``CLOSE_GRACE_S``.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time

READY = b"@@corral-relay@@\n"
#: The most of each of a member's streams passed up (the head keeps as much).
MAX_OUTPUT = 1024 * 1024
#: The largest frame body.
CHUNK = 65536
#: How long a member's stderr is held back when it prints nothing else.
HOLD_S = 2.0
#: After the head's channel closes: members' grace before their ssh is killed.
CLOSE_GRACE_S = 5.0
#: What ssh says when it could not log in at all (the command never ran).
UNREACHED = re.compile(
    r"^(?:ssh: .*|Permission denied \(.*\)\.|Host key verification failed\.|kex_exchange_identification: .*"
    r"|Connection (?:closed|reset) by .*|Connection timed out during banner exchange"
    r"|No ED25519 host key is known for .*|No \w+ host key is known for .*)\r?$",
    re.MULTILINE,
)


class Member:
    """One node this relay runs the command on (itself, or over its own ssh)."""

    def __init__(self, index, proc, local):
        self.index = index
        self.proc = proc
        self.local = local
        self.started = time.monotonic()
        self.open = 2
        self.sent = {"o": 0, "e": 0}
        self.said_out = False
        self.held = []  # stderr chunks not yet passed up
        self.held_bytes = 0
        #: The end of its stderr, passed up or not: what says whether ssh logged in.
        self.tail = b""


class Up:
    """Frames to the head, on this process's stdout."""

    def __init__(self, fd):
        self.fd = fd

    def write(self, data):
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            view = view[n:]

    def frame(self, kind, index, body=b""):
        self.write(b"%s %d %d\n" % (kind, index, len(body)) + body)

    def data(self, member, kind, data):
        """Pass ``data`` up for ``member`` (stream ``kind`` o/e), within ``MAX_OUTPUT``."""
        room = MAX_OUTPUT - member.sent[kind]
        keep = data[: max(0, room)]
        member.sent[kind] += len(keep)
        for i in range(0, len(keep), CHUNK):
            self.frame(kind.encode(), member.index, keep[i : i + CHUNK])
        if len(data) > len(keep):
            self.write(b"%s %d %d\n" % (kind.upper().encode(), member.index, len(data) - len(keep)))

    def release(self, member):
        for chunk in member.held:
            self.data(member, "e", chunk)
        member.held, member.held_bytes = [], 0


def _mux_options():
    """ssh options that keep a master connection per member on this relay, so
    a second ``corral exec`` within a minute skips the handshakes here too (the
    control directory private, as on the head; none if it cannot be)."""
    try:
        base = runtime_dir() or "/tmp"  # noqa: F821 - from corral.agent.private, sent first
        path = os.path.join(base, "corral-relay-%d" % os.getuid()) if base == "/tmp" else \
            os.path.join(base, "corral-relay")
        private_dir(path, base)  # noqa: F821
    except Exception:
        return []
    return ["-o", "ControlMaster=auto", "-o", "ControlPath=%s/%%C" % path, "-o", "ControlPersist=60"]


def relay(members, probe, stream=None):
    """Run each of ``members`` ({"argv": [...], "local": bool}) and pass their
    output up until all have ended; returns how many were reached."""
    if hasattr(signal, "SIGPIPE"):
        # Writing to a head that went away ends this relay (its members see
        # their channels close and stop), rather than raise mid-frame.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    up = Up(sys.stdout.fileno())
    sys.stdout.flush()
    mux = _mux_options()
    sel = selectors.DefaultSelector()
    running = []
    up.write(READY)
    for i, m in enumerate(members):
        argv = list(m["argv"])
        if not m.get("local") and os.path.basename(argv[0]) == "ssh":
            argv = argv[:1] + mux + argv[1:]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            up.frame(b"u", i, ("cannot run %s on the relay: %s" % (argv[0], e.strerror)).encode())
            continue
        member = Member(i, proc, bool(m.get("local")))
        if not member.local and probe:
            try:
                proc.stdin.write(probe.encode())
                proc.stdin.flush()
            except OSError:
                pass
        sel.register(proc.stdout, selectors.EVENT_READ, (member, "o"))
        sel.register(proc.stderr, selectors.EVENT_READ, (member, "e"))
        running.append(member)
    head_fd = stream.fileno() if stream is not None else 0
    sel.register(head_fd, selectors.EVENT_READ, None)
    kill_at = None
    reached = 0
    while running:
        # A member whose pipes closed is reaped within 10 ms, not at the next tick.
        wait = 0.01 if any(m.open == 0 for m in running) else 0.25
        for key, _ in sel.select(wait):
            if key.data is None:
                if not os.read(head_fd, 4096):  # the head went away: stop everything
                    sel.unregister(head_fd)
                    kill_at = time.monotonic() + CLOSE_GRACE_S
                    for member in running:
                        _close(member.proc.stdin)
                continue
            member, kind = key.data
            data = os.read(key.fd, CHUNK)
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                member.open -= 1
                continue
            if kind == "e":
                member.tail = (member.tail + data)[-4096:]
            if kind == "o":
                member.said_out = True
                up.release(member)
                up.data(member, "o", data)
            elif member.said_out or time.monotonic() - member.started >= HOLD_S:
                up.release(member)
                up.data(member, "e", data)
            else:
                member.held.append(data)
                member.held_bytes += len(data)
                if member.held_bytes > CHUNK:
                    up.release(member)
        now = time.monotonic()
        for member in list(running):
            if member.held and now - member.started >= HOLD_S:
                up.release(member)
            if kill_at is not None and now >= kill_at and member.proc.poll() is None:
                member.proc.kill()
            if member.open or member.proc.poll() is None:
                continue
            running.remove(member)
            _close(member.proc.stdin)
            rc = member.proc.returncode
            rc = 128 - rc if rc < 0 else rc
            if rc == 255 and not member.said_out and not member.local and UNREACHED.search(
                    member.tail.decode("utf-8", "replace")):
                # ssh never logged in (a refused key, a timeout: also after HOLD_S).
                up.frame(b"u", member.index, member.tail)
                continue
            reached += 1
            up.release(member)
            up.write(b"x %d %d\n" % (member.index, rc))
    up.write(b"z 0 0\n")
    return reached


def _close(pipe):
    try:
        pipe.close()
    except OSError:
        pass

