"""The system calls of the sandbox: ``ip``, ``tc`` and the process table.

Thin on purpose: each function builds one command (or reads ``/proc``) and
turns a failure into ``SandboxError`` with the command and its stderr, so the
orchestration in ``instance.py`` reads as a list of steps.

Processes of a node are found by their *network namespace* (the same
comparison ``ip netns pids`` makes), never through pid files: inside a PID
namespace a pid file holds the namespace's own numbers (sshd's says 1), and
killing that number from outside would hit the wrong process.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from corral.errors import SandboxError

log = logging.getLogger(__name__)

NETNS_DIR = "/run/netns"
#: Queueing delay a shaped link accepts before dropping (like a switch buffer).
TBF_LATENCY = "50ms"


def run(
    argv: Sequence[str], *, input: str | None = None, check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run a system tool, raising ``SandboxError`` with its stderr when it fails."""
    log.debug("run: %s", " ".join(argv))
    try:
        proc = subprocess.run(
            list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise SandboxError(
            f"{argv[0]} is not installed",
            hint="install the sandbox's system tools: make system-deps "
            "(or apt-get install iproute2 openssh-server util-linux)",
        ) from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s") from None
    if check and proc.returncode != 0:
        what = " ".join(argv)
        detail = (proc.stderr or proc.stdout).strip().replace("\n", "; ")
        raise SandboxError(f"`{what}` failed (exit {proc.returncode}): {detail}")
    return proc


def ip_batch(lines: Iterable[str], *, netns: str | None = None, force: bool = False) -> None:
    """Run many ``ip`` commands in one process (``ip -batch``): fast for 32+ nodes.

    ``force`` runs every line even when some fail and ignores the failures:
    for removals, whose result the caller verifies afterwards.
    """
    text = "".join(line + "\n" for line in lines)
    if not text:
        return
    argv = ["ip"] + (["-n", netns] if netns else []) + (["-force"] if force else []) + ["-batch", "-"]
    run(argv, input=text, check=not force)


def links() -> dict[str, dict]:
    """Every interface of the root namespace, by name (``ip -j link show``)."""
    out = run(["ip", "-j", "link", "show"]).stdout
    return {entry["ifname"]: entry for entry in json.loads(out or "[]")}


def link_is_up(entry: dict) -> bool:
    return "UP" in entry.get("flags", [])


def netns_list() -> list[str]:
    """Names of the ``ip netns`` namespaces (the files ``ip netns add`` creates)."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def networks_in_use(*, ignore_links: Iterable[str] = ()) -> list[ipaddress.IPv4Network]:
    """IPv4 networks of the root namespace's addresses and routes.

    A new sandbox subnet must overlap none of them, or traffic for a real
    network would be routed into the sandbox (or the other way round).
    """
    ignore = set(ignore_links)
    nets: list[ipaddress.IPv4Network] = []
    for entry in json.loads(run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        if entry.get("ifname") in ignore:
            continue
        for info in entry.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False))
    for route in json.loads(run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = route.get("dst", "")
        if route.get("dev") in ignore or dst in ("", "default") or route.get("type") in (
            "broadcast",
            "local",
        ):
            continue
        try:
            nets.append(ipaddress.IPv4Network(dst, strict=False))
        except ValueError:
            continue
    return nets


# ---------------------------------------------------------------------------
# traffic shaping


def tbf_args(bps: int) -> list[str]:
    """A token bucket at ``bps``: bursts of 10 ms of traffic (at least 32 KiB)."""
    burst = max(bps // 8 // 100, 32 * 1024)
    return ["tbf", "rate", f"{bps}bit", "burst", str(burst), "latency", TBF_LATENCY]


def shape(dev: str, bps: int | None, *, netns: str | None = None) -> None:
    """Limit ``dev``'s egress to ``bps`` (``None`` removes the limit)."""
    base = ["tc"] + (["-n", netns] if netns else [])
    if bps is None:
        proc = run(base + ["qdisc", "del", "dev", dev, "root"], check=False)
        # An unshaped veth has the default root qdisc, which tc cannot delete
        # ("handle of zero"): that is the state we want, not an error.
        if proc.returncode != 0 and "handle of zero" not in proc.stderr:
            raise SandboxError(f"`tc qdisc del dev {dev} root` failed: {proc.stderr.strip()}")
        return
    run(base + ["qdisc", "replace", "dev", dev, "root"] + tbf_args(bps))


# ---------------------------------------------------------------------------
# processes


def _ns_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def pids_by_netns(names: Iterable[str]) -> dict[str, list[int]]:
    """Processes in each named network namespace, from one scan of ``/proc``.

    This is ``ip netns pids`` for many namespaces at once.  Zombies have no
    namespace link and do not appear (there is nothing left to kill).
    """
    keys: dict[tuple[int, int], str] = {}
    result: dict[str, list[int]] = {}
    for name in names:
        result[name] = []
        key = _ns_key(os.path.join(NETNS_DIR, name))
        if key is not None:
            keys[key] = name
    if not keys:
        return result
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        key = _ns_key(f"/proc/{entry}/ns/net")
        if key in keys:
            result[keys[key]].append(int(entry))
    return result


def pids_by_init(node_dirs: Mapping[str, str]) -> dict[str, list[int]]:
    """``pids_by_netns`` for a user who may not read root's namespaces (status
    as non-root): each node's init, found by its command line
    (``nodeinit.py --node-dir DIR``), and the processes descended from it.
    ``node_dirs``: namespace name -> node directory."""
    by_dir = {d: ns for ns, d in node_dirs.items()}
    parent: dict[int, int] = {}
    inits: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        ppid = _ppid(pid)
        if ppid is None:
            continue
        parent[pid] = ppid
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "--node-dir" in args[:-1] and any(a.endswith("nodeinit.py") for a in args):
            ns = by_dir.get(args[args.index("--node-dir") + 1])
            if ns is not None:
                inits[pid] = ns
    result: dict[str, list[int]] = {ns: [] for ns in node_dirs}
    for pid in parent:
        hop, steps = pid, 0
        while hop not in inits and hop in parent and steps < 64:
            hop, steps = parent[hop], steps + 1
        if hop in inits and _alive(pid):
            result[inits[hop]].append(pid)
    return result


def nspid(pid: int) -> list[int]:
    """The ``NSpid`` chain of ``pid``: its number in each nested PID namespace."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return []


def find_init(pids: Iterable[int]) -> int | None:
    """The node init among ``pids``: pid 1 of a PID namespace one level down."""
    for pid in pids:
        chain = nspid(pid)
        if len(chain) >= 2 and chain[-1] == 1:
            return pid
    return None


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def empty_netns(names: Sequence[str], *, grace: float = 5.0) -> dict[str, list[int]]:
    """Kill everything in the namespaces ``names``; return what survived SIGKILL.

    Each node init gets SIGTERM first (it stops its node's processes, and
    when it exits the kernel kills the rest of its PID namespace); what is
    still there after ``grace`` seconds (for example processes started with
    ``ip netns exec``, outside the node's PID namespace) gets SIGKILL.
    """
    for members in pids_by_netns(names).values():
        init = find_init(members)
        # The init stops its own PID namespace; the rest (``ip netns exec``
        # processes, nsenter) get SIGTERM directly -- except the init's parent,
        # ``unshare --kill-child``, whose death would SIGKILL the init at once.
        spare = {init, _ppid(init)} if init is not None else set()
        if init is not None:
            _signal(init, signal.SIGTERM)
        for pid in members:
            if pid not in spare and len(nspid(pid)) == 1:
                _signal(pid, signal.SIGTERM)
    if not _wait_empty(names, grace):
        for members in pids_by_netns(names).values():
            for pid in members:
                log.info("SIGKILL %d (still running after SIGTERM)", pid)
                _signal(pid, signal.SIGKILL)
        _wait_empty(names, 3.0)
    left = {ns: [p for p in members if _alive(p)] for ns, members in pids_by_netns(names).items()}
    return {ns: members for ns, members in left.items() if members}


def _wait_empty(names: Sequence[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not any(_alive(p) for members in pids_by_netns(names).values() for p in members):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


#: The kernel's per-CPU queue of packets received from virtual links
#: (``netif_rx``): every node's veth delivers into it, on the head's few CPUs.
BACKLOG_SYSCTL = Path("/proc/sys/net/core/netdev_max_backlog")
#: Sandboxes from this size on get a queue of ``BACKLOG_PER_NODE`` x nodes.
BACKLOG_FROM_NODES = 32
BACKLOG_PER_NODE = 256


def ensure_packet_backlog(nodes: int, path: Path = BACKLOG_SYSCTL) -> tuple[int, int] | None:
    """Raise ``net.core.netdev_max_backlog`` for a sandbox of ``nodes`` nodes;
    ``(before, after)`` when it was raised, else None.

    Why: all the nodes' virtual links hand their packets to one per-CPU
    queue of the head's kernel, 1000 packets by default.  At 256 nodes a
    launch overflowed it (216,000 packets dropped in one run, counted in
    ``/proc/net/softnet_stat``); TCP's retransmit backoff then stalled one
    node's connection past corral's 10 s heartbeat, and 4 of 10 launches
    lost a node that was never down (none of the next 9, raised).  A real
    cluster has a NIC per node.
    The value is machine-wide and stays until reboot; it is only raised.
    """
    if nodes < BACKLOG_FROM_NODES:
        return None
    want = BACKLOG_PER_NODE * nodes
    try:
        before = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if before >= want:
        return None
    try:
        path.write_text(f"{want}\n")
    except OSError as err:
        raise SandboxError(f"cannot raise {path} to {want} for {nodes} nodes: {err}",
                           hint=f"sysctl -w net.core.netdev_max_backlog={want}, then up again") from None
    return before, want


#: The kernel's neighbour (ARP) table, shared by every network namespace of
#: the machine: its hard limit is ``gc_thresh3`` entries in all of them together.
NEIGH_SYSCTL_DIR = Path("/proc/sys/net/ipv4/neigh/default")


def ensure_neighbour_table(nodes: int, path: Path = NEIGH_SYSCTL_DIR) -> tuple[int, int] | None:
    """Raise the ARP table's limits (``gc_thresh3``, and ``gc_thresh2`` with it)
    for a sandbox of ``nodes`` nodes; ``(before, after)`` of ``gc_thresh3``
    when raised, else None.

    Why: a real node keeps its own ARP table; the sandbox's nodes all share
    the head kernel's, 1,024 entries by default.  Every node that talks to
    every other (``corral doctor``'s port check, ``corral exec``'s relays,
    NCCL's ring, sync's chain) needs an entry per peer in it: at 32 nodes
    doctor's port check found 730 of 992 node-to-node connections "timed
    out" (dmesg: "neighbour: arp_cache: neighbor table overflow!"), and at
    256 nodes relays' logins to their members timed out.  Sized for every
    node knowing every node and the head; machine-wide until reboot, only
    ever raised.
    """
    if nodes < BACKLOG_FROM_NODES:
        return None
    want = nodes * (nodes + 2)
    try:
        before = int((path / "gc_thresh3").read_text().split()[0])
        soft = int((path / "gc_thresh2").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if before >= want:
        return None
    try:
        (path / "gc_thresh3").write_text(f"{want}\n")
        if soft < want:
            (path / "gc_thresh2").write_text(f"{want}\n")
    except OSError as err:
        raise SandboxError(f"cannot raise {path}/gc_thresh3 to {want} for {nodes} nodes: {err}",
                           hint=f"sysctl -w net.ipv4.neigh.default.gc_thresh3={want} "
                                f"net.ipv4.neigh.default.gc_thresh2={want}, then up again") from None
    return before, want
