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
import ipaddress
import logging
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

from corral.agent.bundle import hook_source
from corral.agent.session import AgentPool, AgentSession
from corral.errors import EXIT_INFRA, EXIT_INTERRUPTED, HostError, PreflightError
from corral.logs import RunLogs
from corral.model import Cluster, Host
from corral.plan import LaunchPlan, NodeFacts, RunSpec, build_plan
from corral.watch import Failure, JobWatch, Sink

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    runs_dir: Path
    max_restarts: int = 0
    #: Agent silence after which the head declares a node lost (seconds).
    node_timeout: float = 10.0
    #: SIGTERM -> SIGKILL grace when tearing the job down (seconds).
    grace: float = 3.0
    connect_timeout: float = 10.0
    #: Keep the node-side temp dir (rank files) after the run, for debugging.
    keep_node_tmp: bool = False


@dataclass(frozen=True, kw_only=True)
class RunResult:
    run_id: str
    status: str  # "succeeded", "failed", "interrupted"
    exit_code: int
    run_dir: Path | None
    plan: LaunchPlan | None
    failure: Failure | None = None
    failure_tail: tuple[str, ...] = ()
    failure_log: Path | None = None
    diagnoses: tuple[Any, ...] = ()
    attempts: int = 1
    duration_s: float = 0.0


class RunView(Sink, Protocol):
    """What the run loop tells its user interface (the CLI's console)."""

    def message(self, text: str) -> None: ...
    def stopping(self) -> None: ...
    def close(self) -> None: ...


class _NullView:
    def line(self, host: str, rank: int | None, stream: str, text: str) -> None: ...
    def status(self, host: str, rank: int | None, text: str) -> None: ...
    def message(self, text: str) -> None: ...
    def stopping(self) -> None: ...
    def close(self) -> None: ...


class _LogSink:
    def __init__(self, logs: RunLogs):
        self.logs = logs

    def line(self, host: str, rank: int | None, stream: str, text: str) -> None:
        self.logs.line(host, rank, text)

    def status(self, host: str, rank: int | None, text: str) -> None:
        self.logs.status(host, rank, text)


# ---------------------------------------------------------------------------
# preflight


def _needs_path_check(spec: RunSpec) -> bool:
    return not spec.module and (spec.launcher != "command" or spec.program.endswith(".py"))


def _workdir(spec: RunSpec, cluster: Cluster, host: Host, head_cwd: str) -> str:
    return spec.workdir or cluster.workdir_for(host) or head_cwd


async def preflight(pool: AgentPool, cluster: Cluster, spec: RunSpec, head_cwd: str) -> dict[str, dict]:
    """One round trip per node; every problem on every node in one error."""
    from corral.launchers import PLANNERS, NodeContext

    # The launcher's required module does not depend on the node.
    probe_ctx = NodeContext(python="python3", program=spec.program, args=(), module=spec.module,
                            node_rank=0, nnodes=1, nproc=1, master_addr="x", master_port=1,
                            hostnames=("x",))
    required = PLANNERS[spec.launcher](probe_ctx).requires
    first = cluster.hosts[0].name

    def args_for(s: AgentSession) -> dict:
        return {
            "workdir": _workdir(spec, cluster, s.host, head_cwd),
            "paths": [spec.program] if _needs_path_check(spec) else [],
            "modules": [required] if required else [],
            "want_port": s.name == first and spec.master_port is None,
        }

    results = await pool.call_all("probes.preflight", args_for, timeout=30)
    problems: list[HostError] = []
    for s in pool.sessions:
        r = results[s.name]
        wd = r.get("workdir") or {}
        if wd and not wd.get("exists"):
            problems.append(HostError(
                s.name, f"working directory {wd.get('path')} does not exist",
                hint="copy the project there first (`corral sync`, or `corral run --sync`), "
                     "or choose another with --workdir / `workdir` in the cluster file",
                kind="no-workdir"))
            continue
        for missing in r.get("missing", []):
            problems.append(HostError(
                s.name, f"{missing} not found in {wd.get('path')}",
                hint="sync the project to every node (`corral sync`) or check the path",
                kind="no-script"))
        for mod, ok in (r.get("modules") or {}).items():
            if not ok:
                problems.append(HostError(
                    s.name, f"{r.get('executable')} cannot import {mod} (needed by --launcher {spec.launcher})",
                    hint=f"install {mod} in that environment, or point `python` for this host at the "
                         "interpreter that has it (cluster file)",
                    kind="no-module"))
    if problems:
        raise PreflightError(problems, what="preflight")
    return results


# ---------------------------------------------------------------------------
# rendezvous address


def _head_view(host: Host) -> set[str]:
    """Addresses the head itself resolves ``host`` to (its likely cluster IP)."""
    out = set()
    for name in {host.address, host.name} - {None}:
        try:
            for info in socket.getaddrinfo(name, None, socket.AF_INET):  # type: ignore[arg-type]
                out.add(info[4][0])
        except OSError:
            pass
    return out


def master_candidates(host0: Host, probe0: dict, peers: list[dict]) -> list[str]:
    """Node 0's addresses, most likely to be reachable by every peer first."""
    addrs = probe0.get("addresses") or []
    head_view = _head_view(host0)

    def shared_subnets(a: dict) -> int:
        net = ipaddress.ip_network(f"{a['address']}/{a['prefix']}", strict=False)
        return sum(
            any(ipaddress.ip_address(p["address"]) in net for p in (peer.get("addresses") or []))
            for peer in peers
        )

    def key(a: dict) -> tuple:
        return (a["address"] not in head_view, -shared_subnets(a))

    ordered = [a["address"] for a in sorted(addrs, key=key)]
    for extra in sorted(head_view):
        if extra not in ordered and not extra.startswith("127."):
            ordered.append(extra)
    return ordered


async def choose_master(pool: AgentPool, probes: Mapping[str, dict], port: int) -> str:
    """An address of node 0 that every other node reaches on ``port``."""
    s0 = pool.sessions[0]
    others = pool.sessions[1:]
    if not others:
        return "127.0.0.1"
    candidates = master_candidates(s0.host, probes[s0.name], [probes[s.name] for s in others])
    if not candidates:
        raise PreflightError([HostError(s0.name, "has no network address other nodes could use",
                                        kind="no-address")], what="rendezvous")
    opened = await s0.call("probes.listen_start", addresses=candidates, port=port, seconds=30)
    if not opened["bound"]:
        detail = "; ".join(f"{a}: {e}" for a, e in opened["errors"].items())
        raise PreflightError([HostError(s0.name, f"cannot listen on port {port} ({detail})",
                                        hint="choose another --master-port", kind="port")],
                             what="rendezvous")
    try:
        reach = await asyncio.gather(*(
            s.call("probes.connect", addresses=opened["bound"], port=port, timeout=3.0) for s in others
        ))
    finally:
        await s0.call("probes.listen_stop", port=port)
    for addr in opened["bound"]:
        if all(r.get(addr) == "ok" for r in reach):
            return addr
    problems = []
    for s, r in zip(others, reach):
        failed = {a: e for a, e in r.items() if e != "ok"}
        if len(failed) == len(opened["bound"]):
            detail = ", ".join(f"{a} ({e})" for a, e in failed.items())
            problems.append(HostError(
                s.name, f"cannot reach {s0.name} on port {port} at any of its addresses: {detail}",
                hint="a firewall or a separate network is in the way; `corral doctor` shows the "
                     "TCP reachability matrix", kind="unreachable-peer"))
    if not problems:  # each address is reachable by some, none by all
        problems.append(HostError(s0.name, "no single address of it is reachable from every node",
                                  hint="`corral doctor` shows which node reaches which address",
                                  kind="unreachable-peer"))
    raise PreflightError(problems, what="rendezvous")


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
        self.cluster = cluster
        self.spec = spec
        self.options = options
        self.view: RunView = view or _NullView()
        self.head_env = head_env
        self.head_cwd = head_cwd
        self.logs: RunLogs | None = None
        self.attempt: _Attempt | None = None
        self.interrupts = 0
        self._wake: asyncio.Event | None = None
        self.started = time.time()

    # -- signals -----------------------------------------------------------

    def interrupt(self) -> None:
        self.interrupts += 1
        if self._wake is not None:
            self._wake.set()

    def _install_signals(self) -> list[int]:
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                loop.add_signal_handler(sig, self.interrupt)
                installed.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                pass  # not the main thread (library use): the caller handles signals
        return installed

    # -- events ------------------------------------------------------------

    def _on_event(self, session: AgentSession, ev: dict) -> None:
        if self.attempt is not None:
            self.attempt.watch.event(session.name, ev)
            if ev.get("ev") in ("exit", "rank_exit", "closed", "fatal") and self._wake is not None:
                self._wake.set()

    # -- main --------------------------------------------------------------

    async def run(self) -> RunResult:
        self._wake = asyncio.Event()
        installed = self._install_signals()
        try:
            return await self._run()
        finally:
            loop = asyncio.get_running_loop()
            for sig in installed:
                loop.remove_signal_handler(sig)
            if self.logs is not None:
                self.logs.close()

    async def _run(self) -> RunResult:
        attempts = 0
        while True:
            attempts += 1
            result = await self._attempt(attempts)
            if result.status != "failed" or attempts > self.options.max_restarts or self.interrupts:
                return result
            self.view.message(
                f"{result.failure.describe() if result.failure else 'failed'}; restarting the job "
                f"(restart {attempts}/{self.options.max_restarts})"
            )
            if self.logs is not None:
                self.logs.marker(f"restart {attempts}/{self.options.max_restarts}")

    async def _open_and_plan(self) -> tuple[AgentPool, LaunchPlan]:
        pool = AgentPool(self.cluster, tag=self.spec.run_id, on_event=self._on_event,
                         connect_timeout=self.options.connect_timeout,
                         head_timeout=self.options.node_timeout)
        await pool.open()
        try:
            probes = await preflight(pool, self.cluster, self.spec, self.head_cwd)
            port = self.spec.master_port or probes[pool.sessions[0].name].get("port")
            master = await choose_master(pool, probes, int(port))
            facts = {
                s.name: NodeFacts(gpus=probes[s.name].get("gpus"), address=self._node_address(s, probes, master))
                for s in pool.sessions
            }
            plan = build_plan(self.cluster, self.spec, facts, master_addr=master, master_port=int(port),
                              head_env=self.head_env, head_cwd=self.head_cwd)
        except BaseException:
            await pool.close()
            raise
        return pool, plan

    @staticmethod
    def _node_address(s: AgentSession, probes: Mapping[str, dict], master: str) -> str | None:
        """The address of a node on the same network as the master, for CORRAL_NODE_IPS."""
        addrs = probes[s.name].get("addresses") or []
        if master == "127.0.0.1":
            return "127.0.0.1"
        try:
            m = ipaddress.ip_address(master)
            for a in addrs:
                if m in ipaddress.ip_network(f"{a['address']}/{a['prefix']}", strict=False):
                    return a["address"]
        except ValueError:
            pass
        return addrs[0]["address"] if addrs else None

    async def _attempt(self, number: int) -> RunResult:
        pool, plan = await self._open_and_plan()
        if self.logs is None:
            self.logs = RunLogs(self.options.runs_dir, self.spec.run_id)
        watch = JobWatch(plan, sinks=[_LogSink(self.logs), self.view])
        self.attempt = _Attempt(plan=plan, watch=watch, pool=pool)
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

        async def one(node) -> None:
            spec = {
                "argv": list(node.argv),
                "env": dict(node.env),
                "cwd": node.cwd,
                "pipe_rank": node.pipe_rank,
                "hook_source": hook,
                "tag": f"{plan.run_id}-{number}",
                "keep_tmp": self.options.keep_node_tmp,
            }
            await pool[node.host.name].send(op="start", spec=spec)

        await asyncio.gather(*(one(n) for n in plan.nodes))

    async def _watch(self, pool: AgentPool, watch: JobWatch) -> None:
        """Wait for every node to finish; tear everything down on the first failure.

        The failing node's own launcher gets ``grace`` seconds to wind down
        by itself (torchrun then reports which of its ranks failed); every
        other node is stopped at once, since its ranks can only hang or fail
        on the missing peer.
        """
        assert self._wake is not None
        stopping_since: float | None = None
        stop_sent: set[str] = set()
        pending: dict[str, float] = {}
        hard = False

        async def stop(s: AgentSession, reason: str) -> None:
            stop_sent.add(s.name)
            await s.send(op="stop", grace=self.options.grace, reason=reason)

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
            if stopping_since is None and (watch.failed or self.interrupts):
                cause = None if self.interrupts else watch.root_cause()
                reason = "interrupted" if cause is None else cause.describe()
                self.view.message(f"{reason}: stopping every node")
                self.view.stopping()
                watch.stopping = True
                stopping_since = now
                for s in pool.sessions:
                    if cause is not None and s.name == cause.host and not watch.nodes[s.name].done:
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
                limit = self.options.grace * 2 + 8
                if (self.interrupts > 1 or waited > limit) and not hard:
                    hard = True  # drop the channels: agents kill their trees on EOF
                    for s in pool.sessions:
                        if not watch.nodes[s.name].done:
                            await s.kill()
                            watch.lose(s.name, "did not stop in time; its channel was closed")
                if waited > limit + 15:
                    break

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
        if failure is not None:
            tail = tuple(watch.tail_for(failure))
            failure_log = self.logs.path_for(failure.host, failure.rank)
            diagnoses = _diagnose(watch.text_for_diagnosis(failure), failure)
        self._record(plan, status, failure, attempts, exit_code=code)
        return RunResult(
            run_id=plan.run_id, status=status, exit_code=code, run_dir=self.logs.dir, plan=plan,
            failure=failure, failure_tail=tail, failure_log=failure_log, diagnoses=diagnoses,
            attempts=attempts, duration_s=duration,
        )

    def _record(self, plan: LaunchPlan, status: str, failure: Failure | None, attempts: int,
                exit_code: int | None = None) -> None:
        assert self.logs is not None
        self.logs.write_record({
            "run_id": plan.run_id,
            "status": status,
            "exit_code": exit_code,
            "started": self.started,
            "ended": time.time() if status != "running" else None,
            "attempts": attempts,
            "launcher": plan.launcher,
            "program": self.spec.program,
            "args": list(self.spec.args),
            "master_addr": plan.master_addr,
            "master_port": plan.master_port,
            "world_size": plan.world_size,
            "cluster": {"source": self.cluster.source, "name": self.cluster.name},
            "hosts": [
                {"name": n.host.name, "node_rank": n.node_rank, "ranks": list(n.ranks),
                 "argv": list(n.argv), "cwd": n.cwd, "env_names": sorted(n.env)}
                for n in plan.nodes
            ],
            "failure": None if failure is None else {
                "host": failure.host, "rank": failure.rank, "kind": failure.kind,
                "exit_code": failure.code, "signal": failure.signal_name, "exception": failure.exc,
                "reason": failure.reason, "description": failure.describe(),
            },
        })


def _diagnose(text: str, failure: Failure) -> tuple[Any, ...]:
    """Likely cause and fix from the knowledge base, when it is available."""
    try:
        from corral.diagnose import diagnose_text
    except ImportError:
        return ()
    try:
        return tuple(diagnose_text(text, origin=f"{failure.host} (live)", host=failure.host,
                                   rank=failure.rank)[:3])
    except Exception as e:  # diagnosis must never hide the failure itself
        log.debug("diagnosis failed: %s", e)
        return ()


def run_job(cluster: Cluster, spec: RunSpec, options: RunOptions, *, view: RunView | None = None,
            head_env: Mapping[str, str], head_cwd: str) -> RunResult:
    """Synchronous wrapper for library users."""
    return asyncio.run(Runner(cluster, spec, options, view=view, head_env=head_env, head_cwd=head_cwd).run())
