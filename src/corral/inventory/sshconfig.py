"""Fill in what ``~/.ssh/config`` says about each host, via ``ssh -G``.

Users already describe their machines as ssh aliases (``Host gpu1`` /
``HostName 10.0.0.7`` / ``Port 2222`` / ``User ubuntu``).  Rather than parse
ssh_config ourselves -- ``Match``, ``Include``, tokens and first-match-wins
make that a trap -- we ask the real client: ``ssh -G HOST`` prints the
effective configuration and exits without touching the network.

The resolved address matters beyond ssh: it is what the other nodes dial for
the rendezvous, where an alias like ``gpu1`` means nothing.

Option order mirrors what the transport must do, because ssh keeps the
*first* value it sees for each option: explicit ``-p``/``-l`` from the host,
then the host's ``ssh_options``, then the cluster's.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from corral.errors import HostError, InventoryError
from corral.model import Cluster, Host

log = logging.getLogger(__name__)

#: ``ssh -G`` runs no network I/O, but ``Match exec`` lines can run commands.
SSH_G_TIMEOUT_S = 15.0
MAX_PARALLEL = 16


def ssh_g_argv(cluster: Cluster, host: Host, *, ssh_config_file: str | None = None) -> list[str]:
    """The ``ssh -G`` command line that shows how ssh would reach ``host``."""
    argv = ["ssh", "-G"]
    config = ssh_config_file or cluster.ssh_config
    if config:
        argv += ["-F", config]
    if host.port is not None:
        argv += ["-p", str(host.port)]
    if host.user is not None:
        argv += ["-l", host.user]
    for option in (*host.ssh_options, *cluster.ssh_options):
        argv += ["-o", option]
    argv += ["--", host.name]
    return argv


def resolve_ssh(
    cluster: Cluster,
    *,
    ssh_config_file: str | None = None,
    max_workers: int = MAX_PARALLEL,
) -> Cluster:
    """Return ``cluster`` with address, port and user filled from ssh_config.

    Only fields the cluster left unset are filled; local hosts are skipped.
    ``ssh_config_file`` (``ssh -F``) overrides ``cluster.ssh_config``.  All
    hosts are resolved in parallel; any failure raises one error naming the
    host and ssh's own message.
    """
    remote = [h for h in cluster.hosts if not h.local]
    if not remote or cluster.transport != "ssh":  # srun reaches Slurm's nodes by name
        return cluster
    if shutil.which("ssh") is None:
        raise HostError(
            socket.gethostname(),
            "the ssh client is not installed here, so ssh aliases cannot be resolved",
            hint="install OpenSSH (apt-get install openssh-client) or pass --no-resolve",
        )
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(remote)))) as pool:
        results = list(
            pool.map(lambda h: _ssh_g(cluster, h, ssh_config_file), remote)
        )
    failures = [(h, err) for h, (_, err) in zip(remote, results) if err is not None]
    if failures:
        host, err = failures[0]
        more = f" (and {len(failures) - 1} more host(s))" if len(failures) > 1 else ""
        command = " ".join(ssh_g_argv(cluster, host, ssh_config_file=ssh_config_file))
        raise InventoryError(
            f"ssh cannot read its configuration for {host.name!r}: {err}{more}",
            path=cluster.path,
            hint=f"check ssh_options and the ssh config; `{command}` shows what ssh would use",
        )
    resolved = iter(fields for fields, _ in results)
    hosts = tuple(_fill(h, next(resolved)) if not h.local else h for h in cluster.hosts)
    return replace(cluster, hosts=hosts)


def _ssh_g(cluster: Cluster, host: Host, config: str | None) -> tuple[dict[str, str], str | None]:
    """Run ``ssh -G`` for one host: (effective options, error text or None)."""
    argv = ssh_g_argv(cluster, host, ssh_config_file=config)
    log.debug("resolving %s: %s", host.name, argv)
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=SSH_G_TIMEOUT_S, check=False,
        )
    except subprocess.TimeoutExpired:
        return {}, f"`ssh -G` did not finish in {SSH_G_TIMEOUT_S:.0f}s (a slow 'Match exec'?)"
    if proc.returncode != 0:
        lines = [
            ln for ln in proc.stderr.splitlines()
            if ln.strip() and "Pseudo-terminal will not be allocated" not in ln
        ]
        return {}, "; ".join(lines) or f"ssh -G exited with status {proc.returncode}"
    fields: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        fields.setdefault(key.lower(), value.strip())
    return fields, None


def _fill(host: Host, fields: dict[str, str]) -> Host:
    changes: dict[str, object] = {}
    hostname = fields.get("hostname")
    if host.address is None and hostname and hostname.lower() != host.name.lower():
        changes["address"] = hostname
    if host.port is None and fields.get("port", "").isdigit():
        changes["port"] = int(fields["port"])
    if host.user is None and fields.get("user"):
        changes["user"] = fields["user"]
    if not changes:
        return host
    try:
        return host.with_(**changes)
    except ValueError as err:  # what ssh_config says goes into argv and ssh files too
        raise InventoryError(
            f"your ssh config gives {err}", hint=f"check the Host block for {host.name} "
            f"(`ssh -G {host.name}` shows what ssh would use)",
        ) from None
