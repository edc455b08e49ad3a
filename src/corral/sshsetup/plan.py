"""What every node's blocks should hold: a pure function of what was learnt.

Inputs are the verified host keys (``hostkeys``), how the head reaches each
host (``ssh -G``), each node's own facts (its public key, its host names)
and the head's public key; the output is, per node, the lines of each
marked block, and the ssh argv each node uses to prove a login to each
peer.  Every node gets the same blocks: they describe the whole cluster.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from corral.errors import HostError, PreflightError
from corral.names import HOST_NAME_RULE, is_address, is_host_name, is_ip, is_user_name
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


#: Host names a node may report (``hostname``, its fqdn): a handful, not a list to loop on.
MAX_REPORTED_NAMES = 8
#: One public key line: type, base64 blob, optional comment; no options, one line.
_PUBLIC_KEY = re.compile(r"(?:ssh|ecdsa|sk)-[A-Za-z0-9@.-]{1,64} [A-Za-z0-9+/]{1,16384}={0,3}"
                         r"(?: [^\x00-\x1f\x7f]{0,1024})?")


def peers(verdicts: Mapping[str, HostKeys], facts: Mapping[str, dict]) -> list[Peer]:
    """Every host as a ``Peer``, in cluster order (``verdicts`` keeps it).

    Raises ``PreflightError`` naming every node whose report (host names,
    public key) or resolved address, port or user would not be safe to write
    into ssh_config, known_hosts, authorized_keys or /etc/hosts.
    """
    out = []
    problems: list[HostError] = []
    for name, verdict in verdicts.items():
        target = verdict.target
        fact = facts.get(name, {})
        address = address_of(target)
        problems += check_report(name, verdict, fact, address)
        reported = fact.get("hostnames", [])
        own = [n for n in reported if n and n != name and not is_ip(n)] if isinstance(
            reported, list) else []
        out.append(
            Peer(
                name=name,
                address=address,
                port=target.port,
                user=target.host.user,
                aliases=tuple(dict.fromkeys(own)),
                keys=verdict.keys,
            )
        )
    if problems:
        raise PreflightError(problems, what="checking what the nodes reported")
    return out


def check_report(name: str, verdict: HostKeys, fact: dict, address: str | None) -> list[HostError]:
    """What a node reported that is not a plain name or key, as problems naming it.

    A node's host names come from the node (``socket.gethostname()`` there):
    ``*`` written as ``Host *`` in every node's ssh config would send all
    their ssh traffic to it, and a name with a newline would add directives
    (``ProxyCommand``) that the login check then runs.  Nothing is cleaned
    up or skipped silently: the node is named and the user fixes it, and
    ``peers`` raises before any block is planned.
    """
    target = verdict.target
    out: list[HostError] = []

    def bad(message: str, hint: str) -> None:
        out.append(HostError(name, message, hint=hint, kind="bad-report"))

    if not is_address(name):
        bad(f"{_shown(name)} is not a host name corral writes into ssh files",
            f"name the host in the cluster file with {HOST_NAME_RULE}")
    reported = fact.get("hostnames", [])
    if not isinstance(reported, list) or len(reported) > MAX_REPORTED_NAMES:
        bad("reported a malformed list of host names", "check the node's python3 and hostname")
        reported = []
    for own in reported:
        if not is_host_name(own) and not is_ip(own):
            bad(f"reports its host name as {_shown(own)}, which is not a valid host name; "
                "nothing was written to any node's ssh config, known_hosts or /etc/hosts",
                f"set a valid host name on {name} (`hostnamectl set-hostname NAME`: "
                f"{HOST_NAME_RULE}), or leave {name} out of the cluster")
    if address is not None and not is_ip(address):
        bad(f"resolves to {_shown(address)}, which is not an IP address",
            "check its HostName in your ssh config and its DNS entry")
    if not isinstance(target.port, int) or not 1 <= target.port <= 65535:
        bad(f"port {target.port!r} is not a TCP port", "check Port in your ssh config")
    user = target.host.user
    if user is not None and not is_user_name(user):
        bad(f"user {_shown(user)} is not a valid user name", "check User in your ssh config")
    key = fact.get("public_key")
    if key is not None and not (isinstance(key, str) and _PUBLIC_KEY.fullmatch(key.strip())):
        bad(f"reported a public key that is not one OpenSSH public key line: {_shown(str(key))}",
            f"check ~/.ssh/id_ed25519.pub on {name}")
    return out


def _shown(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


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
