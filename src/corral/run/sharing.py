"""Several jobs on the same nodes: what the head asks each node to hold, and
what it makes of the answers.

Every node's agent holds the job's GPUs (and node 0 its rendezvous port) in
the node's registry of corral jobs (``corral.agent.holds``) during
preflight, in the same round trip.  A GPU or port another live corral job
holds is an error naming that job before anything starts; GPUs busy with
processes no corral job started are named in a warning.  What a node
answers is untrusted: every holding is checked again here.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping

from corral.agent import private
from corral.agent.holds import clean_holding
from corral.errors import HostError
from corral.model import Host
from corral.run.plan import RunSpec, gpus_for


def hold_args(spec: RunSpec, host: Host, *, first: bool) -> dict:
    """What ``probes.preflight`` holds on ``host`` for this job."""
    subset = gpus_for(spec, host)
    return {"run_id": spec.run_id, "head": socket.gethostname(),
            "gpus": list(subset) if subset is not None else None,
            "port": spec.master_port if first else None}


def describe_holder(h: dict) -> str:
    """``corral run 20261127-...-a1b2c3 of alice since 19:02:11 (started from laptop)``."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"])) if h.get("since") else "?"
    return f"corral run {h['run_id']} of {h['user']} since {since} (started from {h['head']}, agent pid {h['pid']})"


def _entries(value: object) -> list[str]:
    if not isinstance(value, list):
        return []
    return [v for v in value[:1024] if isinstance(v, str) and v.replace("-", "").replace(":", "").isalnum()][:1024]


def held_gpus(answer: Mapping) -> tuple[str, ...] | None:
    """The GPUs a node says it now holds for the job (None: it held nothing)."""
    gpus = _entries(answer.get("gpus"))
    return tuple(gpus) if gpus else None


def hold_problems(name: str, answer: object, spec: RunSpec, host: Host) -> list[HostError]:
    """What stops the job on this node: GPUs it does not have, GPUs or a port
    another corral job holds, a registry that cannot be used."""
    if not isinstance(answer, dict):
        return []
    subset = gpus_for(spec, host)
    if answer.get("error") and answer.get("unsafe"):
        return [HostError(name, f"the registry of the jobs' GPUs and ports: {str(answer['error'])[:300]}; "
                                "nothing was started", hint=private.HINT, kind="unsafe-tmp")]
    if answer.get("error"):
        return [HostError(name, f"cannot record the job's GPUs and port there: {str(answer['error'])[:300]}",
                          hint="free space in its temp dir, or set TMPDIR for this host with `env` in the "
                               "cluster file; see docs/security.md (\"Several jobs on one node\")", kind="holds")]
    if "missing" in answer:
        missing = [g for g in answer["missing"] if isinstance(g, int)][:64] if isinstance(answer["missing"], list) else []
        listed = answer.get("listed") if isinstance(answer.get("listed"), int) else None
        has = "no GPU" if not listed else f"GPUs 0-{listed - 1}" if listed > 1 else "GPU 0 only"
        flag = "--gpus" if spec.gpus is not None else "`gpus` for this host in the cluster file"
        wanted = ",".join(str(g) for g in (subset or ()))
        return [HostError(name, f"has no GPU {','.join(str(g) for g in missing)} ({flag} asks for {wanted}; "
                                f"nvidia-smi there lists {has})",
                          hint="pick GPUs that exist on every node (`corral doctor` lists them); nothing was started",
                          kind="no-gpu")]
    problems = []
    held_by = answer.get("held_by") if isinstance(answer.get("held_by"), list) else []
    holders = [c for c in (clean_holding(h) for h in held_by[:16]) if c]
    for h in holders:
        mine = set(_entries(answer.get("gpus")))
        both = [g for g in h["gpus"] if g in mine] or h["gpus"]
        problems.append(HostError(
            name, f"GPU {','.join(both)} {'is' if len(both) == 1 else 'are'} held by {describe_holder(h)}",
            hint=f"wait for it to end, stop it (`corral stop {h['run_id']}`), or run on other GPUs "
                 "(--gpus, or `gpus` for the host in the cluster file); nothing was started",
            kind="gpus-held"))
    port_holder = clean_holding(answer.get("port_held_by")) if answer.get("port_held_by") else None
    if port_holder:
        problems.append(HostError(
            name, f"port {spec.master_port} is held by {describe_holder(port_holder)}",
            hint="leave --master-port out (corral then picks a port no job holds), or choose another",
            kind="port"))
    return problems


def busy_warning(answers: Mapping[str, object]) -> str | None:
    """GPUs the job is about to use that processes no corral job started are
    on (another user's job, a notebook): said, not refused, since corral
    cannot tell whether they leave room."""
    parts = []
    for name, answer in answers.items():
        busy = answer.get("busy") if isinstance(answer, dict) else None
        if not isinstance(busy, list):
            continue
        by_gpu: dict[str, list[str]] = {}
        for p in busy[:64]:
            if not isinstance(p, dict) or not isinstance(p.get("pid"), int):
                continue
            gpu = str(p.get("gpu"))[:16]
            mib = f", {p['mib']} MiB" if isinstance(p.get("mib"), int) else ""
            by_gpu.setdefault(gpu, []).append(f"pid {p['pid']} {str(p.get('name'))[:40]}{mib}")
        for gpu, procs in sorted(by_gpu.items()):
            parts.append(f"{name} GPU {gpu}: {'; '.join(procs)}")
    if not parts:
        return None
    return ("GPUs this job will use are busy with processes corral did not start (another user's job?): "
            + ", ".join(parts) + "; the job starts anyway, and may run out of GPU memory or run slowly "
            "(--gpus picks other GPUs)")


def unchecked_warning(spec: RunSpec, hosts: list[Host], gpus_seen: Mapping[str, object]) -> str | None:
    """A GPU subset on nodes without nvidia-smi cannot be checked there."""
    names = [h.name for h in hosts if gpus_for(spec, h) is not None and gpus_seen.get(h.name) is None]
    if not names:
        return None
    from corral.hostrange import fold

    return (f"no nvidia-smi on {fold(names)}: the GPU numbers of --gpus / `gpus` were not checked there "
            "(CUDA_VISIBLE_DEVICES is set as asked)")
