"""Removing a sandbox: ``down``, and the clean-up of a crashed ``up``.

Order matters: first every process in the nodes' namespaces (init first,
then SIGKILL for stragglers), then the namespaces (their veth ends go with
them), then the remaining links and bridges, the /etc/hosts block, and last
the state directory, so a failed ``down`` can always be run again.
Only what the sandbox created is touched: its namespaces by name, its links
by alias (``corral-sandbox:<name>``), and in the state directory only the
files it writes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import TYPE_CHECKING

from corral.errors import SandboxError
from corral.sandbox import files, netns, preflight
from corral.sandbox import spec as specs
from corral.sandbox.files import STATE_FILE

if TYPE_CHECKING:  # pragma: no cover
    from corral.sandbox.instance import Sandbox

log = logging.getLogger(__name__)

#: What ``down`` may delete in a state directory; anything else is left alone.
OWNED = {
    STATE_FILE, "hostfile", "corral.toml", "ssh_config", "known_hosts", "id_ed25519",
    "id_ed25519.pub", "nodes", ".lock", "slurm",
}


def present_sandboxes() -> list[str]:
    """Names of the sandboxes with namespaces or an /etc/hosts block on this machine.

    Found from the system, not from state directories, so it also lists a
    sandbox whose state directory is gone (a crashed ``up``, a deleted temp dir).
    """
    names = set()
    for ns in netns.netns_list():
        if ns.startswith("corral_") and ns.count("_") >= 2:
            names.add(ns.split("_")[1])
    try:
        text = files.ETC_HOSTS.read_text()
    except OSError:
        text = ""
    names.update(files.block_names(text))
    return sorted(names)


class TeardownOps:
    """Mixed into ``Sandbox``."""

    def down(self: Sandbox) -> dict:
        """Remove everything of this sandbox; idempotent.  Returns what was removed."""
        preflight.check_privileges()
        if self.state_dir.exists():
            with self._lock():
                removed = self._teardown()
                removed["state_dir"] = self._remove_state_dir()
        else:
            removed = self._teardown()
            removed["state_dir"] = None
        return removed

    def _teardown(self: Sandbox, *, leftovers: bool = False) -> dict:
        """Kill, then delete namespaces, links and the /etc/hosts block (state dir kept)."""
        prefix = specs.netns_prefix(self.name)
        stopped = self.slurm_down() if self.state_dir.exists() else []
        spaces = [ns for ns in netns.netns_list() if ns.startswith(prefix)]
        left = netns.empty_netns(spaces) if spaces else {}
        if left:
            pids = ", ".join(f"{ns}: {' '.join(map(str, p))}" for ns, p in left.items())
            raise SandboxError(f"processes survived SIGKILL ({pids}); nothing was removed",
                               hint="they are stuck in the kernel (D state?); retry `corral sandbox down` later")
        if spaces:
            netns.ip_batch((f"netns del {ns}" for ns in spaces), force=True)
        ours = self._own_links()
        # A veth whose namespace just went may vanish on its own while we delete it.
        netns.ip_batch((f"link del {name}" for name in ours), force=True)
        with files.locked_etc_hosts() as (text, write):
            stripped = files.strip_blocks(text, self.name)
            had_block = stripped != text
            if had_block:
                write(stripped)
        if (spaces or ours or had_block) and leftovers:
            log.info("removed leftovers of sandbox %s: %s %s", self.name, spaces, ours)
        leftover = self._leftovers(prefix)
        if leftover:
            raise SandboxError(f"could not remove {', '.join(leftover)}",
                               hint="retry `corral sandbox down`; see `ip link` and `ip netns list`")
        sock_dir = f"/run/corral-slurm-{specs.tag_for(self.name)}"
        if os.path.isdir(sock_dir) and not os.path.islink(sock_dir):
            shutil.rmtree(sock_dir, ignore_errors=True)
        return {"namespaces": spaces, "links": ours, "hosts_block": had_block, "slurm": stopped}

    def _leftovers(self: Sandbox, prefix: str, timeout: float = 2.0) -> list[str]:
        """Namespaces and links still there (kernel cleanup is asynchronous: wait a bit)."""
        deadline = time.monotonic() + timeout
        while True:
            left = [ns for ns in netns.netns_list() if ns.startswith(prefix)] + self._own_links()
            if not left or time.monotonic() > deadline:
                return left
            netns.ip_batch((f"link del {name}" for name in self._own_links()), force=True)
            time.sleep(0.1)

    def _own_links(self: Sandbox) -> list[str]:
        tag = specs.tag_for(self.name)
        alias = f"corral-sandbox:{self.name}"
        out = []
        for name, entry in netns.links().items():
            if entry.get("ifalias") == alias:
                out.append(name)
            elif name.startswith(tag) and entry.get("ifalias") is None and name[len(tag):][:1] in ("b", "e", "f"):
                out.append(name)  # created, crashed before its alias was set
        # Bridges last: a veth enslaved to a bridge goes with its namespace anyway.
        return sorted(out, key=lambda n: n.startswith(tag + "b"))

    def _remove_state_dir(self: Sandbox) -> str | None:
        if not self.state_dir.exists():
            return None
        for entry in os.listdir(self.state_dir):
            path = self.state_dir / entry
            if entry not in OWNED and not entry.endswith(".tmp"):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        try:
            self.state_dir.rmdir()
        except OSError:
            log.warning("left %s in place: it holds files corral did not create", self.state_dir)
        return str(self.state_dir)
