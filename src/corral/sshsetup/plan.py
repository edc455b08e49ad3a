"""What every node's blocks should hold: a pure function of what was learnt.

Inputs are the verified host keys (``hostkeys``), how the head reaches each
host (``ssh -G``), each node's own facts (its public key, its host names)
and the head's public key; the output is, per node, the lines of each
marked block, and the ssh argv each node uses to prove a login to each
peer.  Every node gets the same blocks: they describe the whole cluster.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from corral.sshsetup.hostkeys import HostKeys, address_of, known_hosts_lines

#: Seconds a node waits for one peer login in the matrix.
MATRIX_CONNECT_TIMEOUT_S = 5


@dataclass(frozen=True, kw_only=True)
class Peer:
    """One node as its peers see it."""

    name: str
    address: str | None
    port: int
    user: str | None
    #: The node's own host names (``hostname``, fqdn) when they differ from ``name``.
    aliases: tuple[str, ...]
    keys: tuple[tuple[str, str], ...]

    @property
    def names(self) -> list[str]:
        out = [self.name, *self.aliases]
        if self.address:
            out.append(self.address)
        return list(dict.fromkeys(n for n in out if n))


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def peers(verdicts: Mapping[str, HostKeys], facts: Mapping[str, dict]) -> list[Peer]:
    """Every host as a ``Peer``, in cluster order (``verdicts`` keeps it)."""
    out = []
    for name, verdict in verdicts.items():
        target = verdict.target
        own = [
            n for n in facts.get(name, {}).get("hostnames", []) if n and n != name and not is_ip(n)
        ]
        out.append(
            Peer(
                name=name,
                address=address_of(target),
                port=target.port,
                user=target.host.user,
                aliases=tuple(dict.fromkeys(own)),
                keys=verdict.keys,
            )
        )
    return out


def authorized_keys(head_key: str, facts: Mapping[str, dict]) -> list[str]:
    """The head's key, then every node's, once each."""
    lines = [head_key.strip()]
    for fact in facts.values():
        key = (fact.get("public_key") or "").strip()
        if key:
            lines.append(key)
    return list(dict.fromkeys(lines))


def known_hosts(all_peers: list[Peer]) -> list[str]:
    lines: list[str] = []
    for p in all_peers:
        lines += known_hosts_lines(p.names, p.port, p.keys)
    return lines


def ssh_config(all_peers: list[Peer]) -> list[str]:
    """Host entries so that ``ssh NAME`` on a node finds address, port and user."""
    lines: list[str] = []
    for p in all_peers:
        lines.append("Host " + " ".join(n for n in [p.name, *p.aliases]))
        if p.address and p.address != p.name:
            lines.append(f"    HostName {p.address}")
        if p.port != 22:
            lines.append(f"    Port {p.port}")
        if p.user:
            lines.append(f"    User {p.user}")
    return lines


def etc_hosts(all_peers: list[Peer]) -> list[str]:
    return [
        f"{p.address}\t{' '.join([p.name, *p.aliases])}"
        for p in all_peers
        if p.address and is_ip(p.address) and not is_ip(p.name)
    ]


def blocks(
    head_key: str,
    all_peers: list[Peer],
    facts: Mapping[str, dict],
    *,
    want_ssh_config: bool,
    want_etc_hosts: bool,
) -> dict[str, dict[str, list[str]]]:
    """node name -> {file kind: block lines}.

    The ssh config and /etc/hosts blocks are written when asked for, and
    kept up to date where an earlier run wrote them.
    """
    common = {
        "authorized_keys": authorized_keys(head_key, facts),
        "known_hosts": known_hosts(all_peers),
    }
    out: dict[str, dict[str, list[str]]] = {}
    for p in all_peers:
        has = facts.get(p.name, {}).get("has_block", {})
        mine = dict(common)
        if want_ssh_config or has.get("ssh_config"):
            mine["ssh_config"] = ssh_config(all_peers)
        if want_etc_hosts or has.get("etc_hosts"):
            mine["etc_hosts"] = etc_hosts(all_peers)
        out[p.name] = mine
    return out


def matrix_argv(peer: Peer, *, bare: bool) -> list[str]:
    """How a node proves it can log in to ``peer`` without a password.

    ``bare`` (the node has corral's ssh config block) runs exactly what pdsh
    and DeepSpeed run: ``ssh NAME``.  Otherwise port and user are given.
    Host keys are checked strictly and never written; no multiplexing, so
    each cell is a real login.
    """
    argv = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "UpdateHostKeys=no",
        "-o",
        f"ConnectTimeout={MATRIX_CONNECT_TIMEOUT_S}",
        "-o",
        "ControlPath=none",
        "-o",
        "LogLevel=ERROR",
        "-T",
    ]
    if not bare:
        if peer.port != 22:
            argv += ["-p", str(peer.port)]
        if peer.user:
            argv += ["-l", peer.user]
    return argv + [peer.name, "true"]
