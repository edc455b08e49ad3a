"""Network checks: the interface per node, decoy interfaces, NCCL/gloo variables,
InfiniBand, name resolution, MTU and link speed.

The interface choice itself lives in ``corral.doctor.checks.nics``; here it becomes
findings with the exact variables to set (``corral doctor --fix-env`` writes
them into the cluster file).
"""

from __future__ import annotations

import ipaddress
import statistics
from collections.abc import Mapping
from typing import Any

from corral.agent.probes import advertises_loopback
from corral.doctor.checks.base import (
    ERROR,
    OK,
    WARNING,
    Evidence,
    Finding,
    describe_groups,
    group_hosts,
    ipv4_interfaces,
    odd_ones,
)
from corral.doctor.checks.nics import (
    active_ib_ports,
    choose_nics,
    duplicated_addresses,
    nccl_default,
    nccl_matches,
)
from corral.hostrange import HostSet

FIX = "`corral doctor --fix-env` writes it into the cluster file"


def interfaces(ev: Evidence) -> list[Finding]:
    """The interface that reaches every peer, per node; an error where there is none."""
    out: list[Finding] = []
    chosen: dict[str, tuple] = {}
    for host, c in choose_nics(ev).items():
        if c.interface is None:
            out.append(_no_interface(host, c.partial or {}))
            continue
        chosen[host] = (c.interface, c.method, c.alternatives)
    for (name, method, alts), hosts in group_hosts(chosen):
        how = {"subnet": "shares a subnet with every peer", "route": "the route to every peer",
               "single": "the only node"}.get(method, method)
        extra = (f"; {', '.join(alts)} also reach{'es' if len(alts) == 1 else ''} every peer "
                 "(`corral bench` measures which is faster)") if alts else ""
        out.append(Finding(check="network.interface", severity=OK, hosts=hosts,
                           message=f"{name}: {how} -> NCCL_SOCKET_IFNAME={name} "
                                   f"GLOO_SOCKET_IFNAME={name}{extra}"))
    return out


def _no_interface(host: str, partial: Mapping[str, tuple[str, ...]]) -> Finding:
    reached = "; ".join(f"{n} reaches {HostSet.of(p) or 'no peer'}" for n, p in partial.items())
    return Finding(
        check="network.interface", severity=ERROR, hosts=HostSet.of([host]),
        message="no network interface reaches every other node"
                + (f" ({reached})" if reached else " (no usable IPv4 address)"),
        hint="put every node on one network (or route between them); `ip addr` and `ip route` on "
             f"{host} show what it has",
    )


def decoys(ev: Evidence) -> list[Finding]:
    """Container bridges and shared addresses that NCCL, gloo or MPI could pick by mistake."""
    if len(ev.reachable) < 2:
        return []  # one node: nothing travels between nodes
    dup = duplicated_addresses(ev)
    choices = choose_nics(ev)
    found: dict[str, tuple[str, ...]] = {}
    for host in ev.reachable:
        items = []
        for iface, addr in ipv4_interfaces(ev.facts[host]):
            kind = iface.get("kind")
            if kind == "loopback" or iface["name"] == choices[host].interface:
                continue
            if kind in ("docker", "bridge") or str(addr.ip) in dup:
                items.append(f"{iface['name']} ({addr})")
        if items:
            found[host] = tuple(items)
    out = []
    for items, hosts in group_hosts(found):
        pinned = [h for h in hosts if _pinned(ev, h, choices[h].interface)]
        loose = HostSet.of(h for h in hosts if h not in pinned)
        what = ", ".join(items)
        if loose:
            names = sorted({choices[h].interface for h in loose if choices[h].interface})
            env = " ".join(f"{v}={'|'.join(names)}" for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"))
            out.append(Finding(
                check="network.decoy", severity=WARNING, hosts=loose,
                message=f"{what}: a container/virtual bridge or an address other nodes share; "
                        "it cannot carry traffic between nodes (corral's choice skips it)",
                hint=f"pin the right interface on {loose} so NCCL, gloo and MPI never pick it: "
                     f"{env} ({FIX})",
            ))
        if pinned:
            out.append(Finding(check="network.decoy", severity=OK, hosts=HostSet.of(pinned),
                               message=f"{what} present, but the socket variables pin the right "
                                       "interface"))
    return out


def _pinned(ev: Evidence, host: str, interface: str | None) -> bool:
    env = ev.env_of(host)
    names = [i["name"] for i in ev.facts[host].get("interfaces") or []]
    nccl = env.get("NCCL_SOCKET_IFNAME")
    gloo = env.get("GLOO_SOCKET_IFNAME")
    return bool(interface and nccl and gloo and nccl_matches(nccl, names)[:1] == [interface]
                and gloo.split(",")[0].strip() == interface)


def socket_env(ev: Evidence) -> list[Finding]:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME that name a wrong interface; gloo's guess."""
    choices = choose_nics(ev)
    multi = len(ev.reachable) > 1
    gpus = any(ev.facts[h].get("gpus") for h in ev.reachable)
    out: list[Finding] = []
    for host in ev.reachable:
        f, env, best = ev.facts[host], ev.env_of(host), choices[host].interface
        names = [i["name"] for i in f.get("interfaces") or []]
        one = HostSet.of([host])
        for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            value = env.get(var)
            if value is None:
                continue
            picked = nccl_matches(value, names) if var.startswith("NCCL") else \
                [n for n in (v.strip() for v in value.split(",")) if n in names]
            if not picked:
                out.append(Finding(check="network.env", severity=ERROR, hosts=one,
                                   message=f"{var}={value} matches no interface (it has "
                                           f"{', '.join(names)})",
                                   hint=_fix_hint(var, best, host)))
            elif best and best not in picked:
                out.append(Finding(check="network.env", severity=ERROR, hosts=one,
                                   message=f"{var}={value} selects {', '.join(picked)}, not {best} "
                                           "(the interface that reaches every peer)",
                                   hint=_fix_hint(var, best, host)))
        if gpus and multi and "NCCL_SOCKET_IFNAME" not in env and best:
            guess = nccl_default(f)
            if guess and guess != best:
                out.append(Finding(check="network.env", severity=WARNING, hosts=one,
                                   message=f"NCCL would pick {guess} by itself, not {best}",
                                   hint=_fix_hint("NCCL_SOCKET_IFNAME", best, host)))
        if multi and "GLOO_SOCKET_IFNAME" not in env:
            out.extend(_gloo_guess(host, f, best))
    return out


def _fix_hint(var: str, best: str | None, host: str) -> str:
    if best is None:
        return f"fix the network of {host} first (see network.interface)"
    return f"set {var}={best} for {host} ({FIX})"


def _gloo_guess(host: str, f: Mapping[str, Any], best: str | None) -> list[Finding]:
    """gloo advertises the address the hostname resolves to (loopback when it
    resolves to nothing): 127.0.1.1 breaks multi-node runs.  corral run sets
    GLOO_SOCKET_IFNAME on such a node by itself; other launchers do not."""
    hostname = f.get("hostname")
    resolved = f.get("hostname_addresses")  # in getaddrinfo's order: gloo takes the first
    if resolved is None:  # facts of an older corral
        resolved = (f.get("resolve") or {}).get(hostname) or []
    if not advertises_loopback(resolved):
        return []
    what = (f"resolves to {resolved[0]} (loopback){' first' if len(resolved) > 1 else ''}" if resolved
            else "does not resolve (gloo then uses 127.0.0.1)")
    fix = _fix_hint("GLOO_SOCKET_IFNAME", best, host)
    return [Finding(check="network.hostname", severity=WARNING, hosts=HostSet.of([host]),
                    message=f"its hostname {hostname!r} {what}: gloo would tell the other nodes to "
                            "connect there; `corral run` sets GLOO_SOCKET_IFNAME for its ranks by itself, "
                            "a launcher started otherwise (DeepSpeed's runner, torchrun by hand) fails",
                    hint=fix + ("" if resolved else f", or add {hostname} to /etc/hosts")
                         + (", or take the `127.0.1.1` line out of /etc/hosts there" if resolved else ""))]


def infiniband(ev: Evidence) -> list[Finding]:
    """IB on all nodes or none; not disabled where present; ports up at one rate."""
    active = {h: active_ib_ports(ev.facts[h]) for h in ev.reachable}
    present = {h: ev.facts[h].get("infiniband") or [] for h in ev.reachable}
    out: list[Finding] = []
    with_ib = HostSet.of(h for h in ev.reachable if active[h])
    if not with_ib:
        down = HostSet.of(h for h in ev.reachable if present[h])
        if down:
            out.append(Finding(check="network.ib", severity=WARNING, hosts=down,
                               message="InfiniBand devices present but no port is ACTIVE",
                               hint="check the cables and the subnet manager (`ibstat`); NCCL "
                                    "will use TCP sockets until then"))
        out.append(Finding(check="network.ib", severity=OK, hosts=HostSet.of(ev.reachable),
                           message="no active InfiniBand: NCCL will use TCP sockets; "
                                   "NCCL_IB_DISABLE=1 makes that explicit"))
        return out
    without = HostSet.of(h for h in ev.reachable if not active[h])
    if without:
        out.append(Finding(check="network.ib", severity=ERROR, hosts=without,
                           message=f"no active InfiniBand here, but {with_ib} have it",
                           hint="bring the IB ports up on those nodes (`ibstat`), or set "
                                "NCCL_IB_DISABLE=1 on every node to use sockets everywhere"))
    for h in with_ib:
        env = ev.env_of(h)
        if env.get("NCCL_IB_DISABLE", "").strip().lower() in ("1", "true", "yes"):
            out.append(_ib_disabled(h, "NCCL_IB_DISABLE=" + env["NCCL_IB_DISABLE"]))
        elif env.get("NCCL_NET", "").strip().lower() == "socket":
            out.append(_ib_disabled(h, "NCCL_NET=Socket"))
    rates = {h: tuple(sorted({p.get("rate") or "?" for p in active[h]})) for h in with_ib}
    groups = group_hosts(rates)
    if len(groups) > 1:
        out.append(Finding(check="network.ib", severity=WARNING, hosts=odd_ones(groups),
                           message="InfiniBand rates differ: "
                                   + describe_groups(groups, lambda r: ", ".join(r)),
                           hint="a port at a lower rate slows every collective: check its cable "
                                "and switch port (`ibstat`)"))
    elif not out:
        out.append(Finding(check="network.ib", severity=OK, hosts=with_ib,
                           message=f"InfiniBand active ({', '.join(groups[0][0])})"))
    return out


def _ib_disabled(host: str, setting: str) -> Finding:
    return Finding(check="network.ib", severity=WARNING, hosts=HostSet.of([host]),
                   message=f"InfiniBand is present but {setting} makes NCCL use TCP sockets "
                           "(typically 5-10x slower)",
                   hint=f"remove {setting.split('=')[0]} from the environment of {host} "
                        "(shell profile, cluster file, --env)")


def resolution(ev: Evidence) -> list[Finding]:
    """Every node resolves every cluster name to the same address."""
    out: list[Finding] = []
    consistent = True
    for name in ev.hosts:
        if _is_ip(name):
            continue
        views = {h: tuple((ev.facts[h].get("resolve") or {}).get(name) or ())
                 for h in ev.reachable if name in (ev.facts[h].get("resolve") or {})}
        if views.get(name):  # a node's own name on loopback (Debian's 127.0.1.1): network.hostname's
            views[name] = tuple(a for a in views[name] if not ipaddress.ip_address(a).is_loopback)
            if not views[name]:
                del views[name]
        if not views:
            continue
        unresolved = HostSet.of(h for h, v in views.items() if not v)
        groups = group_hosts({h: v for h, v in views.items() if v})
        if len(groups) > 1:
            consistent = False
            out.append(Finding(
                check="network.resolve", severity=ERROR, hosts=odd_ones(groups),
                message=f"{name} resolves differently: "
                        + describe_groups(groups, lambda v: ", ".join(v)),
                hint=f"make /etc/hosts (or DNS) agree about {name} on every node",
            ))
        if unresolved:
            consistent = False
            out.append(Finding(
                check="network.resolve", severity=WARNING, hosts=unresolved,
                message=f"{name} does not resolve here",
                hint=f"add {name} to /etc/hosts on these nodes if DeepSpeed/pdsh or MPI will use "
                     "it (corral itself passes addresses)",
            ))
    if consistent and ev.reachable:
        out.append(Finding(check="network.resolve", severity=OK, hosts=HostSet.of(ev.reachable),
                           message="every node resolves every node name the same way"))
    return out


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def mtu(ev: Evidence) -> list[Finding]:
    """One MTU on the chosen interfaces: a jumbo-frame mismatch hangs large messages."""
    values = {h: c.mtu for h, c in choose_nics(ev).items() if c.interface and c.mtu}
    groups = group_hosts(values)
    if len(groups) < 2:
        return []
    return [Finding(check="network.mtu", severity=WARNING, hosts=odd_ones(groups),
                    message="MTU differs on the chosen interfaces: "
                            + describe_groups(groups, lambda v: f"MTU {v}"),
                    hint="set one MTU on every node and switch port; large messages stall when "
                         "jumbo frames meet a 1500-byte hop")]


def link_speed(ev: Evidence) -> list[Finding]:
    """The chosen interface's negotiated speed: a link at a fraction of its peers' is flagged."""
    speeds = {h: c.speed_mbps for h, c in choose_nics(ev).items() if c.interface and c.speed_mbps}
    if len(speeds) < 2:
        return []
    out = []
    for h, s in speeds.items():
        others = [v for k, v in speeds.items() if k != h]
        ref = statistics.median(others)
        if s < ref / 2:
            out.append(Finding(
                check="network.speed", severity=WARNING, hosts=HostSet.of([h]),
                message=f"its interface {choose_nics(ev)[h].interface} runs at {s} Mbit/s; the "
                        f"other nodes' at {ref:.0f} Mbit/s",
                hint="the link negotiated a lower speed: check the cable, transceiver and switch "
                     "port (`ethtool <interface>`)",
            ))
    return out


CHECKS = (interfaces, decoys, socket_env, infiniband, resolution, mtu, link_speed)
