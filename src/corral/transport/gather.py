"""Fold identical answers from many hosts into one, under a folded host set.

``nvidia-smi -L`` on 64 nodes is one block under ``gpu[01-63]`` and one
under ``gpu64`` (the node with a missing GPU), not 64 blocks to compare by
eye (ClusterShell's ``clush -b`` / pdsh's ``dshbak -c``).
"""

from __future__ import annotations

from dataclasses import dataclass

from corral.hostrange import fold
from corral.transport.fanout import HostResult


@dataclass(frozen=True, kw_only=True)
class Group:
    """Hosts that answered exactly the same (output, exit code, error)."""

    hosts: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    error: str | None

    @property
    def label(self) -> str:
        return fold(self.hosts)


def group_results(results: list[HostResult]) -> list[Group]:
    """Groups in order of first appearance; the largest group first."""
    groups: dict[tuple, list[str]] = {}
    for r in results:
        key = (r.returncode, r.stdout, r.stderr if r.error is None else "",
               r.error.message.split(": ", 1)[-1] if r.error else None)
        groups.setdefault(key, []).append(r.host)
    out = [Group(hosts=tuple(hosts), returncode=k[0], stdout=k[1], stderr=k[2], error=k[3])
           for k, hosts in groups.items()]
    return sorted(out, key=lambda g: -len(g.hosts))
