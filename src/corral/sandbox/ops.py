"""Operations on one node of a running sandbox: exec, and fault injection.

The faults are the ones multi-node jobs meet on real clusters:

- ``partition``: the node's cable is pulled (its head-side veth goes down):
  packets vanish, in-flight TCP stalls instead of failing fast, ssh times out;
- ``heal``: the cable is back;
- ``stop``: the machine dies: every process on it is killed, sshd included;
  ``up`` boots it again (same disk: its files and host key survive);
- ``slow``: the link is throttled to a rate (``None`` removes the limit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from corral.errors import SandboxError, UsageError
from corral.sandbox import netns, preflight
from corral.sandbox import node as nodes_mod
from corral.sandbox.spec import NodeNames, SandboxSpec, parse_rate

if TYPE_CHECKING:  # pragma: no cover
    from corral.sandbox.instance import Sandbox

__all__ = ["UNLIMITED", "NodeOps"]

#: Words ``slow`` accepts for "remove the limit".
UNLIMITED = ("none", "off", "unlimited")


class NodeOps:
    """Mixed into ``Sandbox``: everything that acts on one named node."""

    def node_names(self: Sandbox, node: str) -> tuple[SandboxSpec, NodeNames]:
        """The spec and the names of ``node``; ``UsageError`` (exit 2: a name the
        user typed) if there is no such node."""
        sp = self.spec
        for nn in sp.all_nodes():
            if nn.name == node:
                return sp, nn
        first, last = sp.node(1).name, sp.node(sp.nodes).name
        raise UsageError(
            f"sandbox {self.name!r} has no node {node!r} (its nodes are {first}..{last})",
            hint="corral sandbox status lists them",
        )

    def init_pid(self: Sandbox, node: str) -> int:
        """The head pid of ``node``'s init; ``SandboxError`` when the node is stopped."""
        _, nn = self.node_names(node)
        pid = netns.find_init(netns.pids_by_netns([nn.netns])[nn.netns])
        if pid is None:
            raise SandboxError(
                f"{node} is stopped (no init running in {nn.netns})",
                hint=f"corral sandbox up{'' if self.name == 'sandbox' else ' --name ' + self.name} "
                "restarts stopped nodes",
            )
        return pid

    def exec(
        self: Sandbox,
        node: str,
        argv: Sequence[str],
        *,
        input: str | bytes | None = None,
        timeout: float | None = None,
        capture: bool = True,
        text: bool = True,
        check: bool = False,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``node`` (all its namespaces, cwd ~root, a login-like
        environment), like ``ssh node argv`` but without ssh.  The exit code is the
        command's own.

        ``capture=False`` passes the caller's stdin/stdout/stderr through (the
        CLI's interactive ``exec``).  With ``capture``, stdin is ``input`` or
        empty, and on ``timeout`` the whole command (its process group, inside
        the node too) is killed before ``subprocess.TimeoutExpired`` is raised.
        """
        if not argv:
            raise SandboxError("exec needs a command", hint="corral sandbox exec node1 -- hostname")
        preflight.check_privileges()
        pid = self.init_pid(node)
        nsenter = preflight.which("nsenter") or "nsenter"
        cmd = [nsenter, "-t", str(pid), "-n", "-m", "-u", "-i", "-p", "-w", "--", *argv]
        if not capture:
            proc = subprocess.run(cmd, check=False, input=input, text=text, timeout=timeout,
                                  env=nodes_mod.node_env(env))
        else:
            proc = _run_captured(cmd, input=input, text=text, timeout=timeout, env=nodes_mod.node_env(env))
        if check and proc.returncode != 0:
            err = proc.stderr.strip() if capture and isinstance(proc.stderr, str) else ""
            raise SandboxError(f"{node}: `{' '.join(argv)}` exited {proc.returncode}" + (f": {err}" if err else ""))
        return proc

    def partition(self: Sandbox, node: str) -> None:
        """Cut ``node`` off every network (its head-side links go down)."""
        self._set_links(node, "down")

    def heal(self: Sandbox, node: str) -> None:
        """Undo ``partition``; return once the link carries traffic again.

        While the cable was out, ARP for the node's peers failed and the
        kernels remember it (neighbour entries in FAILED state answer "No
        route to host" for a while), so the neighbour tables of every node
        are flushed, and the link is waited for.
        """
        self._set_links(node, "up")
        sp, nn = self.node_names(node)
        devs = [nn.veth] + ([nn.fast_veth] if sp.fast_subnet else [])
        for peer in self.nodes:
            _, pn = self.node_names(peer)
            netns.ip_batch(["neigh flush all"], netns=pn.netns, force=True)
        netns.ip_batch([f"neigh flush dev {sp.bridge}"], force=True)  # the head's view, this bridge only
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            present = netns.links()
            if all(d in present and netns.link_is_up(present[d]) for d in devs):
                break
            time.sleep(0.05)

    def _set_links(self: Sandbox, node: str, updown: str) -> None:
        preflight.check_privileges()
        sp, nn = self.node_names(node)
        devs = [nn.veth] + ([nn.fast_veth] if sp.fast_subnet else [])
        present = netns.links()
        missing = [d for d in devs if d not in present]
        if missing:
            raise SandboxError(f"{node}: its link {missing[0]} is missing (half-built sandbox)",
                               hint="corral sandbox up repairs it")
        netns.ip_batch(f"link set dev {d} {updown}" for d in devs)

    def stop(self: Sandbox, node: str) -> None:
        """Kill everything on ``node`` (its init first, then stragglers); the node
        stays defined, and ``up`` starts it again."""
        preflight.check_privileges()
        _, nn = self.node_names(node)
        with self._lock():
            left = netns.empty_netns([nn.netns])
        if left:
            raise SandboxError(f"{node}: processes survived SIGKILL: {left[nn.netns]}",
                               hint="they are stuck in the kernel; retry later")

    def slow(self: Sandbox, node: str, rate: str | int | None) -> None:
        """Limit ``node``'s link to ``rate`` both ways (``"50mbit"``, bits/s, or ``None``)."""
        preflight.check_privileges()
        _, nn = self.node_names(node)
        if isinstance(rate, str):
            bps = None if rate.strip().lower() in UNLIMITED else parse_rate(rate)
        else:
            bps = rate
        netns.shape(nn.veth, bps)
        netns.shape("eth0", bps, netns=nn.netns)
        with self._lock():
            state = self._load() or {}
            state.setdefault("rates", {})[node] = bps
            self._save(state)


def _run_captured(
    cmd: list[str], *, input: str | bytes | None, text: bool, timeout: float | None, env: dict[str, str]
) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a session of its own, so a timeout kills the command
    inside the node as well as ``nsenter`` (which forks it into the PID namespace)."""
    stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
    with subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=text, env=env, start_new_session=True) as popen:
        try:
            out, err = popen.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            out, err = popen.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout or 0, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, popen.returncode, out, err)
