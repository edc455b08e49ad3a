"""How the head reaches a host: argv builders (ssh, local) and failure naming.

A transport only *builds argv*; ``corral.agent.session`` runs it.  The local
transport has the same interface as the ssh one (and srun, inside a Slurm
allocation, too), so this machine and the
tests take the same code path as a remote node.

``fanout`` runs one command on many hosts at once over these transports,
with no agent (``corral exec``, the sync's node-side steps); ``gather``
folds what the hosts printed into one block per distinct output.
"""

from __future__ import annotations

from corral.model import Cluster, Host
from corral.transport.base import Transport
from corral.transport.local import LocalTransport
from corral.transport.srun import SrunTransport
from corral.transport.ssh import SSHTransport, classify_ssh_failure

__all__ = ["Transport", "LocalTransport", "SSHTransport", "SrunTransport", "classify_ssh_failure",
           "transport_for"]


def transport_for(cluster: Cluster, host: Host, *, connect_timeout: float = 10.0) -> Transport:
    """The transport that reaches ``host``: local for this machine, srun for the
    nodes of the Slurm allocation corral runs in, else ssh."""
    if host.local:
        return LocalTransport()
    if cluster.transport == "srun":
        return SrunTransport(cluster, connect_timeout=connect_timeout)
    return SSHTransport(cluster, connect_timeout=connect_timeout)
