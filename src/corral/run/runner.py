"""``corral run``: preflight, rendezvous, launch, watch, teardown, restart.

The run loop, in order:

1. connect to every host's agent in parallel (named errors for every host
   that cannot be reached, all at once);
2. preflight on every node in one round trip: working directory, script,
   the launcher's Python module, GPUs, addresses, a free port on node 0;
3. choose the rendezvous address: an address of node 0 that every other
   node proves it can reach (a real TCP connection to the chosen port);
4. start every node's launcher through its agent;
5. watch: the first failure (or a lost node, or Ctrl-C) stops every other
   node (SIGTERM, then SIGKILL after ``grace``); ``--max-restarts`` restarts
   the whole job;
6. record ``run.json`` and return a ``RunResult``.

Library API: ``Runner(cluster, spec, options, view).run()`` returns a
result and never prints; the CLI passes a view that does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral import ui
from corral.agent.bundle import hook_source, preload_modules
from corral.agent.session import AgentPool, AgentSession
from corral.diagnose.stacks import (
    fold_ranks,
    stack_key_text,
)
from corral.errors import (
    EXIT_INFRA,
    EXIT_INTERRUPTED,
    CorralError,
    HostError,
    PreflightError,
    UsageError,
)
from corral.limits import ensure_open_files, files_needed, telemetry_interval
from corral.model import Cluster
from corral.run.control import collect_stacks, control_path, ranks_of, serve
from corral.run.flightrec import FlightDumps, at_failure, flight_report, save_report
from corral.run.hangs import declare_hang, quiet_notice
from corral.run.imports import node_accelerate_notes
from corral.run.logs import RunLogs
from corral.run.options import RunOptions, RunView, _NullView
from corral.run.plan import LaunchPlan, RunSpec, build_plan, ds_config_notes, job_sets
from corral.run.preflight import choose_master, node_facts, preflight
from corral.run.record import error_record, failure_record, one_line, plan_record
from corral.run.recovery import Recovery, hosts_in_error
from corral.run.result import RunResult, diagnose_failure, env_hint
from corral.run.scriptcheck import script_checks
from corral.run.telemetry import TelemetryFiles
from corral.run.watch import Failure, JobWatch, node_notice

#: Launchers whose per-node process is torchrun's elastic agent, and the module
#: each node imports ahead of its job (preloaded ranks need that agent).
PREWARMED = {"torchrun": "torch.distributed.run", "accelerate": "accelerate.commands.launch"}
#: A restart that cannot reconnect waits this long before the next try,
#: doubled each time in a row, up to the maximum (seconds).
RESTART_BACKOFF_S = 2.0
RESTART_BACKOFF_MAX_S = 30.0
#: Signals the head passes on to every rank (Slurm's warning before the time
#: limit, ``--signal=B:USR1@120``; frameworks' checkpoint requests).
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)
#: At a failure, the flight recorder's dumps and the GPU nodes' health are
#: read before the teardown, for at most this long (seconds).
EVIDENCE_WAIT_S = 6.0

log = logging.getLogger(__name__)


def _check_shown_ranks(shown: frozenset[int] | None, world_size: int) -> None:
    """--ranks naming a rank the run does not have would silently show nothing."""
    missing = sorted(r for r in (shown or ()) if r >= world_size)
    if missing:
        have = "rank 0" if world_size == 1 else f"ranks 0-{world_size - 1}"
        raise UsageError(
            f"--ranks names {fold_ranks(set(missing))}, but this run has {world_size} rank(s) ({have})",
            hint=f"pick ranks below {world_size} (--ranks all shows every rank); "
                 "nothing was started")


class _LogSink:
    def __init__(self, logs: RunLogs):
        self.logs = logs

    def line(self, host: str, rank: int | None, stream: str, text: str) -> None:
        self.logs.line(host, rank, text)

    def line_batch(self, host: str, rank: int | None, stream: str, texts: list[str]) -> None:
        self.logs.lines(host, rank, texts)

    def status(self, host: str, rank: int | None, text: str) -> None:
        self.logs.status(host, rank, text)


# ---------------------------------------------------------------------------
# the run


@dataclass
class _Attempt:
    plan: LaunchPlan
    watch: JobWatch
    pool: AgentPool


class Runner:
    """Runs one job; ``await run()`` returns a RunResult (or raises PreflightError)."""

    def __init__(
        self,
        cluster: Cluster,
        spec: RunSpec,
        options: RunOptions,
        *,
        view: RunView | None = None,
        head_env: Mapping[str, str],
        head_cwd: str,
    ):
        self.spec = spec
        self.options = options
        self.view: RunView = view or _NullView()
        #: Which nodes each attempt runs on (spares held back) and whether a failure is restarted.
        self.recovery = Recovery(cluster, options.recovery, tag=spec.run_id, max_restarts=options.max_restarts,
                                 connect_timeout=options.connect_timeout, node_timeout=options.node_timeout,
                                 say=self.view.message)
        self.cluster = self.recovery.cluster
        self.head_env = head_env
        self.head_cwd = head_cwd
        self.logs: RunLogs | None = None
        self.attempt: _Attempt | None = None
        self.interrupts = 0
        self._script_checked = False
        self._gloo_said = False
        #: Attempts that failed and were restarted (--max-restarts): what failed.
        self.restarts: list[dict] = []
        #: What stopped the head: SIGINT (Ctrl-C) is passed on to the ranks as
        #: SIGINT, so their KeyboardInterrupt handlers run; SIGTERM/SIGHUP as SIGTERM.
        self.interrupt_signal: int | None = None
        self.hang_stacks: tuple[str, ...] = ()
        #: Flight recorder dumps the nodes sent, and what they say (lines).
        self.flight = FlightDumps()
        self.flight_lines: tuple[str, ...] = ()
        #: What the GPU nodes' kernels, GPUs and NCCL said at a failure.
        self.health: tuple[str, ...] = ()
        self._wake: asyncio.Event | None = None
        self.started = time.time()
        self.tm_files: TelemetryFiles | None = None
        #: SIGUSR1/2 being passed on to the ranks (``forward``).
        self._forwarding: set[asyncio.Task] = set()

    # -- signals -----------------------------------------------------------

    def interrupt(self, sig: int = signal.SIGINT) -> None:
        self.interrupts += 1
        if self.interrupt_signal is None:
            self.interrupt_signal = sig
        if self._wake is not None:
            self._wake.set()

    def _install_signals(self) -> list[int]:
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                loop.add_signal_handler(sig, self.interrupt, sig)
                installed.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                pass  # not the main thread (library use): the caller handles signals
        for sig in FORWARDED:
            try:
                loop.add_signal_handler(sig, self.forward, sig)
                installed.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                pass
        return installed

    def forward(self, sig: int) -> None:
        """Pass ``sig`` (SIGUSR1/2) on to every rank of the running attempt.

        Slurm's ``--signal=B:USR1@120`` warns the batch script before the time
        limit; ``corral submit``'s script hands it to corral, and the ranks
        (each main process the rank hook registered) get it here so they can
        checkpoint.  The job goes on: the script decides whether to exit."""
        attempt = self.attempt
        name = signal.Signals(sig).name
        if attempt is None:
            self.view.message(f"{name} received before the ranks started: not forwarded")
            return
        self.view.message(f"{name} received: forwarded to every rank")
        task = asyncio.get_running_loop().create_task(
            asyncio.gather(*(s.signal(sig) for s in attempt.pool.sessions)))
        self._forwarding.add(task)
        task.add_done_callback(self._forwarding.discard)

    # -- events ------------------------------------------------------------

    def _on_event(self, session: AgentSession, ev: dict) -> None:
        if ev.get("ev") == "flightrec":
            self.flight.take(session.name, ev)
        if ev.get("ev") == "tm":
            if self.logs is not None:
                self.tm_files = self.tm_files or TelemetryFiles(self.logs.dir, on_error=self.view.message)
                self.tm_files.write(session.name, ev)
            return
        notice = node_notice(session.name, ev, interrupted=bool(self.interrupts))
        if notice:
            self.view.message(notice)
        if self.attempt is not None:
            self.attempt.watch.event(session.name, ev)
            if ev.get("ev") in ("exit", "rank_exit", "closed", "fatal") and self._wake is not None:
                self._wake.set()

    # -- main --------------------------------------------------------------

    async def run(self) -> RunResult:
        self._wake = asyncio.Event()
        installed = self._install_signals()
        self.control = self._control_path()
        server = await serve(self.control, self._control_request)
        try:
            return await self._run()
        finally:
            server.close()
            self.control.unlink(missing_ok=True)
            loop = asyncio.get_running_loop()
            for sig in installed:
                loop.remove_signal_handler(sig)
            if self.logs is not None:
                self.logs.close()
            if self.tm_files is not None:
                self.tm_files.close()

    def _control_path(self) -> Path:
        """Where `corral stacks` reaches this run (a detached run's supervisor keeps it in its job directory)."""
        return control_path(self.spec.run_id)

    async def _control_request(self, request: str) -> dict:
        """`corral stacks RUN` from another process."""
        if request != "stacks":
            return {"error": f"unknown request {request!r}"}
        if self.attempt is None:
            return {"error": "the job has not started yet"}
        silent: list[str] = []
        dumps = await collect_stacks(self.attempt.pool, unanswered=silent)
        plan = self.attempt.plan
        report = None
        if self.options.flight_recorder and self.logs is not None:
            report = await flight_report(self.attempt.pool, self.flight, self.logs.dir, plan.world_size)
        return {"run_id": self.spec.run_id, "world_size": plan.world_size,
                "master_addr": plan.master_addr, "master_port": plan.master_port,
                "unanswered": {str(r): h for r, h in ranks_of(plan, silent).items()},
                "stacks": {stack_key_text(k): v for k, v in dumps.items()},
                "flightrec": report.lines() if report is not None else []}

    async def _quiet(self, pool: AgentPool, watch: JobWatch, silent: float) -> None:
        assert self.logs is not None
        await quiet_notice(self.view, pool, watch, self.logs.dir, silent)

    async def _hang(self, pool: AgentPool, watch: JobWatch, silent: float) -> None:
        assert self.logs is not None
        self.hang_stacks, self.flight_lines = await declare_hang(
            self.view, pool, watch, self.logs.dir, silent, self.flight,
            flight_recorder=self.options.flight_recorder, since=self.started)

    async def _run(self) -> RunResult:
        attempts = 0
        unreachable = 0  # restarts in a row that could not reconnect
        lost: set[str] = set()  # nodes to wait for, replace or leave out (--min-nodes, spares)
        while True:
            attempts += 1
            try:
                if lost:  # wait for them, replace them, or go on without them
                    assert self._wake is not None
                    self.cluster = await self.recovery.regroup(lost, attempts, self._wake,
                                                               lambda: bool(self.interrupts))
                    lost = set()
                result = await self._attempt(attempts)
            except CorralError as e:
                if attempts == 1:
                    raise  # before the first launch: preflight's error, as it is
                unreachable += 1
                await self._restart_not_started(e, attempts, unreachable)
                lost = hosts_in_error(e) if self.recovery.can_regroup else set()
                continue
            unreachable = 0
            if result.status != "failed" or attempts > self.options.max_restarts or self.interrupts:
                return result
            assert self.attempt is not None
            if not self.recovery.judge(self.attempt.watch, attempts):  # says why, once; run.json too
                self._record(result.plan, result.status, result.failure, attempts,  # type: ignore[arg-type]
                             exit_code=result.exit_code, left_early=result.left_early)
                return result
            if self.recovery.can_regroup:
                lost = {name for name, node in self.attempt.watch.nodes.items() if node.lost}
            why = result.failure.describe() if result.failure else "failed"
            self.restarts.append({"attempt": attempts, "failure": why})
            self.view.message(f"{why}; restarting the job (restart {attempts}/{self.options.max_restarts})")
            if self.logs is not None:
                self.logs.marker(f"restart {attempts}/{self.options.max_restarts}")

    async def _restart_not_started(self, error: CorralError, attempt: int, in_a_row: int) -> None:
        """A restart that could not start (a node not back yet, its ssh
        refused): with restarts left, say so, wait (2 s, 4 s, ... up to 30 s)
        and return so the next one tries again; else raise ``error``.  Either
        way run.json records the attempt."""
        assert self.attempt is not None and self.logs is not None
        plan = self.attempt.plan
        why = "could not restart: " + one_line(error)
        retry = (isinstance(error, (PreflightError, HostError)) and attempt <= self.options.max_restarts
                 and not self.interrupts)
        if not retry:
            status = "interrupted" if self.interrupts else "failed"
            self._record(plan, status, None, attempt, exit_code=error.exit_code, error=(error, why))
            raise error
        self.restarts.append({"attempt": attempt, "failure": why})
        delay = min(RESTART_BACKOFF_S * 2 ** (in_a_row - 1), RESTART_BACKOFF_MAX_S)
        self.view.message(f"{why}; trying again in {delay:g} s (restart {attempt}/{self.options.max_restarts})")
        self.logs.marker(f"restart {attempt}/{self.options.max_restarts} (after {delay:g} s)")
        self._record(plan, "running", None, attempt)
        assert self._wake is not None
        self._wake.clear()  # set by Ctrl-C (no pool is open to set it otherwise)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)
        if self.interrupts:
            self._record(plan, "interrupted", None, attempt, exit_code=EXIT_INTERRUPTED)
            raise CorralError("interrupted while waiting to restart the job; nothing of it is running",
                              exit_code=EXIT_INTERRUPTED)

    async def _open_and_plan(self) -> tuple[AgentPool, LaunchPlan]:
        pool = AgentPool(self.cluster, tag=self.spec.run_id, on_event=self._on_event,
                         connect_timeout=self.options.connect_timeout,
                         head_timeout=self.options.node_timeout)
        await pool.open()
        try:
            module = PREWARMED.get(self.spec.launcher)
            if module is not None:
                # torchrun (also inside `accelerate launch`) spends most of its
                # start-up importing torch: let every node do that now, while
                # preflight and the rendezvous check run.
                preload = preload_modules() if self.spec.preload else None
                await asyncio.gather(*(s.send(op="prewarm", python=s.host.python, module=module, elastic=True,
                                              preload_modules=preload) for s in pool.sessions))
            probes = await preflight(pool, self.cluster, self.spec, self.head_cwd, warn=ui.notice)
            note = await self.recovery.disk_notice(pool, probes, self.spec, self.head_cwd)
            if note:
                ui.notice(note)
            port = self.spec.master_port or probes[pool.sessions[0].name].get("port")
            master = await choose_master(pool, probes, int(port))
            facts = node_facts(pool, probes, master, warn=(lambda _: None) if self._gloo_said else ui.notice,
                               job_sets_gloo=lambda h: job_sets("GLOO_SOCKET_IFNAME", self.cluster, self.spec, h,
                                                                self.head_env))
            self._gloo_said = True  # once per run, not once per restart
            plan = build_plan(self.cluster, self.spec, facts, master_addr=master, master_port=int(port),
                              head_env=self.head_env, head_cwd=self.head_cwd)
            _check_shown_ranks(self.options.shown_ranks, plan.world_size)
            ensure_open_files(files_needed(len(pool.sessions), plan.world_size),  # a log file per rank
                              f"a run of {plan.world_size} ranks on {len(pool.sessions)} nodes", say=ui.notice)
            if not self._script_checked and not self.spec.module:
                self._script_checked = True
                problem, notes = script_checks(self.spec.program, Path(self.head_cwd), launcher=self.spec.launcher,
                                               args=self.spec.args, nproc=plan.nodes[0].nproc,
                                               nnodes=len(plan.nodes), told=self.spec.nproc_per_node is not None)
                if problem:
                    raise UsageError(problem[0], hint=problem[1])
                notes += ds_config_notes(self.spec, self.head_cwd, plan.world_size)
                notes += node_accelerate_notes(self.spec, self.cluster.hosts, facts, plan.nodes[0].nproc)
                for note in notes:
                    ui.notice(note)
        except BaseException:
            await pool.close()
            raise
        return pool, plan

    async def _attempt(self, number: int) -> RunResult:
        pool, plan = await self._open_and_plan()
        if self.logs is None:
            try:
                self.logs = RunLogs(
                    self.options.runs_dir, self.spec.run_id,
                    on_error=lambda why: self.view.message(
                        f"{why}: the job goes on, its output only on this terminal (free space "
                        "there, or --runs-dir / $CORRAL_RUNS_DIR elsewhere, for the next run)"))
            except FileExistsError:
                # Another run took this id (started in the same second, same
                # random part): never write into its directory.
                await pool.close(timeout=self.options.grace + 5)
                raise CorralError(
                    f"run directory {self.options.runs_dir / self.spec.run_id} already exists: another "
                    "corral run has the same id; nothing was started",
                    hint="run the command again (it draws a new id)", exit_code=EXIT_INFRA) from None
        watch = JobWatch(plan, sinks=[_LogSink(self.logs), self.view])
        self.attempt = _Attempt(plan=plan, watch=watch, pool=pool)
        self.recovery.started(plan, number)
        self._record(plan, "running", None, number)
        try:
            await self._start(pool, plan, number)
            await self._watch(pool, watch)
        finally:
            await pool.close(timeout=self.options.grace + 5)
            self.logs.flush()
        return self._result(plan, watch, number)

    async def _start(self, pool: AgentPool, plan: LaunchPlan, number: int) -> None:
        hook = hook_source()
        self.flight.clear()  # dumps and health of this attempt only
        self.flight_lines = self.health = ()

        async def one(node) -> None:
            # which run of the job this is: a script resumes from its checkpoint after a restart
            env = dict(node.env, **self.recovery.env(number))
            spec = {
                "argv": list(node.argv),
                "env": env,
                "env_refs": [[name, [list(p) for p in parts]] for name, parts in node.env_refs],
                "cwd": node.cwd,
                "pipe_rank": node.pipe_rank,
                "ranks": [node.first_rank, node.nproc],  # the agent ignores other ranks' files
                "hook_source": hook,
                "tag": f"{plan.run_id}-{number}",
                "keep_tmp": self.options.keep_node_tmp,
                "preload": self.spec.preload and self.spec.launcher in PREWARMED,
                "flight_recorder": self.options.flight_recorder,
                "telemetry": self.options.telemetry,
                "telemetry_s": telemetry_interval(len(plan.nodes)),
            }
            session = pool[node.host.name]
            session.ranks = node.ranks  # a frame for any other rank is a protocol error
            await session.send(op="start", spec=spec)

        await asyncio.gather(*(one(n) for n in plan.nodes))

    async def _watch(self, pool: AgentPool, watch: JobWatch) -> None:
        """Wait for every node to finish; tear everything down on the first failure.

        The failing node's own launcher gets ``grace`` seconds to wind down
        by itself (torchrun then reports which of its ranks failed); every
        other node is stopped at once, since its ranks can only hang or fail
        on the missing peer -- unless the first failure is itself such an
        echo, when every node gets the grace to report the real error.
        """
        assert self._wake is not None
        stopping_since: float | None = None
        stop_sent: set[str] = set()
        pending: dict[str, float] = {}
        hard = False
        quiet_since, quiet_next = watch.last_progress, self.options.quiet_notice

        async def stop(s: AgentSession, reason: str) -> None:
            stop_sent.add(s.name)
            ctrl_c = self.interrupts and self.interrupt_signal == signal.SIGINT
            await s.send(op="stop", grace=self._grace(), reason=reason,
                         sig=int(signal.SIGINT if ctrl_c else signal.SIGTERM))

        while not watch.all_done:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
            now = time.monotonic()
            for s in pool.sessions:
                if not watch.nodes[s.name].done and s.silent_for() > self.options.node_timeout:
                    watch.lose(s.name, f"no heartbeat for {s.silent_for():.0f}s (network partition, "
                                       "frozen or crashed host)")
                    await s.kill()
            hang = self.options.hang_timeout
            if hang and stopping_since is None and not watch.failed and now - watch.last_progress > hang:
                await self._hang(pool, watch, now - watch.last_progress)
            if quiet_since != watch.last_progress:
                quiet_since, quiet_next = watch.last_progress, self.options.quiet_notice
            if (not hang and stopping_since is None and not watch.failed and not self.interrupts
                    and now - watch.last_progress > quiet_next):
                quiet_next *= 2
                await self._quiet(pool, watch, now - watch.last_progress)
            if stopping_since is None and (watch.failed or self.interrupts):
                cause = None if self.interrupts else watch.root_cause()
                if cause is None:
                    reason = "interrupted"
                    self.view.message(f"interrupted: stopping every node (its processes get up to "
                                      f"{self._grace():g} s to exit, --grace; Ctrl-C again stops them now)")
                else:
                    reason = cause.describe()
                    self.view.message(f"{reason}: stopping every node")
                    if cause.kind != "hang":  # the collectives and GPUs, before the teardown (a hang's: read)
                        # bounded: a node that died without closing its channel (srun)
                        # must not hold the teardown (nor the lost-node check) up
                        try:
                            self.health = await asyncio.wait_for(at_failure(
                                pool, enabled=self.options.flight_recorder, since=self.started,
                                lost=frozenset(n for n, st in watch.nodes.items() if st.lost)), EVIDENCE_WAIT_S)
                        except asyncio.TimeoutError:
                            self.health = ()
                self.view.stopping()
                watch.stopping = True
                stopping_since = now
                for s in pool.sessions:
                    # A failure that looks like an echo (a peer vanished) may
                    # have its cause on any node: every node then gets the
                    # grace to report its own error before it is stopped.
                    if (cause is not None and (cause.consequential or s.name == cause.host)
                            and not watch.nodes[s.name].done):
                        pending[s.name] = now + self.options.grace
                    else:
                        await stop(s, reason)
            if self.interrupts and pending:
                pending = {name: now for name in pending}  # Ctrl-C: no more waiting
            for name, due in list(pending.items()):
                if now >= due:
                    del pending[name]
                    if name not in stop_sent and not watch.nodes[name].done:
                        await stop(pool[name], "teardown")
            if stopping_since is not None:
                waited = now - stopping_since
                limit = self._grace() * 2 + 8
                if (self.interrupts > 1 or waited > limit) and not hard:
                    hard = True  # drop the channels: agents kill their trees on EOF
                    for s in pool.sessions:
                        if not watch.nodes[s.name].done:
                            await s.kill()
                            watch.lose(s.name, "did not stop in time; its channel was closed", closed_by_us=True)
                if waited > limit + 15:
                    break

    def _grace(self) -> float:
        """Seconds the job's processes get between the stop signal and SIGKILL."""
        return self.options.interrupt_grace if self.interrupts else self.options.grace

    # -- results -----------------------------------------------------------

    def _result(self, plan: LaunchPlan, watch: JobWatch, attempts: int) -> RunResult:
        assert self.logs is not None
        failure = watch.root_cause()
        duration = time.time() - self.started
        if self.interrupts and (failure is None or failure.kind != "lost"):
            status, code, failure = "interrupted", EXIT_INTERRUPTED, None
        elif failure is not None:
            status = "failed"
            code = EXIT_INFRA if failure.kind == "lost" else failure.exit_code
        else:
            status, code = "succeeded", 0
        tail: tuple[str, ...] = ()
        diagnoses: tuple[Any, ...] = ()
        failure_log = None
        left_early: tuple[tuple[str, int], ...] = ()
        hints: tuple[str, ...] = ()
        if failure is not None and failure.kind != "hang":  # a hang's story is its stacks
            report = save_report(self.flight, self.logs.dir, plan.world_size)
            self.flight_lines = (tuple(report.lines()) if report is not None and report.culprits else ()) + self.health
            left_early = tuple(watch.left_early(failure))
            hints = tuple(h for h in (env_hint(self.head_env, plan, failure, watch.tail_for(failure)),) if h)
            tail = tuple(watch.tail_for(failure))
            failure_log = self.logs.path_for(failure.host, failure.rank)
            diagnoses = diagnose_failure(watch.text_for_diagnosis(failure), failure)
        self._record(plan, status, failure, attempts, exit_code=code, left_early=left_early)
        return RunResult(
            run_id=plan.run_id, status=status, exit_code=code, run_dir=self.logs.dir, plan=plan,
            failure=failure, failure_tail=tail, failure_log=failure_log, diagnoses=diagnoses,
            left_early=left_early, hints=hints, restarts=tuple(r["failure"] for r in self.restarts),
            attempts=attempts, duration_s=duration, stacks=self.hang_stacks, flightrec=self.flight_lines,
            caught=tuple((h, r, exc, str(self.logs.path_for(h, r)))
                         for (h, r), exc in sorted(watch.tracebacks.items(), key=lambda kv: kv[0][1]))
            if status == "succeeded" else (),
        )

    def _record(self, plan: LaunchPlan, status: str, failure: Failure | None, attempts: int,
                exit_code: int | None = None, left_early: tuple[tuple[str, int], ...] = (),
                error: tuple[CorralError, str] | None = None) -> None:
        """run.json; ``error``: what stopped a restart before it started, and how it reads."""
        assert self.logs is not None
        self.logs.write_record({
            **plan_record(plan, self.spec, self.cluster),
            "status": status,
            "exit_code": exit_code,
            "started": self.started,
            "ended": time.time() if status != "running" else None,
            "attempts": attempts,
            "restarts": list(self.restarts),
            "control": str(self.control) if status == "running" else None,
            "failure": failure_record(failure, left_early) if error is None else error_record(*error),
            **self.recovery.record(),
        })


def run_job(cluster: Cluster, spec: RunSpec, options: RunOptions, *, view: RunView | None = None,
            head_env: Mapping[str, str], head_cwd: str) -> RunResult:
    """Synchronous wrapper for library users."""
    return asyncio.run(Runner(cluster, spec, options, view=view, head_env=head_env, head_cwd=head_cwd).run())
