"""Head side of the node agent: one session per host, and a pool for a cluster.

A session spawns the transport's argv (``ssh ... python3 -c BOOTSTRAP`` or
the same locally), sends the agent payload, waits for ``hello`` and then
exchanges JSON lines.  It pings the agent every second, less often past 64
nodes (``limits.ping_interval``; the agent tears its job down when the head
goes silent) and tracks when it last heard from the agent (the head declares
a node lost when the agent goes silent).

Spawned processes get ``PR_SET_PDEATHSIG``: if the head is SIGKILLed, the
ssh clients (or the local agent) are terminated by the kernel, the channels
close, and every agent cleans up at once instead of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from corral import ui
from corral.agent.bundle import payload, remote_argv
from corral.errors import HostError, PreflightError
from corral.frames import MAX_FRAME, FrameError, FrameReader, ProtocolErrors, check_frame
from corral.limits import ensure_open_files, files_needed, ping_interval
from corral.limits import start_grace as start_grace_s  # the parameter's name is taken
from corral.model import Cluster, Host
from corral.transport import Transport, transport_for
from corral.transport.fanout import PROGRESS_HOSTS, PROGRESS_S
from corral.transport.ssh import SHELL_READ_INPUT, python_hint, shell_read_input

log = logging.getLogger(__name__)

PING_S = 1.0
#: Events an agent sends at most once per job.
ONCE = frozenset({"started", "exit", "killed", "leftover"})
#: How much the channel is read at a time.
READ_CHUNK = 256 * 1024
#: Longest line kept of ssh's stderr or of what a login shell printed (characters).
MAX_NOISE_LINE = 2000
Event = dict[str, Any]
EventHandler = Callable[["AgentSession", Event], None]


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class AgentError(Exception):
    """The agent answered a call with an error."""


@dataclass(eq=False)
class AgentSession:
    """A live agent on one host."""

    host: Host
    transport: Transport
    tag: str
    on_event: EventHandler | None = None
    proc: asyncio.subprocess.Process | None = None
    hello: Event = field(default_factory=dict)
    last_heard: float = 0.0
    closed: bool = False
    exit_event: Event | None = None
    #: Set ("10 s") when the agent said it stops because the head went silent.
    head_silent: str = ""
    #: When the last ping was handed to ssh, and the longest time between two
    #: (which side stalled, when an agent says it heard nothing).
    last_ping: float = 0.0
    ping_gap_max: float = 0.0
    #: The longest wait to hand a ping to ssh (its stdin pipe full: ssh not reading).
    ping_write_max: float = 0.0
    #: The silence after which the agent stops (``start``'s ``head_timeout``).
    head_timeout: float = 10.0
    #: Seconds between pings, and between the agent's heartbeats (``limits.ping_interval``).
    ping_s: float = PING_S
    _stderr: collections.deque = field(default_factory=lambda: collections.deque(maxlen=50))
    #: What the login shell printed on stdout before the agent started (should be nothing).
    login_output: list[str] = field(default_factory=list)
    _pending: dict[int, asyncio.Future] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _tasks: list[asyncio.Task] = field(default_factory=list)
    #: The tasks reading the agent's stdout and stderr (read to the end on close).
    _readers: list[asyncio.Task] = field(default_factory=list)
    _hello: asyncio.Future | None = None
    _lost: asyncio.Future | None = None
    #: An event handler (watch, console, logs) raised once already: said once.
    _handler_failed: bool = False
    #: The global ranks the head's plan gave this node (set before its job
    #: starts): a frame for any other rank is a protocol error.
    ranks: range | None = None
    #: Frames this node sent that broke the protocol (see ``corral.frames``).
    protocol_errors: ProtocolErrors | None = None
    #: Events that come once per job (``ONCE``), and ranks that exited, this
    #: job: a repeat is a protocol error (each would be a failure, a notice).
    _seen: set = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def stderr_text(self) -> str:
        return "\n".join(self._stderr)

    async def start(self, *, timeout: float = 60.0, head_timeout: float = 10.0, start_grace: float = 0.0) -> None:
        """Spawn, send the payload, wait for hello; raise a named HostError."""
        argv = self.transport.argv(self.host, remote_argv(self.host.python, self.tag))
        log.debug("%s: %s", self.name, argv)
        loop = asyncio.get_running_loop()
        self._hello = loop.create_future()
        # Once start() has given up (timeout, Ctrl-C), the connection's end
        # still fails _hello; that is no news (asyncio would print "Future
        # exception was never retrieved" over the user's terminal).
        self._hello.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._lost = loop.create_future()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # Ctrl-C reaches the head only; it tears down in order
                preexec_fn=_pdeathsig,
                env=self.transport.env(),  # ssh: without the head's LC_* (transport.ssh.client_env)
            )
        except FileNotFoundError as e:
            raise HostError(self.name, f"cannot run {argv[0]!r}: {e.strerror}",
                            hint="install the OpenSSH client (apt-get install openssh-client)") from None
        self.last_heard = time.monotonic()
        self._readers = [
            asyncio.create_task(self._read_events()),
            asyncio.create_task(self._read_stderr()),
        ]
        self._tasks = list(self._readers)
        assert self.proc.stdin is not None
        self.proc.stdin.write(payload())

        async def hello() -> None:
            # The payload (over 128 KiB) fills the pipe and asyncio's buffer:
            # a login that never reads it must time out here too.
            try:
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            await asyncio.shield(self._hello)

        try:
            await asyncio.wait_for(hello(), timeout)
        except asyncio.TimeoutError:
            await self.kill()
            raise HostError(self.name, f"no answer from the agent within {timeout:.0f}s",
                            hint=f"check that the host is not overloaded, its Python starts, and logging in is quick "
                                 f"(`time ssh {self.name} true`: a slow ~/.bashrc, a hung home directory)",
                            kind="timeout") from None
        except HostError:
            await self.kill()
            raise
        self.head_timeout = head_timeout
        await self.send(op="config", head_timeout=head_timeout, hb_s=self.ping_s, start_s=start_grace)
        self._tasks.append(asyncio.create_task(self._ping()))

    async def _read_events(self) -> None:
        """Read frames until the channel ends; each is checked where it enters
        (``corral.frames``): a bad one is dropped and counted, never acted on."""
        assert self.proc is not None and self.proc.stdout is not None
        reader = self.proc.stdout
        frames = FrameReader()
        while True:
            data = await reader.read(READ_CHUNK)
            for frame in frames.feed(data) if data else frames.rest():
                self.last_heard = time.monotonic()
                self._frame(frame)
            if not data:
                break
        await self._ended()

    def _frame(self, frame: bytes | int) -> None:
        """One frame (or the size of one over ``MAX_FRAME``, dropped)."""
        if isinstance(frame, int):
            if not self.hello:
                self._login_line(f"(a line of {frame} bytes)")
            else:
                self._protocol_error(f"a frame of {frame} bytes, over the limit of {MAX_FRAME}")
            return
        try:
            ev = check_frame(frame, self.ranks)
        except FrameError as e:
            if not self.hello and not frame.lstrip().startswith(b"{"):
                self._login_line(frame.decode(errors="replace").rstrip())
            else:
                self._protocol_error(str(e))
            return
        if self._repeated(ev):
            return
        self._dispatch(ev)

    def _repeated(self, ev: Event) -> bool:
        """An event that comes once per job (a rank's exit: once per rank),
        again: a protocol error (each would be one more failure or notice)."""
        kind = ev["ev"]
        once = kind if kind in ONCE else (kind, ev["r"]) if kind == "rank_exit" else None
        if once is None:
            return False
        if once in self._seen:
            rank = f" for rank {ev['r']}" if kind == "rank_exit" else ""
            self._protocol_error(f"a second {kind} event{rank} in one job")
            return True
        self._seen.add(once)
        return False

    def _login_line(self, text: str) -> None:
        """Before the agent speaks: the login shell's own output (a banner in
        ~/.bashrc), which breaks rsync and scp; a few lines kept, cut short."""
        text = text[:MAX_NOISE_LINE]
        self._stderr.append(text)
        if text.strip() and len(self.login_output) < 5:
            self.login_output.append(text)

    def _protocol_error(self, why: str) -> None:
        if self.protocol_errors is None:
            self.protocol_errors = ProtocolErrors(self.name)
        said = self.protocol_errors.add(why)
        if said:
            log.warning("%s", said)

    def _dispatch(self, ev: Event) -> None:
        kind = ev.get("ev")
        if kind == "hb":
            return
        if kind == "hello":
            self.hello = ev
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(ev)
            return
        if kind == "fatal" and self._hello is not None and not self._hello.done():
            old = ev.get("kind") == "old-python"
            self._hello.set_exception(HostError(self.name, str(ev.get("t")),
                                                hint=python_hint(self.host) if old else None,
                                                kind="no-python" if old else "agent-failed"))
            return
        if kind == "result":
            fut = self._pending.pop(ev.get("id"), None)
            if fut is not None and not fut.done():
                if "error" in ev:
                    fut.set_exception(AgentError(ev["error"]))
                else:
                    fut.set_result(ev.get("value"))
            return
        if kind == "exit":
            self.exit_event = ev
        if kind == "log" and str(ev.get("t", "")).startswith("head silent for "):
            self.head_silent = str(ev["t"]).split(":")[0][len("head silent for "):]  # "10 s"
        if self.on_event is not None:
            try:
                self.on_event(self, ev)
            except Exception as e:  # noqa: BLE001 - a bug of ours must not look like a lost node
                # An error here used to end this reader, and the node was then
                # declared lost ("network partition") while it was fine.  Keep
                # reading; say it once, with the traceback under --debug.
                if not self._handler_failed:
                    self._handler_failed = True
                    log.error("%s: corral failed to handle an event (%s: %s); the run goes on, but its "
                              "output or summary may be incomplete (please report this, with --debug)",
                              self.name, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        lines = FrameReader(limit=MAX_NOISE_LINE)
        while True:
            data = await self.proc.stderr.read(READ_CHUNK)
            for raw in lines.feed(data) if data else lines.rest():
                self._stderr_line(b"...(a long line)" if isinstance(raw, int) else raw)
            if not data:
                break

    def _stderr_line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip()
        self._stderr.append(line)
        if self._hello is not None and not self._hello.done() and SHELL_READ_INPUT.search(line):
            # It would wait for more input until the start-up timeout.
            self._hello.set_exception(shell_read_input(self.host, line))

    async def _ended(self) -> None:
        """stdout closed: the agent (or ssh) is gone."""
        assert self.proc is not None
        try:
            rc = await asyncio.wait_for(self.proc.wait(), 5)
        except asyncio.TimeoutError:
            rc = -1
        # Give the stderr reader a moment to collect ssh's last words.
        await asyncio.sleep(0.05)
        err = self.transport.failure(self.host, rc, self.stderr_text)
        if self.head_silent:  # the agent left by itself, and said why
            err = HostError(self.name, f"its agent stopped: it heard nothing from this machine for "
                                       f"{self.head_silent} ({self._silence_side()})", kind="head-silent",
                            hint="a loaded head: --node-timeout longer; otherwise see the node's link")
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(err)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(err)
        self.closed = True
        summary = self.protocol_errors.summary() if self.protocol_errors else None
        if summary:
            log.warning("%s", summary)
        if self.on_event is not None:
            why = err.message
            if why.startswith(f"{self.name}: "):
                why = why[len(self.name) + 2:]  # the host is named by whoever reports it
            if self.hello and err.kind == "ssh-failed" and not self.stderr_text.strip():
                # It had answered, and ssh ended without a word of its own
                # (it runs with LogLevel=ERROR): a crash or reboot, not a
                # network silence (that is a missed heartbeat instead).
                why = ("its connection closed (ssh ended without a message): the node went down or "
                       "rebooted, or its sshd or corral's agent there was killed")
            self.on_event(self, {"ev": "closed", "rc": rc, "error": why})

    async def _ping(self) -> None:
        while not self.closed:
            t0 = time.monotonic()
            await self.send(op="ping")
            now = time.monotonic()
            self.ping_write_max = max(self.ping_write_max, now - t0)
            if self.last_ping:
                self.ping_gap_max = max(self.ping_gap_max, now - self.last_ping)
            self.last_ping = now
            await asyncio.sleep(self.ping_s)

    def _silence_side(self) -> str:
        """Which side stalled, from the pings this machine handed to ssh."""
        if not self.last_ping:
            return "this machine had not pinged it yet: it was too busy to finish connecting"
        gap = max(self.ping_gap_max, time.monotonic() - self.last_ping)
        if gap > max(1.5 * self.ping_s, self.head_timeout / 2):
            if self.ping_write_max > self.head_timeout / 2:
                return (f"this machine's pings to it were up to {gap:.0f} s apart: its ssh took up to "
                        f"{self.ping_write_max:.0f} s to take one (ssh or its connection stalled)")
            return f"this machine's pings to it were up to {gap:.0f} s apart: this machine was too busy"
        return (f"this machine pinged it every {max(gap, self.ping_s):.1f} s or less: the connection stalled "
                "one way, or the node was too busy to read")

    async def send(self, **op: Any) -> None:
        if self.closed or self.proc is None or self.proc.stdin is None:
            return
        if op.get("op") == "start":
            self._seen.clear()  # a new job
        try:
            self.proc.stdin.write((json.dumps(op) + "\n").encode())
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            pass

    async def signal(self, sig: int) -> None:
        """Have the agent send ``sig`` to each of its ranks (the ones the rank hook
        registered); its answer names them and is not waited for."""
        await self.send(op="signal", sig=int(sig), id=next(self._ids))

    async def call(self, fn: str, *, timeout: float = 30.0, **args: Any) -> Any:
        """Run ``probes.<fn>``-style function on the node and return its value."""
        if self.closed:
            raise HostError(self.name, "the agent connection is closed", kind="lost")
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        await self.send(op="call", id=call_id, fn=fn, args=args)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(call_id, None)
            raise HostError(self.name, f"{fn} got no answer within {timeout:.0f}s", kind="timeout") from None

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    async def close(self, *, timeout: float = 10.0) -> None:
        """Say bye (agent cleans up), then make sure the process is gone."""
        if self.proc is None:
            return
        if not self.closed:
            await self.send(op="bye")
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError, RuntimeError):
                pass
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            await self.kill()
        # What the agent wrote before it exited is still in the pipe: read it
        # to the end before stopping the readers.
        try:
            await asyncio.wait_for(asyncio.gather(*self._readers, return_exceptions=True), timeout)
        except asyncio.TimeoutError:
            pass
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def kill(self) -> None:
        """Drop the channel hard: the agent sees EOF and kills its tree.

        Over ssh, killing the client closes the channel and the agent on the
        node tears its job down on EOF.  The local agent *is* the process
        here: SIGKILL would leave its job's processes and temporary files
        behind, so it gets SIGTERM (its own teardown, a few seconds), and
        SIGKILL only if it is still there after that.  srun gets SIGTERM
        too: it then cancels the agent's job step, where a SIGKILLed srun
        would leave the step running."""
        if self.proc is not None and self.proc.returncode is None:
            # srun: SIGTERM ends the job step (Slurm cancels it); a SIGKILLed
            # srun would leave the step, and the agent, running.
            local = self.transport.name in ("local", "srun")
            try:
                if local:
                    self.proc.send_signal(signal.SIGTERM)
                else:
                    self.proc.kill()
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), 20 if local else 5)
            except asyncio.TimeoutError:
                if local:
                    try:
                        self.proc.kill()
                    except ProcessLookupError:
                        pass
        self.closed = True


class AgentPool:
    """Agents on every host of a cluster, opened in parallel (bounded)."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        tag: str,
        on_event: EventHandler | None = None,
        fanout: int = 64,
        connect_timeout: float = 10.0,
        head_timeout: float = 10.0,
        start_grace: float | None = None,
    ):
        self.cluster = cluster
        self.tag = tag
        #: An agent's longer patience in its job's first seconds (``limits.start_grace``).
        self.start_grace = start_grace_s(len(cluster.hosts)) if start_grace is None else start_grace
        self.on_event = on_event
        self.fanout = fanout
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        ping_s = ping_interval(len(cluster.hosts), head_timeout)
        self.sessions: list[AgentSession] = [
            AgentSession(host=h, transport=transport_for(cluster, h, connect_timeout=connect_timeout),
                         tag=tag, on_event=self._relay, ping_s=ping_s)
            for h in cluster.hosts
        ]

    def _relay(self, session: AgentSession, ev: Event) -> None:
        if self.on_event is not None:
            self.on_event(session, ev)

    def __getitem__(self, name: str) -> AgentSession:
        for s in self.sessions:
            if s.name == name:
                return s
        raise KeyError(name)

    async def open(self) -> None:
        """Start every agent; on failure close the rest and raise all problems at once."""
        ensure_open_files(files_needed(len(self.sessions)), f"a connection to each of {len(self.sessions)} nodes",
                          say=ui.notice)
        sem = asyncio.Semaphore(self.fanout)

        async def one(s: AgentSession) -> HostError | None:
            async with sem:
                try:
                    await s.start(timeout=self.connect_timeout + 30, head_timeout=self.head_timeout,
                                  start_grace=self.start_grace)
                    return None
                except HostError as e:
                    return e

        progress = asyncio.create_task(self._progress()) if len(self.sessions) >= PROGRESS_HOSTS else None
        try:
            results = await asyncio.gather(*(one(s) for s in self.sessions))
        finally:
            if progress is not None:
                progress.cancel()
        problems = [r for r in results if r is not None]
        if problems:
            await self.close()
            raise PreflightError(problems, what="connecting")

    async def _progress(self) -> None:
        """Hundreds of nodes take seconds to connect: say how far it is."""
        while True:
            await asyncio.sleep(PROGRESS_S)
            up = sum(1 for s in self.sessions if s.hello)
            ui.notice(f"connected to {up} of {len(self.sessions)} nodes...")

    async def call_all(
        self, fn: str, args_for: Callable[[AgentSession], dict] | None = None, *, timeout: float = 30.0
    ) -> dict[str, Any]:
        """Call ``fn`` on every host; raise PreflightError naming every failure."""

        async def one(s: AgentSession) -> Any:
            return await s.call(fn, timeout=timeout, **(args_for(s) if args_for else {}))

        results = await asyncio.gather(*(one(s) for s in self.sessions), return_exceptions=True)
        problems: list[HostError] = []
        out: dict[str, Any] = {}
        for s, r in zip(self.sessions, results):
            if isinstance(r, HostError):
                problems.append(r)
            elif isinstance(r, BaseException):
                problems.append(HostError(s.name, f"{fn} failed: {r}", kind="agent-error"))
            else:
                out[s.name] = r
        if problems:
            raise PreflightError(problems, what=fn)
        return out

    async def broadcast(self, **op: Any) -> None:
        await asyncio.gather(*(s.send(**op) for s in self.sessions))

    async def close(self, *, timeout: float = 10.0) -> None:
        await asyncio.gather(*(s.close(timeout=timeout) for s in self.sessions if s.proc is not None))

