"""What every check reads (``Evidence``) and returns (``Finding``).

``Evidence`` is everything ``corral doctor`` gathered, as plain data: the
facts each node reported (``corral.agent.facts``), the environment a job
would see there, and the node-to-node measurements (TCP ports, SSH mesh,
link throughput, clock offsets, the smoke test).  Checks are pure functions
``Evidence -> list[Finding]``, so they are tested on recorded facts
(``tests/fixtures/facts``) and a report can be recomputed from a saved
``--json``.

A ``Finding`` names a host set (printed folded: ``node[1-3]``), says what is
wrong (or right) and how to fix it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from corral.hostrange import HostSet

ERROR = "error"
WARNING = "warning"
OK = "ok"
SEVERITIES = (ERROR, WARNING, OK)


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One conclusion about a set of hosts."""

    #: Which check said it, ``family.name`` (``software.versions``).
    check: str
    severity: str
    hosts: HostSet
    message: str
    hint: str | None = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    @property
    def family(self) -> str:
        return self.check.split(".", 1)[0]

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "severity": self.severity, "hosts": str(self.hosts),
                "host_list": list(self.hosts), "message": self.message, "hint": self.hint}


# ---------------------------------------------------------------------------
# measurements


@dataclass(frozen=True, kw_only=True)
class PortProbe:
    """One TCP connection attempt from ``src`` to ``dst`` at ``address:port``."""

    src: str
    dst: str
    address: str
    port: int
    #: ok | refused | timeout | unreachable | "error: ..."
    result: str


@dataclass(frozen=True, kw_only=True)
class SshProbe:
    """``ssh -o BatchMode=yes dst true`` run on ``src``."""

    src: str
    dst: str
    #: ok | unknown-host-key | changed-host-key | permission-denied | refused |
    #: closed | timeout | unresolved | unreachable | no-ssh | error
    result: str
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class LinkProbe:
    """Measured TCP throughput from ``src`` to ``dst`` (bits per second)."""

    src: str
    dst: str
    address: str
    bps: float | None
    error: str | None = None
    #: "iperf3" or "builtin".
    tool: str = "builtin"


@dataclass(frozen=True, kw_only=True)
class ClockSample:
    """A node's clock minus the head's, and the half round trip that bounds the error."""

    offset_s: float
    uncertainty_s: float


@dataclass(frozen=True, kw_only=True)
class SmokeOutcome:
    """How the smoke all-reduce through ``corral run``'s launch path went."""

    #: ok | failed | skipped
    status: str
    backend: str | None = None
    world_size: int | None = None
    seconds: float | None = None
    #: The host (and rank) the run names as the first failure.
    host: str | None = None
    rank: int | None = None
    message: str = ""
    #: Hosts whose addresses appear in the failure's output (the other end of a link).
    peers: tuple[str, ...] = ()
    tail: tuple[str, ...] = ()
    log: str | None = None
    #: "Socket" or "IB" when NCCL said which network it used.
    nccl_net: str | None = None


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """Everything the checks reason about; plain data, JSON round-trippable."""

    #: Host names in cluster order.
    hosts: tuple[str, ...]
    #: Facts per reachable host (``corral.agent.facts.collect``).
    facts: Mapping[str, Mapping[str, Any]]
    #: ``slots`` from the cluster file (None: one process per GPU).
    slots: Mapping[str, int | None] = field(default_factory=dict)
    #: The environment a job would see on each host: the node's own, plus
    #: what ``corral run`` adds (allow-listed head variables, cluster file env).
    env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: The address the head knows each host by (ssh target), if any.
    addresses: Mapping[str, str] = field(default_factory=dict)
    #: Hosts the agent could not reach, with the reason (and the fix, when known).
    unreachable: Mapping[str, str] = field(default_factory=dict)
    unreachable_hints: Mapping[str, str] = field(default_factory=dict)
    clock: Mapping[str, ClockSample] = field(default_factory=dict)
    ports: tuple[PortProbe, ...] | None = None
    ssh: tuple[SshProbe, ...] | None = None
    links: tuple[LinkProbe, ...] | None = None
    smoke: SmokeOutcome | None = None

    @property
    def reachable(self) -> tuple[str, ...]:
        return tuple(h for h in self.hosts if h in self.facts)

    def env_of(self, host: str) -> Mapping[str, str]:
        if host in self.env:
            return self.env[host]
        return self.facts.get(host, {}).get("env") or {}

    def to_json(self) -> dict[str, Any]:
        def many(items: tuple | None) -> list | None:
            return None if items is None else [asdict(i) for i in items]

        return {
            "hosts": list(self.hosts), "facts": dict(self.facts), "slots": dict(self.slots),
            "env": {h: dict(e) for h, e in self.env.items()}, "addresses": dict(self.addresses),
            "unreachable": dict(self.unreachable), "unreachable_hints": dict(self.unreachable_hints),
            "clock": {h: asdict(c) for h, c in self.clock.items()},
            "ports": many(self.ports), "ssh": many(self.ssh), "links": many(self.links),
            "smoke": None if self.smoke is None else asdict(self.smoke),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Evidence:
        def many(kind: type, items: list | None) -> tuple | None:
            return None if items is None else tuple(kind(**i) for i in items)

        smoke = data.get("smoke")
        if smoke is not None:
            smoke = SmokeOutcome(**{**smoke, "peers": tuple(smoke.get("peers", ())),
                                    "tail": tuple(smoke.get("tail", ()))})
        return cls(
            hosts=tuple(data["hosts"]), facts=data.get("facts", {}), slots=data.get("slots", {}),
            env=data.get("env", {}), addresses=data.get("addresses", {}),
            unreachable=data.get("unreachable", {}),
            unreachable_hints=data.get("unreachable_hints", {}),
            clock={h: ClockSample(**c) for h, c in (data.get("clock") or {}).items()},
            ports=many(PortProbe, data.get("ports")), ssh=many(SshProbe, data.get("ssh")),
            links=many(LinkProbe, data.get("links")), smoke=smoke,
        )


Check = Callable[[Evidence], list[Finding]]


# ---------------------------------------------------------------------------
# helpers shared by the checks


def group_hosts(values: Mapping[str, Hashable]) -> list[tuple[Hashable, HostSet]]:
    """Hosts grouped by value, largest group first (ties: first seen first)."""
    groups: dict[Hashable, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    ordered = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    return [(value, HostSet.of(hosts)) for value, hosts in ordered]


def describe_groups(groups: list[tuple[Hashable, HostSet]], show: Callable[[Any], str]) -> str:
    """``node[1-3]: torch 2.4.0 / node4: torch 2.3.1``."""
    return " / ".join(f"{hosts}: {show(value)}" for value, hosts in groups)


def odd_ones(groups: list[tuple[Hashable, HostSet]]) -> HostSet:
    """Hosts outside the largest group; every host when the largest is not a majority."""
    if len(groups) < 2:
        return HostSet()
    if len(groups[0][1]) == len(groups[1][1]):
        return HostSet.of(h for _, hosts in groups for h in hosts)
    return HostSet.of(h for _, hosts in groups[1:] for h in hosts)


def hosts_of(names: Iterable[str]) -> HostSet:
    return HostSet.of(names)


def ipv4_interfaces(facts: Mapping[str, Any]) -> list[tuple[dict, ipaddress.IPv4Interface]]:
    """``(interface, 10.0.0.2/24)`` for every IPv4 address of a node."""
    out = []
    for iface in facts.get("interfaces") or []:
        for text in iface.get("addresses") or []:
            try:
                addr = ipaddress.ip_interface(text)
            except ValueError:
                continue
            if isinstance(addr, ipaddress.IPv4Interface):
                out.append((iface, addr))
    return out


def version_tuple(text: str | None) -> tuple[int, ...]:
    """``"12.4"`` -> ``(12, 4)``; ``"2.4.0+cu121"`` -> ``(2, 4, 0)``; junk -> ``()``."""
    out: list[int] = []
    for part in (text or "").split("+", 1)[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_bps(bps: float | None) -> str:
    if bps is None:
        return "unknown"
    if bps >= 1e9:
        return f"{bps / 1e9:.2f} Gbit/s"
    return f"{bps / 1e6:.0f} Mbit/s"
