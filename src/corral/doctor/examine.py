"""``corral doctor``: gather evidence from every node, run the checks, smoke-test.

In order, over one agent per node (``corral.agent``):

1. facts from every node in one round trip (``facts.collect``), and clock
   offsets (three timed calls each);
2. with the interface each node should use (``corral.doctor.checks.nics``):
   a TCP port matrix (every node listens on a free port, plus ``--port``s;
   every other node connects to it) and the SSH mesh, concurrently;
3. a short link-throughput matrix (corral's built-in sender, ~1s a round);
4. the checks (``corral.doctor.checks``), pure functions over all of that;
5. optionally (the CLI decides, after ``--fix-env``) the smoke all-reduce
   through ``corral run``'s own launch path (``smoke``).

A host that cannot be reached is a finding, not an abort: the others are
still examined.  The library never prints; ``progress`` receives one-line
notes for the CLI.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from corral.agent.links import MESH_PARALLEL
from corral.agent.session import AgentPool, AgentSession
from corral.doctor.bench import measure_links
from corral.doctor.checks import (
    ERROR,
    WARNING,
    ClockSample,
    Evidence,
    Finding,
    PortProbe,
    SmokeOutcome,
    SshProbe,
    choose_nics,
    recommend_env,
    run_checks,
)
from corral.doctor.checks.base import LinkProbe, ipv4_interfaces
from corral.doctor.checks.connectivity import slow_links, slow_nodes
from corral.errors import HostError, PreflightError
from corral.model import Cluster
from corral.run.plan import env_from_head

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    #: Working directory to check on every node (default: the cluster's, else the head's cwd).
    workdir: str | None = None
    #: Extra TCP ports to test between every pair (e.g. a fixed --master-port).
    ports: tuple[int, ...] = ()
    ssh: bool = True
    links: bool = True
    #: Import torch on every node (its CUDA build, NCCL version, and whether it imports).
    torch: bool = True
    link_seconds: float = 1.0
    connect_timeout: float = 10.0
    smoke_timeout: float = 180.0
    #: Processes per node in the smoke test (default: one per GPU, else 1).
    smoke_nproc: int | None = None


@dataclass(frozen=True, kw_only=True)
class DoctorReport:
    cluster: Cluster
    evidence: Evidence
    findings: tuple[Finding, ...]
    recommended_env: Mapping[str, Mapping[str, str]]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARNING]

    def with_smoke(self, smoke: SmokeOutcome) -> DoctorReport:
        ev = replace(self.evidence, smoke=smoke)
        return replace(self, evidence=ev, findings=tuple(run_checks(ev)))

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": {"source": self.cluster.source, "hosts": list(self.cluster.names)},
            "ok": not self.errors, "errors": len(self.errors), "warnings": len(self.warnings),
            "findings": [f.to_json() for f in self.findings],
            "recommended_env": {h: dict(e) for h, e in self.recommended_env.items()},
            "evidence": self.evidence.to_json(),
        }


async def examine(cluster: Cluster, options: DoctorOptions, *, head_env: Mapping[str, str],
                  head_cwd: str, progress: Progress | None = None) -> DoctorReport:
    """Steps 1-4: gather the evidence and run the checks (no smoke test)."""
    note = progress or (lambda _: None)
    ev = await gather(cluster, options, head_env=head_env, head_cwd=head_cwd, progress=note)
    return DoctorReport(cluster=cluster, evidence=ev, findings=tuple(run_checks(ev)),
                        recommended_env=recommend_env(ev))


async def gather(cluster: Cluster, options: DoctorOptions, *, head_env: Mapping[str, str],
                 head_cwd: str, progress: Progress) -> Evidence:
    progress(f"connecting to {len(cluster.hosts)} node(s)...")
    pool, down = await _open_reachable(cluster, options.connect_timeout)
    unreachable = {h: e.message.split(": ", 1)[-1] for h, e in down.items()}
    hints = {h: e.hint for h, e in down.items() if e.hint}
    if pool is None:
        return Evidence(hosts=tuple(cluster.names), facts={}, unreachable=unreachable,
                        unreachable_hints=hints)
    try:
        progress("collecting facts" + (" (importing torch on every node)..." if options.torch else "..."))
        facts, failed = await _facts(pool, cluster, options, head_cwd)
        unreachable.update(failed)
        clock = await _clock(pool, facts)
        ev = Evidence(
            hosts=tuple(cluster.names), facts=facts, unreachable=unreachable,
            unreachable_hints=hints, clock=clock,
            slots={h.name: h.slots for h in cluster.hosts},
            env={h.name: _effective_env(cluster, h.name, facts, head_env) for h in cluster.hosts
                 if h.name in facts},
            addresses={h.name: h.connect_address for h in cluster.hosts},
        )
        try:
            ev = await _pairs(pool, cluster, options, ev, progress)
        except HostError as e:
            if e.host not in ev.facts:
                raise
            # The pairwise tests included the lost node: none are kept.
            return _lost(ev, e.host, e.message.split(": ", 1)[-1], e.hint, pairs=False)
        for s in pool.sessions:
            if s.closed and s.name in ev.facts:
                # Lost while links were measured (those failures are per pair).
                ev = _lost(ev, s.name, "its connection closed", None, pairs=True)
        return ev
    finally:
        await pool.close()


def _lost(ev: Evidence, host: str, why: str, hint: str | None, *, pairs: bool) -> Evidence:
    """``host`` went away in the middle (it went down, its link failed): it is
    named like a node that never answered, and what was learnt of the others
    is still checked; with ``pairs``, the pairwise results without it."""
    def without(probes):
        return None if probes is None else tuple(p for p in probes if host not in (p.src, p.dst))

    return replace(
        ev, facts={h: f for h, f in ev.facts.items() if h != host},
        env={h: v for h, v in ev.env.items() if h != host},
        clock={h: c for h, c in ev.clock.items() if h != host},
        unreachable={**ev.unreachable, host: f"lost while testing the links between nodes: {why}"},
        unreachable_hints={**ev.unreachable_hints, **({host: hint} if hint else {})},
        ports=without(ev.ports) if pairs else None, ssh=without(ev.ssh) if pairs else None,
        links=without(ev.links) if pairs else None,
    )


async def _pairs(pool: AgentPool, cluster: Cluster, options: DoctorOptions, ev: Evidence,
                 progress: Progress) -> Evidence:
    """The tests between every pair of nodes: TCP ports, SSH, link throughput."""
    live = [pool[h] for h in ev.reachable]
    if len(live) > 1:
        targets = _targets(ev)
        progress("testing TCP ports" + (" and SSH" if options.ssh else "") + f" {mesh_words(len(live))}...")
        ports, ssh = await asyncio.gather(
            _ports(live, targets, options.ports),
            _ssh(live, cluster) if options.ssh else _none(),
        )
        ev = replace(ev, ports=tuple(ports), ssh=None if ssh is None else tuple(ssh))
        if options.links:
            progress("measuring link throughput...")
            addresses = {h: a[0] for h, a in targets.items() if a}
            blocked = frozenset((p.src, p.dst) for p in ports if p.result != "ok")
            probes = await _links(pool, addresses, options.link_seconds, blocked)
            ev = replace(ev, links=tuple(probes))
    return ev


async def _links(pool: AgentPool, addresses: dict[str, str], seconds: float,
                 blocked: frozenset[tuple[str, str]]) -> list[LinkProbe]:
    """The link matrix; what looks slow is measured again, alone, and the better result kept.

    A real slow link stays slow; a link that lost a round to a busy CPU does not.
    """
    probes, _ = await measure_links(pool, addresses, seconds=seconds, omit=0.25, tool="builtin",
                                    skip=blocked)
    nodes = slow_nodes(probes)
    suspects = frozenset((p.src, p.dst) for p in probes if p.src in nodes or p.dst in nodes)
    suspects |= frozenset((p.src, p.dst) for p, _ in slow_links(probes))
    if not suspects:
        return probes
    again, _ = await measure_links(pool, addresses, seconds=seconds, omit=0.25, tool="builtin",
                                   sequential=True, only=suspects)
    best = {(p.src, p.dst): p for p in again if p.bps}
    return [best[(p.src, p.dst)] if (p.src, p.dst) in best and (p.bps or 0) < best[(p.src, p.dst)].bps
            else p for p in probes]


async def _none() -> None:
    return None


async def _open_reachable(cluster: Cluster, timeout: float) -> tuple[AgentPool | None, dict[str, HostError]]:
    """A pool on every host that answers; the others with their error."""
    pool = AgentPool(cluster, tag="corral-doctor", connect_timeout=timeout)
    try:
        await pool.open()
        return pool, {}
    except PreflightError as err:
        down = {p.host: p for p in err.problems if isinstance(p, HostError)}
    rest = tuple(h for h in cluster.hosts if h.name not in down)
    if not rest:
        return None, down
    pool = AgentPool(replace(cluster, hosts=rest), tag="corral-doctor", connect_timeout=timeout)
    try:
        await pool.open()
    except PreflightError as err:
        down.update({p.host: p for p in err.problems if isinstance(p, HostError)})
        return None, down
    return pool, down


async def _facts(pool: AgentPool, cluster: Cluster, options: DoctorOptions, head_cwd: str
                 ) -> tuple[dict[str, dict], dict[str, str]]:
    peers = [{"name": h.name, "address": h.connect_address} for h in cluster.hosts]

    async def one(s: AgentSession) -> dict:
        workdir = options.workdir or cluster.workdir_for(s.host) or head_cwd
        return await s.call("facts.collect", workdir=workdir, peers=peers, torch=options.torch,
                            tmpdir=cluster.env_for(s.host).get("TMPDIR"), timeout=240)

    results = await asyncio.gather(*(one(s) for s in pool.sessions), return_exceptions=True)
    facts, failed = {}, {}
    for s, r in zip(pool.sessions, results):
        if isinstance(r, BaseException):
            why = str(getattr(r, "message", None) or r)
            if why.startswith(f"{s.name}: "):
                why = why[len(s.name) + 2:]  # the finding names the host already
            failed[s.name] = f"collecting facts failed: {why}"
        else:
            facts[s.name] = {**r, "host": s.name, "login_output": list(s.login_output)}
    return facts, failed


async def _clock(pool: AgentPool, facts: Mapping[str, dict]) -> dict[str, ClockSample]:
    """Each node's clock minus the head's, from the fastest of three round trips."""
    async def one(s: AgentSession) -> ClockSample | None:
        best: ClockSample | None = None
        for _ in range(3):
            t0 = time.time()
            try:
                remote = await s.call("facts.clock", timeout=10)
            except HostError:
                return best
            t1 = time.time()
            sample = ClockSample(offset_s=remote - (t0 + t1) / 2, uncertainty_s=(t1 - t0) / 2)
            if best is None or sample.uncertainty_s < best.uncertainty_s:
                best = sample
        return best

    live = [s for s in pool.sessions if s.name in facts]
    samples = await asyncio.gather(*(one(s) for s in live))
    return {s.name: c for s, c in zip(live, samples) if c is not None}


def _effective_env(cluster: Cluster, name: str, facts: Mapping[str, dict],
                   head_env: Mapping[str, str]) -> dict[str, str]:
    """What a job would see: the node's environment, then what `corral run` adds."""
    env = dict(facts[name].get("env") or {})
    env.update(env_from_head(head_env))
    env.update(cluster.env_for(cluster.host(name)))
    return env


def _targets(ev: Evidence) -> dict[str, list[str]]:
    """Addresses to test per host: its chosen interface's, else every candidate's."""
    out: dict[str, list[str]] = {}
    for host, choice in choose_nics(ev).items():
        if choice.address:
            out[host] = [choice.address]
        else:
            out[host] = [str(a.ip) for i, a in ipv4_interfaces(ev.facts[host])
                         if i.get("kind") not in ("loopback", "docker") and not a.ip.is_link_local
                         and not a.ip.is_loopback]
    return out


#: Up to this many nodes every pair is tested (ports, SSH); above, each node
#: tests ``mesh_peers``: every pair of 256 nodes is 65,280 connections.
FULL_MESH_NODES = 32


def mesh_peers(names: list[str]) -> dict[str, list[str]]:
    """Whom each node tests: every other node up to ``FULL_MESH_NODES``; above,
    node 0 (the rendezvous host) and the nodes 1, 2, 4, 8, ... places before
    and after it in the list (about 2 log2 N peers): every node is tested as
    source and as destination, a broken node or a firewalled subset shows."""
    n = len(names)
    if n <= FULL_MESH_NODES:
        return {a: [b for b in names if b != a] for a in names}
    steps = [1 << k for k in range(n.bit_length()) if (1 << k) < n]
    out = {}
    for i, a in enumerate(names):
        picks = {0} | {(i + d) % n for d in steps} | {(i - d) % n for d in steps}
        picks.discard(i)
        out[a] = [names[j] for j in sorted(picks)]
    return out


def mesh_words(n: int) -> str:
    """How the pair tests' progress line names the pairs tested."""
    if n <= FULL_MESH_NODES:
        return "between every pair"
    k = max(len(p) for p in mesh_peers([str(i) for i in range(n)]).values())
    return f"between each node and up to {k} of its {n - 1} peers (every pair of {n} nodes is {n * (n - 1):,} tests)"


async def _ports(live: list[AgentSession], targets: Mapping[str, list[str]],
                 extra: tuple[int, ...]) -> list[PortProbe]:
    """Every node listens (a free port, plus ``extra``); the others (``mesh_peers``) connect."""
    wanted = [0, *extra]
    opened: dict[str, list[int]] = {}
    try:
        for s in live:
            results = await asyncio.gather(*(s.call("links.listen", port=p, seconds=120) for p in wanted))
            opened[s.name] = [r["port"] for r in results if not r.get("error")]
        probes: list[PortProbe] = []
        calls = []
        peers = mesh_peers([s.name for s in live])
        for src in live:
            plan = [{"dst": dst, "address": a, "port": p}
                    for dst in peers[src.name]
                    for a in targets.get(dst, []) for p in opened[dst]]
            calls.append(src.call("links.connect", targets=plan, wait=3.0, timeout=60))
        results = await asyncio.gather(*calls)
        for src, res in zip(live, results):
            probes += [PortProbe(src=src.name, dst=r["dst"], address=r["address"], port=int(r["port"]),
                                 result=r["result"]) for r in res]
        return probes
    finally:
        await asyncio.gather(*(s.call("links.unlisten", port=p, timeout=10)
                               for s in live for p in opened.get(s.name, [])),
                             return_exceptions=True)


async def _ssh(live: list[AgentSession], cluster: Cluster) -> list[SshProbe]:
    names = [s.name for s in live]
    hosts = {n: cluster.host(n) for n in names}
    peers = mesh_peers(names) if len(names) > FULL_MESH_NODES else None
    # Up to FULL_MESH_NODES each node starts at itself and goes round: at any moment
    # a node's sshd sees about as many logins as one node makes at once.
    orders = [peers[n] if peers else names[i:] + names[:i] for i, n in enumerate(names)]
    targets = [[{"name": n, "port": hosts[n].port, "user": hosts[n].user} for n in order] for order in orders]
    rounds = (max(map(len, orders)) + MESH_PARALLEL - 1) // MESH_PARALLEL
    results = await asyncio.gather(*(s.call("links.ssh_check", targets=targets[i], connect_timeout=5,
                                            timeout=60 + rounds * 22)
                                     for i, s in enumerate(live)))
    return [SshProbe(src=s.name, dst=r["name"], result=r["result"], detail=r.get("detail", ""))
            for s, res in zip(live, results) for r in res]
