"""One node's life: its directory, its network, its init process, its readiness.

A node's state directory (``<state>/nodes/<name>``) holds everything that
makes it a distinct machine: its host key, its sshd_config, the upper
layer of its ``/etc`` (its own hosts and account files, and what it
changes), and the directories bind-mounted over ``~/.ssh``, ``/tmp``,
``/var/tmp``, ``/srv`` and ``/home`` inside it.  It survives ``stop`` and a
re-``up`` (like a disk survives a reboot) and goes with ``down``.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.errors import SandboxError, UsageError
from corral.sandbox import files, netns
from corral.sandbox.spec import DECOY_ADDRESS, NodeNames, SandboxSpec

log = logging.getLogger(__name__)

NODEINIT = Path(__file__).with_name("nodeinit.py")
#: The environment of a node's init (and so of its sshd): nothing from the head's.
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: How long ``up`` waits for every node's sshd to answer.
READY_TIMEOUT = 30.0


@dataclass(frozen=True, kw_only=True)
class Accounts:
    """The node-private account files every node gets (same content on each)."""

    passwd: str
    shadow: str
    group: str
    #: (uid, home inside the node) of the password test user, if any.
    test_user: tuple[int, str] | None = None


def prepare_dir(
    node_dir: Path,
    spec: SandboxSpec,
    node: NodeNames,
    *,
    hosts_text: str,
    nsswitch_text: str,
    accounts: Accounts,
    authorized_key: str | None,
    private_home: bool,
) -> None:
    """Create or refresh a node's directory.  Never wipes what the node wrote
    (its /srv, its ~/.ssh set up by ``corral ssh``...): a re-``up`` converges."""
    node_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for sub, mode in files.NODE_DIRS.items():
        path = node_dir / sub
        path.mkdir(exist_ok=True)
        os.chmod(path, mode)
    files.write_text(node_dir / "sshd_config", files.sshd_config(spec, run_dir="/run/corral/node"))
    etc = node_dir / "etc"  # the upper layer of the node's /etc
    files.write_text(etc / "hosts", hosts_text)
    files.write_text(etc / "nsswitch.conf", nsswitch_text)
    files.write_text(etc / "passwd", accounts.passwd)
    files.write_text(etc / "group", accounts.group)
    files.write_text(etc / "shadow", accounts.shadow, mode=0o600)
    if authorized_key:
        _authorize(node_dir / "ssh" / "authorized_keys", authorized_key)
    if accounts.test_user is not None:
        uid, home = accounts.test_user
        # Inside the node, /home is <node>/home, /srv is <node>/srv.
        root = "home" if private_home else "srv"
        inner = home.split("/", 2)[2]  # "/home/corral" -> "corral"
        host_home = node_dir / root / inner
        host_home.mkdir(parents=True, exist_ok=True)
        os.chown(host_home, uid, uid)
        os.chmod(host_home, 0o755)


def _authorize(path: Path, key: str) -> None:
    """Add ``key`` to an authorized_keys file unless it is there already."""
    line = key.strip()
    existing = path.read_text() if path.exists() else ""
    if line in existing.splitlines():
        return
    if existing and not existing.endswith("\n"):
        existing += "\n"
    files.write_text(path, existing + line + "\n", mode=0o600)


def network_commands(spec: SandboxSpec, node: NodeNames) -> tuple[list[str], list[str]]:
    """``ip -batch`` lines that create a node's network: (head side, inside the node)."""
    alias = f"corral-sandbox:{spec.name}"
    head = [
        f"netns add {node.netns}",
        f"link add {node.veth} type veth peer name eth0 netns {node.netns}",
        f"link set dev {node.veth} alias {alias} master {spec.bridge} up",
    ]
    inside = [
        f"addr replace {spec.address(node.index)}/{spec.prefixlen()} dev eth0",
        "link set eth0 up",
        "link set lo up",
    ]
    fast = spec.fast_address(node.index)
    if fast is not None:
        plen = spec.fast_subnet.split("/")[1]  # type: ignore[union-attr]
        head += [
            f"link add {node.fast_veth} type veth peer name eth1 netns {node.netns}",
            f"link set dev {node.fast_veth} alias {alias} master {spec.fast_bridge} up",
        ]
        inside += [f"addr replace {fast}/{plen} dev eth1", "link set eth1 up"]
    if "decoy" in spec.extra_nics:
        # Like docker0 on a host with no containers: an address, no carrier,
        # the same 172.17.0.1 on every node, reachable from nowhere else.
        inside += [
            "link add docker0 type bridge",
            f"addr replace {DECOY_ADDRESS} dev docker0",
            "link set docker0 up",
        ]
    return head, inside


def start(
    *,
    tools: dict[str, str],
    python: str,
    spec: SandboxSpec,
    node: NodeNames,
    node_dir: Path,
    home: str,
    private_home: bool,
    hide: Sequence[str],
    shares: Sequence[str] = (),
) -> None:
    """Start the node's init, detached from the head (``setsid -f``): the node
    outlives the ``corral sandbox up`` that started it, and the head keeps no
    zombie when it stops."""
    (node_dir / "init.json").unlink(missing_ok=True)
    argv = [
        tools["setsid"], "-f",
        tools["ip"], "netns", "exec", node.netns,
        tools["unshare"], "--pid", "--fork", "--kill-child", "--mount", "--uts", "--ipc",
        "--propagation", "private",
        python, "-I", "-S", str(NODEINIT),
        "--node-dir", str(node_dir), "--hostname", node.name, "--home", home,
        "--sshd", tools["sshd"],
    ]
    if private_home:
        argv.append("--private-home")
    for path in hide:
        argv += ["--hide", path]
    for path in shares:
        argv += ["--share", path]
    with open(node_dir / "init.log", "ab") as logfile:
        proc = subprocess.run(
            argv,
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=logfile,
            stderr=logfile,
            env={"PATH": NODE_PATH, "LANG": "C.UTF-8"},
            timeout=30,
        )
    if proc.returncode != 0:
        raise SandboxError(f"{node.name}: could not start its init (exit {proc.returncode})",
                           hint=f"see {node_dir / 'init.log'}")


def ssh_banner(address: str, port: int, *, timeout: float = 0.5) -> bool:
    """True when an SSH server answers at ``address:port`` (reads its banner)."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def wait_ready(spec: SandboxSpec, nodes: Sequence[NodeNames], node_dirs: dict[str, Path],
               *, timeout: float = READY_TIMEOUT) -> None:
    """Wait until every node's init is up and its sshd answers on the node's address.

    Fails fast, with the node's log, if a node's init died.
    """
    pending = {n.name: n for n in nodes}
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    while pending:
        for name, node in list(pending.items()):
            if (node_dirs[name] / "init.json").exists() and ssh_banner(
                spec.address(node.index), spec.ssh_port
            ):
                del pending[name]
        if not pending:
            return
        if time.monotonic() - started > 1.0:
            alive = netns.pids_by_netns([n.netns for n in pending.values()])
            dead = [n for n in pending.values() if not alive[n.netns]]
            if dead:
                raise _failed(dead[0], node_dirs[dead[0].name], "its init exited")
        if time.monotonic() > deadline:
            node = next(iter(pending.values()))
            raise _failed(node, node_dirs[node.name],
                          f"sshd did not answer on {spec.address(node.index)}:{spec.ssh_port} "
                          f"within {timeout:.0f}s")
        time.sleep(0.05)


def _failed(node: NodeNames, node_dir: Path, what: str) -> SandboxError:
    tail = log_tail(node_dir / "init.log")
    return SandboxError(
        f"{node.name} did not come up: {what}" + (f"; its log ends with: {tail}" if tail else ""),
        hint=f"full log: {node_dir / 'init.log'}; `corral sandbox down` removes the half-built sandbox",
    )


def log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(l.strip() for l in text.strip().splitlines()[-lines:])


def host_key(node_dir: Path) -> str:
    return (node_dir / "ssh_host_ed25519_key.pub").read_text().strip()


def init_info(node_dir: Path) -> dict:
    return files.read_json(node_dir / "init.json") or {}


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What a login on the node would see: a fresh environment, not the head's."""
    env = {
        "PATH": NODE_PATH,
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "SHELL": "/bin/bash",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    if "TERM" in os.environ:
        env["TERM"] = os.environ["TERM"]
    env.update(extra or {})
    return env


def dump_json(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


#: Node-private directories a shared Python must not live in.
_NODE_LOCAL = ("/tmp", "/var/tmp", "/srv")


def python_layout(share: Sequence[str] = ()) -> tuple[str, bool, list[str]]:
    """The interpreter nodes run, whether /home can be node-private, and shares.

    Nodes share the head's filesystem except their private directories, like
    machines booted from one image; the head's Python must be visible there.
    When it lives under a node-private directory (a virtual environment in
    /tmp or /var/tmp, as CI systems often make), exactly the interpreter's
    directories are mounted through into every node: the *shares*.  Never the
    project around them, nor corral's own source tree (nodes get corral's
    agent over ssh, as real machines do): a project in /var/tmp stays on the
    head, so ``corral sync`` has real work to do, as between machines.
    ``share``: directories the user asks to see on every node (``--share``,
    like an NFS-mounted project); outside the node-private directories they
    are shared anyway.
    """
    python = sys.executable
    paths = {os.path.abspath(p) for p in (python, sys.prefix, sys.base_prefix)}
    paths.add(os.path.realpath(python))
    wanted = {os.path.abspath(sys.prefix), os.path.dirname(os.path.realpath(python)),
              os.path.abspath(sys.base_prefix)}
    shares = []
    for path in sorted(wanted):
        if _node_local(path):
            if path in _NODE_LOCAL:
                raise SandboxError(f"this Python ({python}) lives directly in {path}, which is private "
                                   "to each sandbox node",
                                   hint="install corral in a virtual environment in a directory of its own")
            shares.append(path)
    for path in share:
        checked = _checked_share(path)
        if _node_local(checked):
            shares.append(checked)
    shares = sorted(set(shares))
    shares = [p for p in shares if not any(p != q and p.startswith(q + "/") for q in shares)]
    if shares:
        log.info("mounted through into every node (they live under node-private directories): %s",
                 ", ".join(shares))
    private_home = not any(p == "/home" or p.startswith("/home/") for p in paths)
    if not private_home:
        log.info("/home is shared with the nodes: this Python lives there (%s)", python)
    return python, private_home, shares


def _node_local(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in _NODE_LOCAL)


def _checked_share(path: str) -> str:
    """An absolute, existing directory that is not a node-private directory itself."""
    resolved = os.path.realpath(path)
    if not os.path.isdir(resolved):
        raise UsageError(f"--share {path}: not a directory on this machine",
                         hint="name an existing directory, e.g. --share /var/tmp/data")
    if resolved in _NODE_LOCAL:
        raise UsageError(f"--share {path}: all of {resolved} would stop being private to each node",
                         hint=f"share a directory inside it, e.g. --share {resolved}/data")
    return resolved


def ensure_mountpoints(private_home: bool) -> None:
    """Directories a node mounts over must exist on the shared filesystem."""
    home = pwd.getpwuid(0).pw_dir
    wanted = [os.path.join(home, ".ssh"), "/srv", "/var/tmp"] + (["/home"] if private_home else [])
    for path in wanted:
        if not os.path.isdir(path):
            log.info("creating %s (a node mounts its private copy over it)", path)
            os.makedirs(path, mode=0o700 if path.endswith(".ssh") else 0o755, exist_ok=True)
