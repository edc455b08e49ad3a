"""Restarts that can heal, and the nodes a restarted job runs on.

``--max-restarts N`` restarts the whole job after a failure.  Two questions
are answered here, so that the run loop (runner.py) only asks them:

- **Is it worth restarting?** (``judge``, ``RestartGate``)  A lost node, a
  process killed by a signal (the kernel's OOM killer, an admin, a flaky
  GPU), a hang, or a rank that failed only because its peer went away or a
  collective timed out: the next attempt can get past it.  A Python error in
  the program itself (``SyntaxError``, ``ImportError``, ``NameError``...)
  cannot: it is not restarted.  Any other exception gets one more try, and
  the same exception line at the same place (file and line of the innermost
  frame) in a second attempt ends the restarts, said once.
- **On which nodes?** (``Recovery.regroup``)  A node lost in an attempt gets
  ``--rejoin-timeout`` seconds to answer again (its agent is reconnected to).
  If it does not, a spare host of the cluster file (``spare = true``) takes
  its place; without one, the job goes on without it when ``--min-nodes``
  allows, re-planned on the smaller cluster (ranks and world size
  recomputed); below that it stops, naming the lost nodes.

The script resumes from its own checkpoint: ``Recovery.env`` is what every
rank is told about the attempt (docs/run.md, "Surviving a lost node").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import signal as _signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from corral.agent.session import AgentPool
from corral.errors import EXIT_INFRA, EXIT_INTERRUPTED, CorralError, PreflightError, UsageError
from corral.hostrange import fold
from corral.model import Cluster, Host
from corral.run.plan import LaunchPlan, RunSpec
from corral.run.preflight import local_disk_warning
from corral.run.record import one_line
from corral.run.watch import Failure, JobWatch, short_exc

#: Default for --rejoin-timeout: long enough for a host that only rebooted
#: its network, short next to the hours a lost node usually stays away.
REJOIN_TIMEOUT_S = 60.0
#: Between two reconnect rounds to a lost node (seconds).
REJOIN_PAUSE_S = 1.0

#: Python exceptions that say the program itself is wrong: the same code on
#: the same nodes raises them again at the same place, so none is restarted.
CODE_ERRORS = frozenset({"SyntaxError", "IndentationError", "TabError", "ImportError", "ModuleNotFoundError",
                         "NameError", "UnboundLocalError"})
#: An exception that says a peer, the network or a collective went away or
#: timed out (gloo's "Connection reset by peer", NCCL's watchdog timeout):
#: the next attempt, on nodes that answer, can get past it.
_TRANSIENT = re.compile(
    r"timed? ?out|timeout|connection (?:reset|refused|closed|aborted)|broken pipe|DistNetworkError|"
    r"nccl(?:System|Remote|Internal)Error|NCCL communicator|ECONNRESET|EPIPE|no route to host|"
    r"network is unreachable|stale file handle|input/output error",
    re.IGNORECASE,
)


# ---------------------------------------------------------------------------
# is it worth restarting?


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What a failed attempt was, and whether a restart can get past it."""

    restart: bool
    #: The failure in a few words ("ValueError: bad shape at train.py:12").
    what: str
    #: (exception line, path:line of the innermost frame) of a Python
    #: exception: seen again in a later attempt, the restarts end.
    signature: tuple[str, str] | None = None


def _signal_exit(code: int | None) -> str | None:
    """128+N from a shell (``--launcher command`` through bash): killed by signal N."""
    if code is None or not 128 < code < 128 + 65:
        return None
    try:
        return _signal.Signals(code - 128).name
    except ValueError:
        return None


def _last_exception(lines: Sequence[str]) -> Any:
    """The last Python traceback in ``lines`` (a ``PyException``), parsed as
    ``corral diagnose`` parses rank logs; imported here, on a failure."""
    from corral.diagnose.logtext import iter_text
    from corral.diagnose.pyexc import parse_traceback

    return parse_traceback(iter_text("\n".join(lines)))


def judge(failure: Failure, lines: Sequence[str]) -> Verdict:
    """Whether a restart can get past ``failure``; ``lines``: the failed
    rank's last output (its node launcher's, for a node-level failure)."""
    if failure.kind == "lost":
        return Verdict(restart=True, what=f"{failure.host} was lost")
    if failure.kind == "hang":
        return Verdict(restart=True, what="a hang")
    killer = failure.signal_name or _signal_exit(failure.code)
    if killer:
        return Verdict(restart=True, what=f"a process killed by {killer}")
    if failure.consequential:
        return Verdict(restart=True, what="a rank whose peer went away")
    if failure.kind == "start":
        return Verdict(restart=False, what=f"{failure.host} could not start the job ({failure.reason}), "
                                           "which a restart would not change")
    exc = _last_exception(lines)
    text = exc.text if exc is not None else failure.exc
    if text and _TRANSIENT.search(text):
        return Verdict(restart=True, what=f"a network error or timeout ({short_exc(text, 160)})")
    if exc is None or not exc.frames:
        said = short_exc(text, 160) if text else f"exit code {failure.code}"
        return Verdict(restart=True, what=said, signature=(said, "?"))
    frame = exc.frames[-1]  # the innermost: where it was raised
    what = f"{short_exc(exc.text, 160)} at {frame.short}"
    if exc.type.rsplit(".", 1)[-1] in CODE_ERRORS:
        return Verdict(restart=False, what=f"{what}, an error in the program itself that a restart runs "
                                           "into again")
    return Verdict(restart=True, what=what, signature=(exc.text, f"{frame.file}:{frame.line}"))


def failure_lines(watch: JobWatch, failure: Failure) -> list[str]:
    """What the failed rank (or its node's launcher) last wrote."""
    if failure.rank is not None:
        return list(watch.tails[failure.rank])
    node = watch.nodes.get(failure.host)
    return list(node.launcher_tail) if node is not None else []


class RestartGate:
    """Judges each failed attempt; the same Python exception at the same
    place as in an earlier attempt ends the restarts."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], int] = {}

    def decide(self, failure: Failure, lines: Sequence[str], attempt: int) -> Verdict:
        verdict = judge(failure, lines)
        if not verdict.restart or verdict.signature is None:
            return verdict
        first = self._seen.setdefault(verdict.signature, attempt)
        if first == attempt:
            return verdict
        return Verdict(restart=False, signature=verdict.signature,
                       what=f"{verdict.what} again, as in attempt {first}: the same exception at the same "
                            "place, where a restart would fail once more")


# ---------------------------------------------------------------------------
# on which nodes?


class NotEnoughNodes(CorralError):
    """Fewer nodes answer than the job may run on (--min-nodes)."""

    exit_code = EXIT_INFRA
    category = "infrastructure"


@dataclass(frozen=True, kw_only=True)
class Exclusion:
    """A node the job goes on without, from ``attempt`` on."""

    host: str
    attempt: int
    reason: str
    #: The spare host that took its place (its node rank), if one did.
    replaced_by: str | None = None


def regroup(active: Sequence[Host], lost: set[str], spares: Sequence[Host],
            min_nodes: int | None) -> tuple[tuple[Host, ...], dict[str, str | None]]:
    """The next attempt's hosts: each lost host replaced where it stood by the
    next spare (so the others keep their node ranks), else left out; and, per
    lost host, its replacement (None: none).  Raises NotEnoughNodes when fewer
    than ``min_nodes`` are left (None: than there were)."""
    free = list(spares)
    hosts: list[Host] = []
    swaps: dict[str, str | None] = {}
    for host in active:
        if host.name not in lost:
            hosts.append(host)
            continue
        spare = free.pop(0) if free else None
        swaps[host.name] = spare.name if spare else None
        if spare is not None:
            hosts.append(spare.with_(spare=False))  # a node of the job from now on
    if len(hosts) < (len(active) if min_nodes is None else min_nodes):
        gone = [h.name for h in active if h.name in lost]
        left = fold([h.name for h in hosts]) if hosts else "none"
        need = f"--min-nodes {min_nodes}" if min_nodes is not None else \
            f"the {len(active)} it ran on (--min-nodes M lets it go on with M)"
        raise NotEnoughNodes(
            f"{fold(gone)} lost and not back; no spare host to take {'its' if len(gone) == 1 else 'their'} "
            f"place: {len(hosts)} node(s) left ({left}), fewer than {need}; the job stops here",
            hint=f"bring {fold(gone)} back and run the same command again (the script resumes from its "
                 "checkpoint), list a spare host in the cluster file (spare = true), or lower --min-nodes")
    return tuple(hosts), swaps


def hosts_in_error(error: CorralError) -> set[str]:
    """The hosts a restart could not connect to (its agent did not start)."""
    if isinstance(error, PreflightError) and error.message.startswith("connecting failed"):
        return {p.host for p in error.problems}
    return set()


@dataclass(frozen=True, kw_only=True)
class RecoveryOptions:
    #: Fewest nodes the job may go on with after a node is lost (None: all it started on).
    min_nodes: int | None = None
    #: Seconds a lost node gets to answer again before the job goes on without it.
    rejoin_timeout: float = REJOIN_TIMEOUT_S
    #: Where the script writes its checkpoints (absolute, or relative to the work dir).
    checkpoint_dir: str | None = None


def check_checkpoint_dir(path: str | None) -> None:
    """``--checkpoint-dir`` travels to every rank as a variable, taken as it is."""
    if path is None:
        return
    if not path.strip() or any(c in path for c in "\0\n\r"):
        raise UsageError(f"--checkpoint-dir {path!r} is not a directory name",
                         hint="give an absolute path, or one relative to the work dir")
    if path.startswith("~"):
        raise UsageError(f"--checkpoint-dir {path}: '~' would reach the script unexpanded in "
                         "CORRAL_CHECKPOINT_DIR", hint="give an absolute path, or one relative to the work dir")


class Recovery:
    """The nodes a job runs on, attempt by attempt, and what it is told about them."""

    def __init__(self, cluster: Cluster, options: RecoveryOptions, *, tag: str, max_restarts: int,
                 connect_timeout: float, node_timeout: float, say: Callable[[str], None]):
        self.full = cluster
        #: The hosts the next attempt starts on.
        self.cluster = cluster.without_spares()
        self.spares = list(cluster.spares)
        self.options = options
        self.tag = tag
        self.max_restarts = max_restarts
        self.connect_timeout = connect_timeout
        self.node_timeout = node_timeout
        self.say = say
        self.gate = RestartGate()
        self.excluded: list[Exclusion] = []
        #: Why the restarts ended before --max-restarts was used up (said once).
        self.refused: str | None = None
        #: attempt -> (hosts, world size), for the attempts that launched.
        self.launched: dict[int, tuple[list[str], int]] = {}
        #: The checkpoint storage is looked at before the first launch and
        #: again after the nodes change; its warning is said once.
        self._disk_due = True
        self._disk_said = False
        self._changed = False
        n = len(self.cluster.hosts)
        if options.min_nodes is not None and options.min_nodes > n:
            raise UsageError(f"--min-nodes {options.min_nodes}, but the job starts on {n} node(s)"
                             + (f" ({len(self.spares)} spare(s) not counted)" if self.spares else ""),
                             hint=f"give --min-nodes {n} or fewer")
        check_checkpoint_dir(options.checkpoint_dir)

    @property
    def can_regroup(self) -> bool:
        """Whether a lost node can be replaced or left out (else the job waits for it)."""
        return self.options.min_nodes is not None or bool(self.spares)

    # -- judging ------------------------------------------------------------

    def judge(self, watch: JobWatch, attempt: int) -> bool:
        """Whether the failed ``attempt`` is restarted; if not, say why (once)."""
        failure = watch.root_cause()
        if failure is None:
            return True
        verdict = self.gate.decide(failure, failure_lines(watch, failure), attempt)
        if not verdict.restart:
            left = self.max_restarts - attempt + 1
            unused = f"{left} of --max-restarts {self.max_restarts} unused"
            self.refused = f"not restarting ({unused}): {verdict.what}"
            self.say(self.refused)
        return verdict.restart

    # -- regrouping ----------------------------------------------------------

    async def regroup(self, lost: set[str], attempt: int, wake: asyncio.Event,
                      interrupted: Callable[[], bool]) -> Cluster:
        """The cluster for ``attempt`` after ``lost`` nodes went away: each
        gets --rejoin-timeout to answer again, then a spare takes its place,
        or the job goes on without it (--min-nodes)."""
        order = [h.name for h in self.cluster.hosts if h.name in lost]
        if not order:
            return self.cluster
        wait = self.options.rejoin_timeout
        if self.spares:
            then = "restarting with a spare host in its place"
        elif len(self.cluster.hosts) - len(order) >= (self.options.min_nodes or len(self.cluster.hosts)):
            then = "restarting on the nodes left"
        else:
            then = "stopping (--min-nodes: too few nodes would be left)"
        self.say(f"{fold(order)} lost: waiting up to {wait:g} s for it to answer again (--rejoin-timeout), "
                 f"then {then}")
        gone = await self._rejoin(order, wake, interrupted)
        if not gone:
            self.say(f"{fold(order)} answers again: restarting on all {len(self.cluster.hosts)} nodes")
            return self.cluster
        spares = await self._answering_spares(len(gone))
        hosts, swaps = regroup(self.cluster.hosts, set(gone), spares, self.options.min_nodes)
        why = f"lost in attempt {attempt - 1} and did not answer within --rejoin-timeout {wait:g} s"
        for name in gone:
            self.excluded.append(Exclusion(host=name, attempt=attempt, reason=why, replaced_by=swaps[name]))
        used = {s for s in swaps.values() if s}
        self.spares = [s for s in self.spares if s.name not in used]
        self.cluster = dataclasses.replace(self.cluster, hosts=hosts)
        self._changed = self._disk_due = True
        said = [f"{swaps[n]} (spare) takes the place of {n}" for n in gone if swaps[n]]
        left = [n for n in gone if not swaps[n]]
        if left:
            said.append(f"going on without {fold(left)}")
        self.say(f"{'; '.join(said)}: restarting on {len(hosts)} node(s) ({fold([h.name for h in hosts])}), "
                 "ranks and world size recomputed")
        return self.cluster

    async def _rejoin(self, names: list[str], wake: asyncio.Event,
                      interrupted: Callable[[], bool]) -> list[str]:
        """Reconnect to each lost node until it answers or --rejoin-timeout
        runs out; the ones that never answered."""
        deadline = time.monotonic() + self.options.rejoin_timeout
        waiting = list(names)
        while waiting:
            left = deadline - time.monotonic()
            timeout = max(min(self.connect_timeout, left), 1.0)
            answers = await asyncio.gather(*(self._answers(self.cluster.host(n), timeout) for n in waiting))
            waiting = [n for n, why in zip(waiting, answers) if why is not None]
            if interrupted():
                raise CorralError("interrupted while waiting for a lost node; nothing of the job is running",
                                  exit_code=EXIT_INTERRUPTED)
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            wake.clear()  # set by Ctrl-C
            with contextlib.suppress(asyncio.TimeoutError):  # the last try at the deadline itself
                await asyncio.wait_for(wake.wait(), min(REJOIN_PAUSE_S, left))
        return waiting

    async def _answering_spares(self, wanted: int) -> list[Host]:
        """Up to ``wanted`` spare hosts whose agent starts, in file order; one
        that does not is named and kept for a later restart."""
        found: list[Host] = []
        for spare in self.spares:
            if len(found) == wanted:
                break
            why = await self._answers(spare, self.connect_timeout)
            if why is None:
                found.append(spare)
            else:
                self.say(f"spare host {spare.name} does not answer either ({why}); not used")
        return found

    async def _answers(self, host: Host, timeout: float) -> str | None:
        """None when ``host``'s agent starts; else why not, in one line."""
        pool = AgentPool(dataclasses.replace(self.full, hosts=(host,)), tag=self.tag,
                         connect_timeout=timeout, head_timeout=self.node_timeout)
        try:
            await pool.open()
        except CorralError as e:
            return one_line(e)
        await pool.close(timeout=5)
        return None

    # -- what the job is told, and what run.json says ---------------------

    def started(self, plan: LaunchPlan, attempt: int) -> None:
        self.launched[attempt] = ([n.host.name for n in plan.nodes], plan.world_size)

    def env(self, attempt: int) -> dict[str, str]:
        """The attempt's variables for every rank (docs/run.md, "The contract")."""
        env = {"CORRAL_ATTEMPT": str(attempt), "CORRAL_MAX_RESTARTS": str(self.max_restarts)}
        ckpt = self.options.checkpoint_dir
        if ckpt:
            env["CORRAL_CHECKPOINT_DIR"] = ckpt
        before = [a for a in self.launched if a < attempt]
        if before:
            previous = max(before)
            env["CORRAL_PREVIOUS_ATTEMPT"] = str(previous)
            env["CORRAL_PREVIOUS_WORLD_SIZE"] = str(self.launched[previous][1])
            if ckpt:
                env["CORRAL_RESUME_DIR"] = ckpt  # what the previous attempt wrote, to resume from
        if self.excluded:
            env["CORRAL_EXCLUDED_HOSTS"] = ",".join(e.host for e in self.excluded)
        return env

    def record(self) -> dict[str, Any]:
        """run.json's part: the nodes left out, and each attempt's nodes."""
        return {
            "min_nodes": self.options.min_nodes,
            "checkpoint_dir": self.options.checkpoint_dir,
            "excluded": [dataclasses.asdict(e) for e in self.excluded],
            "attempt_hosts": {str(a): hosts for a, (hosts, _) in sorted(self.launched.items())},
            "not_restarted": self.refused,
        }

    # -- checkpoints on node-local disks -----------------------------------

    async def disk_notice(self, pool: AgentPool, probes: Mapping[str, dict], spec: RunSpec,
                          head_cwd: str) -> str | None:
        """Before the first launch, and before a relaunch on other nodes: the
        warning (given once) when the checkpoints land on each node's own
        disk, where a restarted job on other nodes cannot read them."""
        if not self._disk_due or self._disk_said or not self.max_restarts:
            return None
        self._disk_due = False
        ckpt = self.options.checkpoint_dir
        if ckpt:
            def args_for(s: Any) -> dict:
                return {"path": ckpt, "base": spec.workdir or self.cluster.workdir_for(s.host) or head_cwd}

            try:
                facts = await pool.call_all("probes.dir_facts", args_for, timeout=15)
            except PreflightError:
                return None  # a node gone quiet: the launch names it
            note = local_disk_warning({n: {"dir": f} for n, f in facts.items()}, key="dir",
                                      what="--checkpoint-dir")
        else:
            note = local_disk_warning(probes)
        if not note:
            return None
        self._disk_said = True
        return f"restarting on {fold(list(pool.cluster.names))}: {note}" if self._changed else note
