"""Nodes that log in to each other, as on a cluster with a shared home.

Most clusters let every node ssh to every other with one key (a home
directory shared over NFS holds ``~/.ssh/id_*`` and ``authorized_keys``)
and known host keys (``/etc/ssh/ssh_known_hosts``).  ``corral ssh setup``
builds that on machines that lack it and proves it with an all-to-all login
matrix, which at 256 nodes is 65,536 logins.  A sandbox meant to measure
what *uses* node-to-node logins (``corral exec``'s relays, sync's chain) at
that size gets them here instead, written straight into each node's
private ``~/.ssh``: one node key, authorized everywhere, and every node's
host key under its name and address.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from corral.sandbox import files
from corral.sandbox import node as nodes_mod
from corral.sandbox.instance import Sandbox


def mesh(sandbox: Sandbox) -> int:
    """Let every node of the running ``sandbox`` log in to every node (its
    login user, by key, host keys checked); returns how many nodes."""
    known = sandbox.known_hosts.read_text()
    if not known.strip():
        # Without --with-keys the head has no host keys yet: read the nodes'.
        sp = sandbox.spec
        keys = {n.name: nodes_mod.host_key(sandbox.node_dir(n.name)) for n in sp.all_nodes()}
        known = files.known_hosts(sp, keys)
    with tempfile.TemporaryDirectory(prefix="corral-mesh-") as tmp:
        key = Path(tmp) / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "corral-sandbox-mesh",
                        "-f", str(key)], check=True, capture_output=True)
        private, public = key.read_text(), (Path(tmp) / "id_ed25519.pub").read_text()
    names = sandbox.nodes
    for name in names:
        ssh = sandbox.node_dir(name) / "ssh"
        files.write_text(ssh / "id_ed25519", private, mode=0o600)
        files.write_text(ssh / "id_ed25519.pub", public, mode=0o644)
        files.write_text(ssh / "known_hosts", known, mode=0o644)
        nodes_mod._authorize(ssh / "authorized_keys", public)
    return len(names)


__all__ = ["mesh"]
