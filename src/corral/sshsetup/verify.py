"""The all-to-all login matrix: can every node log in to every node, by key?

Each node runs ``ssh -o BatchMode=yes PEER true`` for every peer (itself
included: pdsh and DeepSpeed's runner log in to the launching node too), in
parallel, and reports "ok" or ssh's own last words.  A cell that fails names
both ends and why, so the fix is obvious (a missing /etc/hosts entry, a
port, a key).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from corral.hostrange import fold
from corral.model import Host
from corral.sshsetup.plan import Peer, matrix_argv
from corral.sshsetup.remote import gather_hosts

NodeCall = Callable[[Host, str, dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """``cells[(src, dst)]`` is "ok" or why ``src`` cannot log in to ``dst``."""

    hosts: tuple[str, ...]
    cells: Mapping[tuple[str, str], str]
    #: Nodes the head could not ask at all: name -> error.
    unreachable: Mapping[str, str]

    @property
    def ok(self) -> bool:
        return not self.unreachable and all(v == "ok" for v in self.cells.values())

    def failures(self) -> list[tuple[str, str, str]]:
        return [(s, d, why) for (s, d), why in self.cells.items() if why != "ok"]

    def summary(self) -> str:
        n = len(self.hosts)
        good = sum(1 for v in self.cells.values() if v == "ok")
        if self.ok:
            return f"all {n * n} logins work ({n} x {n}, {fold(self.hosts)})"
        return f"{good} of {n * n} logins work; {n * n - good} fail"

    def to_json(self) -> dict[str, Any]:
        return {
            "hosts": list(self.hosts),
            "ok": self.ok,
            "unreachable": dict(self.unreachable),
            "cells": {
                s: {d: self.cells.get((s, d), "not checked") for d in self.hosts}
                for s in self.hosts
            },
        }


async def run_matrix(
    hosts: list[Host],
    all_peers: list[Peer],
    call: NodeCall,
    *,
    bare: Mapping[str, bool],
    timeout: float = 10.0,
) -> Matrix:
    """Ask every node to log in to every peer; ``bare[node]``: it has corral's ssh config."""

    async def one(host: Host) -> Any:
        targets = [
            {"name": p.name, "argv": matrix_argv(p, bare=bare.get(host.name, False))}
            for p in all_peers
        ]
        return await call(host, "matrix", {"targets": targets, "timeout": timeout})

    values, problems = await gather_hosts(hosts, one)
    cells: dict[tuple[str, str], str] = {}
    for src, row in values.items():
        for dst, why in row.items():
            cells[(src, dst)] = why
    return Matrix(
        hosts=tuple(h.name for h in hosts),
        cells=cells,
        unreachable={p.host: p.message for p in problems},
    )


def hint_for(reason: str) -> str:
    """What to do about one failed cell, from ssh's message."""
    low = reason.lower()
    if "could not resolve" in low or "name or service not known" in low:
        return "the name does not resolve on that node: add --etc-hosts (or --ssh-config)"
    if "connection refused" in low:
        return "wrong port? nodes on another port than 22 need --ssh-config"
    if "host key verification failed" in low or "no ed25519 host key" in low:
        return "its host key is not known under that name on the node: run setup again"
    if "permission denied" in low:
        return "the key was refused: check sshd's AuthorizedKeysFile and home permissions"
    return "run `corral ssh setup` again; `ssh -v` from that node shows more"
