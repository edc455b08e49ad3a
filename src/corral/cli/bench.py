"""`corral bench`: link bandwidth between every pair of nodes, and all-reduce bus bandwidth."""

from __future__ import annotations

import asyncio
import os
import sys

import click
from rich.markup import escape
from rich.table import Table

from corral import ui
from corral.cli.common import ClusterOptions, cluster_options, emit_json
from corral.doctor.bench import (
    DEFAULT_MAX_GLOO,
    DEFAULT_MAX_NCCL,
    AllReduceResult,
    LinkBench,
    allreduce_bench,
    link_bench,
    node_facts,
    parse_size,
    size_sweep,
)
from corral.doctor.checks import ERROR, OK, Evidence
from corral.doctor.checks.base import human_bps
from corral.doctor.checks.gpus import visible_gpus
from corral.doctor.smoke import backend_for
from corral.errors import UsageError
from corral.hostrange import HostSet

EXIT_FAILED = 1


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    return None if value is None else parse_size(value)


@click.command(name="bench")
@cluster_options
@click.option("--links/--no-links", default=True, show_default=True,
              help="Measure throughput from every node to every other node.")
@click.option("--allreduce/--no-allreduce", default=True, show_default=True,
              help="Time all-reduces over a size sweep through corral run's launch path.")
@click.option("--tool", type=click.Choice(["auto", "iperf3", "builtin"]), default="auto", show_default=True,
              help="Link tool: iperf3 where every node has it (auto), or corral's built-in TCP sender.")
@click.option("--seconds", type=click.FloatRange(min=0.5), default=3.0, show_default=True,
              help="Measuring time per link (after a 1s warm-up).")
@click.option("--sequential", is_flag=True,
              help="One link at a time (default: each round, every node sends to one peer and "
                   "receives from another, in parallel).")
@click.option("--min-size", callback=_size, default="1MiB", show_default=True, help="Smallest all-reduce.")
@click.option("--max-size", callback=_size, default=None,
              help="Largest all-reduce. Default: 1GiB with NCCL, 64MiB with gloo (CPU).")
@click.option("--iters", type=click.IntRange(min=1), default=None,
              help="Timed all-reduces per size. Default: 20 with NCCL, 5 with gloo.")
@click.option("--warmup", type=click.IntRange(min=0), default=None,
              help="Untimed all-reduces first. Default: 5 with NCCL, 2 with gloo.")
@click.option("--backend", type=click.Choice(["auto", "nccl", "gloo"]), default="auto", show_default=True,
              help="auto: NCCL when every node has GPUs and a CUDA torch, else gloo.")
@click.option("-n", "--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Processes per node for the all-reduce. Default: one per GPU, else 1.")
@click.option("--timeout", type=click.FloatRange(min=10), default=900.0, show_default=True,
              help="Seconds before the all-reduce run is stopped.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench(cluster_opts: ClusterOptions, links: bool, allreduce: bool, tool: str, seconds: float,
          sequential: bool, min_size: int, max_size: int | None, iters: int | None,
          warmup: int | None, backend: str, nproc_per_node: int | None, timeout: float,
          as_json: bool) -> None:
    """Measure link bandwidth between every pair of nodes and all-reduce bus bandwidth.

    \b
    Examples:
      corral bench -c hostfile                         # both, with defaults
      corral bench -c hostfile --no-allreduce --sequential
      corral bench --no-links --max-size 256MiB --json

    Links: every node runs a receiver (iperf3 where installed, else corral's
    built-in one); in each round every node sends to one peer while it
    receives from another.  A link (or a node whose every link is) under half
    its peers' throughput is flagged.  All-reduce: float32 sums from 1 MiB up,
    printed like nccl-tests' all_reduce_perf (busbw = algbw x 2(n-1)/n); with
    NCCL, a run over TCP sockets where InfiniBand exists is flagged.
    """
    if not links and not allreduce:
        raise UsageError("nothing to do: both --no-links and --no-allreduce given")
    cluster = cluster_opts.load()
    ev = asyncio.run(node_facts(cluster))
    lb: LinkBench | None = None
    if links:
        ui.notice(f"measuring {len(cluster.hosts) * (len(cluster.hosts) - 1)} links...")
        lb = asyncio.run(link_bench(cluster, ev, seconds=seconds, tool=tool, sequential=sequential))
    ar: AllReduceResult | None = None
    if allreduce:
        chosen = backend_for(ev) if backend == "auto" else backend
        nccl = chosen == "nccl"
        nproc = nproc_per_node or (min(visible_gpus(ev.facts[h]) for h in ev.reachable) if nccl else 1)
        sizes = size_sweep(min_size, max_size or (DEFAULT_MAX_NCCL if nccl else DEFAULT_MAX_GLOO))
        ui.notice(f"all-reduce with {chosen}: {len(sizes)} sizes, {nproc} process(es) per node...")
        ar = asyncio.run(allreduce_bench(
            cluster, sizes=sizes, backend=chosen, nproc=nproc, warmup=warmup if warmup is not None else (5 if nccl else 2),
            iters=iters or (20 if nccl else 5), timeout=timeout, head_env=os.environ, head_cwd=os.getcwd()))
    failed = _failed(lb, ar)
    if as_json:
        emit_json("bench", _json(lb, ar, ev), default=str)
        if failed:  # the JSON says what failed; say that it did where a person looks
            for f in (lb.findings if lb else ()):
                if f.severity == ERROR:
                    ui.notice(f"error: {f.message}")
            if ar is not None and not ar.run.succeeded:
                ui.notice("error: the all-reduce run failed (see \"allreduce\" in the JSON)")
    else:
        if lb is not None:
            render_links(lb)
        if ar is not None:
            render_allreduce(ar, ev)
    sys.exit(EXIT_FAILED if failed else 0)


def _failed(lb: LinkBench | None, ar: AllReduceResult | None) -> bool:
    return bool((lb and any(f.severity == ERROR for f in lb.findings))
                or (ar and not ar.run.succeeded))


def _ib_ignored(ar: AllReduceResult, ev: Evidence) -> bool:
    from corral.doctor.checks.nics import active_ib_ports

    return ar.nccl_net == "Socket" and any(active_ib_ports(ev.facts[h]) for h in ev.reachable)


# ---------------------------------------------------------------------------
# rendering


def render_links(lb: LinkBench) -> None:
    con = ui.console()
    hosts = list(lb.evidence.reachable)
    rounds = "one link at a time" if lb.sequential else "each node sending to one peer at a time"
    con.print(f"\n[bold]Link bandwidth[/] ({lb.tool}, {lb.seconds:g}s per link, {rounds}; "
              "rows send, columns receive)")
    flagged = {(f.hosts.names[0], f.hosts.names[-1]) for f in lb.findings if f.severity != OK}
    slow_nodes = {f.hosts.names[0] for f in lb.findings if f.severity != OK and len(f.hosts) == 1}
    table = Table(box=None, padding=(0, 2, 0, 2))
    table.add_column("from \\ to", style="bold")
    for h in hosts:
        table.add_column(escape(h), justify="right")
    probes = {(p.src, p.dst): p for p in lb.evidence.links or ()}
    for src in hosts:
        cells = []
        for dst in hosts:
            p = probes.get((src, dst))
            if src == dst or p is None:
                cells.append("[dim]-[/]")
            elif p.bps is None:
                cells.append(f"[red]{escape(p.error or 'failed')}[/]")
            else:
                bad = (src, dst) in flagged or src in slow_nodes or dst in slow_nodes
                cells.append(f"[{'yellow' if bad else 'green'}]{human_bps(p.bps)}[/]")
        table.add_row(escape(src), *cells)
    con.print(table)
    speeds: dict[tuple, list[str]] = {}
    for h, c in lb.nics.items():
        speeds.setdefault((c.interface, c.speed_mbps), []).append(h)
    con.print("  interfaces: " + "; ".join(
        f"{escape(str(HostSet.of(hs)))} {name} at {f'{s} Mbit/s' if s else 'unknown speed'}"
        for (name, s), hs in speeds.items()))
    for f in lb.findings:
        icon = {ERROR: "[bold red]✗[/]", OK: "[green]✓[/]"}.get(f.severity, "[yellow]![/]")
        con.print(f"  {icon} [bold]{escape(str(f.hosts))}[/] {ui.shown(f.message)}")
        if f.hint and f.severity != OK:
            con.print(f"      [dim]hint:[/] {ui.shown(f.hint)}")


def render_allreduce(ar: AllReduceResult, ev: Evidence) -> None:
    con = ui.console()
    con.print(f"\n[bold]All-reduce[/] ({ar.backend}, {ar.world_size} ranks on {len(ev.reachable)} "
              "node(s), in place; busbw = algbw x 2(n-1)/n as in nccl-tests)")
    if not ar.run.succeeded:
        res = ar.run.result
        why = (ar.run.preflight.message if ar.run.preflight else
               "timed out" if ar.run.timed_out else
               res.failure.describe() if res and res.failure else "no result")
        con.print(f"  [bold red]✗ the all-reduce run failed:[/] {escape(why)}")
        if ar.run.run_dir:
            con.print(f"    logs: {escape(str(ar.run.run_dir))}")
    lines = [
        f"#  {'size':>10}  {'count':>12}  {'type':>6}  {'redop':>6}  {'time':>9}  {'algbw':>7}  {'busbw':>7}",
        f"#  {'(B)':>10}  {'(elements)':>12}  {'':>6}  {'':>6}  {'(us)':>9}  {'(GB/s)':>7}  {'(GB/s)':>7}",
    ]
    for r in ar.rows:
        lines.append(f"   {r.size:>10}  {r.count:>12}  {r.dtype:>6}  {r.redop:>6}  {r.time_us:>9.1f}  "
                     f"{r.algbw_gbs:>7.3f}  {r.busbw_gbs:>7.3f}")
    for line in lines:
        con.print(escape(line), highlight=False)
    if ar.rows:
        peak = max(r.busbw_gbs for r in ar.rows)
        con.print(f"# peak busbw: {peak:.3f} GB/s ({peak * 8:.2f} Gbit/s)")
    if ar.nccl_net:
        con.print(f"  NCCL network: {escape(ar.nccl_net)}")
    if _ib_ignored(ar, ev):
        con.print("  [yellow]![/] NCCL used TCP sockets although InfiniBand is active on these nodes")
        con.print("      [dim]hint:[/] unset NCCL_IB_DISABLE / NCCL_NET=Socket; `corral doctor` "
                  "checks the IB ports and the environment")


def _json(lb: LinkBench | None, ar: AllReduceResult | None, ev: Evidence) -> dict:
    out: dict = {"hosts": list(ev.hosts)}
    if lb is not None:
        out["links"] = {
            "tool": lb.tool, "seconds": lb.seconds, "sequential": lb.sequential,
            "interfaces": {h: {"name": c.interface, "address": c.address, "speed_mbps": c.speed_mbps}
                           for h, c in lb.nics.items()},
            "matrix": [{"src": p.src, "dst": p.dst, "address": p.address, "bps": p.bps,
                        "error": p.error, "link_speed_bps": lb.link_speed_bps(p.src, p.dst)}
                       for p in lb.evidence.links or ()],
            "findings": [f.to_json() for f in lb.findings],
        }
    if ar is not None:
        res = ar.run.result
        out["allreduce"] = {
            "backend": ar.backend, "world_size": ar.world_size, "ok": ar.run.succeeded,
            "nccl_net": ar.nccl_net, "socket_despite_ib": _ib_ignored(ar, ev),
            "rows": [r.__dict__ for r in ar.rows],
            "failure": None if ar.run.succeeded else (
                ar.run.preflight.message if ar.run.preflight else
                "timed out" if ar.run.timed_out else
                res.failure.describe() if res and res.failure else "no result"),
            "log": str(ar.run.run_dir) if ar.run.run_dir else None,
        }
    return out
