"""GPU health before launch: what a node's kernel, GPUs and NCCL say (``gpus.health``).

The same reading as ``corral run`` does at a failure or a hang
(``agent/health.py`` on the node, ``diagnose/gpuhealth.py`` on the head),
here with the Xids since boot: a node that needs draining fails the doctor
before a job lands on it.
"""

from __future__ import annotations

from corral.diagnose.gpuhealth import DRAIN, IGNORE, RESTART_APP, node_health
from corral.doctor.checks.base import ERROR, OK, WARNING, Evidence, Finding
from corral.hostrange import HostSet


def health(ev: Evidence) -> list[Finding]:
    """The GPUs' own state before launch: Xid messages in the kernel log since
    boot, uncorrectable ECC errors, pending or failed row remapping / page
    retirement (``nvidia-smi -q``), and NCCL RAS errors of a job running now.
    A node to drain is an error; a GPU to reset, a warning; a kernel log the
    user may not read is said, with why."""
    out: list[Finding] = []
    clean: list[str] = []
    for h in ev.reachable:
        node = node_health(h, ev.facts[h].get("gpu_health") or {})
        if node is None:
            continue
        one = HostSet.of([h])
        serious = [x for x in node.xids if x.action not in (IGNORE, RESTART_APP)]
        memory = [p for m in node.memory for p in m.problems()]
        for line in dict.fromkeys([x.line() for x in serious] + memory + list(node.ras)):
            out.append(Finding(check="gpus.health", severity=ERROR if DRAIN in line else WARNING, hosts=one,
                               message=line, hint="see docs/diagnose.md, 'GPU and node health'"))
        for why in node.unread:
            out.append(Finding(check="gpus.health", severity=WARNING, hosts=one, message=why))
        if not serious and not memory and not node.ras and not node.unread:
            clean.append(h)
    if clean:
        out.append(Finding(check="gpus.health", severity=OK, hosts=HostSet.of(clean),
                           message="no GPU Xid needing action since boot; ECC and row remapping clean"))
    return out


CHECKS = (health,)
