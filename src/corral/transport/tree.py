"""``corral exec`` through relay nodes: the head logs in to a few, they to the rest.

One head holding one ssh connection per node spends its own CPU on one key
exchange per node: at 256 nodes that is most of what ``corral exec`` (or
pdsh) costs the machine it runs on.  Past ``fanout.TREE_MIN_HOSTS`` ssh hosts the
hosts are split into about sqrt(N) groups of consecutive hosts; the head
logs in to the first host of each group (its relay), which runs the
command on itself and reaches the rest of its group with its own ssh
(``corral.transport.relaynode``), so the head makes sqrt(N) handshakes and
the relays make the others in parallel, on their own CPUs, as ClusterShell's
gateways and pdsh's fan-out do, with nothing installed on any node.

A relay needs to log in to its group (``corral ssh setup``, or the shared
home of most clusters).  What cannot go through a relay is done from here,
so the tree never loses a host:

- a host its relay could not log in to (ssh said so before the command
  printed anything) is reached from here, and ``Fallbacks`` says so once;
- a relay that could not be reached or could not start (no Python) has its
  whole group, itself included, reached from here;
- a relay lost *while* its group ran the command leaves those hosts named
  ("relay X stopped ..."), not run a second time: whether the command
  finished there is unknown, and a command is not assumed to be safe to
  repeat.

What a relay sends is untrusted like anything from a node: frames are
checked (kind, member index, length) and bounded, and a relay that breaks
the format is stopped and its unfinished hosts named.  A relay does vouch
for its group's output, though: a compromised relay can make up what its
members said.  ``--tree off`` (docs/security.md) keeps every node's answer
on its own connection.
"""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from corral.agent import private
from corral.errors import HostError
from corral.model import Cluster, Host
from corral.transport import relaynode, transport_for
from corral.transport.fanout import (
    CLOSE_GRACE_S,
    STDIN_PROBE,
    HostResult,
    LineCallback,
    _Output,
    close_stdin,
    remote_argv,
)
from corral.transport.ssh import command_line, hop_argv, quote

#: The most a relay may print before its ready line (a login shell's noise).
MAX_NOISE = 1024 * 1024
#: The relay's stderr kept for naming its failure.
MAX_RELAY_ERR = 64 * 1024
#: A frame header: ``K I N\n``.
MAX_HEADER = 64
#: How long a relay may take to start, past its ssh connect timeout.
START_GRACE_S = 20.0


def node_source() -> str:
    """What a relay runs: ``corral.agent.private`` (its control directory),
    then ``relaynode``, as one module; ``from __future__`` may only open it."""
    head = Path(private.__file__).read_text()
    body = Path(relaynode.__file__).read_text().replace("from __future__ import annotations\n", "", 1)
    return head + "\n\n" + body


def groups(hosts: Sequence[Host], width: int | None = None) -> list[list[Host]]:
    """Consecutive ssh hosts in about sqrt(N) groups (the first of each is its
    relay); each local host is a group of its own (run from here)."""
    remote = [h for h in hosts if not h.local]
    out: list[list[Host]] = [[h] for h in hosts if h.local]
    if not remote:
        return out
    k = width or max(1, math.isqrt(len(remote) - 1) + 1)
    size = math.ceil(len(remote) / k)
    out += [remote[i : i + size] for i in range(0, len(remote), size)]
    return out


def member_argv(host: Host, command: str, connect_timeout: float) -> list[str]:
    """What a relay runs to reach ``host``: its own ssh, keepalives as here."""
    return hop_argv(host, connect_timeout=connect_timeout, keepalive=True) + [
        "--", command_line(remote_argv(command))]


class Member(_Output):
    """A host reached through a relay: what it said, as the relay passed it up."""

    def __init__(self, host: Host, transport, via: str):
        super().__init__(host, transport)
        self.via = via
        self.rc: int | None = None
        #: Why the relay could not reach it (then the head does).
        self.unreached: str | None = None
        self.reported = False


class Fallbacks:
    """Hosts that were reached from here instead of through their relay, to
    say once after the command (not a line per host)."""

    def __init__(self) -> None:
        self.unreached: list[tuple[str, str, str]] = []  # (relay, host, why)
        self.relays: list[tuple[str, str]] = []  # (relay, why)

    def notices(self) -> list[str]:
        from corral.hostrange import fold

        lines = []
        if self.relays:
            names = fold([r for r, _ in self.relays])
            lines.append(f"relay {names} could not run ({self.relays[0][1]}); "
                         "its hosts were reached from here")
        if self.unreached:
            relay, host, why = self.unreached[0]
            lines.append(
                f"{len(self.unreached)} host(s) could not be reached through their relay "
                f"({relay} -> {host}: {why}); reached from here: {fold([h for _, h, _ in self.unreached])}. "
                "`corral ssh setup` lets nodes log in to each other; --tree off (or CORRAL_EXEC_TREE=off) "
                "skips relays")
        return lines


class RelayJob:
    """One relay's ssh process, read by ``run_everywhere``'s loop as a job."""

    relay = True

    def __init__(self, relay: Host, members: list[Member], proc: subprocess.Popen[bytes],
                 timeout: float | None, connect_timeout: float = 10.0):
        self.host = relay
        self.members = members
        self.proc = proc
        self.open_streams = 2
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timed_out = False
        self.kill_at: float | None = None
        #: The relay stops its members first (their grace), then ends itself.
        self.grace = CLOSE_GRACE_S + relaynode.CLOSE_GRACE_S
        self.buf = bytearray()
        self.noise = 0
        self.ready = False
        self.ended = False
        #: Why the relay's frames were not believed (it was then stopped).
        self.broken: str | None = None
        self.err = bytearray()
        #: Not started by then (a login shell reading corral's input as its
        #: own, ``exec zsh`` in ~/.bashrc): stopped, its group reached from here.
        self.start_by: float | None = time.monotonic() + connect_timeout + START_GRACE_S
        self.stalled = False

    # -- the loop's side -------------------------------------------------

    def close_channel(self) -> None:
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace
            if self.timed_out:
                for m in self.members:
                    if m.rc is None and m.unreached is None:
                        m.timed_out = True
            close_stdin(self.proc)

    def done(self) -> bool:
        return self.open_streams == 0 and self.proc.poll() is not None

    def feed(self, stream: str, data: bytes, on_line: LineCallback | None) -> None:
        if stream == "err":
            self.err += data
            del self.err[:-MAX_RELAY_ERR]
            return
        if not data:  # the end of the stream: members' last lines
            for m in self.members:
                for s in ("out", "err"):
                    m.end_stream(s, on_line)
            return
        if self.broken or self.ended:
            return
        self.buf += data
        try:
            self._parse(on_line)
        except ValueError as e:
            self.broken = str(e)
            self.buf.clear()
            self.proc.kill()

    def check_started(self, now: float) -> None:
        """Stop a relay that has not started in time; nothing of it has run."""
        if self.ready:
            self.start_by = None
        elif self.start_by is not None and now >= self.start_by and self.kill_at is None:
            self.stalled, self.start_by = True, None
            self.proc.kill()

    def finished(self) -> list[Member]:
        """Members that ended since the last call."""
        out = [m for m in self.members if m.rc is not None and not m.reported]
        for m in out:
            m.reported = True
        return out

    def settle(self, results: dict[str, HostResult], timeout: float | None,
               fallback: Fallbacks) -> list[Host]:
        """The relay has ended: name its unfinished members, or hand them back
        (to be reached from here) when none of them can have run."""
        close_stdin(self.proc)
        for m in self.finished():
            results[m.host.name] = m.result_for(m.rc, timeout)  # type: ignore[arg-type]
        back = [m.host for m in self.members if m.unreached is not None]
        for m in self.members:
            if m.unreached is not None:
                fallback.unreached.append((self.host.name, m.host.name, m.unreached))
        left = [m for m in self.members if m.rc is None and m.unreached is None]
        if not left:
            return back
        why = self._failure()
        if not self.ready and not self.timed_out and self.kill_at is None:
            fallback.relays.append((self.host.name, why))
            return back + [m.host for m in left]
        for m in left:
            if m.timed_out or self.timed_out:
                m.timed_out = True
                results[m.host.name] = m.result_for(124, timeout)
                continue
            err = HostError(m.host.name, f"relay {self.host.name} stopped while the command ran here "
                            f"({why}); whether it finished here is unknown",
                            hint=f"check {self.host.name}; `--tree off` reaches every node from this machine",
                            kind="relay-lost")
            results[m.host.name] = HostResult(host=m.host.name, returncode=255, stdout=m.text("out"),
                                              stderr=m.text("err"), error=err, via=self.host.name)
        return back

    def _failure(self) -> str:
        if self.stalled:
            return ("it did not start in time: a login shell that replaces itself (`exec zsh` in "
                    "~/.bashrc) reads corral's input as commands, or a slow login")
        if self.broken:
            return f"it sent {self.broken}"
        text = bytes(self.err).decode(errors="replace").strip()
        rc = self.proc.returncode
        last = quote(text.splitlines()[-1]) if text else ""
        if self.ready:
            said = f"its connection ended (ssh exit {rc})"
            return f"{said}: {last}" if last else said
        if rc == 255:
            return f"ssh to it failed: {last}" if last else "ssh to it failed"
        return f"exit {rc}: {last}" if last else f"exit {rc}"

    # -- frames ----------------------------------------------------------

    def _parse(self, on_line: LineCallback | None) -> None:
        buf = self.buf
        if not self.ready:
            at = buf.find(relaynode.READY)
            if at < 0:
                keep = len(relaynode.READY) - 1
                self.noise += max(0, len(buf) - keep)
                del buf[: max(0, len(buf) - keep)]
                if self.noise > MAX_NOISE:
                    raise ValueError(f"more than {MAX_NOISE} bytes before it started")
                return
            del buf[: at + len(relaynode.READY)]
            self.ready = True
        while buf and not self.ended:
            nl = buf.find(b"\n", 0, MAX_HEADER)
            if nl < 0:
                if len(buf) >= MAX_HEADER:
                    raise ValueError("a frame header that is too long")
                return
            parts = bytes(buf[:nl]).split(b" ")
            if len(parts) != 3 or len(parts[0]) != 1 or not parts[1].isdigit() or not parts[2].isdigit():
                raise ValueError(f"a malformed frame header {bytes(buf[:nl])[:40]!r}")
            kind, index, n = parts[0], int(parts[1]), int(parts[2])
            if kind == b"z":
                self.ended = True
                del buf[:]
                return
            if index >= len(self.members):
                raise ValueError(f"a frame for member {index} of {len(self.members)}")
            member = self.members[index]
            if kind in (b"o", b"e", b"u"):
                if n > relaynode.CHUNK:
                    raise ValueError(f"a frame of {n} bytes (at most {relaynode.CHUNK})")
                if len(buf) < nl + 1 + n:
                    return
                body = bytes(buf[nl + 1 : nl + 1 + n])
                del buf[: nl + 1 + n]
            else:
                body = b""
                del buf[: nl + 1]
            if member.rc is not None or member.unreached is not None:
                raise ValueError(f"a frame for member {index} after its end")
            if kind == b"o":
                member.take("out", body, on_line)
            elif kind == b"e":
                member.take("err", body, on_line)
            elif kind in (b"O", b"E"):
                member.cut["out" if kind == b"O" else "err"] += n
            elif kind == b"x":
                if n > 255:
                    raise ValueError(f"an exit code {n}")
                for s in ("out", "err"):
                    member.end_stream(s, on_line)
                member.rc = n
            elif kind == b"u":
                member.unreached = quote(body.decode(errors="replace").strip().splitlines()[-1]
                                         if body.strip() else "ssh failed")
            else:
                raise ValueError(f"an unknown frame kind {kind!r}")


def start(cluster: Cluster, group: list[Host], command: str, timeout: float | None,
          connect_timeout: float) -> RelayJob | None:
    """Start the relay (``group[0]``) for its group; None if ssh cannot even run."""
    from corral.sshsetup.remote import payload, remote_command

    relay = group[0]
    transport = transport_for(cluster, relay, connect_timeout=connect_timeout)
    members = [Member(h, transport_for(cluster, h, connect_timeout=connect_timeout), relay.name)
               for h in group]
    specs = [{"argv": remote_argv(command), "local": True}]
    specs += [{"argv": member_argv(h, command, connect_timeout)} for h in group[1:]]
    argv = transport.argv(relay, remote_command(relay.python))
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, env=transport.env())
    except OSError:
        return None
    job = RelayJob(relay, members, proc, timeout, connect_timeout)
    try:
        proc.stdin.write(payload("relay", SOURCE, "relay",  # type: ignore[union-attr]
                                 {"members": specs, "probe": STDIN_PROBE.decode()}, stream=True))
        proc.stdin.flush()  # type: ignore[union-attr]
    except OSError:
        pass  # ssh already gone: its exit says why
    return job


SOURCE = node_source()

__all__ = ["Fallbacks", "RelayJob", "groups", "start"]
