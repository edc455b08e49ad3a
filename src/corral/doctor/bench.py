"""``corral bench``: link bandwidth between every pair of nodes, and all-reduce bus bandwidth.

Links.  Every node runs a receiver (``iperf3 -s`` where every node has
iperf3, else corral's built-in TCP sink); then, round by round, every node
sends to one peer while receiving from another (round ``k``: node ``i`` ->
node ``i+k``).  No node sends or receives twice at once, so a round
measures ``n`` links without them sharing a NIC; ``sequential=True``
measures one link at a time instead (for fabrics whose switches are
oversubscribed).  The receiver's count after a warm-up is the result.

All-reduce.  ``allreduce_perf.py`` runs through ``corral run``'s launch path
on every node and times float32 all-reduces over a size sweep; bandwidths
follow nccl-tests (``algbw = size / time``; ``busbw = algbw * 2(n-1)/n``,
the bandwidth each link must sustain in a ring, comparable across world
sizes).  With NCCL, ``NCCL_DEBUG=INFO`` tells whether it used InfiniBand or
TCP sockets.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from corral.agent.session import AgentPool
from corral.doctor.checks.base import Evidence, Finding, LinkProbe
from corral.doctor.checks.connectivity import links as links_check
from corral.doctor.checks.nics import NicChoice, choose_nics
from corral.doctor.scripted import ScriptRun, run_workload
from corral.errors import UsageError
from corral.model import Cluster

MIB = 1 << 20
#: Default sweep: 1 MiB to 1 GiB with NCCL; CPU gloo all-reduces are ~100x slower.
DEFAULT_MAX_NCCL = 1 << 30
DEFAULT_MAX_GLOO = 64 * MIB


# ---------------------------------------------------------------------------
# link matrix


def schedule(hosts: list[str], *, sequential: bool = False) -> list[list[tuple[str, str]]]:
    """Rounds of (src, dst): in each, every node sends once and receives once."""
    n = len(hosts)
    rounds = [[(hosts[i], hosts[(i + k) % n]) for i in range(n)] for k in range(1, n)]
    if sequential:
        return [[pair] for r in rounds for pair in r]
    return rounds


async def measure_links(
    pool: AgentPool,
    addresses: Mapping[str, str],
    *,
    seconds: float = 2.0,
    omit: float = 1.0,
    tool: str = "auto",
    sequential: bool = False,
    skip: frozenset[tuple[str, str]] = frozenset(),
    only: frozenset[tuple[str, str]] | None = None,
) -> tuple[list[LinkProbe], str]:
    """Throughput of every ordered pair of ``addresses``' hosts; returns (probes, tool used).

    Pairs in ``skip`` (known not to connect) are left out rather than timed out;
    with ``only``, just those pairs are measured.
    """
    hosts = [h for h in addresses if addresses[h]]
    if len(hosts) < 2:
        return [], "none"
    used, ports = await _start_receivers(pool, hosts, tool, omit)
    probes: list[LinkProbe] = []
    try:
        for pairs in schedule(hosts, sequential=sequential):
            wanted = [(s, d) for s, d in pairs if (s, d) not in skip and (only is None or (s, d) in only)]
            probes += await asyncio.gather(*(
                _send(pool, src, dst, addresses[dst], ports[dst], used, seconds, omit)
                for src, dst in wanted
            ))
    finally:
        stop = "links.iperf3_stop" if used == "iperf3" else "links.sink_stop"
        await asyncio.gather(*(pool[h].call(stop, port=ports[h], timeout=15) for h in hosts),
                             return_exceptions=True)
    return probes, used


async def _start_receivers(pool: AgentPool, hosts: list[str], tool: str, omit: float
                           ) -> tuple[str, dict[str, int]]:
    if tool not in ("auto", "iperf3", "builtin"):
        raise UsageError(f"--tool {tool!r}: expected auto, iperf3 or builtin")
    if tool in ("auto", "iperf3"):
        started = await asyncio.gather(*(pool[h].call("links.iperf3_start", timeout=20) for h in hosts))
        ports = {h: r.get("port") for h, r in zip(hosts, started)}
        if all(ports.values()):
            return "iperf3", ports  # type: ignore[return-value]
        await asyncio.gather(*(pool[h].call("links.iperf3_stop", port=p, timeout=15)
                               for h, p in ports.items() if p), return_exceptions=True)
        if tool == "iperf3":
            missing = [h for h, r in zip(hosts, started) if not r.get("port")]
            why = next(r.get("error") for r in started if not r.get("port"))
            raise UsageError(f"--tool iperf3: {why} on {', '.join(missing)}",
                             hint="install iperf3 there, or use --tool builtin")
    started = await asyncio.gather(*(pool[h].call("links.sink_start", omit=omit, timeout=20)
                                     for h in hosts))
    return "builtin", {h: r["port"] for h, r in zip(hosts, started)}


async def _send(pool: AgentPool, src: str, dst: str, address: str, port: int, tool: str,
                seconds: float, omit: float) -> LinkProbe:
    fn = "links.iperf3_send" if tool == "iperf3" else "links.send"
    extra = {"omit": max(1, math.ceil(omit))} if tool == "iperf3" else {"omit": omit}
    try:
        r = await pool[src].call(fn, address=address, port=port, seconds=seconds,
                                 timeout=seconds + omit + 45, **extra)
    except Exception as e:  # noqa: BLE001 - a failed measurement is a result, reported per link
        return LinkProbe(src=src, dst=dst, address=address, bps=None, error=str(e), tool=tool)
    return LinkProbe(src=src, dst=dst, address=address, bps=r.get("bps"), error=r.get("error"),
                     tool=tool)


# ---------------------------------------------------------------------------
# all-reduce bus bandwidth


@dataclass(frozen=True, kw_only=True)
class AllReduceRow:
    """One line of the all_reduce_perf-style table."""

    size: int
    count: int
    dtype: str
    redop: str
    time_us: float
    algbw_gbs: float
    busbw_gbs: float


@dataclass(frozen=True, kw_only=True)
class AllReduceResult:
    backend: str
    world_size: int
    rows: tuple[AllReduceRow, ...]
    run: ScriptRun
    #: "IB" or "Socket" when NCCL said which network it used.
    nccl_net: str | None = None


def bus_bandwidth(size_bytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s), nccl-tests' definition for all-reduce."""
    if seconds <= 0 or world < 1:
        raise ValueError("time and world size must be positive")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (world - 1) / world


def rows_from(marks: Iterable[Mapping]) -> list[AllReduceRow]:
    out = []
    for m in marks:
        algbw, busbw = bus_bandwidth(int(m["size"]), float(m["seconds"]), int(m["world_size"]))
        out.append(AllReduceRow(size=int(m["size"]), count=int(m["count"]), dtype=str(m["type"]),
                                redop=str(m.get("redop", "sum")), time_us=float(m["seconds"]) * 1e6,
                                algbw_gbs=algbw, busbw_gbs=busbw))
    return out


def size_sweep(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of two from ``min_bytes`` to ``max_bytes`` (both rounded to a multiple of 4)."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise UsageError(f"sizes must satisfy 4 <= min ({min_bytes}) <= max ({max_bytes})",
                         hint="e.g. --min-size 1MiB --max-size 64MiB")
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size // 4 * 4)
        size *= 2
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64MiB"``, ``"1G"``, ``"1048576"`` -> bytes (binary units: 1M = 1 MiB, as nccl-tests)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"size {text!r}: expected a number with an optional unit K, M, G (binary)",
                         hint="e.g. 1MiB, 64M, 1G")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


_NET_LINE = re.compile(r"NCCL INFO (?:Using network (\w+)|NET/(IB|Socket)\s*: Using)")


def nccl_network(lines: Iterable[str]) -> str | None:
    """``"IB"`` or ``"Socket"`` from NCCL_DEBUG=INFO output ("Using network Socket", "NET/IB : Using")."""
    found = None
    for text in lines:
        m = _NET_LINE.search(text)
        if m:
            net = m.group(1) or m.group(2)
            if m.group(1):
                return net
            found = found or net
    return found


async def allreduce_bench(
    cluster: Cluster,
    *,
    sizes: list[int],
    backend: str,
    nproc: int,
    warmup: int,
    iters: int,
    timeout: float,
    head_env: Mapping[str, str],
    head_cwd: str,
) -> AllReduceResult:
    """Time all-reduces over ``sizes`` on every node through the launch path."""
    env = {"CORRAL_BENCH_BACKEND": backend}
    if backend == "nccl":
        env.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"})
    args = tuple(str(s) for s in sizes) + ("--warmup", str(warmup), "--iters", str(iters))
    run = await run_workload(cluster, "allreduce_perf.py", marker="CORRAL_BENCH", args=args, env=env,
                             nproc=nproc, timeout=timeout, head_env=head_env, head_cwd=head_cwd)
    world = int(run.marks[0]["world_size"]) if run.marks else nproc * len(cluster.hosts)
    return AllReduceResult(backend=backend, world_size=world, rows=tuple(rows_from(run.marks)),
                           run=run, nccl_net=nccl_network(t for _, _, t in run.lines))


# ---------------------------------------------------------------------------
# the link benchmark as `corral bench` runs it


@dataclass(frozen=True, kw_only=True)
class LinkBench:
    """The measured matrix, with the facts it was measured on and what stands out."""

    evidence: Evidence
    tool: str
    seconds: float
    sequential: bool
    findings: tuple[Finding, ...]
    nics: Mapping[str, NicChoice]

    def link_speed_bps(self, src: str, dst: str) -> float | None:
        """The slower of the two interfaces' negotiated speeds, if both are known."""
        speeds = [self.nics[h].speed_mbps for h in (src, dst) if h in self.nics]
        if len(speeds) < 2 or not all(speeds):
            return None
        return min(speeds) * 1e6  # type: ignore[type-var]


async def node_facts(cluster: Cluster, *, connect_timeout: float = 10.0) -> Evidence:
    """Facts from every node without importing torch (interfaces, tools, GPUs, IB)."""
    pool = AgentPool(cluster, tag="corral-bench", connect_timeout=connect_timeout)
    await pool.open()
    try:
        peers = [{"name": h.name, "address": h.connect_address} for h in cluster.hosts]
        facts = await pool.call_all("facts.collect", lambda s: {"peers": peers, "torch": False},
                                    timeout=120)
    finally:
        await pool.close()
    return Evidence(hosts=tuple(cluster.names), facts={h: {**f, "host": h} for h, f in facts.items()},
                    addresses={h.name: h.connect_address for h in cluster.hosts})


async def link_bench(cluster: Cluster, ev: Evidence, *, seconds: float, tool: str, sequential: bool,
                     connect_timeout: float = 10.0) -> LinkBench:
    """The matrix between the addresses of the interface each node should use (``choose_nics``)."""
    nics = choose_nics(ev)
    addresses = {h: c.address or "" for h, c in nics.items()}
    no_nic = [h for h, a in addresses.items() if not a]
    if no_nic:
        raise UsageError(f"no interface of {', '.join(no_nic)} reaches every other node",
                         hint="`corral doctor` shows what each node reaches")
    pool = AgentPool(cluster, tag="corral-bench", connect_timeout=connect_timeout)
    await pool.open()
    try:
        probes, used = await measure_links(pool, addresses, seconds=seconds, tool=tool,
                                           sequential=sequential)
    finally:
        await pool.close()
    ev = replace(ev, links=tuple(probes))
    return LinkBench(evidence=ev, tool=used, seconds=seconds, sequential=sequential,
                     findings=tuple(links_check(ev)), nics=nics)
