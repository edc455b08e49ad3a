"""Connectivity checks: agents reached, TCP ports between every pair, the SSH mesh,
measured link throughput, and the smoke all-reduce."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from corral.doctor.checks.base import (
    ERROR,
    OK,
    WARNING,
    Evidence,
    Finding,
    LinkProbe,
    group_hosts,
    human_bps,
)
from corral.doctor.checks.nics import active_ib_ports
from corral.hostrange import HostSet
from corral.transport.ssh import quiet_login_hint

#: A link (or node) slower than this fraction of its peers' is flagged.
SLOW_FRACTION = 0.5

_PORT_WHY = {
    "timeout": "timed out: packets are dropped (a firewall)",
    "refused": "refused: a firewall REJECT rule, or nothing listening",
    "unreachable": "no route to it",
}
_SSH_HINTS = {
    "unknown-host-key": "the peer's host key is not in known_hosts there: `corral ssh setup` "
                        "records every node's key on every node (or ssh-keyscan)",
    "changed-host-key": "the peer's host key changed (reinstalled node?): remove the old entry "
                        "with `ssh-keygen -R <peer>` on the source node, then `corral ssh setup`",
    "permission-denied": "the source node's key is not in the peer's authorized_keys: "
                         "`corral ssh setup` authorizes every node on every node",
    "refused": "no sshd on the peer's port (or a REJECT rule): check sshd and the port",
    "closed": "the peer's sshd closed the connection before any login, twice: an AllowUsers/DenyUsers "
              "or /etc/hosts.deny rule, or too many logins arriving at once from elsewhere too (its "
              "MaxStartups, 10:30:100 by default; this check sends each sshd about four at a time); its "
              "sshd log says which",
    "timeout": "ssh timed out: a firewall drops port 22 (or the cluster file's port) between them",
    "unresolved": "the source node cannot resolve the peer's name: add it to /etc/hosts there",
    "unreachable": "no route from the source node to the peer",
    "no-ssh": "install the OpenSSH client on the source node",
    "error": "run the ssh command by hand on the source node to see why",
}


def agents(ev: Evidence) -> list[Finding]:
    """Every host answered (an unreachable host cannot be checked at all)."""
    out = [Finding(check="connectivity.agent", severity=ERROR, hosts=HostSet.of([h]),
                   message=f"not reachable from this machine: {why}",
                   hint=ev.unreachable_hints.get(h)
                   or "`corral hosts` shows how corral reaches it; try `ssh` to it by hand")
           for h, why in ev.unreachable.items()]
    if ev.reachable:
        out.append(Finding(check="connectivity.agent", severity=OK,
                           hosts=HostSet.of(ev.reachable), message="the corral agent answers"))
    return out


def ports(ev: Evidence) -> list[Finding]:
    """Every node reaches every other node's TCP ports (what rendezvous, NCCL and gloo open)."""
    if ev.ports is None:
        return []
    failed: dict[tuple[str, int, str], list[str]] = {}
    for p in ev.ports:
        if p.result != "ok":
            failed.setdefault((p.dst, p.port, p.result), []).append(p.src)
    if not failed:
        n = len({(p.src, p.dst) for p in ev.ports})
        portset = sorted({p.port for p in ev.ports})
        pairs = f"all {n} node pairs" if n >= len(ev.reachable) * (len(ev.reachable) - 1) \
            else f"the {n} node pairs tested (each node with some of its peers)"  # mesh_peers
        return [Finding(check="connectivity.ports", severity=OK, hosts=HostSet.of(ev.reachable),
                        message=f"{pairs} connect over TCP (ports "
                                f"{', '.join(map(str, portset[:6]))}{'...' if len(portset) > 6 else ''})")]
    out = []
    for (dst, port, result), srcs in failed.items():
        sources = HostSet.of(srcs)
        why = _PORT_WHY.get(result, result)
        out.append(Finding(
            check="connectivity.ports", severity=ERROR, hosts=sources | HostSet.of([dst]),
            message=f"{sources} -> {dst}: TCP port {port} {why}",
            hint=f"allow TCP from {sources} to {dst} on all ports (NCCL and gloo listen on random "
                 f"ports, the rendezvous on --master-port): e.g. on {dst} `iptables -I INPUT -s "
                 "<peer address> -j ACCEPT`, or a security group rule for traffic inside the cluster",
        ))
    return out


def ssh_mesh(ev: Evidence) -> list[Finding]:
    """Passwordless SSH between every pair (DeepSpeed's pdsh launcher and MPI need it).

    No edge working at all is a warning (torchrun and accelerate through corral do
    not need it); a partial mesh is an error: someone set it up and it is broken.
    """
    if ev.ssh is None:
        return []
    ok = [p for p in ev.ssh if p.result == "ok"]
    bad = [p for p in ev.ssh if p.result != "ok"]
    if not bad:
        n = len({(p.src, p.dst) for p in ev.ssh if p.src != p.dst})
        sampled = n < len(ev.reachable) * (len(ev.reachable) - 1)
        return [Finding(check="connectivity.ssh", severity=OK, hosts=HostSet.of(ev.reachable),
                        message=f"passwordless SSH works between the {n} node pairs tested" if sampled
                        else "passwordless SSH works between every pair of nodes")]
    if not ok:
        reasons = sorted({p.result for p in bad})
        return [Finding(
            check="connectivity.ssh", severity=WARNING, hosts=HostSet.of(ev.reachable),
            message=f"no passwordless SSH between the nodes ({', '.join(reasons)}); corral's own "
                    "launches do not need it, DeepSpeed's pdsh launcher and MPI do",
            hint="`corral ssh setup` creates the mesh (keys, authorized_keys, known_hosts)",
        )]
    grouped: dict[tuple[str, str], list[str]] = {}
    for p in bad:
        grouped.setdefault((p.dst, p.result), []).append(p.src)
    out = []
    for (dst, result), srcs in grouped.items():
        sources = HostSet.of(srcs)
        detail = next((p.detail for p in bad if p.dst == dst and p.result == result and p.detail), "")
        out.append(Finding(
            check="connectivity.ssh", severity=ERROR, hosts=sources | HostSet.of([dst]),
            message=f"{sources} -> {dst}: ssh fails ({result})" + (f": {detail}" if detail else ""),
            hint=_SSH_HINTS.get(result, _SSH_HINTS["error"]),
        ))
    return out


def links(ev: Evidence) -> list[Finding]:
    """Measured throughput: a node or link under half its peers' speed."""
    if not ev.links:
        return []
    out = [Finding(check="connectivity.links", severity=ERROR, hosts=HostSet.of([p.src, p.dst]),
                   message=f"{p.src} -> {p.dst}: could not measure: {p.error}",
                   hint="see the port check: the two nodes may not reach each other")
           for p in ev.links if p.bps is None]
    slow = slow_links(ev.links)
    nodes = slow_nodes(ev.links)
    for host, (best, ref) in nodes.items():
        out.append(Finding(
            check="connectivity.links", severity=WARNING, hosts=HostSet.of([host]),
            message=f"every link to and from it is slow: at best {human_bps(best)}, while the "
                    f"other nodes reach {human_bps(ref)}",
            hint=f"check {host}'s network: cable, switch port, negotiated speed (`ethtool`), "
                 "traffic shaping (`tc qdisc show`), a busy NIC",
        ))
    for p, ref in slow:
        if p.src in nodes or p.dst in nodes:
            continue
        out.append(Finding(
            check="connectivity.links", severity=WARNING, hosts=HostSet.of([p.src, p.dst]),
            message=f"{p.src} -> {p.dst}: {human_bps(p.bps)}, under half of its peers' "
                    f"{human_bps(ref)}",
            hint="check the path between these two nodes (switch uplinks, cabling)",
        ))
    measured = [p.bps for p in ev.links if p.bps]
    if not out and measured:
        out.append(Finding(check="connectivity.links", severity=OK, hosts=HostSet.of(ev.reachable),
                           message=f"links measured {human_bps(min(measured))} to "
                                   f"{human_bps(max(measured))}, none under half its peers'"))
    return out


def node_best(links: Iterable[LinkProbe]) -> dict[str, float]:
    """Per node, the fastest link to or from it: a healthy node has at least one fast link."""
    best: dict[str, float] = {}
    for p in links:
        if p.bps:
            for h in (p.src, p.dst):
                best[h] = max(best.get(h, 0.0), p.bps)
    return best


def slow_nodes(links: Iterable[LinkProbe]) -> dict[str, tuple[float, float]]:
    """Nodes whose *best* link is under half the median of the other nodes' best.

    Only a node whose every link is slow qualifies, so one noisy measurement
    never blames a node; with two nodes nothing can be told apart.
    """
    best = node_best(links)
    if len(best) < 3:
        return {}
    out = {}
    for h, b in best.items():
        ref = statistics.median(v for k, v in best.items() if k != h)
        if b < SLOW_FRACTION * ref:
            out[h] = (b, ref)
    return out


def slow_links(links: Iterable[LinkProbe]) -> list[tuple[LinkProbe, float]]:
    """Links under half the median of their peers (the other measured links)."""
    measured = [p for p in links if p.bps]
    out = []
    for p in measured:
        others = [q.bps for q in measured if q is not p]
        if len(others) < 2:
            continue
        ref = statistics.median(others)
        if p.bps < SLOW_FRACTION * ref:  # type: ignore[operator]
            out.append((p, ref))
    return out


def smoke(ev: Evidence) -> list[Finding]:
    """The all-reduce through corral's launch path."""
    s = ev.smoke
    if s is None:
        return []
    everyone = HostSet.of(ev.hosts)
    if s.status == "ok" and s.nccl_net == "Socket":
        with_ib = HostSet.of(h for h in ev.reachable if active_ib_ports(ev.facts[h]))
        if with_ib:
            return [Finding(
                check="smoke.allreduce", severity=WARNING, hosts=with_ib,
                message="the NCCL all-reduce worked, but over TCP sockets although InfiniBand is "
                        "active here (typically 5-10x slower)",
                hint="look for NCCL_IB_DISABLE / NCCL_NET=Socket in the environment, and for a "
                     "missing libibverbs or RDMA device access (containers: --device=/dev/infiniband)",
            )]
    if s.status == "ok":
        return [Finding(check="smoke.allreduce", severity=OK, hosts=everyone,
                        message=f"all-reduce across {s.world_size} rank{'' if s.world_size == 1 else 's'} "
                                f"with {s.backend} "
                                f"succeeded in {s.seconds:.1f}s"
                                + (f" (NCCL used {s.nccl_net})" if s.nccl_net else ""))]
    if s.status == "skipped":
        return [Finding(check="smoke.allreduce", severity=WARNING, hosts=everyone,
                        message=f"smoke test skipped: {s.message}",
                        hint="fix the errors above, then run `corral doctor` again")]
    where = HostSet.of(([s.host] if s.host else []) + list(s.peers)) or everyone
    link = f" (the other end: {HostSet.of(s.peers)})" if s.peers else ""
    return [Finding(
        check="smoke.allreduce", severity=ERROR, hosts=where,
        message=f"smoke test ({s.backend or 'torch.distributed'}) failed"
                + (f" on {s.host}" + (f" rank {s.rank}" if s.rank is not None else "") if s.host else "")
                + f"{link}: {s.message}",
        hint=(f"full log: {s.log}; " if s.log else "") + "the network and port checks above usually "
             "say why; `corral diagnose` explains the log",
    )]


def login_output(ev: Evidence) -> list[Finding]:
    """A login shell that writes to stdout for non-interactive logins (a banner
    or an ``echo`` in ~/.bashrc) garbles rsync's and scp's protocols."""
    noisy = {h: (ev.facts[h]["login_output"][0], ev.facts[h].get("shell"))
             for h in ev.reachable if ev.facts[h].get("login_output")}
    return [Finding(
        check="connectivity.login", severity=WARNING, hosts=hosts,
        message=f"the login shell writes to stdout before any command runs ({text!r}): rsync "
                "(`corral sync`) and scp fail on it",
        hint=quiet_login_hint(str(hosts), shell),
    ) for (text, shell), hosts in group_hosts(noisy)]


CHECKS = (agents, ports, ssh_mesh, login_output, links, smoke)
