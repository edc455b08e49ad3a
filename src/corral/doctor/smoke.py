"""The smoke test of ``corral doctor``: one checked all-reduce through ``corral run``'s path.

gloo on CPU, NCCL when every node has GPUs and a CUDA torch.  It runs only
when nothing the checks found would make it fail for a known reason (a host
unreachable, a blocked port, torch missing): then a failure here is new
information, and the report names the node (the run's first failure) and the
link (the peer addresses its output mentions).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from corral.doctor.bench import nccl_network
from corral.doctor.checks import ERROR, Evidence, Finding, SmokeOutcome
from corral.doctor.checks.base import ipv4_interfaces
from corral.doctor.checks.gpus import visible_gpus
from corral.doctor.checks.nics import duplicated_addresses
from corral.doctor.scripted import ScriptRun, run_workload
from corral.model import Cluster

#: Errors that make the smoke test pointless until they are fixed.
BLOCKING = ("connectivity.agent", "connectivity.ports", "network.interface", "software.torch",
            "software.python", "network.hostname")
_IPV4 = re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3})\b")


def blockers(findings: list[Finding] | tuple[Finding, ...]) -> list[Finding]:
    return [f for f in findings if f.severity == ERROR and f.check in BLOCKING]


def backend_for(ev: Evidence) -> str:
    """NCCL when every node has a GPU and a CUDA build of torch; gloo otherwise."""
    hosts = ev.reachable
    cuda = all(visible_gpus(ev.facts[h]) and (ev.facts[h].get("packages") or {}).get("torch_cuda")
               for h in hosts)
    return "nccl" if hosts and cuda else "gloo"


async def smoke_test(cluster: Cluster, ev: Evidence, *, head_env: Mapping[str, str], head_cwd: str,
                     timeout: float, nproc: int | None = None) -> SmokeOutcome:
    backend = backend_for(ev)
    if nproc is None:
        nproc = min(visible_gpus(ev.facts[h]) for h in ev.reachable) if backend == "nccl" else 1
    env = {"CORRAL_SMOKE_BACKEND": backend, "CORRAL_SMOKE_TIMEOUT": str(max(10, int(timeout * 0.6)))}
    if backend == "nccl":
        env.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"})
    run = await run_workload(cluster, "smoke_allreduce.py", marker="CORRAL_SMOKE", env=env,
                             nproc=nproc, timeout=timeout, head_env=head_env, head_cwd=head_cwd)
    return outcome(run, ev, backend=backend, timeout=timeout)


def outcome(run: ScriptRun, ev: Evidence, *, backend: str, timeout: float) -> SmokeOutcome:
    """Name the node and the link from what the run reported."""
    net = nccl_network(t for _, _, t in run.lines)
    done = next((m for m in run.marks if "world_size" in m), None)
    if run.succeeded and done is not None:
        return SmokeOutcome(status="ok", backend=done.get("backend", backend),
                            world_size=done.get("world_size"), seconds=run.seconds, nccl_net=net)
    log = str(run.run_dir) if run.run_dir else None
    broken = next((m["links"] for m in run.marks if m.get("links")), None)
    if broken:
        first = broken[0]
        return SmokeOutcome(
            status="failed", backend=backend, seconds=run.seconds, host=first["src"],
            peers=tuple(dict.fromkeys(f["dst"] for f in broken if f["src"] == first["src"])),
            message="; ".join(f"{f['src']} cannot open a TCP connection to {f['dst']} at "
                              f"{f['address']} ({f['error']})" for f in broken),
            log=str(run.result.failure_log) if run.result and run.result.failure_log else log)
    if run.preflight is not None:
        first = run.preflight.problems[0] if run.preflight.problems else None
        host = getattr(first, "host", None)
        message = first.message if first else run.preflight.message
        if host and message.startswith(f"{host}: "):
            message = message[len(host) + 2:]  # the outcome names the host
        return SmokeOutcome(status="failed", backend=backend, seconds=run.seconds,
                            host=host, message=message, log=log)
    result = run.result
    f = result.failure if result is not None else None
    tail = tuple(result.failure_tail[-12:]) if result is not None else ()
    text = "\n".join(tail) + "\n" + (f.exc or "" if f else "")
    peers = tuple(h for h in _hosts_named(text, ev) if f is None or h != f.host)
    if run.timed_out:
        message = (f"no result within {timeout:.0f}s (a hang: usually a blocked port or a wrong "
                   "interface between two nodes)")
    elif f is not None:
        message = f.describe() + (f": {f.exc}" if f.exc else "")
    else:
        message = "the run ended without a result from rank 0"
    return SmokeOutcome(status="failed", backend=backend, seconds=run.seconds,
                        host=f.host if f else None, rank=f.rank if f else None, message=message,
                        peers=peers, tail=tail,
                        log=str(result.failure_log) if result and result.failure_log else log,
                        nccl_net=net)


def _hosts_named(text: str, ev: Evidence) -> list[str]:
    """Hosts whose (unique) addresses appear in ``text``."""
    dup = duplicated_addresses(ev)
    owner = {str(a.ip): h for h in ev.reachable for _, a in ipv4_interfaces(ev.facts[h])
             if str(a.ip) not in dup and not a.ip.is_loopback}
    seen: list[str] = []
    for ip in _IPV4.findall(text):
        host = owner.get(ip)
        if host and host not in seen:
            seen.append(host)
    return seen


def skipped(reason: str) -> SmokeOutcome:
    return SmokeOutcome(status="skipped", message=reason)
