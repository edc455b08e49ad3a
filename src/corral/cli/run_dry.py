"""`corral run --dry-run`: the plan every node would get, and nothing started.

No node is asked anything: processes per node come from slots, --gpus or
-n (else shown as 1), and the rendezvous port, chosen by node 0 at launch,
is shown as ``<port>`` wherever it would land.  Values of secret-looking
variables are masked (``plan.is_secret_name``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from corral import ui
from corral.cli.common import emit_json
from corral.diagnose.stacks import fold_ranks
from corral.errors import UsageError
from corral.run.plan import LaunchPlan, NodeFacts, RunSpec, build_plan, gpus_for, is_secret_name
from corral.run.runner import PREWARMED
from corral.run.scriptcheck import local_rank_problem, self_launch_note

#: Stands for the master port in a dry run's plan (corral picks a free one on
#: node 0 only at launch); shown as ``PORT_UNCHOSEN`` wherever it lands.
_PORT_STANDIN = 65099
PORT_UNCHOSEN = "<port>"


def show_plan(cluster, spec: RunSpec, as_json: bool) -> None:
    cluster = cluster.without_spares()  # a spare is used only when a node is lost
    first = cluster.hosts[0]
    master = "127.0.0.1" if len(cluster.hosts) == 1 else first.connect_address
    port = spec.master_port or 0
    plan = build_plan(cluster, spec, {h.name: NodeFacts() for h in cluster.hosts}, master_addr=master,
                      master_port=port or _PORT_STANDIN, head_env=os.environ, head_cwd=os.getcwd())
    if not port:
        plan = _port_unchosen(plan)
    unknown_slots = spec.nproc_per_node is None and any(h.slots is None and gpus_for(spec, h) is None
                                                          for h in cluster.hosts)
    if as_json:
        emit_json("run.plan", _plan_json(plan, unknown_slots, preload=spec.preload and spec.launcher in PREWARMED))
        return
    con = ui.console()
    con.print(f"[bold]dry run[/] {spec.run_id}: {spec.launcher}, {len(plan.nodes)} node(s), "
              f"rendezvous {master}:{port or '<free port chosen at launch>'}")
    if spec.launcher in PREWARMED:
        con.print("ranks: " + ("preloaded (forked from a torchrun that has imported torch, where nothing "
                               "they start with would differ; docs/run.md)" if spec.preload
                               else "fresh interpreters (--fresh-ranks)"))
    if unknown_slots:
        con.print("[yellow]note:[/] some hosts have no slots: processes per node = their GPU count, "
                  "detected at launch (shown here as 1)")
    problem = None if spec.module else local_rank_problem(spec.program, Path.cwd(), launcher=spec.launcher,
                                                          world_size=plan.world_size, args=spec.args)
    if problem:  # the run would refuse it
        raise UsageError(problem[0], hint=problem[1])
    note = None if spec.module else self_launch_note(spec.program, Path.cwd(), launcher=spec.launcher,
                                                       nproc=plan.nodes[0].nproc, nnodes=len(plan.nodes),
                                                       args=spec.args)
    if note:
        con.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    for node in plan.nodes:
        ranks = fold_ranks(set(range(node.first_rank, node.first_rank + node.nproc)))
        con.print(f"\n[bold]node {node.node_rank}[/] {escape(node.host.name)}  {ranks}  cwd {escape(node.cwd)}")
        con.print("  argv: " + escape(" ".join(_q(a) for a in node.argv)), soft_wrap=True)
        table = Table(box=None, show_header=False, padding=(0, 1, 0, 4))
        for k in sorted(node.env):
            table.add_row(k, "***" if is_secret_name(k) else escape(node.env[k]))
        for k, parts in node.env_refs:
            table.add_row(k, "***" if is_secret_name(k) else escape(_shown_ref(parts)) + "  (filled in on the node)")
        con.print(table)
    ui.notice("dry run: nothing was started")


def _port_unchosen(plan: LaunchPlan) -> LaunchPlan:
    """The plan with the stand-in port shown as ``<port>`` (launcher flags,
    ``$MASTER_PORT`` in the script's arguments, the environment)."""

    standin = re.compile(rf"(?<![0-9]){_PORT_STANDIN}(?![0-9])")

    def sub(text: str) -> str:
        return standin.sub(PORT_UNCHOSEN, text)

    nodes = tuple(dataclasses.replace(n, argv=tuple(sub(a) for a in n.argv),
                                      env={k: sub(v) for k, v in n.env.items()}) for n in plan.nodes)
    return dataclasses.replace(plan, master_port=0, nodes=nodes)


def _shown_ref(parts) -> str:
    """``/opt/x:${LD_LIBRARY_PATH}``: a value the node fills in from its own variables."""
    return "".join(text if kind == "lit" else "${%s}" % text for kind, text in parts)


def _q(word: str) -> str:
    if word == PORT_UNCHOSEN or word.endswith("=" + PORT_UNCHOSEN) or word.endswith(":" + PORT_UNCHOSEN):
        return word  # a placeholder, not a shell word
    return shlex.quote(word)


def _plan_json(plan: LaunchPlan, unknown_slots: bool, *, preload: bool) -> dict:
    return {
        "run_id": plan.run_id, "launcher": plan.launcher, "preloaded_ranks": preload,
        "master_addr": plan.master_addr,
        "master_port": plan.master_port or None, "world_size": plan.world_size,
        "processes_per_node_detected_at_launch": unknown_slots,
        "nodes": [
            {"host": n.host.name, "node_rank": n.node_rank, "nproc": n.nproc, "first_rank": n.first_rank,
             "cwd": n.cwd, "argv": list(n.argv),
             "env": {k: ("***" if is_secret_name(k) else v) for k, v in n.env.items()},
             "env_from_node": {k: ("***" if is_secret_name(k) else _shown_ref(p)) for k, p in n.env_refs}}
            for n in plan.nodes
        ],
    }
