"""Which network interface each node should use for NCCL and gloo, and why.

NCCL picks an interface by name (InfiniBand first, then anything but
``docker*``/``lo``, in kernel order); gloo uses whatever the hostname
resolves to.  Both guesses go wrong on real machines: a management NIC
listed first, a libvirt ``virbr0`` or a Kubernetes ``cni0`` bridge, a
hostname that resolves to 127.0.1.1.  corral chooses from evidence instead:

1. candidates are a node's IPv4 addresses, minus loopback, container
   bridges (``docker0``, ``br-<id>``), interfaces that are down, link-local
   addresses, and any address that more than one node has (every node's
   ``docker0`` is 172.17.0.1: it identifies nobody);
2. an interface whose subnet holds an address of *every* peer wins;
   among several, the fastest link, then the one the kernel routes the
   peers' known addresses through, then the name;
3. failing that (a routed network), the interface the kernel routes every
   peer through, if it is one and the same.

Interface names may differ between nodes (``eth0`` here, ``ens5`` there),
so the recommendation is per host.  Pure functions over facts.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corral.doctor.checks.base import Evidence, ipv4_interfaces

#: Kinds that never carry traffic between nodes.
EXCLUDED_KINDS = ("loopback", "docker")


@dataclass(frozen=True, kw_only=True)
class NicChoice:
    """The interface one node should use, or why there is none."""

    host: str
    interface: str | None
    address: str | None = None
    #: "subnet" (shares a subnet with every peer), "route" (kernel routes every
    #: peer through it), "single" (a one-node cluster).
    method: str | None = None
    #: Other interfaces that also reach every peer.
    alternatives: tuple[str, ...] = ()
    #: interface -> peers it reaches, when no single interface reaches all.
    partial: Mapping[str, tuple[str, ...]] | None = None
    speed_mbps: int | None = None
    mtu: int | None = None


def duplicated_addresses(ev: Evidence) -> set[str]:
    """IPv4 addresses present on more than one node (decoy bridges, NAT'd VMs)."""
    seen: dict[str, str] = {}
    dup: set[str] = set()
    for h in ev.reachable:
        for _, addr in ipv4_interfaces(ev.facts[h]):
            ip = str(addr.ip)
            if ip in seen and seen[ip] != h:
                dup.add(ip)
            seen.setdefault(ip, h)
    return dup


def candidates(facts: Mapping[str, Any], dup: set[str]) -> list[tuple[dict, ipaddress.IPv4Interface]]:
    """Addresses of a node that could carry traffic to other nodes."""
    out = []
    for iface, addr in ipv4_interfaces(facts):
        if iface.get("kind") in EXCLUDED_KINDS or addr.ip.is_loopback or addr.ip.is_link_local:
            continue
        if iface.get("up") is False or iface.get("state") == "down":
            continue
        if str(addr.ip) in dup:
            continue
        out.append((iface, addr))
    return out


def choose_nics(ev: Evidence) -> dict[str, NicChoice]:
    """The interface each reachable node should use (see the module docstring)."""
    dup = duplicated_addresses(ev)
    cands = {h: candidates(ev.facts[h], dup) for h in ev.reachable}
    peer_ips = {h: {a.ip for _, a in c} for h, c in cands.items()}
    return {h: _choose(h, ev, cands, peer_ips) for h in ev.reachable}


def _choose(host: str, ev: Evidence, cands: dict, peer_ips: dict) -> NicChoice:
    mine = cands[host]
    others = [p for p in ev.reachable if p != host]
    if not mine:
        return NicChoice(host=host, interface=None, partial={})
    if not others:
        iface, addr = mine[0]
        return _made(host, iface, addr, "single", ())
    reach: dict[str, set[str]] = {}
    first_addr: dict[str, tuple[dict, ipaddress.IPv4Interface]] = {}
    for iface, addr in mine:
        name = iface["name"]
        first_addr.setdefault(name, (iface, addr))
        hit = {p for p in others if any(ip in addr.network for ip in peer_ips[p])}
        reach.setdefault(name, set()).update(hit)
    routed = _routed_counts(host, ev, mine)
    full = [n for n, hit in reach.items() if hit == set(others)]
    if full:
        def rank(name: str) -> tuple:
            iface = first_addr[name][0]
            return (-(iface.get("speed_mbps") or 0), -routed.get(name, 0), name)

        full.sort(key=rank)
        iface, addr = first_addr[full[0]]
        return _made(host, iface, addr, "subnet", tuple(full[1:]))
    via = _single_route(host, ev, mine, others)
    if via is not None:
        iface, addr = via
        return _made(host, iface, addr, "route", ())
    partial = {n: tuple(p for p in ev.reachable if p in hit) for n, hit in reach.items()}
    return NicChoice(host=host, interface=None, partial=partial)


def _made(host: str, iface: dict, addr: ipaddress.IPv4Interface, method: str,
          alternatives: tuple[str, ...]) -> NicChoice:
    return NicChoice(host=host, interface=iface["name"], address=str(addr.ip), method=method,
                     alternatives=alternatives, speed_mbps=iface.get("speed_mbps"),
                     mtu=iface.get("mtu"))


def _iface_of_source(mine: list, source: str | None) -> tuple[dict, ipaddress.IPv4Interface] | None:
    for iface, addr in mine:
        if source is not None and str(addr.ip) == source:
            return iface, addr
    return None


def _peer_targets(ev: Evidence, peer: str) -> list[str]:
    """Addresses a node may use to reach ``peer``: the head's view, then the peer's own."""
    out = []
    if ev.addresses.get(peer):
        out.append(ev.addresses[peer])
    for _, addr in ipv4_interfaces(ev.facts.get(peer, {})):
        out.append(str(addr.ip))
    return out


def _routed_counts(host: str, ev: Evidence, mine: list) -> dict[str, int]:
    """Interface -> how many peers' head-known addresses the kernel routes through it."""
    routes = ev.facts[host].get("routes") or {}
    counts: dict[str, int] = {}
    for peer in ev.reachable:
        if peer == host or not ev.addresses.get(peer):
            continue
        found = _iface_of_source(mine, routes.get(ev.addresses[peer]))
        if found is not None:
            counts[found[0]["name"]] = counts.get(found[0]["name"], 0) + 1
    return counts


def _single_route(host: str, ev: Evidence, mine: list, others: list[str]):
    """The one candidate interface the kernel routes every peer through, if any."""
    routes = ev.facts[host].get("routes") or {}
    chosen = None
    for peer in others:
        found = None
        for target in _peer_targets(ev, peer):
            found = _iface_of_source(mine, routes.get(target))
            if found is not None:
                break
        if found is None:
            return None
        if chosen is not None and chosen[0]["name"] != found[0]["name"]:
            return None
        chosen = chosen or found
    return chosen


# ---------------------------------------------------------------------------
# InfiniBand and the recommended environment


def active_ib_ports(facts: Mapping[str, Any]) -> list[dict]:
    return [p for p in facts.get("infiniband") or [] if (p.get("state") or "").upper() == "ACTIVE"]


def recommend_env(ev: Evidence) -> dict[str, dict[str, str]]:
    """Per host: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, and NCCL_IB_DISABLE=1 without IB.

    Hosts with no usable interface get no socket variables (the check says why).
    """
    out: dict[str, dict[str, str]] = {}
    for host, choice in choose_nics(ev).items():
        env: dict[str, str] = {}
        if choice.interface:
            env["NCCL_SOCKET_IFNAME"] = choice.interface
            env["GLOO_SOCKET_IFNAME"] = choice.interface
        if not active_ib_ports(ev.facts[host]):
            env["NCCL_IB_DISABLE"] = "1"
        out[host] = env
    return out


def nccl_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces ``NCCL_SOCKET_IFNAME=spec`` selects (``^`` excludes, ``=`` exact, else prefix)."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    body = body[1:] if exact else body
    wanted = [w.strip() for w in body.split(",") if w.strip()]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [n for n in names if hit(n) != exclude]


def nccl_default(facts: Mapping[str, Any]) -> str | None:
    """The interface NCCL picks without NCCL_SOCKET_IFNAME: ``ib*`` first, then not docker/lo."""
    usable = [i["name"] for i, a in ipv4_interfaces(facts)
              if i.get("up") is not False and not a.ip.is_link_local]
    usable = list(dict.fromkeys(usable))
    ib = [n for n in usable if n.startswith("ib")]
    rest = [n for n in usable if not n.startswith(("docker", "lo"))]
    return (ib or rest or [None])[0]
