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
``started``, ``rank_exit``, ``exit``, ``result``, ``log``, ``fatal``, ``tm``
(telemetry, once a second while a job runs; see ``telemetry.py``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

try:  # on a node, modules are installed under their wire names
    from corral_agent_flightrec import job_env as flightrec_env
    from corral_agent_flightrec import request as flightrec_request
    from corral_agent_flightrec import send_dumps as flightrec_send
    from corral_agent_holds import release as release_holding
    from corral_agent_jobdir import JobDir
    from corral_agent_jobenv import activate_python, elastic_log_dir, fill_env_refs, job_environment
    from corral_agent_prescan import env_mismatch
    from corral_agent_prewarm import PREWARM_FIXED, PREWARM_SENSITIVE, prewarm_program
    from corral_agent_private import UnsafePlace
    from corral_agent_proctree import (
        become_subreaper,
        kill_tree,
        leftovers,
        libc_prctl,
        reap_orphans,
    )
    from corral_agent_rankstacks import collect as collect_stacks
    from corral_agent_relay import Channel, RankTailer, Relay, pump_pipe
    from corral_agent_telemetry import Telemetry
except ImportError:  # imported as part of the corral package (tests, head)
    from corral.agent.flightrec import job_env as flightrec_env
    from corral.agent.flightrec import request as flightrec_request
    from corral.agent.flightrec import send_dumps as flightrec_send
    from corral.agent.holds import release as release_holding
    from corral.agent.jobdir import JobDir
    from corral.agent.jobenv import activate_python, elastic_log_dir, fill_env_refs, job_environment
    from corral.agent.prescan import env_mismatch
    from corral.agent.prewarm import PREWARM_FIXED, PREWARM_SENSITIVE, prewarm_program
    from corral.agent.private import UnsafePlace
    from corral.agent.proctree import (
        become_subreaper,
        kill_tree,
        leftovers,
        libc_prctl,
        reap_orphans,
    )
    from corral.agent.rankstacks import collect as collect_stacks
    from corral.agent.relay import Channel, RankTailer, Relay, pump_pipe
    from corral.agent.telemetry import Telemetry

PROTOCOL = 1


def _die_with_agent() -> None:  # pragma: no cover - runs between fork and exec
    """SIGTERM to the launcher when the agent dies (PR_SET_PDEATHSIG).

    Set from the agent's main thread, which lives as long as the agent: the
    signal fires when the thread that forked the child exits."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != _AGENT_PID:
        raise OSError("the agent exited while starting the job")


#: libc's prctl, resolved in ``main`` (see ``libc_prctl``).
_PRCTL = None
#: This agent (the module is run once per agent process).
_AGENT_PID = os.getpid()


#: How often the agent says it is alive, and how long it tolerates a silent head: while its
#: job runs, and with none or in the job's first ``start_s`` (a head busy starting hundreds).
HEARTBEAT_S = 1.0
DEFAULT_HEAD_TIMEOUT_S, IDLE_HEAD_TIMEOUT_S = 10.0, 60.0
HEAD_SILENT = "head silent for %.0f s: stopping"


# --------------------------------------------------------------------------
# The agent


def limit_note(e: BaseException) -> str:
    """What to do about a start that failed on a per-user limit of the node."""
    import errno
    import resource

    if getattr(e, "errno", None) == errno.EMFILE:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (" (this node's open-files limit for the login, `ulimit -n`, is %d: raise it, e.g. in /etc/security/"
                "limits.conf or the login shell's start-up files; training needs thousands)" % soft)
    if getattr(e, "errno", None) == errno.EAGAIN:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        return (" (this node's process limit for the login, `ulimit -u`, is %s, or the machine is "
                "out of processes: raise it, e.g. in /etc/security/limits.conf)"
                % ("unlimited" if soft == resource.RLIM_INFINITY else soft))
    return ""


def _last_line(pipe) -> str:
    """': <the last line>' a dead process left on ``pipe``, or ''."""
    try:
        lines = pipe.read().decode("utf-8", "replace").strip().splitlines() if pipe else []
    except (OSError, ValueError):
        return ""
    return ": " + lines[-1][-300:] if lines else ""


def planned_ranks(spec: dict):
    """This node's ranks, from the plan (first, count), else all of ``WORLD_SIZE``; None when neither says."""
    try:
        first, count = spec["ranks"]
        return range(int(first), int(first) + int(count))
    except (KeyError, TypeError, ValueError):
        pass
    world = str((spec.get("env") or {}).get("WORLD_SIZE", ""))
    return range(int(world)) if world.isdigit() else None


class Agent:
    def __init__(self, chan: Channel, reader):
        self.chan = chan
        self.reader = reader
        self.inbox: queue.Queue = queue.Queue()
        self.last_heard = time.monotonic()
        self.head_timeout, self.hb_s = DEFAULT_HEAD_TIMEOUT_S, HEARTBEAT_S
        self.start_s = self.started = 0.0  # the head's start grace; when the job started
        self.proc = None
        self.tailer = None
        self.telemetry = None
        self.pumps: list = []
        self.pipe_relays: list = []
        self.prewarmed = None
        self.prewarmed_argv: list = []
        #: Why the prewarmed launcher was not used for preloaded ranks (said once).
        self.fresh_note = None
        self.job_dir = JobDir()
        #: The job's flight recorder dumps (None: off, ``--no-flight-recorder``).
        self.fr_dir = None
        self.stopping = False
        #: When a stop's grace ends (monotonic): what is still running then is
        #: killed.  The main loop checks it, so a second stop (the head's
        #: channel closing after a second Ctrl-C) is not held up by the first.
        self.stop_due = None
        self.stop_grace = 0.0
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
            busy = self.proc is not None and time.monotonic() - self.started >= self.start_s
            limit = self.head_timeout if busy else max(IDLE_HEAD_TIMEOUT_S, self.head_timeout)
            if time.monotonic() - self.last_heard > limit:
                self.chan.send(ev="log", level="warning", t=HEAD_SILENT % limit)  # the head says why
                self.inbox.put({"op": "stop", "grace": 2.0, "reason": "head silent"})
                self.inbox.put({"op": "eof"})
                return
            self.done.wait(self.hb_s)

    # -- ops ---------------------------------------------------------------

    def op_start(self, msg: dict) -> None:
        if self.proc is not None:
            self.chan.send(ev="fatal", t="a workload is already running on this agent")
            return
        spec = msg["spec"]
        if spec.get("cwd"):
            spec = dict(spec, cwd=os.path.expanduser(spec["cwd"]))  # `~/proj`: this node's home
        self.stopping = False
        self.stop_due = None
        try:
            tmp = self.job_dir.make(spec)
            log_dir = os.path.join(tmp, "logs")
            hook_dir = self.job_dir.write_hook(spec["hook_source"])
        except UnsafePlace as e:
            # (the head's line names the host)
            self.chan.send(ev="fatal", kind="unsafe-tmp",
                           t="the job's directory: %s; nothing was started (remove it, after checking "
                             "what is in it: another user may have made it; or set TMPDIR for this host with "
                             "`env` in the cluster file)" % e)
            self.job_dir.path = self.job_dir.root = None  # not ours: never removed
            return
        except OSError as e:
            self.chan.send(ev="fatal", t="cannot create %s: %s (the job's files go to its $TMPDIR, else "
                                         "/tmp: free space there, or set TMPDIR for this host with `env` "
                                         "in the cluster file)" % (self.job_dir.path, e))
            self.job_dir.remove()
            return
        env = job_environment(dict(os.environ), spec.get("env", {}))
        fill_env_refs(env, spec.get("env_refs") or [])
        old_pp = env.get("PYTHONPATH")
        env["PYTHONPATH"] = hook_dir + (os.pathsep + old_pp if old_pp else "")
        env["CORRAL_LOG_DIR"] = log_dir
        self.fr_dir = os.path.join(tmp, "flightrec") if spec.get("flight_recorder") else None
        if self.fr_dir:
            env.update(flightrec_env(self.fr_dir, env))
        activate_python(env)
        spec = dict(spec, argv=elastic_log_dir(list(spec["argv"]), env, os.path.join(tmp, "elastic")))
        self.proc, self.started = self.take_prewarmed(spec, env, hook_dir), time.monotonic()
        if self.proc is None:
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
                    preexec_fn=_die_with_agent,  # noqa: PLW1509 - only a prctl call
                )
            except (OSError, subprocess.SubprocessError) as e:
                self.chan.send(ev="exit", code=127, sig=None,
                               error="cannot start %s: %s%s" % (spec["argv"][0], e, limit_note(e)))
                self.job_dir.remove()
                return
        pipe_rank = spec.get("pipe_rank")
        self.telemetry = Telemetry(self.chan, every_s=spec.get("telemetry_s") or 1) if spec.get("telemetry") else None
        chan = self.telemetry.chan if self.telemetry else self.chan  # counts each rank's lines
        self.pipe_relays = []
        for pipe, stream in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            relay = Relay(chan, pipe_rank, stream)
            self.pipe_relays.append(relay)
            if stream == "err" and self.job_dir.note:
                relay.feed(("corral: %s\n" % self.job_dir.note).encode())
                self.job_dir.note = None
            if stream == "err" and self.fresh_note:
                relay.feed(("corral: starting ranks as fresh interpreters: %s\n" % self.fresh_note).encode())
                self.fresh_note = None
            t = threading.Thread(target=pump_pipe, args=(pipe, relay), daemon=True)
            t.start()
            self.pumps.append(t)
        self.tailer = RankTailer(chan, log_dir, planned_ranks(spec))
        self.tailer.start()
        if self.telemetry:
            self.telemetry.begin(lambda: self.tailer.pids)
        self.chan.send(ev="started", pid=self.proc.pid)

    def op_prewarm(self, msg: dict) -> None:
        """Start ``python -m <module>`` now, importing it while the head still checks.

        For torchrun, importing torch is most of its start-up; the head sends
        this as soon as it is connected, so the import overlaps preflight and
        the rendezvous check.  The process then waits for its argv, cwd and
        environment (``take_prewarmed``) and runs the module's ``main`` exactly
        as ``python -m`` would."""
        if self.prewarmed is not None or self.proc is not None:
            return
        # torchrun's elastic agent (also inside `accelerate launch`): the head says.
        elastic = bool(msg.get("elastic"))
        preload = msg.get("preload_modules") if elastic else None
        try:
            self.prewarmed = subprocess.Popen(
                [msg["python"], "-c", prewarm_program(msg["module"], elastic=elastic, preload=preload,
                                                      agent_pid=os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, close_fds=True,
            )
            self.prewarmed_argv = [msg["python"], "-m", msg["module"]]
        except OSError:
            self.prewarmed = None  # start() will spawn normally and report any error

    def take_prewarmed(self, spec: dict, env: dict, hook_dir: str):
        """The prewarmed process, handed its job; None to spawn normally.

        Not when the job's environment changes what Python decided at start-up
        (``PYTHONPATH``, ``LD_PRELOAD``, the locale, ...): the prewarmed
        process started before the job's variables were known."""
        proc, self.prewarmed = self.prewarmed, None
        argv = list(spec["argv"])
        if proc is None:
            return None
        if proc.poll() is not None and spec.get("preload") and argv[:3] == self.prewarmed_argv:
            # Never silently: a user who asked for preloaded ranks is told why not.
            self.fresh_note = "the prewarmed launcher exited%s" % _last_line(proc.stderr)  # (its code: reaped by _on_child)
        differs = env_mismatch(dict(os.environ), env, hook_dir, skip=PREWARM_FIXED, prefixes=PREWARM_SENSITIVE)
        if argv[:3] != self.prewarmed_argv or proc.poll() is not None or differs:
            if proc.poll() is None:  # prepared for another command: not needed
                proc.kill()
                proc.wait()
            if differs and spec.get("preload") and argv[:3] == self.prewarmed_argv:
                # as the zygote says it when it declines (preload.py), so the user knows why
                self.fresh_note = "%s differs from the preloaded interpreter's" % differs
            return None
        job = {"args": argv[3:], "cwd": spec.get("cwd") or os.getcwd(), "env": env,
               "preload": bool(spec.get("preload"))}
        try:
            proc.stdin.write((json.dumps(job) + "\n").encode())
            proc.stdin.close()
        except OSError:
            return None
        return proc

    def op_stop(self, msg: dict) -> None:
        if self.proc is None or self.stopping:
            return
        self.stopping = True
        grace = float(msg.get("grace", 5.0))
        self.chan.send(ev="log", level="info", t="stopping (%s)" % msg.get("reason", "asked by head"))
        sig = int(msg.get("sig") or signal.SIGTERM)
        # As a terminal (Ctrl-C) or a scheduler (SIGTERM) delivers it: to the
        # launcher's process group only.  torchrun (accelerate, deepspeed)
        # passes it on to its workers, which run in sessions of their own,
        # once; signalling them too would deliver a second one in the middle
        # of their handler (the KeyboardInterrupt `finally`, the checkpoint a
        # SIGTERM handler saves).
        try:
            pgid = os.getpgid(self.proc.pid)
            if pgid == self.proc.pid:
                os.killpg(pgid, sig)
            else:
                os.kill(self.proc.pid, sig)
        except OSError:
            pass
        self.stop_due = time.monotonic() + grace
        self.stop_grace = grace

    def check_stop(self) -> None:
        """The grace of a stop is over and the launcher still runs: SIGTERM
        what is left, then SIGKILL; say what that was."""
        if self.stop_due is None or self.proc is None or self.proc.poll() is not None:
            return
        if time.monotonic() < self.stop_due:
            return
        self.stop_due = None
        left = leftovers(0.0)
        if left:
            self.chan.send(ev="killed", n=len(left), names=sorted(set(left))[:5], grace=self.stop_grace)
        kill_tree(1.0, {self.proc.pid})

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
        # The launcher is gone: nothing of the run may outlive it.  Say so when
        # that stops something the job started and left running (a
        # tensorboard, a server), rather than end it silently.
        self.stop_telemetry()  # (its nvidia-smi is no leftover of the job's)
        left = leftovers() if not self.stopping else []
        if left:
            self.chan.send(ev="leftover", n=len(left), names=sorted(set(left))[:5])
        kill_tree(2.0, {self.proc.pid})
        for t in self.pumps:
            t.join(timeout=2.0)
        self.pumps = []
        if self.tailer is not None:
            # Every line the ranks wrote goes out before ``exit``: the head
            # closes the channel once it has that, and a chatty job's last
            # lines (the final metrics) would be lost.
            self.tailer.stop_evt.set()
            self.tailer.join(timeout=600.0)
        rc = self.proc.returncode
        if rc != 0:
            self.say_if_tmp_full()
            if self.fr_dir and self.tailer is not None:
                # What the ranks wrote as they exited, before their directory goes.
                flightrec_send(self.chan, self.fr_dir, dict(self.tailer.pids))
        self.chan.send(ev="exit", code=rc if rc >= 0 else None, sig=-rc if rc < 0 else None)
        self.proc = None
        self.job_dir.remove()

    def stop_telemetry(self) -> None:
        if self.telemetry is not None:
            self.telemetry.stop()
            self.telemetry = None

    def say_if_tmp_full(self) -> None:
        """A failed job whose directory's file system is full: say so among the launcher's lines."""
        line = self.job_dir.full_line()
        if line:
            self.chan.send(ev="line", r=None, s="err", t=line)

    def shutdown(self) -> None:
        """Stop everything this agent started; signals no longer interrupt it."""
        global _TEARING_DOWN
        _TEARING_DOWN = True
        self.stop_telemetry()
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
        self.job_dir.remove()
        release_holding()  # the job's GPUs and port are free once nothing of it runs
        self.done.set()

    def serve(self) -> int:
        threading.Thread(target=self.read_loop, name="read", daemon=True).start()
        threading.Thread(target=self.heartbeat_loop, name="hb", daemon=True).start()
        handlers = {
            "prewarm": self.op_prewarm,
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
                if op == "config":  # the heartbeat is slower on hundreds of nodes (head's limits.ping_interval)
                    self.head_timeout, self.hb_s, self.start_s = (
                        float(msg.get(k, d)) for k, d in (("head_timeout", 10), ("hb_s", 1), ("start_s", 0)))
                elif op in handlers:
                    try:
                        handlers[op](msg)
                    except Exception as e:
                        self.chan.send(ev="fatal", t="agent error in %s: %s: %s" % (op, type(e).__name__, e))
            for relay in self.pipe_relays:
                relay.tick()
            self.check_stop()
            self.check_workload()
            if _CHILD_EXITED.is_set():  # scanning /proc only when a child changed state
                _CHILD_EXITED.clear()
                reap_orphans({self.proc.pid} if self.proc is not None else set())
        self.shutdown()
        return 0


#: The running agent, for functions called through the ``call`` op.
AGENT = None


def stacks(sig: int, timeout: float = 3.0) -> dict:
    """Every rank's Python stacks on this node (``rankstacks.collect``)."""
    agent = AGENT
    if agent is None or agent.tailer is None:
        return {}
    return collect_stacks(agent.tailer, int(sig), float(timeout))


def flightrec(wait: float = 3.0) -> dict:
    """Every live rank's flight recorder dump, sent as ``flightrec`` events
    ahead of this call's result; the result says, per rank, whether it
    answered: {rank: "dumped" | "no answer" | "no flight recorder"}."""
    agent = AGENT
    if agent is None or agent.tailer is None or not agent.fr_dir:
        return {}
    pids = dict(agent.tailer.pids)
    state = flightrec_request(agent.fr_dir, sorted(pids), float(wait))
    flightrec_send(agent.chan, agent.fr_dir, pids)
    return {str(r): v for r, v in state.items()}


_CHILD_EXITED = threading.Event()


def _on_child(signum, frame):  # pragma: no cover - signal plumbing
    _CHILD_EXITED.set()


#: Set once the agent tears down; a signal after that is ignored.
_TEARING_DOWN = False


def _on_term(signum, frame):  # pragma: no cover - exercised by head-death tests
    """The first SIGTERM or SIGHUP unwinds into ``main``'s teardown; later ones
    are ignored.  The head's death may deliver several within a millisecond:
    PR_SET_PDEATHSIG fires each time the kernel moves us to another exiting
    thread of a multi-threaded parent.  A second SystemExit raised inside the
    teardown used to end the agent before it stopped the job, leaving the
    launcher and its ranks running."""
    global _TEARING_DOWN
    if _TEARING_DOWN:
        return
    _TEARING_DOWN = True
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
    global _PRCTL
    _PRCTL = libc_prctl()
    subreaper = become_subreaper(_PRCTL)
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
    except SystemExit as e:  # SIGTERM or SIGHUP (the head or its ssh died)
        code = e.code if isinstance(e.code, int) else 1
        agent.shutdown()
    except BaseException as e:  # a bug here must not leave the job running
        code = 70
        chan.send(ev="fatal", t="agent error: %s: %s" % (type(e).__name__, e))
        agent.shutdown()
    finally:
        # os._exit: the stdin reader thread may be blocked in a read, and a
        # normal interpreter shutdown would abort on its buffer lock.
        os._exit(code)
