"""The local transport: "this machine" through the same agent path as a node."""

from __future__ import annotations

from corral.errors import HostError
from corral.model import Host
from corral.transport.ssh import quote


class LocalTransport:
    name = "local"

    def env(self) -> None:
        """This machine's processes inherit the environment as it is."""
        return None

    def argv(self, host: Host, remote: list[str]) -> list[str]:
        return list(remote)

    def failure(self, host: Host, returncode: int, stderr: str) -> HostError:
        last = quote(stderr.strip().splitlines()[-1]) if stderr.strip() else f"exit code {returncode}"
        if returncode == 127 or "No such file or directory" in stderr:
            return HostError(
                host.name,
                f"cannot run the interpreter {host.python!r}: {last}",
                hint="set `python` for this host in the cluster file to an existing interpreter",
                kind="no-python",
            )
        return HostError(host.name, f"local agent failed: {last}", kind="agent-failed")
