"""The typed cluster model every other layer works on.

Readers in ``corral.inventory`` turn what users already have (hostfiles,
``-H`` lists, Slurm variables, ssh aliases, ``corral.toml``) into a
``Cluster``; the planner, the transports and the checks only ever see these
frozen objects, so there is one place that says what a host *is*.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from corral.names import is_address, is_user_name

#: Default interpreter used to run the node agent when a host does not name one.
DEFAULT_PYTHON = "python3"


#: GPU indices go up to this (a bound on what a list like ``0-99999999`` expands to).
MAX_GPUS = 1024


def parse_gpus(text: str) -> tuple[int, ...]:
    """``"0-3"``, ``"4,5"``, ``"0-1,6"``: GPU indices as nvidia-smi numbers
    them, in the order given (CUDA_VISIBLE_DEVICES's order: local rank i runs
    on the i-th).  ``ValueError`` says what is wrong with the text."""
    out: list[int] = []
    for item in str(text).split(","):
        item = item.strip()
        low, dash, high = item.partition("-")
        if not low.strip().isdigit() or (dash and not high.strip().isdigit()):
            raise ValueError(f"{item!r} is not a GPU index or a range like 0-3")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{item!r} counts down (write {last}-{first})")
        if last >= MAX_GPUS:
            raise ValueError(f"GPU {last} is past the largest index corral accepts ({MAX_GPUS - 1})")
        for g in range(first, last + 1):
            if g in out:
                raise ValueError(f"GPU {g} is listed twice")
            out.append(g)
    return tuple(out)


def format_gpus(gpus: tuple[int, ...]) -> str:
    """The CUDA_VISIBLE_DEVICES value for ``gpus``: ``0,1,2,3``."""
    return ",".join(str(g) for g in gpus)


@dataclass(frozen=True, kw_only=True)
class Host:
    """One machine of a cluster.

    ``name`` is how the user refers to the host (a hostfile token, an ssh
    alias, a Slurm node name); it is what reports print and what ``ssh`` is
    given, so the user's ``~/.ssh/config`` applies.  ``address`` is the
    resolved network address when known (from ``ssh -G`` or the cluster
    file); it is informational for ssh and used for the rendezvous address.
    """

    name: str
    #: Resolved address (IP or DNS name) if known; ``None`` means "same as name".
    address: str | None = None
    #: SSH port; ``None`` leaves it to ssh_config (default 22).
    port: int | None = None
    #: SSH login user; ``None`` leaves it to ssh_config.
    user: str | None = None
    #: Processes to start on this host; ``None`` means "one per GPU, detected".
    slots: int | None = None
    #: Free-form tags from the cluster file (``labels = ["a100"]``).
    labels: tuple[str, ...] = ()
    #: Interpreter that runs the node agent (and, by default, the workload).
    python: str = DEFAULT_PYTHON
    #: Extra environment for processes on this host only (``NCCL_SOCKET_IFNAME``...).
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: Working directory on this host; ``None`` means the cluster's / the caller's.
    workdir: str | None = None
    #: True for "this machine": reached through the local transport, not ssh.
    local: bool = False
    #: Extra ``ssh -o`` options for this host only, as ``Key=Value`` strings.
    ssh_options: tuple[str, ...] = ()
    #: The GPUs (nvidia-smi indices) jobs use on this host (``gpus = "0-3"``);
    #: ``None`` means all of them.
    gpus: tuple[int, ...] | None = None
    #: A spare (``spare = true`` in corral.toml): not used when a run starts;
    #: it replaces a node lost during the run (``--max-restarts``, docs/run.md).
    spare: bool = False

    def __post_init__(self) -> None:
        # The readers raise InventoryError with file and line first; this
        # guards library users: a name like "-oProxyCommand=..." would be read
        # by ssh as an option, "*" or a newline as ssh_config syntax.
        problem = self._problem()
        if problem:
            raise ValueError(f"host {self.name[:80]!r}: {problem}")

    def _problem(self) -> str | None:
        if not self.local and not is_address(self.name):
            return "not a host name, ssh alias or IP address"
        if self.address is not None and not is_address(self.address):
            return f"address {self.address[:80]!r} is not a host name or IP address"
        if self.user is not None and not is_user_name(self.user):
            return f"user {self.user[:80]!r} is not a valid user name"
        if self.port is not None and not (isinstance(self.port, int) and 1 <= self.port <= 65535):
            return f"port {self.port!r} is not between 1 and 65535"
        if self.slots is not None and not (isinstance(self.slots, int) and self.slots > 0):
            return f"slots {self.slots!r} is not a positive integer"
        if self.gpus is not None and (not self.gpus or len(set(self.gpus)) != len(self.gpus)
                                      or not all(isinstance(g, int) and 0 <= g < MAX_GPUS for g in self.gpus)):
            return f"gpus {self.gpus!r} is not a list of distinct GPU indices"
        return None

    @property
    def connect_address(self) -> str:
        """What the network layer should dial: the address, else the name."""
        return self.address or self.name

    def with_(self, **changes: object) -> "Host":
        """Return a copy with ``changes`` applied (hosts are immutable)."""
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """An ordered set of hosts plus cluster-wide defaults.

    Host order is meaningful: node rank ``i`` runs on ``hosts[i]`` and the
    first host hosts the rendezvous.
    """

    hosts: tuple[Host, ...]
    #: Human description of where this came from, e.g. ``hostfile ./hosts:1``.
    source: str = ""
    #: Optional cluster name (``[cluster] name`` in corral.toml, sandbox name).
    name: str | None = None
    #: Environment applied on every host (host ``env`` wins over it).
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: Cluster-wide working directory (host ``workdir`` wins over it).
    workdir: str | None = None
    #: Extra ``ssh -o`` options for every host, as ``Key=Value`` strings.
    ssh_options: tuple[str, ...] = ()
    #: An ssh_config file to use instead of ~/.ssh/config (``ssh -F``), if any.
    ssh_config: str | None = None
    #: Path of the cluster file this came from, when there is one (for --fix-env).
    path: str | None = None
    #: How nodes are reached: ``"ssh"``, or ``"srun"`` for the nodes of the
    #: Slurm allocation corral runs in (``corral.transport.srun``).
    transport: str = "ssh"

    def __post_init__(self) -> None:
        if not self.hosts:
            # Readers raise InventoryError with file/line before this; this
            # guards library users building clusters by hand.
            raise ValueError("a cluster needs at least one host")

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @property
    def is_local(self) -> bool:
        """True when every host is this machine (the default cluster)."""
        return all(h.local for h in self.hosts)

    @property
    def spares(self) -> tuple[Host, ...]:
        """Hosts held back to replace a lost node, in file order."""
        return tuple(h for h in self.hosts if h.spare)

    def without_spares(self) -> "Cluster":
        """The hosts a run starts on (every host when none is a spare)."""
        if not self.spares:
            return self
        return replace(self, hosts=tuple(h for h in self.hosts if not h.spare))

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def env_for(self, host: Host) -> dict[str, str]:
        """Cluster env overlaid with the host's own env."""
        merged = dict(self.env)
        merged.update(host.env)
        return merged

    def workdir_for(self, host: Host) -> str | None:
        return host.workdir or self.workdir
