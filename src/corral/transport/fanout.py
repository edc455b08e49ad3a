"""Run one shell command on every host at once (what people use pdsh for).

Each host gets the command through the same transport as everything else
(ssh with the user's config and connection multiplexing, or locally), with
bounded parallelism.  Results are per host (exit code, output, or a named
connection error) instead of an exception on the first failure, so one
dead node never hides the other sixty-three answers.

The command runs under a tiny POSIX-sh wrapper.  When the head goes away
(Ctrl-C, a crash, a closed connection) the wrapper sees its stdin close and
kills the channel's whole ssh session: no orphan is left behind on a node,
without needing Python there.

What a node prints is untrusted and may be endless (``yes``, a binary on
stdout): the head keeps the first ``MAX_OUTPUT`` bytes of each stream per
host and counts the rest, which it reads and drops as it arrives; a line
being assembled for ``on_line`` is kept to ``MAX_LINE``.  So the head's
memory is bounded per host whatever the node sends, and the cut is said
(a ``[cut N bytes]`` marker in the text, ``stdout_cut``/``stderr_cut``).

The loop is synchronous (``selectors`` over the ssh processes' pipes), not
asyncio: ``corral exec`` is raced against pdsh, and asyncio's import, its
per-process child-watcher thread and one event-loop round trip per spawn
cost the head CPU that the ssh handshakes need.  Here every ssh process is
started in one tight loop and the head sleeps in ``select`` until output
arrives.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from corral.errors import HostError
from corral.frames import MAX_LINE, cut_marker
from corral.model import Cluster, Host
from corral.transport import transport_for
from corral.transport.base import Transport
from corral.transport.ssh import shell_read_input

#: How often ``run_everywhere`` reports progress (when asked to).
PROGRESS_S = 5.0
#: From this many hosts on, ``corral exec`` and a run's connect say how far they are.
PROGRESS_HOSTS = 64
#: From this many ssh hosts on, ``corral exec`` goes through relay nodes by
#: default (``corral.transport.tree``).
TREE_MIN_HOSTS = 128

#: One line, no newlines inside quotes and no "!" but ``$!``: safe under sh,
#: bash, zsh and (non-interactive) csh login shells.  The command runs in the foreground,
#: in the user's login shell, ``$SHELL -c CMD``, as under ``ssh host CMD``
#: (bash syntax, ``source``; SIGINT and SIGQUIT not ignored, no wrapper
#: variables or arguments, stdin from /dev/null; the wrapper's own
#: "Terminated" goes to /dev/null).  A watcher reads the channel (fd 3); at
#: EOF (Ctrl-C, ``--timeout``, the head's death) it TERMs every process of the
#: ssh session the command runs in (sshd gives every channel a session of its
#: own; never a name or pattern) but the wrapper, its login shell and itself,
#: waits up to 2 s, polling only those pids, and KILLs what is left; the
#: wrapper exits after its watcher, so ssh ends once the node is clean.  The
#: session is used only when its leader is the wrapper or its login shell
#: (``/proc/$$/stat``); otherwise the wrapper's descendants are.  Candidates
#: come from ``pgrep -s`` where it exists, else from /proc (dash reads a byte
#: at a time: one scan of a busy node's /proc costs a few tens of ms).
WRAPPER = (
    "exec 3<&0; s=; read -r _ _ _ _ _ s _ </proc/$$/stat 2>/dev/null; "
    '[ "$s" = $$ ] || [ "$s" = $PPID ] || s=; '
    "( exec </dev/null >/dev/null 2>&1; while read -r _ <&3; do :; done; exec 3<&-; trap : TERM; "
    "read -r m _ </proc/self/stat; t=\" $$ \"; "
    "l(){ n=; for p in $(pgrep -s \"$s\" 2>/dev/null || { cd /proc && echo [0-9]*; }); do "
    'case " $$ $PPID $m " in *" $p "*) continue;; esac; read -r x </proc/$p/stat || continue; set -- ${x##*) }; '
    '[ "$1" = Z ] && continue; '
    'if [ "$s" ]; then [ "$4" = "$s" ]; else case "$t" in *" $2 "*) t="$t$p ";; *) false;; esac; fi && n="$n $p"; '
    'done; [ "$n" ]; }; '
    "a(){ for p in $n; do read -r x </proc/$p/stat || continue; set -- ${x##*) }; [ \"$1\" = Z ] || return 0; done; return 1; }; "
    "l && kill -TERM $n; i=0; while [ $i -lt 20 ] && a; do sleep .1 || { sleep 1; i=$((i+9)); }; i=$((i+1)); done; "
    "i=0; while [ $i -lt 5 ] && l; do kill -KILL $n; i=$((i+1)); done ) & "
    "w=$!; exec 3<&- 4>&2 2>/dev/null; "
    '( exec 2>&4 4>&- </dev/null; exec "${SHELL:-/bin/sh}" -c "$1" ); r=$?; kill $w; wait $w; exit $r'
)

#: Written to the channel first.  The wrapper's watcher reads and drops it; a
#: login shell that never ran the wrapper because a start-up file replaced it
#: with another shell (`exec zsh` in ~/.bashrc) reads it as a command instead,
#: says so and exits, rather than wait on the channel forever.
STDIN_PROBE = b"echo corral-exec-stdin-probe; exit 97\n"
STDIN_PROBE_SEEN = "corral-exec-stdin-probe"

#: After a host's channel is closed (timeout, Ctrl-C), how long its wrapper
#: gets (TERM, 2 s, KILL on the node) before the local ssh is killed.
CLOSE_GRACE_S = 5.0

#: The most of each stream (stdout, stderr) of one host the head keeps: the
#: rest is read and dropped as it arrives, and counted.  ``nvidia-smi`` is a
#: few KiB; a command whose output is the point (a log, a file) belongs in
#: a file on the node or in ``rsync``, not in the head's memory.
MAX_OUTPUT = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class HostResult:
    """What one host answered."""

    host: str
    returncode: int
    stdout: str = ""
    stderr: str = ""
    #: Set when the host could not be reached or the command could not run.
    error: HostError | None = None
    #: Bytes of stdout / stderr dropped past ``MAX_OUTPUT`` (the text then
    #: ends with a ``[cut N bytes]`` marker).
    stdout_cut: int = 0
    stderr_cut: int = 0
    #: The relay node that ran the command here (``corral exec``'s tree);
    #: None when this machine reached the host itself.
    via: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.returncode == 0


#: Put in front of the wrapper for a command with a newline, which travels as
#: ``printf %b`` text (``\n`` for a newline, ``\\`` for a backslash): a csh
#: login shell refuses a newline inside quotes and drops it outside, so
#: ``ssh host CMD`` works there (csh runs the lines) but a quoted word with
#: one does not.  The ``.`` keeps the command's trailing newlines.
_DECODE = "set -- \"$(printf '%b.' \"$1\")\"; set -- \"${1%.}\"; "


def remote_argv(command: str) -> list[str]:
    if "\n" in command:
        encoded = command.replace("\\", "\\\\").replace("\n", "\\n")
        return ["sh", "-c", _DECODE + WRAPPER, "corral-exec", encoded]
    return ["sh", "-c", WRAPPER, "corral-exec", command]


LineCallback = Callable[[str, str, str], None]  # (host, stream, line)

#: What ssh says when the node's sshd refuses another session on the shared
#: connection (``MaxSessions``) and it falls back to a connection of its own:
#: the command still runs, so it is not the command's output.
SSH_MUX_NOISE = re.compile(
    r"^(?:mux_client_request_session: session request failed: .*"
    r"|ControlSocket .* already exists, disabling multiplexing)\r?(?:\n|$)",
    re.MULTILINE,
)


class _Output:
    """What one host has said so far, and its result once it ended (run from
    here, or through a relay of ``corral.transport.tree``)."""

    def __init__(self, host: Host, transport: Transport):
        self.host = host
        self.transport = transport
        self.chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        #: Bytes kept in ``chunks`` and bytes dropped past ``MAX_OUTPUT``.
        self.kept = {"out": 0, "err": 0}
        self.cut = {"out": 0, "err": 0}
        #: The line being assembled for ``on_line`` (at most ``MAX_LINE``
        #: bytes) and how much of it was dropped.
        self.partial: dict[str, bytes] = {"out": b"", "err": b""}
        self.partial_cut = {"out": 0, "err": 0}
        self.timed_out = False
        #: The relay that ran it (None: from here).
        self.via: str | None = None

    def result_for(self, rc: int, timeout: float | None) -> HostResult:
        stdout = self.text("out")
        stderr = SSH_MUX_NOISE.sub("", self.text("err"))
        name = self.host.name
        extra = {"stdout_cut": self.cut["out"], "stderr_cut": self.cut["err"], "via": self.via}
        if self.timed_out:
            error = HostError(name, f"did not finish within {timeout:.0f}s; stopped it",
                              hint="raise --timeout if the command is expected to take longer",
                              kind="timeout")
            return HostResult(host=name, returncode=124, stdout=stdout, stderr=stderr, error=error, **extra)
        if rc == 97 and STDIN_PROBE_SEEN in stdout and not self.host.local:
            return HostResult(host=name, returncode=255, stderr=stderr, via=self.via,
                              error=shell_read_input(self.host, STDIN_PROBE_SEEN))
        if rc == 255 and not self.host.local:
            # ssh's own failure (the remote command's 255 is rare and reads the same).
            return HostResult(host=name, returncode=rc, stdout=stdout, stderr=stderr,
                              error=self.transport.failure(self.host, rc, stderr), **extra)
        return HostResult(host=name, returncode=rc, stdout=stdout, stderr=stderr, **extra)

    def keep(self, stream: str, data: bytes) -> None:
        """Keep ``data`` up to ``MAX_OUTPUT`` bytes of the stream; count the rest."""
        room = MAX_OUTPUT - self.kept[stream]
        if room > 0:
            self.chunks[stream].append(data[:room])
            self.kept[stream] += min(room, len(data))
        self.cut[stream] += max(0, len(data) - max(room, 0))

    def text(self, stream: str) -> str:
        """What was kept of the stream, with the marker where it was cut."""
        text = b"".join(self.chunks[stream]).decode(errors="replace")
        if self.cut[stream]:
            text += cut_marker(self.cut[stream]) + "\n"
        return text

    def take(self, stream: str, data: bytes, on_line: LineCallback | None) -> None:
        """``data`` arrived on ``stream``: keep it, and pass complete lines on."""
        self.keep(stream, data)
        if on_line is None:
            return
        if b"\n" not in data:
            # Most of a long line: add what fits, count the rest (no copy of it).
            room = MAX_LINE - len(self.partial[stream])
            if room > 0:
                self.partial[stream] += data[:room]
            self.partial_cut[stream] += max(0, len(data) - max(room, 0))
            return
        *lines, rest = (self.partial[stream] + data).split(b"\n")
        first_cut = self.partial_cut[stream]
        self.partial[stream] = rest[:MAX_LINE]
        self.partial_cut[stream] = max(0, len(rest) - MAX_LINE)
        for i, line in enumerate(lines):
            text = _line(line, first_cut if i == 0 else 0)
            if stream == "err" and SSH_MUX_NOISE.match(text):
                continue
            on_line(self.host.name, stream, text)

    def end_stream(self, stream: str, on_line: LineCallback | None) -> None:
        """The stream ended: pass on its last, unterminated line."""
        if on_line is not None and (self.partial[stream] or self.partial_cut[stream]):
            on_line(self.host.name, stream, _line(self.partial[stream], self.partial_cut[stream]))
        self.partial[stream], self.partial_cut[stream] = b"", 0


def close_stdin(proc: subprocess.Popen[bytes]) -> None:
    """Close our end of ``proc``'s stdin (ssh forwards the EOF), once."""
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass


class _Job(_Output):
    """One host's ssh (or local sh) process and what it has said so far."""

    relay = False

    def __init__(self, host: Host, transport: Transport, proc: subprocess.Popen[bytes],
                 timeout: float | None):
        super().__init__(host, transport)
        self.proc = proc
        self.open_streams = 2
        self.deadline = None if timeout is None else time.monotonic() + timeout
        #: Set once the channel is closed: kill ssh if it is still there then.
        self.kill_at: float | None = None
        self.grace = CLOSE_GRACE_S

    def close_channel(self) -> None:
        """Close ssh's stdin: the remote wrapper stops the command's session."""
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace
            close_stdin(self.proc)

    def done(self) -> bool:
        return self.open_streams == 0 and self.proc.poll() is not None

    def result(self, timeout: float | None) -> HostResult:
        close_stdin(self.proc)
        rc = self.proc.returncode if self.proc.returncode is not None else 255
        return self.result_for(rc, timeout)

    def feed(self, stream: str, data: bytes, on_line: LineCallback | None) -> None:
        """Bytes (``b""``: end) read from the process's ``stream``."""
        if data:
            self.take(stream, data, on_line)
        else:
            self.end_stream(stream, on_line)


def run_everywhere(
    cluster: Cluster,
    command: str,
    *,
    timeout: float | None = None,
    fanout: int = 64,
    connect_timeout: float = 10.0,
    on_line: LineCallback | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    tree: bool | None = False,
    on_notice: Callable[[str], None] | None = None,
) -> list[HostResult]:
    """``command`` (a shell command line) on every host; results in host order.

    ``on_progress(done, total)`` is called every ``PROGRESS_S`` seconds while
    hosts are still running (hundreds of nodes take seconds to answer).

    At most ``fanout`` hosts (or relays) run at once.  ``on_line(host, stream,
    line)`` sees every complete line as it arrives.  SIGINT, SIGTERM, SIGHUP
    or SIGQUIT (when called from the main thread) close every channel, wait
    for the nodes to stop the command (ssh is killed after ``CLOSE_GRACE_S``),
    then raise KeyboardInterrupt: nothing is left running on any node.

    ``tree``: True reaches the hosts through relay nodes
    (``corral.transport.tree``), None does from ``TREE_MIN_HOSTS`` ssh hosts
    on, False never.  A host a relay could not reach is reached from here;
    ``on_notice`` hears about it, once.
    """
    results: dict[str, HostResult] = {}
    pending: deque[Host] = deque()
    starts: deque[list[Host]] = deque()  # relays' groups
    relays = None
    if tree is not False and (tree or sum(1 for h in cluster.hosts if not h.local) >= TREE_MIN_HOSTS):
        from corral.transport import tree as relays

        for group in relays.groups(cluster.hosts):
            if len(group) == 1:
                pending.append(group[0])
            else:
                starts.append(group)
    else:
        pending.extend(cluster.hosts)
    fallback = relays.Fallbacks() if relays is not None else None
    last_progress = time.monotonic()
    running: list = []
    sel = selectors.DefaultSelector()
    with _signals_to_pipe() as wakeup:
        if wakeup is not None:
            sel.register(wakeup, selectors.EVENT_READ, None)
        stopping = False
        try:
            while starts or pending or running:
                while (starts or pending) and not stopping and len(running) < max(1, fanout):
                    if starts:
                        group = starts.popleft()
                        job = relays.start(cluster, group, command, timeout, connect_timeout)  # type: ignore[union-attr]
                        if job is None:  # no ssh to run here: each host says so
                            pending.extend(group)
                            continue
                    else:
                        job = _start(cluster, pending.popleft(), command, timeout, connect_timeout, results)
                    if job is not None:
                        running.append(job)
                        sel.register(job.proc.stdout, selectors.EVENT_READ, (job, "out"))  # type: ignore[arg-type]
                        sel.register(job.proc.stderr, selectors.EVENT_READ, (job, "err"))  # type: ignore[arg-type]
                if not running:
                    continue
                wait = _wait(running)
                if on_progress is not None:
                    wait = PROGRESS_S if wait is None else min(wait, PROGRESS_S)
                    if time.monotonic() - last_progress >= PROGRESS_S:
                        last_progress = time.monotonic()
                        on_progress(len(results), len(cluster.hosts))
                for key, _ in sel.select(wait):
                    if key.data is None:  # a signal arrived
                        os.read(key.fd, 512)
                        if not stopping:
                            stopping = True
                            pending.clear()
                            starts.clear()
                            for job in running:
                                job.close_channel()
                        continue
                    _read(sel, key, on_line)
                now = time.monotonic()
                for job in list(running):
                    if job.relay:
                        # Members end while their relay runs on.
                        for member in job.finished():
                            results[member.host.name] = member.result_for(member.rc, timeout)
                        job.check_started(now)
                    if job.done():
                        running.remove(job)
                        if job.relay:
                            back = job.settle(results, timeout, fallback)
                            if not stopping:
                                pending.extend(back)
                        else:
                            results[job.host.name] = job.result(timeout)
                        continue
                    if job.deadline is not None and now >= job.deadline and not job.timed_out:
                        job.timed_out = True
                        job.close_channel()
                    if job.kill_at is not None and now >= job.kill_at and job.proc.poll() is None:
                        job.proc.kill()
        finally:
            # Only reached with jobs left on an unexpected error: never leave
            # an ssh process (or its remote command) behind.
            for job in running:
                job.close_channel()
                try:
                    job.proc.wait(job.grace)
                except subprocess.TimeoutExpired:
                    job.proc.kill()
                    job.proc.wait()
            sel.close()
    if on_notice is not None and fallback is not None:
        for line in fallback.notices():
            on_notice(line)
    if stopping:
        # What the hosts said before the stop, for a caller that shows it.
        interrupted = KeyboardInterrupt()
        interrupted.results = [results[h.name] for h in cluster.hosts if h.name in results]  # type: ignore[attr-defined]
        raise interrupted
    return [results[h.name] for h in cluster.hosts]


def _start(cluster: Cluster, host: Host, command: str, timeout: float | None,
           connect_timeout: float, results: dict[str, HostResult]) -> _Job | None:
    transport = transport_for(cluster, host, connect_timeout=connect_timeout)
    argv = transport.argv(host, remote_argv(command))
    try:
        # No PR_SET_PDEATHSIG here (it would force the slow fork path): if
        # corral dies, its end of this stdin pipe closes, ssh forwards the EOF
        # and the remote wrapper stops the command all the same.  A session of
        # its own keeps the terminal's Ctrl-C away from ssh: the head decides.
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                env=transport.env())
    except OSError as e:
        err = HostError(host.name, f"cannot run {argv[0]!r}: {e.strerror}")
        results[host.name] = HostResult(host=host.name, returncode=255, error=err)
        return None
    if not host.local:
        try:
            proc.stdin.write(STDIN_PROBE)  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:
            pass  # ssh already gone: its exit says why
    return _Job(host, transport, proc, timeout)


def _wait(running: list[_Job]) -> float | None:
    """How long ``select`` may sleep: until the next deadline, or a short poll
    while a process whose pipes are closed has not been reaped yet.  A killed
    ssh's mark is dropped: a local command's daemon may hold the pipes open
    (then the loop waits for output, as ssh itself would), and must not spin."""
    now = time.monotonic()
    marks = [t for job in running
             for t in (None if job.timed_out else job.deadline,
                       job.kill_at if job.proc.poll() is None else None,
                       job.start_by if job.relay else None)
             if t is not None]
    wait = max(0.0, min(marks) - now) if marks else None
    if any(job.open_streams == 0 for job in running):
        wait = 0.01 if wait is None else min(wait, 0.01)
    return wait


def _read(sel: selectors.BaseSelector, key: selectors.SelectorKey,
          on_line: LineCallback | None) -> None:
    job, stream = key.data
    data = os.read(key.fd, 65536)
    if not data:
        sel.unregister(key.fileobj)
        key.fileobj.close()  # type: ignore[union-attr]
        job.open_streams -= 1
    job.feed(stream, data, on_line)


def _line(line: bytes, dropped: int) -> str:
    """One line for ``on_line``: at most ``MAX_LINE`` bytes of it, with the
    marker when more was dropped (before it was assembled, or here)."""
    dropped += max(0, len(line) - MAX_LINE)
    text = line[:MAX_LINE].decode(errors="replace")
    return text + cut_marker(dropped) if dropped else text


@contextmanager
def _signals_to_pipe() -> Iterator[int | None]:
    """While inside, SIGINT/SIGTERM/SIGHUP/SIGQUIT wake the loop (through a pipe)
    instead of raising wherever the head happens to be (half-way through
    starting a process).  SIGINT and SIGQUIT are taken over even when
    inherited ignored (a job started in the background of a script), as
    SIGTERM from a scheduler is: each must tear the command down on the
    nodes.  A handled signal is reset to its default in the processes started
    meanwhile, so a command on this machine starts with SIGINT and SIGQUIT not
    ignored, as sshd starts it on a node.  Yields None off the main thread."""
    try:
        r, w = os.pipe()
    except OSError:
        yield None
        return
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    saved: dict[int, object] = {}
    try:
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(r)
        os.close(w)
        yield None
        return
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            saved[sig] = signal.signal(sig, _ignore)
        yield r
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)


def _ignore(signum: int, frame: object) -> None:
    """The wakeup pipe carries the signal; nothing to do here."""


def command_line(words: tuple[str, ...]) -> str:
    """Words after ``--`` as one shell command line, like ssh and pdsh join them."""
    return " ".join(words)


__all__ = ["MAX_OUTPUT", "TREE_MIN_HOSTS", "HostResult", "command_line", "remote_argv", "run_everywhere"]
