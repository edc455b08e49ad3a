"""``Sandbox``: one named simulated cluster on this machine.

``up`` converges (re-running it restarts stopped nodes, heals partitioned
links and restores the configured rate), ``down`` removes every namespace,
interface, process, /etc/hosts line and file the sandbox made, even after a
crashed ``up``.  Both take a lock in the state directory, so two ``up`` of the
same sandbox never interleave; a machine-wide lock on /etc/hosts keeps two
*different* sandboxes from picking the same subnet.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import pwd
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

from corral.errors import SandboxError, UsageError
from corral.model import Cluster, Host
from corral.sandbox import access, files, netns, preflight
from corral.sandbox import node as nodes_mod
from corral.sandbox import slurm as slurm_mod
from corral.sandbox import spec as specs
from corral.sandbox.files import STATE_FILE
from corral.sandbox.ops import UNLIMITED, NodeOps
from corral.sandbox.slurm import SlurmOps
from corral.sandbox.spec import NodeNames, SandboxSpec
from corral.sandbox.status import NodeStatus, SandboxStatus
from corral.sandbox.teardown import OWNED, TeardownOps

log = logging.getLogger(__name__)

STATE_VERSION = 1
#: Where the node-private directories appear inside a node (/etc: the head's,
#: with the node's own hosts, passwd, shadow, group and changes on top).
PRIVATE_DIRS = ("~/.ssh", "/tmp", "/var/tmp", "/srv", "/home", "/dev/shm", "/run", "/etc")


class Sandbox(NodeOps, TeardownOps, SlurmOps):
    """A simulated multi-node cluster: one network/PID/mount/UTS namespace and
    one real sshd per node, on a bridge of its own.

    ``Sandbox(name=None)`` uses ``$CORRAL_SANDBOX`` or ``sandbox``; its state
    lives in ``state_dir`` (default ``~/.local/state/corral/sandbox/<name>``).
    ``prefix`` names the nodes of a new sandbox (an existing one keeps its own).
    """

    def __init__(self, name: str | None = None, *, state_dir: str | os.PathLike | None = None,
                 prefix: str | None = None):
        self.name = specs.check_name(name or specs.default_name())
        self._explicit_dir = bool(state_dir or os.environ.get("CORRAL_SANDBOX_DIR"))
        where = Path(state_dir).expanduser() if state_dir else specs.default_state_dir(self.name)
        if not self._explicit_dir and not os.path.exists(where / STATE_FILE):
            # Started elsewhere (by root --for this user, or with --state-dir): its
            # /etc/hosts block says where.
            where = files.recorded_state_dir(self.name) or where
        self.state_dir = where.absolute()
        self.prefix = specs.check_prefix(prefix) if prefix else None

    def __repr__(self) -> str:
        return f"Sandbox(name={self.name!r}, state_dir='{self.state_dir}')"

    # -- paths and facts (from the state file) ---------------------------------

    @property
    def cluster_file(self) -> Path:
        return self.state_dir / "corral.toml"

    @property
    def hostfile(self) -> Path:
        return self.state_dir / "hostfile"

    @property
    def ssh_config(self) -> Path:
        return self.state_dir / "ssh_config"

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def identity_file(self) -> Path:
        return self.state_dir / "id_ed25519"

    @property
    def spec(self) -> SandboxSpec:
        """The running sandbox's parameters; ``SandboxError`` when it is not up."""
        state = self._load()
        if state is None or "spec" not in state:
            raise SandboxError(
                f"sandbox {self.name!r} is not up (no {self.state_dir / STATE_FILE})",
                hint=f"corral sandbox up 4{'' if self.name == specs.DEFAULT_NAME else ' --name ' + self.name}",
            )
        return state_spec(state)

    @property
    def nodes(self) -> list[str]:
        return [n.name for n in self.spec.all_nodes()]

    @property
    def addresses(self) -> dict[str, str]:
        sp = self.spec
        return {n.name: sp.address(n.index) for n in sp.all_nodes()}

    @property
    def head_address(self) -> str:
        return self.spec.head_address()

    def node_dir(self, node: str) -> Path:
        return self.state_dir / "nodes" / node

    def cluster(self) -> Cluster:
        """The sandbox as a ``corral.model.Cluster`` (what reading corral.toml gives)."""
        sp = self.spec
        state = self._load() or {}
        return Cluster(
            hosts=tuple(
                Host(name=n.name, address=sp.address(n.index), port=sp.ssh_port, user=sp.login_user,
                     slots=sp.slots, python=state.get("python", sys.executable))
                for n in sp.all_nodes()
            ),
            source=f"sandbox {self.name} ({self.cluster_file})",
            name=self.name,
            ssh_options=tuple(files.ssh_options(sp, self.state_dir)),
            path=str(self.cluster_file),
        )

    # -- up --------------------------------------------------------------------

    def up(
        self,
        n: int | None = None,
        *,
        rate: str | int | None = None,
        ssh_port: int | None = None,
        with_keys: bool | None = None,
        password_auth: bool | None = None,
        password: str | None = None,
        extra_nic: str | Sequence[str] | None = None,
        slots: int | None = None,
        subnet: str | None = None,
        share: Sequence[str] | None = None,
        for_user: str | None = None,
        slurm: bool | None = None,
    ) -> SandboxStatus:
        """Bring up ``n`` nodes, or converge a running sandbox back to its settings.

        An argument left at ``None`` means "as the running sandbox has it" (or
        the default, for a new one), so ``up()`` alone repairs a sandbox:
        stopped nodes start, partitioned links heal, ``slow`` rates reset.
        Asking a running sandbox for a different node count, port, keys,
        password auth, NICs or subnet is refused (``down`` first).  ``rate``
        is ``"200mbit"``, bits/s, or ``"off"``; it and ``slots`` may change.
        ``share``: head directories under /tmp, /var/tmp or /srv to mount
        through into every node (an NFS-mounted project); the rest of those
        stays private to each node.  ``for_user``: a login that may use the
        sandbox without root (``--for``; see ``corral.sandbox.access``).
        ``slurm``: also run a Slurm cluster on it (munge, slurmctld on the
        head, one slurmd per node; ``corral.sandbox.slurm``); a running
        sandbox keeps it once started.
        """
        request = specs.UpRequest(
            nodes=n, rate=_rate(rate), ssh_port=ssh_port, with_keys=with_keys,
            password_auth=password_auth, extra_nics=None if extra_nic is None else specs.check_extra_nics(extra_nic),
            slots=slots, subnet=subnet, prefix=self.prefix,
        )
        if n is None and not (self.state_dir / STATE_FILE).exists():
            raise UsageError(
                f"sandbox {self.name!r} is not up: `corral sandbox up N` creates one of N nodes",
                hint=f"corral sandbox up 4 --with-keys{_name_flag(self.name)}",
            )
        tools = preflight.check()
        if slurm:
            slurm_mod.check_tools()
        python, private_home, shares = nodes_mod.python_layout(share or ())
        owner = access.user(for_user) if for_user else None
        if owner is not None:
            if not self._explicit_dir and not os.path.exists(self.state_dir / STATE_FILE):
                self.state_dir = access.shared_state_dir(self.name)
            access.check_reachable(self.state_dir, owner)
        self._claim_state_dir()
        with self._lock():
            state = self._load()
            if state is not None and "spec" in state:
                running = state_spec(state)
                sp = request.resolve(self.name, running)
                diffs = running.differences(sp)
                if share is not None and shares != state.get("shares", []):
                    diffs.append(f"shares: running {state.get('shares', [])!r}, asked {shares!r}")
                if diffs:
                    raise SandboxError(
                        f"sandbox {self.name!r} is already up with other settings ({'; '.join(diffs)})",
                        hint=f"corral sandbox down{_name_flag(self.name)} first, or use another --name",
                    )
                state["rates"] = {}
            else:
                if n is None:
                    raise UsageError(f"sandbox {self.name!r} is not up: `corral sandbox up N` creates one",
                                     hint=f"corral sandbox up 4 --with-keys{_name_flag(self.name)}")
                self._teardown(leftovers=True)  # leftovers of a crashed up without state
                sp = request.resolve(self.name, None)
                state = {"version": STATE_VERSION, "python": python, "private_home": private_home,
                         "shares": shares, "created": time.time(), "rates": {}}
            if owner is not None:
                state["for_user"] = owner.pw_name
            if password is not None and not sp.password_auth:
                raise UsageError("--password only makes sense with --password-auth",
                                 hint="corral sandbox up 4 --password-auth --password SECRET")
            sp = self._network_and_names(sp, state, explicit_subnet=subnet is not None)
            self._prepare_files(sp, state, password)
            raised = netns.ensure_packet_backlog(sp.nodes)
            if raised:
                log.warning("raised net.core.netdev_max_backlog from %d to %d for %d nodes: their virtual links "
                            "share this machine's packet queue, and a full one stalls connections (a lost node "
                            "that is not down); machine-wide, until reboot or `sysctl -w "
                            "net.core.netdev_max_backlog=%d`", raised[0], raised[1], sp.nodes, raised[0])
            raised = netns.ensure_neighbour_table(sp.nodes)
            if raised:
                log.warning("raised the ARP table's limit (net.ipv4.neigh.default.gc_thresh3) from %d to %d for "
                            "%d nodes: every node's entries share this machine's table, and a full one drops "
                            "connections between nodes; machine-wide, until reboot", raised[0], raised[1],
                            sp.nodes)
            self._ensure_network(sp)
            self._start_nodes(sp, state, tools)
            self._check_mesh(sp)
            self._write_head_files(sp, state)
            if slurm or state.get("slurm"):
                self.slurm_up(sp, state)
            if state.get("for_user"):
                access.grant(self.state_dir, access.user(state["for_user"]))
        return self.status()

    def _claim_state_dir(self) -> None:
        """Create the state dir, refusing one that holds anything but a sandbox."""
        if self.state_dir.exists():
            foreign = sorted(set(os.listdir(self.state_dir)) - OWNED - {STATE_FILE + ".tmp"})
            if foreign and not (self.state_dir / STATE_FILE).exists():
                raise SandboxError(
                    f"--state-dir {self.state_dir}: not empty and not a sandbox's state directory "
                    f"(holds {', '.join(foreign[:3])}{'...' if len(foreign) > 3 else ''})",
                    hint="point --state-dir at a new or empty directory; `down` deletes it",
                )
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)

    def _network_and_names(self, sp: SandboxSpec, state: dict, *, explicit_subnet: bool) -> SandboxSpec:
        """Under the machine-wide lock: pick free subnets, claim node names, make bridges."""
        with files.locked_etc_hosts() as (text, write):
            if "spec" not in state:
                ours = {sp.bridge, sp.fast_bridge}
                in_use = netns.networks_in_use(ignore_links=ours)
                if explicit_subnet:
                    clash = [str(x) for x in in_use if x.overlaps(sp.network())]
                    if clash:
                        raise SandboxError(f"--subnet {sp.subnet} overlaps {clash[0]}, in use on this machine",
                                           hint="pick another --subnet, or leave it out to get a free one")
                else:
                    sp = replace(sp, subnet=str(specs.pick_subnet(self.name, in_use, sp.nodes)))
                if "fast" in sp.extra_nics:
                    fast = specs.pick_subnet(self.name + ":fast", in_use + [sp.network()], sp.nodes)
                    sp = replace(sp, fast_subnet=str(fast))
            room = sp.network().num_addresses - specs.FIRST_NODE_HOST - 2
            if sp.nodes > room:  # a running sandbox grown past its subnet
                raise SandboxError(f"sandbox {self.name!r} has room for {room} nodes on {sp.subnet}, "
                                   f"not {sp.nodes}",
                                   hint=f"`corral sandbox down --name {self.name}` first: a new one gets a "
                                        "subnet large enough")
            claimed = files.names_claimed(text, exclude=self.name)
            taken = [f"{n.name} ({claimed[n.name]})" for n in sp.all_nodes() if n.name in claimed]
            if taken:
                raise SandboxError(
                    f"node name(s) already in use on this machine: {', '.join(taken[:4])}",
                    hint="choose another node name prefix with --prefix, e.g. --prefix sim",
                )
            state["spec"] = spec_dict(sp)
            self._save(state)
            self._ensure_bridges(sp)
            write(files.with_block(text, self.name, self._host_entries(sp), self.state_dir))
        return sp

    def _ensure_bridges(self, sp: SandboxSpec) -> None:
        present = netns.links()
        alias = f"corral-sandbox:{self.name}"
        lines: list[str] = []
        wanted = [(sp.bridge, sp.subnet)]
        if sp.fast_subnet:
            wanted.append((sp.fast_bridge, sp.fast_subnet))
        for bridge, subnet in wanted:
            entry = present.get(bridge)
            if entry is not None and entry.get("ifalias") not in (alias, None):
                raise SandboxError(
                    f"interface {bridge} belongs to {entry.get('ifalias')}, not to sandbox {self.name!r}",
                    hint="two sandbox names hash to the same tag; use another --name",
                )
            if entry is None:
                head = str(ipaddress.IPv4Network(subnet)[1])
                plen = subnet.split("/")[1]
                lines += [
                    f"link add {bridge} type bridge forward_delay 0 stp_state 0",
                    f"link set dev {bridge} alias {alias} up",
                    f"addr add {head}/{plen} dev {bridge}",
                ]
            elif not netns.link_is_up(entry):
                lines.append(f"link set dev {bridge} up")
        netns.ip_batch(lines)

    def _host_entries(self, sp: SandboxSpec) -> list[files.HostEntry]:
        return [files.HostEntry(address=sp.address(n.index), name=n.name) for n in sp.all_nodes()]

    def _prepare_files(self, sp: SandboxSpec, state: dict, password: str | None) -> None:
        base_hosts = files.strip_blocks(files.ETC_HOSTS.read_text())
        hosts_text = files.with_block(base_hosts, self.name, self._host_entries(sp))
        try:
            nsswitch = files.node_nsswitch(Path("/etc/nsswitch.conf").read_text())
        except FileNotFoundError:
            nsswitch = files.node_nsswitch(None)
        passwd, shadow, group = (Path(p).read_text() for p in ("/etc/passwd", "/etc/shadow", "/etc/group"))
        test_user = None
        if sp.password_auth:
            uid = state.setdefault("test_uid", files.free_uid(passwd, group))
            home = f"/home/{specs.TEST_USER}" if state["private_home"] else f"/srv/home/{specs.TEST_USER}"
            test_user = (uid, home)
            if password is not None or "test_password_hash" not in state:
                # Only the hash is kept (it is in every node's /etc/shadow anyway).
                state["test_password_hash"] = files.hash_password(password or specs.DEFAULT_PASSWORD)
                state["test_password_default"] = password in (None, specs.DEFAULT_PASSWORD)
            user_files = files.accounts(passwd, shadow, group,
                                        test_user=(uid, home, state["test_password_hash"]))
        else:
            user_files = files.accounts(passwd, shadow, group, test_user=None)
        accounts = nodes_mod.Accounts(passwd=user_files[0], shadow=user_files[1], group=user_files[2],
                                      test_user=test_user)
        key = None
        if sp.with_keys:
            files.generate_user_key(self.identity_file, f"corral-sandbox-{self.name}")
            key = Path(str(self.identity_file) + ".pub").read_text()
        for nn in sp.all_nodes():
            nodes_mod.prepare_dir(self.node_dir(nn.name), sp, nn, hosts_text=hosts_text,
                                  nsswitch_text=nsswitch, accounts=accounts, authorized_key=key,
                                  private_home=state["private_home"])
        files.generate_host_keys([self.node_dir(nn.name) for nn in sp.all_nodes()],
                                 [f"root@{nn.name}" for nn in sp.all_nodes()])
        nodes_mod.ensure_mountpoints(state["private_home"])
        self._save(state)

    def _ensure_network(self, sp: SandboxSpec) -> None:
        """Create each node's namespace and links, or bring existing ones back up."""
        present = netns.links()
        spaces = set(netns.netns_list())
        head: list[str] = []
        inside: dict[str, list[str]] = {}
        repair: dict[str, list[str]] = {}
        for nn in sp.all_nodes():
            if nn.netns in spaces and nn.veth in present:
                head.append(f"link set dev {nn.veth} up")  # heal a partition
                if sp.fast_subnet:
                    head.append(f"link set dev {nn.fast_veth} up")
                # Re-apply the inside half too (an up may have crashed between the two).
                repair[nn.netns] = nodes_mod.network_commands(sp, nn)[1]
                continue
            if nn.netns in spaces:  # half-built: start this node from scratch
                netns.empty_netns([nn.netns])
                netns.run(["ip", "netns", "del", nn.netns])
            for stale in (nn.veth, nn.fast_veth):
                if stale in present:
                    head.append(f"link del {stale}")
            h, i = nodes_mod.network_commands(sp, nn)
            head += h
            inside[nn.netns] = i
        netns.ip_batch(head)
        for ns, lines in inside.items():
            netns.ip_batch(lines, netns=ns)
        for ns, lines in repair.items():
            # Mostly "already exists": the result is checked by wait_ready's ssh probe.
            netns.ip_batch(lines, netns=ns, force=True)
        for nn in sp.all_nodes():
            if sp.rate is not None or nn.netns not in inside:
                self._shape(sp, nn, sp.rate)

    def _shape(self, sp: SandboxSpec, nn: NodeNames, bps: int | None) -> None:
        netns.shape(nn.veth, bps)
        netns.shape("eth0", bps, netns=nn.netns)

    def _start_nodes(self, sp: SandboxSpec, state: dict, tools: dict[str, str]) -> None:
        running = netns.pids_by_netns([nn.netns for nn in sp.all_nodes()])
        hide = [str(self.state_dir)]
        for base in (specs.state_base(), access.SHARED_BASE):  # other sandboxes' keys, too
            if base.is_dir() and str(base.absolute()) not in hide:
                hide.append(str(base.absolute()))
        home = pwd.getpwuid(0).pw_dir
        for nn in sp.all_nodes():
            if netns.find_init(running[nn.netns]) is not None:
                if nodes_mod.ssh_banner(sp.address(nn.index), sp.ssh_port, timeout=2.0):
                    continue
                log.info("%s: init running but sshd silent; restarting the node", nn.name)
            if running[nn.netns]:  # a node without a working init/sshd: clear it first
                netns.empty_netns([nn.netns])
            nodes_mod.start(tools=tools, python=state["python"], spec=sp, node=nn,
                            node_dir=self.node_dir(nn.name), home=home,
                            private_home=state["private_home"], hide=hide,
                            shares=state.get("shares", []))
        nodes_mod.wait_ready(sp, sp.all_nodes(), {nn.name: self.node_dir(nn.name) for nn in sp.all_nodes()})

    def _check_mesh(self, sp: SandboxSpec) -> None:
        """Node-to-node traffic crosses the bridge: prove it once (first -> last node).

        A host firewall can block bridged traffic (docker sets FORWARD to DROP
        and br_netfilter sends bridged packets through it); better to say so
        now than to let the first rendezvous hang.
        """
        if sp.nodes < 2:
            return
        first, last = sp.node(1), sp.node(sp.nodes)
        code = (f"import socket; socket.create_connection(({sp.address(last.index)!r}, "
                f"{sp.ssh_port}), 3).close()")
        proc = self.exec(first.name, [sys.executable, "-I", "-S", "-c", code], timeout=10)
        if proc.returncode != 0:
            raise SandboxError(
                f"{first.name} cannot reach {last.name} ({sp.address(last.index)}:{sp.ssh_port}) "
                "across the sandbox bridge, although the head reaches both",
                hint="a firewall filters bridged traffic (e.g. docker's FORWARD DROP with "
                "br_netfilter): `iptables -S FORWARD`; allow the bridge "
                f"({sp.bridge}) or `sysctl net.bridge.bridge-nf-call-iptables=0`",
            )

    def _write_head_files(self, sp: SandboxSpec, state: dict) -> None:
        if sp.with_keys:
            keys = {nn.name: nodes_mod.host_key(self.node_dir(nn.name)) for nn in sp.all_nodes()}
            files.write_text(self.known_hosts, files.known_hosts(sp, keys))
        elif not self.known_hosts.exists():
            files.write_text(self.known_hosts, "")
        files.write_text(self.hostfile, files.hostfile(sp))
        files.write_text(self.cluster_file, files.corral_toml(sp, self.state_dir, state["python"]))
        files.write_text(self.ssh_config, files.ssh_config(sp, self.state_dir))
        state["spec"] = spec_dict(sp)
        self._save(state)

    # -- status ----------------------------------------------------------------

    def status(self) -> SandboxStatus:
        state = self._load()
        if state is None or "spec" not in state:
            return SandboxStatus(name=self.name, state_dir=str(self.state_dir), exists=False)
        sp = state_spec(state)
        present = netns.links()
        spaces = set(netns.netns_list())
        if os.geteuid() == 0:
            pids = netns.pids_by_netns([nn.netns for nn in sp.all_nodes()])
        else:  # root's namespaces are not ours to read (a sandbox started --for us)
            dirs = {nn.netns: str(self.node_dir(nn.name)) for nn in sp.all_nodes()}
            pids = netns.pids_by_init(dirs)
        rates = state.get("rates", {})
        out = []
        for nn in sp.all_nodes():
            members = pids[nn.netns]
            init = netns.find_init(members)
            link = present.get(nn.veth)
            out.append(NodeStatus(
                name=nn.name, address=sp.address(nn.index), fast_address=sp.fast_address(nn.index),
                netns=nn.netns,
                state="missing" if nn.netns not in spaces else ("running" if init else "stopped"),
                link="missing" if link is None else ("up" if netns.link_is_up(link) else "down"),
                rate=rates.get(nn.name, sp.rate), processes=len(members), init_pid=init,
            ))
        return SandboxStatus(
            name=self.name, state_dir=str(self.state_dir), exists=True, nodes=tuple(out),
            subnet=sp.subnet, fast_subnet=sp.fast_subnet, head_address=sp.head_address(),
            ssh_port=sp.ssh_port, with_keys=sp.with_keys, password_auth=sp.password_auth,
            test_user=specs.TEST_USER if sp.password_auth else None,
            test_password=specs.DEFAULT_PASSWORD if state.get("test_password_default") else None,
            extra_nics=sp.extra_nics, slots=sp.slots,
            files={"cluster_file": str(self.cluster_file), "hostfile": str(self.hostfile),
                   "ssh_config": str(self.ssh_config), "known_hosts": str(self.known_hosts),
                   **({"identity_file": str(self.identity_file)} if sp.with_keys else {}),
                   **({"slurm_conf": str(slurm_mod.conf_path(self))} if state.get("slurm") else {})},
            private_dirs=tuple(d for d in PRIVATE_DIRS if d != "/home" or state.get("private_home")),
        )

    # -- state -----------------------------------------------------------------

    def _load(self) -> dict | None:
        state = files.read_json(self.state_dir / STATE_FILE)
        if state is not None and state.get("version") != STATE_VERSION:
            raise SandboxError(f"{self.state_dir / STATE_FILE}: written by another corral version",
                               hint="corral sandbox down with that version, then up again")
        return state

    def _save(self, state: dict) -> None:
        mode, group = access.state_file_mode(state.get("for_user"))
        files.write_text(self.state_dir / STATE_FILE, nodes_mod.dump_json(state),
                         mode=mode, group=group)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        fd = os.open(self.state_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)



def state_spec(state: dict) -> SandboxSpec:
    data = dict(state["spec"])
    data["extra_nics"] = tuple(data.get("extra_nics", ()))
    return SandboxSpec(**data)


def spec_dict(sp: SandboxSpec) -> dict:
    data = asdict(sp)
    data["extra_nics"] = list(sp.extra_nics)
    return data


def _rate(rate: str | int | None) -> int | None | specs.Unshaped:
    """``None``: not asked; ``UNSHAPED``: asked for no limit; else bits/s."""
    if rate is None or isinstance(rate, int):
        return rate
    if rate.strip().lower() in UNLIMITED:
        return specs.UNSHAPED
    return specs.parse_rate(rate)


def _name_flag(name: str) -> str:
    return "" if name == specs.DEFAULT_NAME else f" --name {name}"
