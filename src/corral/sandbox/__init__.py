"""A simulated multi-node cluster on one Linux machine (``corral sandbox``).

Each node is a set of Linux namespaces (network, PID, mount, UTS, IPC) with
an ``eth0`` on a bridge of its own, a real OpenSSH sshd, its own hostname,
node-private ``~/.ssh``, ``/tmp``, ``/var/tmp``, ``/srv`` and ``/home`` and its
own ``/etc`` (an overlay of the head's); everything else (``/usr``, the Python
environment) is shared, like machines booted from one image.  Users rehearse multi-node runs on it
before renting GPUs; corral's own multi-node tests and benchmarks run on it.

Library use::

    from corral.sandbox import Sandbox

    sb = Sandbox(name="demo", prefix="sim")
    sb.up(4, with_keys=True, rate="1gbit")
    sb.exec("sim1", ["hostname"]).stdout          # 'sim1\\n'
    sb.partition("sim2"); sb.heal("sim2")
    cluster_file = sb.cluster_file                 # for `corral run --cluster`
    sb.down()

See docs/sandbox.md for the commands and the layout.
"""

from corral.sandbox.instance import Sandbox
from corral.sandbox.spec import (
    DEFAULT_NAME,
    DEFAULT_PASSWORD,
    DEFAULT_PREFIX,
    TEST_USER,
    SandboxSpec,
    format_rate,
    parse_rate,
)
from corral.sandbox.status import NodeStatus, SandboxStatus
from corral.sandbox.teardown import present_sandboxes

__all__ = [
    "DEFAULT_NAME",
    "DEFAULT_PASSWORD",
    "DEFAULT_PREFIX",
    "TEST_USER",
    "NodeStatus",
    "Sandbox",
    "SandboxSpec",
    "SandboxStatus",
    "format_rate",
    "parse_rate",
    "present_sandboxes",
]
