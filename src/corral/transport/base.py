"""The transport interface."""

from __future__ import annotations

from typing import Protocol

from corral.errors import HostError
from corral.model import Host


class Transport(Protocol):
    """Builds the local argv that runs ``remote`` (an argv) on ``host``."""

    #: Short name for messages ("ssh", "local").
    name: str

    def argv(self, host: Host, remote: list[str]) -> list[str]:
        """argv to exec on the head so that ``remote`` runs on ``host``."""
        ...

    def env(self) -> dict[str, str] | None:
        """Environment to spawn ``argv`` with (None: inherit corral's)."""
        ...

    def failure(self, host: Host, returncode: int, stderr: str) -> HostError:
        """Name why running something on ``host`` failed, from its exit and stderr."""
        ...
