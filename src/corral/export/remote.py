"""Exports that reach the nodes: an ssh_config, and pdsh's host list and ssh arguments.

The ssh_config is what ``ssh -G`` says corral's own ssh would use for each
host (the cluster file's user, port and ``ssh_options`` over the user's
ssh config), written out so that plain ``ssh -F FILE NODE``, pdsh, DeepSpeed's
runner and mpirun reach the nodes exactly as corral does.  Only what matters
for reaching a node is kept: address, user, port, keys, ProxyJump, host-key
files; ssh's built-in defaults are left out.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from corral.errors import InventoryError, UsageError
from corral.export import Export, ExportFile, ExportRequest
from corral.hostrange import fold
from corral.inventory.sshconfig import SSH_G_TIMEOUT_S, ssh_g_argv
from corral.model import Cluster, Host

SSH_CONFIG = "ssh_config"

#: ssh -G keys written when they differ from ssh's default, in ssh_config's spelling.
_KEPT = {
    "identityfile": "IdentityFile", "identitiesonly": "IdentitiesOnly", "proxyjump": "ProxyJump",
    "proxycommand": "ProxyCommand", "userknownhostsfile": "UserKnownHostsFile",
    "globalknownhostsfile": "GlobalKnownHostsFile", "stricthostkeychecking": "StrictHostKeyChecking",
    "certificatefile": "CertificateFile", "hostkeyalias": "HostKeyAlias", "identityagent": "IdentityAgent",
    "connecttimeout": "ConnectTimeout", "serveraliveinterval": "ServerAliveInterval",
}
#: ssh's own defaults, left out (``ssh -G`` prints them for every host).
_DEFAULT_KEYS = {f"~/.ssh/{n}" for n in ("id_rsa", "id_ecdsa", "id_ecdsa_sk", "id_ed25519", "id_ed25519_sk",
                                         "id_xmss", "id_dsa")}
_DEFAULTS = {
    "identitiesonly": {"no"}, "proxyjump": {"none"}, "proxycommand": {"none"},
    "globalknownhostsfile": {"/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"},
    "stricthostkeychecking": {"ask"}, "certificatefile": {"none"}, "hostkeyalias": {"none"},
    "identityagent": {"none"}, "connecttimeout": {"none"}, "serveraliveinterval": {"0"},
}


def _default_known_hosts() -> set[str]:
    """ssh -G prints the default user known_hosts with the home expanded."""
    import pwd

    homes = {"~", os.path.expanduser("~"), pwd.getpwuid(os.getuid()).pw_dir}
    return {f"{h}/.ssh/known_hosts {h}/.ssh/known_hosts2" for h in homes}


def _ssh_g(cluster: Cluster, host: Host) -> list[tuple[str, str]]:
    """``ssh -G`` for one host: its (key, value) lines, repeated keys kept in order."""
    argv = ssh_g_argv(cluster, host)
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=SSH_G_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise UsageError("the ssh client is not installed here",
                         hint="install OpenSSH (apt-get install openssh-client)") from None
    except subprocess.TimeoutExpired:
        raise InventoryError(f"`ssh -G {host.name}` did not finish in {SSH_G_TIMEOUT_S:.0f}s",
                             path=cluster.path, hint="a slow 'Match exec' in your ssh config?") from None
    if proc.returncode != 0:
        raise InventoryError(f"ssh cannot read its configuration for {host.name!r}: {proc.stderr.strip()}",
                             path=cluster.path, hint=f"`{' '.join(argv)}` shows what ssh would use")
    out = []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        out.append((key.lower(), value.strip()))
    return out


def _value(text: str) -> str:
    """One ssh_config value: quoted when it holds blanks; refused when it
    could start a new line (a name from a file is untrusted)."""
    if re.search(r"[\n\r\"]", text):
        raise UsageError(f"cannot write {text[:60]!r} into an ssh_config (a newline or a quote)",
                         hint="fix the value in the cluster file or your ssh config")
    return f'"{text}"' if re.search(r"\s", text) else text


def host_block(cluster: Cluster, host: Host) -> list[str]:
    """The ``Host`` block for one node, as corral's ssh reaches it."""
    if host.local:
        return [f"Host {host.name}", "    HostName localhost"]
    fields = _ssh_g(cluster, host)
    first = {}
    for key, value in fields:
        first.setdefault(key, value)
    # the cluster file's address wins, as corral's transport passes it (-o HostName=)
    address = host.address or first.get("hostname", host.name)
    lines = [f"Host {host.name}", f"    HostName {_value(address)}"]
    if first.get("user"):
        lines.append(f"    User {_value(first['user'])}")
    if first.get("port"):
        lines.append(f"    Port {first['port']}")
    given = {o.split("=", 1)[0].strip().lower() for o in (*host.ssh_options, *cluster.ssh_options)}
    for key, value in fields:
        if key not in _KEPT:
            continue
        if key == "identityfile":
            if value in _DEFAULT_KEYS and key not in given:
                continue
        elif key == "userknownhostsfile":
            if value in _default_known_hosts() and key not in given:
                continue
        elif value.lower() in _DEFAULTS.get(key, set()) and key not in given:
            continue
        # several known_hosts files are one value of blank-separated paths
        text = value if key.endswith("knownhostsfile") else _value(value)
        lines.append(f"    {_KEPT[key]} {text}")
    return lines


def ssh_config_text(cluster: Cluster) -> str:
    hosts = list(cluster.hosts)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
        blocks = list(pool.map(lambda h: host_block(cluster, h), hosts))
    head = [f"# Written by `corral export` from {cluster.source or 'the cluster'}: every node as corral's",
            "# ssh reaches it.  Use: ssh -F THIS_FILE NODE, or Include it from ~/.ssh/config."]
    return "\n".join(head + [line for block in blocks for line in ([""] + block)]) + "\n"


def ssh_config_file(request: ExportRequest) -> ExportFile:
    return ExportFile(name=SSH_CONFIG, text=ssh_config_text(request.cluster))


def ssh_config(request: ExportRequest) -> Export:
    path = request.path_of(SSH_CONFIG)
    first = request.cluster.hosts[0].name
    return Export(format="ssh-config", files=(ssh_config_file(request),),
                  commands=(f"ssh -F {shlex.quote(str(path))} {first} true",))


def single_user(cluster: Cluster, tool: str) -> str | None:
    """The one login user of every node (pdsh passes its own ``-l``, which
    wins over the ssh_config's ``User``); None when ssh's default applies."""
    users = {h.user for h in cluster.hosts}
    if len(users) > 1:
        detail = ", ".join(f"{h.user or '(default)'}@{h.name}" for h in cluster.hosts)
        raise UsageError(f"{tool} logs in to every node as one user, but the cluster names several ({detail})",
                         hint="give every host the same user in the cluster file")
    return users.pop()


def ssh_args_append(outdir: Path) -> str:
    """PDSH_SSH_ARGS_APPEND: ssh reads the exported ssh_config (and only it)."""
    return f"-F {shlex.quote(str(outdir / SSH_CONFIG))}"


def pdsh(request: ExportRequest) -> Export:
    cluster = request.cluster
    user = single_user(cluster, "pdsh")
    wlist = fold(h.name for h in cluster.hosts)
    append = ssh_args_append(request.outdir)
    env_file = ("# Written by `corral export pdsh`: source it, then `pdsh -w LIST CMD` reaches every node\n"
                "# as corral does (PDSH_SSH_ARGS_APPEND points ssh at the exported ssh_config).\n"
                "export PDSH_RCMD_TYPE=ssh\n"
                f"export PDSH_SSH_ARGS_APPEND={shlex.quote(append)}\n")
    words = ["pdsh", "-R", "ssh", *(["-l", user] if user else []), "-w", wlist, "hostname"]
    command = (f"PDSH_SSH_ARGS_APPEND={shlex.quote(append)} "
               + " ".join(shlex.quote(w) for w in words))
    return Export(format="pdsh", files=(ssh_config_file(request), ExportFile(name="pdsh.env", text=env_file)),
                  commands=(command,),
                  data={"wlist": wlist, "user": user, "pdsh_ssh_args_append": append})
