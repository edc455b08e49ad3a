"""A setup session: how the head talks to the nodes while it sets up SSH.

Every ssh it runs is pinned to the host keys this session verified (a
private known_hosts file first on the command line, ``StrictHostKeyChecking
yes``), offers the head's identity, and is either a key login (``BatchMode``,
multiplexed) or, for the one call that installs the head's key, a password
login through the askpass broker.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from corral.model import Cluster, Host
from corral.sshsetup import nodeside
from corral.sshsetup.askpass import PasswordBroker
from corral.sshsetup.hostkeys import HostKeys, known_hosts_lines
from corral.sshsetup.remote import call_node, remote_command, ssh_argv
from corral.transport.ssh import SSHTransport

_NODESIDE_SOURCE: str | None = None


def nodeside_source() -> str:
    global _NODESIDE_SOURCE
    if _NODESIDE_SOURCE is None:
        _NODESIDE_SOURCE = Path(nodeside.__file__).read_text()
    return _NODESIDE_SOURCE


class Session:
    """Key and password calls to the hosts of one cluster, with pinned host keys."""

    def __init__(
        self,
        cluster: Cluster,
        verdicts: Mapping[str, HostKeys],
        broker: PasswordBroker,
        *,
        identity: Path | None,
        connect_timeout: float = 10.0,
    ):
        self.cluster = cluster
        self.broker = broker
        self.identity = identity
        self.connect_timeout = connect_timeout
        #: Hosts reached by password for every call (dry runs: no key is installed).
        self.by_password: set[str] = set()
        #: Changes made over the password connection (the head's key), per host.
        self.extra_changes: dict[str, list[str]] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="corral-ssh-"))
        self.known_hosts = self._dir / "known_hosts"
        lines: list[str] = []
        for v in verdicts.values():
            lines += known_hosts_lines([v.target.key_name], v.target.port, v.keys)
        self.known_hosts.write_text("\n".join(lines) + "\n")

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def _pinned(self) -> list[str]:
        return [
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "UpdateHostKeys=no",
        ]

    def key_argv(self, host: Host, remote: list[str]) -> list[str]:
        first = self._pinned()
        if self.identity is not None:
            first += ["-i", str(self.identity)]
        return ssh_argv(
            self.cluster, host, remote, first=first, connect_timeout=self.connect_timeout
        )

    def password_argv(self, host: Host, remote: list[str]) -> list[str]:
        first = [
            "-o",
            "BatchMode=no",
            "-o",
            "PubkeyAuthentication=no",
            "-o",
            "PreferredAuthentications=keyboard-interactive,password",
            "-o",
            "NumberOfPasswordPrompts=1",
            "-o",
            "ControlMaster=no",
            "-o",
            "ControlPath=none",
            *self._pinned(),
        ]
        return ssh_argv(
            self.cluster,
            host,
            remote,
            first=first,
            multiplex=False,
            connect_timeout=self.connect_timeout,
        )

    async def call(
        self,
        host: Host,
        fn: str,
        args: dict[str, Any],
        *,
        password: bool = False,
        timeout: float = 120.0,
    ) -> Any:
        """``nodeside.<fn>(**args)`` on ``host``; by password when asked or when pinned to it."""
        remote = remote_command(host.python)
        if password or host.name in self.by_password:
            argv = self.password_argv(host, remote)
            env = self.broker.env_for(host.name)
        else:
            argv = self.key_argv(host, remote)
            env = None
        return await call_node(
            host, argv, "sshsetup", nodeside_source(), fn, args, timeout=timeout, env=env
        )

    async def close_masters(self) -> None:
        """End multiplexed connections, so a removed key cannot keep working through them."""
        transport = SSHTransport(self.cluster, connect_timeout=self.connect_timeout)

        async def one(host: Host) -> None:
            base = transport.base_argv(host)
            proc = await asyncio.create_subprocess_exec(
                base[0],
                "-O",
                "exit",
                *base[1:],
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            await proc.wait()

        await asyncio.gather(*(one(h) for h in self.cluster.hosts))
