"""What ``corral sandbox status`` reports, as data (the CLI renders it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from corral.sandbox.spec import format_rate


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    name: str
    address: str
    #: eth1 address with ``--extra-nic fast``.
    fast_address: str | None = None
    netns: str
    #: ``running`` (init alive), ``stopped`` (``stop``, or crashed) or ``missing``
    #: (no namespace: a half-built or half-removed sandbox).
    state: str
    #: ``up``, ``down`` (``partition``) or ``missing``.
    link: str
    #: Link rate in bits/s; ``None`` is unshaped.
    rate: int | None = None
    #: Processes in the node (its init, sshd, sessions, workloads...).
    processes: int = 0
    #: The node init's pid on the head (what ``exec`` enters), when running.
    init_pid: int | None = None

    @property
    def ok(self) -> bool:
        return self.state == "running" and self.link == "up"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["rate_text"] = format_rate(self.rate)
        return data


@dataclass(frozen=True, kw_only=True)
class SandboxStatus:
    name: str
    state_dir: str
    #: False when there is no sandbox of this name (nothing else is filled in).
    exists: bool
    nodes: tuple[NodeStatus, ...] = ()
    subnet: str | None = None
    fast_subnet: str | None = None
    head_address: str | None = None
    ssh_port: int | None = None
    with_keys: bool = False
    password_auth: bool = False
    #: Login of the password test user (``--password-auth``).
    test_user: str | None = None
    #: Its password when it is the documented default; ``None`` when chosen with --password.
    test_password: str | None = None
    extra_nics: tuple[str, ...] = ()
    slots: int | None = None
    #: Paths of the files ``up`` writes: cluster_file, hostfile, ssh_config, known_hosts, identity_file.
    files: dict[str, str] = field(default_factory=dict)
    #: Directories private to each node, and what is shared with the head.
    private_dirs: tuple[str, ...] = ()

    @property
    def up(self) -> bool:
        """Every node running and connected."""
        return self.exists and bool(self.nodes) and all(n.ok for n in self.nodes)

    def node(self, name: str) -> NodeStatus:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["nodes"] = [n.to_dict() for n in self.nodes]
        data["up"] = self.up
        data["extra_nics"] = list(self.extra_nics)
        data["private_dirs"] = list(self.private_dirs)
        return data
