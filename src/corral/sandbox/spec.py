"""What a sandbox *is*: its parameters, its names and its addresses.

Everything here is pure (no system calls), so the naming rules that keep
several sandboxes apart on one machine can be tested without root:

- the instance ``name`` picks the state directory, the namespaces
  (``corral_<name>_<node>``), a short ``tag`` for interface names (Linux
  allows 15 characters) and, by default, a /24 derived from a hash of the name;
- the node ``prefix`` picks the node names (``node1``..``nodeN``), which are
  also their hostnames and their names in ``/etc/hosts``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from corral.errors import UsageError

DEFAULT_NAME = "sandbox"
DEFAULT_PREFIX = "node"
DEFAULT_SLOTS = 2
DEFAULT_PASSWORD = "corral"
TEST_USER = "corral"
EXTRA_NICS = ("fast", "decoy")
#: The docker0 address every node gets with ``--extra-nic decoy``: the same on
#: every node, so it is useless (and misleading) for traffic between nodes.
DECOY_ADDRESS = "172.17.0.1/16"
#: Default subnets are carved from this block: private, and rarely used by
#: docker (172.17/16), libvirt (192.168.122/24) or cloud VPCs (10.0/16).
SUBNET_POOL = ipaddress.ip_network("10.200.0.0/13")
#: Tried, in order, when a route covers all of ``SUBNET_POOL`` (a VPN's 10/8).
SPARE_POOLS = (ipaddress.ip_network("172.30.0.0/15"), ipaddress.ip_network("192.168.192.0/18"))
#: Node ``i`` (1-based) gets host address ``FIRST_NODE_HOST + i`` of its
#: subnet, so node1 is ``.11``: easy to read, and .2-.10 stay free.
FIRST_NODE_HOST = 10
#: 256 nodes (2,048 GPUs at 8 a node) and room above: a sandbox of more than
#: ``NODES_PER_24`` nodes gets a /23, a bridge holds 1,024 ports.
MAX_NODES = 500
NODES_PER_24 = 240
#: Subnet of a spec whose subnet is still to be picked.
PLACEHOLDER_SUBNET = "0.0.0.0/32"

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9-]{0,20}$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def default_name() -> str:
    """``$CORRAL_SANDBOX`` or ``sandbox``."""
    return os.environ.get("CORRAL_SANDBOX") or DEFAULT_NAME


def default_state_dir(name: str) -> Path:
    """``$CORRAL_SANDBOX_DIR`` or ``~/.local/state/corral/sandbox/<name>``."""
    env = os.environ.get("CORRAL_SANDBOX_DIR")
    if env:
        return Path(env).expanduser()
    return state_base() / name


def state_base() -> Path:
    """The directory that holds every sandbox's default state directory."""
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "corral" / "sandbox"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise UsageError(
            f"--name {name!r}: a sandbox name is 1-31 characters of a-z, 0-9 and '-', "
            "starting with a letter or digit",
            hint="for example: --name rehearsal",
        )
    return name


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix):
        raise UsageError(
            f"--prefix {prefix!r}: node names become hostnames, so the prefix is 1-21 "
            "characters of a-z, 0-9 and '-', starting with a letter",
            hint="for example: --prefix gpu (nodes gpu1, gpu2, ...)",
        )
    return prefix


def parse_rate(text: str, *, flag: str = "--rate") -> int:
    """``"200mbit"`` -> 200_000_000 bits per second.

    Only tc's *bit* units are accepted: in tc, ``mbps`` means megabytes per
    second, a factor-8 trap we refuse rather than guess.
    """
    match = _RATE_RE.match(text)
    if not match:
        raise UsageError(
            f"{flag} {text!r}: expected a number with a unit bit, kbit, mbit, gbit or tbit",
            hint="for example: --rate 200mbit or --rate 1gbit (tc's 'mbps' means megaBYTES/s)",
        )
    bps = int(float(match.group(1)) * _RATE_UNITS[match.group(2).lower()])
    if bps < 8000:
        raise UsageError(f"{flag} {text!r}: rates below 8kbit cannot carry SSH", hint="use e.g. 1mbit")
    return bps


def format_rate(bps: int | None) -> str:
    """Inverse of ``parse_rate`` for display: 200000000 -> ``200mbit``."""
    if bps is None:
        return "unlimited"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _RATE_UNITS[unit]
        if bps >= scale and bps % scale == 0:
            return f"{bps // scale}{unit}"
    return f"{bps}bit"


def check_extra_nics(values: Iterable[str] | str | None) -> tuple[str, ...]:
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        if value not in EXTRA_NICS:
            raise UsageError(
                f"--extra-nic {value!r}: expected one of {', '.join(EXTRA_NICS)}",
                hint="fast: a second, unshaped network on eth1; decoy: a docker0-like "
                "172.17.0.1/16 on every node",
            )
        if value not in out:
            out.append(value)
    return tuple(sorted(out))


def tag_for(name: str) -> str:
    """A short, stable tag for interface names: ``cs`` + 6 hex digits of the name's hash."""
    return "cs" + hashlib.sha256(name.encode()).hexdigest()[:6]


def netns_prefix(name: str) -> str:
    """Every namespace of sandbox ``name`` starts with this (names cannot contain '_')."""
    return f"corral_{name}_"


def subnet_prefix(nodes: int) -> int:
    """24 (a /24) up to ``NODES_PER_24`` nodes, 23 above."""
    return 24 if nodes <= NODES_PER_24 else 23


def subnet_candidates(seed: str, nodes: int = 1) -> Iterable[ipaddress.IPv4Network]:
    """The subnets (/24, or /23 for a large sandbox) of ``SUBNET_POOL`` in an
    order that starts at a hash of ``seed``.

    Distinct names usually land on distinct subnets without coordination; a
    collision with a route in use is resolved by taking the next one.
    """
    digest = int(hashlib.sha256(seed.encode()).hexdigest(), 16)
    for pool in (SUBNET_POOL, *SPARE_POOLS):
        subnets = list(pool.subnets(new_prefix=subnet_prefix(nodes)))
        start = digest % len(subnets)
        for i in range(len(subnets)):
            yield subnets[(start + i) % len(subnets)]


def pick_subnet(
    seed: str, in_use: Iterable[ipaddress.IPv4Network], nodes: int = 1
) -> ipaddress.IPv4Network:
    """The first candidate subnet for ``seed`` (and ``nodes``) that overlaps nothing in ``in_use``."""
    used = list(in_use)
    for net in subnet_candidates(seed, nodes):
        if not any(net.overlaps(other) for other in used):
            return net
    raise UsageError(
        f"every /{subnet_prefix(nodes)} of {', '.join(str(p) for p in (SUBNET_POOL, *SPARE_POOLS))} overlaps "
        "a route on this machine",
        hint="pass a free subnet with --subnet, e.g. --subnet 192.168.77.0/24",
    )


def parse_subnet(text: str, nodes: int) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as err:
        raise UsageError(f"--subnet {text!r}: {err}", hint="for example: --subnet 10.77.0.0/24") from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise UsageError(f"--subnet {text!r}: only IPv4 subnets are supported")
    if net.num_addresses < FIRST_NODE_HOST + nodes + 2:
        raise UsageError(
            f"--subnet {text!r} is too small for {nodes} nodes (node addresses start at "
            f".{FIRST_NODE_HOST + 1})",
            hint=f"use a /{subnet_prefix(nodes)} or larger",
        )
    return net


@dataclass(frozen=True, kw_only=True)
class NodeNames:
    """The names one node goes by, on the head and inside the node."""

    index: int
    #: Node and host name (``node1``).
    name: str
    #: ``ip netns`` name.
    netns: str
    #: Head-side end of the eth0 veth pair (shaped, and set down by ``partition``).
    veth: str
    #: Head-side end of the eth1 veth pair (``--extra-nic fast``).
    fast_veth: str


@dataclass(frozen=True, kw_only=True)
class SandboxSpec:
    """The parameters of ``up``; stored in the state file and compared on re-``up``."""

    name: str
    prefix: str = DEFAULT_PREFIX
    nodes: int
    ssh_port: int = 22
    with_keys: bool = False
    password_auth: bool = False
    extra_nics: tuple[str, ...] = ()
    #: Link rate in bits/s for every node, ``None`` for unshaped.
    rate: int | None = None
    slots: int = DEFAULT_SLOTS
    subnet: str
    #: Subnet of the second network (``--extra-nic fast``), else ``None``.
    fast_subnet: str | None = None

    #: Fields that cannot change on a running sandbox (re-``up`` must match).
    IDENTITY = ("prefix", "nodes", "ssh_port", "with_keys", "password_auth", "extra_nics", "subnet")

    @property
    def tag(self) -> str:
        return tag_for(self.name)

    @property
    def bridge(self) -> str:
        return self.tag + "b0"

    @property
    def fast_bridge(self) -> str:
        return self.tag + "b1"

    def node(self, index: int) -> NodeNames:
        name = f"{self.prefix}{index}"
        return NodeNames(
            index=index,
            name=name,
            netns=netns_prefix(self.name) + name,
            veth=f"{self.tag}e{index}",
            fast_veth=f"{self.tag}f{index}",
        )

    def all_nodes(self) -> list[NodeNames]:
        return [self.node(i) for i in range(1, self.nodes + 1)]

    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet)

    def head_address(self) -> str:
        return str(self.network()[1])

    def address(self, index: int) -> str:
        return str(self.network()[FIRST_NODE_HOST + index])

    def fast_address(self, index: int) -> str | None:
        if self.fast_subnet is None:
            return None
        return str(ipaddress.IPv4Network(self.fast_subnet)[FIRST_NODE_HOST + index])

    def prefixlen(self) -> int:
        return self.network().prefixlen

    @property
    def login_user(self) -> str:
        """Who the generated cluster files log in as: root with ``--with-keys``;
        the password test user with ``--password-auth`` alone (the only account
        a first contact can reach)."""
        return TEST_USER if self.password_auth and not self.with_keys else "root"

    def differences(self, other: SandboxSpec) -> list[str]:
        """Identity fields where ``other`` (a new request) differs from this one."""
        return [
            f"{key}: running {getattr(self, key)!r}, asked {getattr(other, key)!r}"
            for key in self.IDENTITY
            if getattr(self, key) != getattr(other, key)
        ]


def check_nodes(n: int) -> int:
    if not 1 <= n <= MAX_NODES:
        raise UsageError(
            f"N={n}: a sandbox has 1 to {MAX_NODES} nodes",
            hint="for example: corral sandbox up 4",
        )
    return n


def check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise UsageError(f"--ssh-port {port}: expected 1-65535", hint="22 (default) or e.g. 2222")
    return port


class Unshaped:
    """Marker for "no rate limit, explicitly" (``--rate off``), unlike "not asked"."""

    def __repr__(self) -> str:
        return "UNSHAPED"


UNSHAPED = Unshaped()


@dataclass(frozen=True, kw_only=True)
class UpRequest:
    """What one ``up`` asked for; ``None`` fields mean "as running, or the default"."""

    nodes: int | None = None
    prefix: str | None = None
    rate: int | Unshaped | None = None
    ssh_port: int | None = None
    with_keys: bool | None = None
    password_auth: bool | None = None
    extra_nics: tuple[str, ...] | None = None
    slots: int | None = None
    subnet: str | None = None

    def resolve(self, name: str, running: SandboxSpec | None) -> SandboxSpec:
        """The spec to converge to: asked values over running ones over defaults.

        The subnet of a new sandbox without ``--subnet`` is left as a
        placeholder; ``up`` picks a free one under the machine-wide lock.
        """
        if self.nodes is not None:
            check_nodes(self.nodes)
        if self.ssh_port is not None:
            check_port(self.ssh_port)
        if self.slots is not None and self.slots < 1:
            raise UsageError(f"--slots {self.slots}: expected a positive number of processes per node")
        base = running or SandboxSpec(name=name, nodes=self.nodes or 1, subnet=PLACEHOLDER_SUBNET)
        nodes = self.nodes if self.nodes is not None else base.nodes
        subnet = base.subnet
        if self.subnet is not None:
            subnet = str(parse_subnet(self.subnet, nodes))
        rate = base.rate if self.rate is None else (None if self.rate is UNSHAPED else self.rate)

        def pick(value, current):  # type: ignore[no-untyped-def]
            return current if value is None else value

        return SandboxSpec(
            name=name,
            prefix=pick(self.prefix, base.prefix),
            nodes=nodes,
            ssh_port=pick(self.ssh_port, base.ssh_port),
            with_keys=pick(self.with_keys, base.with_keys),
            password_auth=pick(self.password_auth, base.password_auth),
            extra_nics=pick(self.extra_nics, base.extra_nics),
            rate=rate,  # type: ignore[arg-type]
            slots=pick(self.slots, base.slots),
            subnet=subnet,
            fast_subnet=base.fast_subnet,
        )
