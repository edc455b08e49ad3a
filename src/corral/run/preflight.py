"""Before anything starts: every node checked, and a rendezvous every node reaches.

``preflight`` asks every node, in one round trip, for what a launch needs
(working directory, script, the launcher's Python module, GPUs, addresses, a
free port on node 0) and reports *every* problem on *every* node at once; a
node whose script differs from this machine's copy is named in a warning.
``choose_master`` then proves an address of node 0 is reachable: node 0
listens on the chosen port and every other node connects to it, so a
firewall or a wrong network is an error naming the node before torchrun
would hang on it for minutes.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Mapping

from corral.agent.probes import advertises_loopback
from corral.agent.session import AgentPool, AgentSession
from corral.errors import HostError, PreflightError
from corral.model import Cluster, Host, format_gpus
from corral.run.launchers import REQUIRES
from corral.run.plan import NodeFacts, RunSpec, gpus_for
from corral.run.sharing import busy_warning, held_gpus, hold_args, hold_problems, unchecked_warning

log = logging.getLogger(__name__)


def _needs_path_check(spec: RunSpec) -> bool:
    return not spec.module and (spec.launcher != "command" or spec.program.endswith(".py"))


def _workdir(spec: RunSpec, cluster: Cluster, host: Host, head_cwd: str) -> str:
    return spec.workdir or cluster.workdir_for(host) or head_cwd


def local_digest(path: str) -> list | None:
    """[size, sha256] of this machine's copy of a script, or None when there is none."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > 64 << 20:
            return None  # no local copy (or not a script): nothing to compare
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return [len(data), hashlib.sha256(data).hexdigest()]


def stale_script_warning(program: str, nodes: list[str]) -> str:
    from corral.hostrange import fold

    return (f"{program} on {fold(nodes) if len(nodes) > 1 else nodes[0]} is not the same as here (edited since the last sync?): "
            f"{'that node runs its' if len(nodes) == 1 else 'those nodes run their'} copy, not this one; "
            "`corral run --sync ...` (or `corral sync`) copies the project first")


async def preflight(pool: AgentPool, cluster: Cluster, spec: RunSpec, head_cwd: str,
                    *, warn: Callable[[str], None] | None = None) -> dict[str, dict]:
    """One round trip per node; every problem on every node in one error.

    The script on each node is also compared with this machine's copy (size,
    then sha256): nodes with another one are named through ``warn`` (default:
    a logged warning), since they would run it instead of the local edits.
    On a shared filesystem it is the same file.
    """
    required = REQUIRES[spec.launcher]
    first = cluster.hosts[0].name
    paths = [spec.program] if _needs_path_check(spec) else []
    local = os.path.join(head_cwd, spec.program) if paths else None
    digest = local_digest(local) if local else None
    compare = {spec.program: digest} if digest else None

    def args_for(s: AgentSession) -> dict:
        args = {
            "workdir": _workdir(spec, cluster, s.host, head_cwd),
            "paths": paths,
            "modules": [required] if required else [],
            "want_port": s.name == first and spec.master_port is None,
            "env_names": ["GLOO_SOCKET_IFNAME"],  # set in the node's login environment?
        }
        if spec.launcher == "accelerate":
            args["accelerate"] = True  # the node's default config may pick FSDP/DeepSpeed
        visible = {**cluster.env_for(s.host), **spec.env}.get("CUDA_VISIBLE_DEVICES")
        subset = gpus_for(spec, s.host)
        if subset is not None:  # --gpus / `gpus`: what the plan sets
            visible = format_gpus(subset)
        args["hold"] = hold_args(spec, s.host, first=s.name == first)
        if visible is not None:  # one process per GPU its ranks will see, not per GPU there
            args["cuda_visible_devices"] = visible
        if compare:
            args["compare"] = compare
        return args

    results = await pool.call_all("probes.preflight", args_for, timeout=30)
    problems: list[HostError] = []
    for s in pool.sessions:
        r = results[s.name]
        wd = r.get("workdir") or {}
        if wd and not wd.get("exists"):
            dangling = f" (it is a symbolic link to {wd['link_to']}, which does not exist)" if wd.get("link_to") else ""
            problems.append(HostError(
                s.name, f"working directory {wd.get('path')} does not exist{dangling}",
                hint="copy the project there first (`corral sync`, or `corral run --sync`), "
                     "or choose another with --workdir / `workdir` in the cluster file",
                kind="no-workdir"))
            continue
        for missing in r.get("missing", []):
            problems.append(HostError(
                s.name, f"{missing} not found" + ("" if missing.startswith("/") else f" in {wd.get('path')}"),
                hint="sync the project to every node (`corral sync`) or check the path",
                kind="no-script"))
        for mod, ok in (r.get("modules") or {}).items():
            if not ok:
                problems.append(HostError(
                    s.name, f"{r.get('executable')} cannot import {mod} (needed by --launcher {spec.launcher})",
                    hint=f"install {mod} in that environment, or point `python` for this host at the "
                         "interpreter that has it (cluster file)",
                    kind="no-module"))
        problems += hold_problems(s.name, r.get("hold"), spec, s.host)
    problems += same_machine({s.name: results[s.name] for s in pool.sessions})
    if problems:
        raise PreflightError(problems, what="preflight")
    for note in (busy_warning({s.name: results[s.name].get("hold") for s in pool.sessions}),
                 unchecked_warning(spec, [s.host for s in pool.sessions],
                                   {s.name: results[s.name].get("gpus") for s in pool.sessions})):
        if note:
            (warn or log.warning)(note)
    stale = [s.name for s in pool.sessions if spec.program in (results[s.name].get("differs") or [])]
    if stale:
        (warn or log.warning)(stale_script_warning(spec.program, stale))
    return results


def same_machine(results: Mapping[str, dict]) -> list[HostError]:
    """Hosts that are one machine under two names (``gpu2`` and its IP address):
    it would run two nodes' ranks on the same GPUs, in one job directory."""
    seen: dict[tuple, list[str]] = {}
    for name, probe in results.items():
        if probe.get("machine"):
            seen.setdefault(tuple(probe["machine"]), []).append(name)
    problems = []
    for names in seen.values():
        if len(names) > 1:
            listed = ", ".join(names[:-1]) + " and " + names[-1]
            problems.append(HostError(
                names[0], f"{listed} are the same machine (one kernel, one network): it would start "
                          f"{len(names)} nodes' processes there, on the same GPUs",
                hint="list each machine once in the cluster file (for more processes on it, raise its "
                     "`slots` or use --nproc-per-node)", kind="same-machine"))
    return problems


#: File systems that live on one machine: what one node writes there, no other node sees.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "tmpfs",
                               "overlay", "vfat", "exfat", "ntfs", "ntfs3", "ramfs"})


def local_disk_warning(results: Mapping[str, dict], *, key: str = "workdir",
                       what: str = "the work dir") -> str | None:
    """For ``--max-restarts`` on several nodes: a work dir (or the probe's
    ``key``: the ``--checkpoint-dir``) on each node's own disk means a
    checkpoint written under it by one node (rank 0, as usual) is not there
    for the others when the job restarts; they start over while it resumes.
    Said only when every node's file system is a local one."""
    kinds = {name: (r.get(key) or {}).get("fstype") for name, r in results.items()}
    if len(kinds) < 2 or not all(k in LOCAL_FILESYSTEMS for k in kinds.values()):
        return None
    same = {tuple((r.get(key) or {}).get("identity") or (name,)) for name, r in results.items()}
    if len(same) < 2:
        return None  # one directory seen by every node (hosts on one machine sharing it)
    from corral.hostrange import fold

    path = (next(iter(results.values())).get(key) or {}).get("path")
    types = ", ".join(sorted(set(kinds.values())))  # type: ignore[arg-type]
    return (f"--max-restarts: {what} {path} is on each node's own disk ({types} on "
            f"{fold(list(kinds))}), not shared: a checkpoint one node writes there is not seen by the "
            "others, so after a restart they start over while it resumes. Write checkpoints to shared "
            "storage (an absolute path), or on every node")


def _head_view(host: Host) -> set[str]:
    """Addresses the head itself resolves ``host`` to (its likely cluster IP)."""
    out = set()
    for name in {host.address, host.name} - {None}:
        try:
            for info in socket.getaddrinfo(name, None, socket.AF_INET):  # type: ignore[arg-type]
                out.add(info[4][0])
        except OSError:
            pass
    return out


def master_candidates(host0: Host, probe0: dict, peers: list[dict]) -> list[str]:
    """Node 0's addresses, most likely to be reachable by every peer first."""
    addrs = probe0.get("addresses") or []
    head_view = _head_view(host0)

    def shared_subnets(a: dict) -> int:
        net = ipaddress.ip_network(f"{a['address']}/{a['prefix']}", strict=False)
        return sum(
            any(ipaddress.ip_address(p["address"]) in net for p in (peer.get("addresses") or []))
            for peer in peers
        )

    def key(a: dict) -> tuple:
        return (a["address"] not in head_view, -shared_subnets(a))

    ordered = [a["address"] for a in sorted(addrs, key=key)]
    for extra in sorted(head_view):
        if extra not in ordered and not extra.startswith("127."):
            ordered.append(extra)
    return ordered


#: Seconds each node tries each rendezvous address (a SYN at 0 and 1 s), and
#: from how many nodes on it tries longer (SYNs at 0, 1, 3 and 7 s).
CONNECT_EACH_S = 3.0
CONNECT_MANY_NODES = 64
CONNECT_EACH_MANY_S = 8.0


async def choose_master(pool: AgentPool, probes: Mapping[str, dict], port: int) -> str:
    """An address of node 0 that every other node reaches on ``port``."""
    s0 = pool.sessions[0]
    others = pool.sessions[1:]
    if not others:
        return "127.0.0.1"
    candidates = master_candidates(s0.host, probes[s0.name], [probes[s.name] for s in others])
    if not candidates:
        raise PreflightError([HostError(s0.name, "has no network address other nodes could use",
                                        kind="no-address")], what="rendezvous")
    opened = await s0.call("probes.listen_start", addresses=candidates, port=port, seconds=30)
    if not opened["bound"]:
        detail = "; ".join(f"{a}: {e}" for a, e in opened["errors"].items())
        raise PreflightError([HostError(s0.name, f"cannot listen on port {port} ({detail})",
                                        hint="choose another --master-port", kind="port")],
                             what="rendezvous")
    # Each address is tried for 3 s (SYN sent at 0, 1 s), 8 s from 64 nodes on
    # (and at 3 s): hundreds of nodes connecting at once can lose a SYN to a
    # full queue, and a 3 s try then failed a node that was reachable.  The
    # call itself waits longer: hundreds of agents answering at once take seconds.
    each_s = CONNECT_EACH_S if len(others) + 1 < CONNECT_MANY_NODES else CONNECT_EACH_MANY_S
    try:
        reach = await asyncio.gather(*(
            s.call("probes.connect", addresses=opened["bound"], port=port, each_s=each_s,
                   timeout=each_s * len(opened["bound"]) + 30) for s in others
        ))
    finally:
        await s0.call("probes.listen_stop", port=port)
    for addr in opened["bound"]:
        if all(r.get(addr) == "ok" for r in reach):
            return addr
    problems = []
    for s, r in zip(others, reach):
        failed = {a: e for a, e in r.items() if e != "ok"}
        if len(failed) == len(opened["bound"]):
            detail = ", ".join(f"{a} ({e})" for a, e in failed.items())
            problems.append(HostError(
                s.name, f"cannot reach {s0.name} on port {port} at any of its addresses: {detail}",
                hint="a firewall or a separate network is in the way; `corral doctor` shows the "
                     "TCP reachability matrix", kind="unreachable-peer"))
    if not problems:  # each address is reachable by some, none by all
        problems.append(HostError(s0.name, "no single address of it is reachable from every node",
                                  hint="`corral doctor` shows which node reaches which address",
                                  kind="unreachable-peer"))
    raise PreflightError(problems, what="rendezvous")


def node_address(probe: dict, master: str) -> str | None:
    """The address of a node on the same network as the master, for CORRAL_NODE_IPS."""
    addrs = probe.get("addresses") or []
    if master == "127.0.0.1":
        return "127.0.0.1"
    try:
        m = ipaddress.ip_address(master)
        for a in addrs:
            if m in ipaddress.ip_network(f"{a['address']}/{a['prefix']}", strict=False):
                return a["address"]
    except ValueError:
        pass
    return addrs[0]["address"] if addrs else None


def gloo_interface(probe: dict, address: str | None) -> str | None:
    """The interface to name in GLOO_SOCKET_IFNAME on a node whose host name
    resolves to loopback (Debian's ``127.0.1.1 host`` line) or to nothing:
    gloo advertises that address to the other nodes' ranks, which then fail
    with "connectFullMesh failed ... Connection refused, remote=[127.0.1.1]".
    The interface is the one holding the node's rendezvous address.  None when
    gloo's own guess is fine, or the node's login environment sets the
    variable itself."""
    if "GLOO_SOCKET_IFNAME" in (probe.get("env") or {}):
        return None
    resolved = probe.get("hostname_addresses")
    if resolved is None or not advertises_loopback(resolved):
        return None  # unknown (a resolver too slow), or gloo's first address is fine
    return next((a["name"] for a in probe.get("addresses") or [] if a["address"] == address and a.get("name")), None)


def _text_pair(value: object) -> tuple[str, str] | None:
    """A node's ``[path, text]`` (its accelerate default config), if it is one:
    what a node sends is checked where it enters."""
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)
            and len(value[0]) < 4096 and len(value[1]) <= 64 << 10):
        return value[0], value[1]
    return None


def node_facts(pool: AgentPool, probes: Mapping[str, dict], master: str, *, job_sets_gloo: Callable[[Host], bool],
               warn: Callable[[str], None] | None = None) -> dict[str, NodeFacts]:
    """What the plan needs to know of every node, from preflight and the rendezvous.
    ``job_sets_gloo(host)``: the job's environment names GLOO_SOCKET_IFNAME there."""
    facts = {}
    fixed = []
    for s in pool.sessions:
        probe = probes[s.name]
        address = node_address(probe, master)
        gloo = None
        if len(pool.sessions) > 1 and not job_sets_gloo(s.host):
            gloo = gloo_interface(probe, address)
        if gloo:
            resolved = (probe.get("hostname_addresses") or ["nothing"])[0]
            fixed.append(f"{s.name}'s host name {probe.get('hostname')!r} resolves to {resolved}: its ranks get "
                         f"GLOO_SOCKET_IFNAME={gloo} (the interface of {address})")
        facts[s.name] = NodeFacts(gpus=probe.get("gpus"), address=address,
                                  accelerate_mode=probe.get("accelerate_mode"), gloo_ifname=gloo,
                                  accelerate_config=_text_pair(probe.get("accelerate_config")),
                                  held_gpus=held_gpus(probe.get("hold") or {}))
    if fixed:
        (warn or log.warning)(
            "; ".join(fixed) + ", since gloo would tell the other nodes to connect to that address (Debian's "
            "`127.0.1.1 host` line in /etc/hosts); fix /etc/hosts there, or set GLOO_SOCKET_IFNAME for "
            "the host in the cluster file")
    return facts
