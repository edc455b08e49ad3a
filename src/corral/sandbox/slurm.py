"""A real Slurm cluster on the sandbox (``corral sandbox up N --slurm``).

The head runs ``munged`` and ``slurmctld``; every node runs its own
``munged`` (the same key) and a ``slurmd`` in its own namespaces, under its
own name and address, started in *configless* mode (``slurmd
--conf-server HEAD:PORT``): the nodes fetch ``slurm.conf`` from the
controller, as on a site that keeps one copy of it.  ``srun``, ``sbatch``,
``salloc``, ``squeue``, ``sinfo`` and ``scancel`` on the head reach the
controller through ``SLURM_CONF=<state>/slurm/slurm.conf`` (``env()``), never
through ``/etc/slurm``: the machine's own Slurm set-up, if any, is not touched.

Layout:

- ``<state>/slurm/``: ``slurm.conf``, ``munge.key``, the controller's state,
  pid and log files, the head munged's files;
- the munge socket: ``/run/corral-slurm-<tag>/munge.socket.2`` (``AuthInfo``):
  on the head the head's munged, inside each node (a private ``/run``) that
  node's own munged, at the same path;
- in a node: ``/run/corral-slurm/`` holds slurmd's spool and pid file; its
  log goes to ``<node dir>/slurm/slurmd.log`` (read it from the head).

Processes are tracked by the pid files they write; ``down`` stops the head's
two daemons (after checking that the pid still runs *our* daemon with *our*
files) and the nodes' daemons die with their namespaces.  The nodes are
described as the configuration says (``SlurmdParameters=config_overrides``),
not as this machine's CPUs are: 8 CPUs each, whatever the head has.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from corral.errors import SandboxError
from corral.sandbox import files, preflight
from corral.sandbox.spec import SandboxSpec

if TYPE_CHECKING:  # pragma: no cover
    from corral.sandbox.instance import Sandbox

log = logging.getLogger(__name__)

#: Tool -> Debian package (``make system-deps`` installs them).
TOOLS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "srun": "slurm-client",
         "sinfo": "slurm-client", "scontrol": "slurm-client"}
#: CPUs each node says it has (the sandbox shares this machine's CPUs anyway).
NODE_CPUS = 8
#: Inside a node: slurmd's spool and pid file (a private /run).
NODE_SLURM_RUN = "/run/corral-slurm"
#: Inside a node: its own state directory (see ``nodeinit.NODE_RUN``).
NODE_DIR_INSIDE = "/run/corral/node"
#: How long ``up`` waits for every node to be idle in ``sinfo``.
READY_TIMEOUT = 60.0
#: Seconds between scancel's SIGTERM and SIGKILL (Slurm's default is 30).
KILL_WAIT = 5


def check_tools() -> dict[str, str]:
    """Paths of the Slurm and munge programs; one error naming all that are missing."""
    return preflight.find_tools(TOOLS, "--slurm")


def munge_socket(sp: SandboxSpec) -> str:
    """The munge socket path: the same path on the head and in every node (each its own /run)."""
    return f"/run/corral-slurm-{sp.tag}/munge.socket.2"


def cluster_name(sp: SandboxSpec) -> str:
    """Slurm's ClusterName: lower case, letters and digits."""
    return "corral" + sp.tag.lower()


def slurm_conf(sp: SandboxSpec, *, state_dir: Path, port: int, controller: str) -> str:
    """The one slurm.conf: the controller reads it, nodes fetch it, head tools use it."""
    d = state_dir / "slurm"
    lines = [
        "# Written by `corral sandbox up --slurm`; removed by `corral sandbox down`.",
        f"ClusterName={cluster_name(sp)}",
        f"SlurmctldHost={controller}({sp.head_address()})",
        f"SlurmctldPort={port}",
        "SlurmdPort=6818",
        "SlurmctldParameters=enable_configless",
        "SlurmdParameters=config_overrides",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket(sp)}",
        f"StateSaveLocation={d / 'ctld'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}",
        f"SlurmdSpoolDir={NODE_SLURM_RUN}/spool",
        f"SlurmdPidFile={NODE_SLURM_RUN}/slurmd.pid",
        f"SlurmdLogFile={NODE_DIR_INSIDE}/slurm/slurmd.log",
        # linuxproc follows a process's ancestry: the agent's ranks start in
        # sessions of their own (pgid would lose them); no cgroups here.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "ReturnToService=2",
        f"KillWait={KILL_WAIT}",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "MinJobAge=30",
        "MessageTimeout=10",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for nn in sp.all_nodes():
        lines.append(f"NodeName={nn.name} NodeAddr={sp.address(nn.index)} NodeHostname={nn.name} "
                     f"CPUs={NODE_CPUS} State=UNKNOWN")
    first, last = sp.node(1).name, sp.node(sp.nodes).name
    lines.append(f"PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                 f"# {first}..{last}")
    return "\n".join(lines) + "\n"


def env(sb: Sandbox, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment in which the Slurm tools talk to this sandbox's controller."""
    out = dict(os.environ if base is None else base)
    out["SLURM_CONF"] = str(conf_path(sb))
    return out


def conf_path(sb: Sandbox) -> Path:
    return sb.state_dir / "slurm" / "slurm.conf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SlurmOps:
    """Mixed into ``Sandbox``: the Slurm daemons of a sandbox."""

    def slurm_up(self: Sandbox, sp: SandboxSpec, state: dict) -> None:
        """Start (or restart what is missing of) munge, slurmctld and every slurmd."""
        tools = check_tools()
        d = self.state_dir / "slurm"
        d.mkdir(mode=0o700, exist_ok=True)
        (d / "ctld").mkdir(mode=0o700, exist_ok=True)
        info = state.setdefault("slurm", {})
        if "port" not in info:
            info["port"] = _free_port()
        info["controller"] = socket.gethostname().split(".")[0]
        self._save(state)
        key = d / "munge.key"
        if not key.exists():
            files.write_text(key, os.urandom(128).hex() + "\n", mode=0o600)  # munge takes any bytes
        files.write_text(d / "slurm.conf", slurm_conf(sp, state_dir=self.state_dir, port=info["port"],
                                                      controller=info["controller"]))
        self._head_munged(sp, tools, d)
        self._slurmctld(tools, d)
        for nn in sp.all_nodes():
            self._node_daemons(sp, nn.name, tools, info["port"])
        self._wait_idle(sp)

    def _head_munged(self: Sandbox, sp: SandboxSpec, tools: dict[str, str], d: Path) -> None:
        if _alive(d / "munged.pid", "munged"):
            return
        sock = Path(munge_socket(sp))
        sock.parent.mkdir(mode=0o755, exist_ok=True)
        _run([tools["munged"], "--force", f"--key-file={d / 'munge.key'}", f"--socket={sock}",
              f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
              f"--seed-file={d / 'munged.seed'}"], what="the head's munged", log_file=d / "munged.log")

    def _slurmctld(self: Sandbox, tools: dict[str, str], d: Path) -> None:
        if _alive(d / "slurmctld.pid", "slurmctld"):
            return
        _run([tools["slurmctld"], "-f", str(d / "slurm.conf")], what="slurmctld",
             log_file=d / "slurmctld.log")

    def _node_daemons(self: Sandbox, sp: SandboxSpec, node: str, tools: dict[str, str], port: int) -> None:
        """munged and slurmd inside ``node`` (skipped when its slurmd already runs)."""
        node_dir = self.node_dir(node)
        (node_dir / "slurm").mkdir(mode=0o700, exist_ok=True)
        key = node_dir / "slurm" / "munge.key"
        files.write_text(key, (self.state_dir / "slurm" / "munge.key").read_text(), mode=0o600)
        sock = munge_socket(sp)
        inside = f"{NODE_DIR_INSIDE}/slurm"
        script = (
            f"set -e; [ -f {NODE_SLURM_RUN}/slurmd.pid ] && kill -0 $(cat {NODE_SLURM_RUN}/slurmd.pid) "
            f"2>/dev/null && exit 0; mkdir -p {NODE_SLURM_RUN}/spool /run/munge {os.path.dirname(sock)}; "
            f"{tools['munged']} --force --key-file={inside}/munge.key --socket={sock} "
            f"--pid-file={NODE_SLURM_RUN}/munged.pid --log-file={inside}/munged.log "
            f"--seed-file={NODE_SLURM_RUN}/munged.seed; "
            # slurmd asks for its configuration before it knows AuthInfo: munge's default path too.
            f"ln -sf {sock} /run/munge/munge.socket.2; "
            # `ip netns exec` gave the node a fresh /sys without cgroups; slurmd
            # 22.05 starts only where it finds a v1 layout with a systemd hierarchy:
            # a named, empty hierarchy of the sandbox's own (never the head's) is
            # enough, as linuxproc and task/none create no cgroup.
            "mountpoint -q /sys/fs/cgroup || { mount -t tmpfs -o mode=755,size=4k corral-cgroup /sys/fs/cgroup; "
            f"mkdir /sys/fs/cgroup/systemd; mount -t cgroup -o none,name=corral{sp.tag} corral-cgroup "
            "/sys/fs/cgroup/systemd; }; "
            f"{tools['slurmd']} --conf-server {sp.head_address()}:{port} -N {node}"
        )
        proc = self.exec(node, ["/bin/sh", "-c", script], timeout=30)
        if proc.returncode != 0:
            raise SandboxError(f"{node}: could not start munged/slurmd (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-500:]}",
                               hint=f"see {node_dir / 'slurm' / 'slurmd.log'} and munged.log there")

    def _wait_idle(self: Sandbox, sp: SandboxSpec, timeout: float = READY_TIMEOUT) -> None:
        """Until ``sinfo`` shows every node idle (or allocated: a job already runs)."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.slurm_node_states()
            if len(states) == sp.nodes and all(s.rstrip("*~#") in ("idle", "alloc", "mix")
                                               for s in states.values()):
                return
            if any(s.startswith("down") for s in states.values()):
                # A node that was stopped comes back as "down" until told otherwise.
                down = [n for n, s in states.items() if s.startswith("down")]
                subprocess.run(["scontrol", "update", f"NodeName={','.join(down)}", "State=RESUME"],
                               env=env(self), capture_output=True, timeout=10, check=False)
            time.sleep(0.3)
        raise SandboxError(
            f"Slurm nodes not idle within {timeout:.0f}s: {states or 'sinfo answered nothing'}",
            hint=f"see {self.state_dir / 'slurm' / 'slurmctld.log'} and each node's slurm/slurmd.log",
        )

    def slurm_node_states(self: Sandbox) -> dict[str, str]:
        """``sinfo``'s state of each node (``idle``, ``alloc``, ``down*``...); {} when it fails."""
        try:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env(self), capture_output=True,
                                 text=True, timeout=15, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
        return dict(line.split(None, 1) for line in out.splitlines() if len(line.split()) == 2)

    def slurm_down(self: Sandbox) -> list[str]:
        """Stop the head's slurmctld and munged (the nodes' go with their namespaces)."""
        d = self.state_dir / "slurm"
        stopped = []
        for pidfile, name in ((d / "slurmctld.pid", "slurmctld"), (d / "munged.pid", "munged")):
            pid = _alive(pidfile, name)
            if pid is None:
                continue
            _stop(pid)
            stopped.append(name)
        return stopped


def _run(argv: list[str], *, what: str, log_file: Path) -> None:
    """Start a daemon that forks itself into the background; fail with its log."""
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
                          check=False, start_new_session=True)
    if proc.returncode != 0:
        raise SandboxError(f"could not start {what} (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-500:]}", hint=f"see {log_file}")


def _alive(pidfile: Path, name: str) -> int | None:
    """The pid in ``pidfile`` if it runs ``name`` with a command line naming the
    pid file's directory (ours, not a pid reused by another program)."""
    try:
        pid = int(pidfile.read_text().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    if name not in cmdline or str(pidfile.parent) not in cmdline:
        return None
    return pid


def _stop(pid: int, grace: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
