"""The head's own limits: open files for hundreds of nodes.

A run holds, for every node, its ssh process's three pipes, and a log file
for every rank; 256 nodes pass the soft ``ulimit -n`` of a default login
(1024) long before anything else runs out.  The soft limit is the one a
program may raise itself, up to the hard limit (systemd's own advice for
programs that need many files), so corral does that, and says so in one
line; when even the hard limit is too low it stops before connecting, with
the number it needs, instead of failing half-way ("Too many open files"
from a log, a pipe or ssh).
"""

from __future__ import annotations

import resource

from corral.errors import CorralError

#: Files the head holds whatever the cluster's size (its own, rich, sockets).
BASE_FILES = 64
#: Per node: the ssh process's stdin, stdout and stderr, and one spare.
FILES_PER_NODE = 4


def files_needed(nodes: int, ranks: int = 0) -> int:
    """Open files a run on ``nodes`` nodes with ``ranks`` rank logs may hold at once."""
    return BASE_FILES + FILES_PER_NODE * nodes + ranks


def ensure_open_files(needed: int, what: str, say=None) -> None:
    """Make sure this process may open ``needed`` files: raise the soft limit
    when it is lower (``say`` gets the line that says so), or raise a
    CorralError naming the numbers when the hard limit is lower still."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise CorralError(
            f"{what} needs about {needed} open files at once; this process may open {hard} "
            f"(the hard `ulimit -Hn`)",
            hint=f"raise it where you log in (`nofile` in /etc/security/limits.conf, or LimitNOFILE= "
                 f"for a service) to {needed} or more, or run on fewer nodes",
        )
    new = hard if hard != resource.RLIM_INFINITY else max(needed, 65536)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if say is not None:
        say(f"raised this process's open-file limit (ulimit -n) from {soft} to {new}: "
            f"{what} holds about {needed} files at once")


#: Up to this many nodes, the head pings each agent and each agent beats
#: once a second, and telemetry is sampled once a second.
STEADY_NODES = 64
#: The longest ping/heartbeat interval (a quarter of the default 10 s
#: timeouts: a lost node is still named within them), and telemetry's.
PING_MAX_S = 2.5
TELEMETRY_MAX_S = 5.0


def ping_interval(nodes: int, timeout: float = 10.0) -> float:
    """Seconds between the head's pings to an agent, and the agent's heartbeats.

    Why: every ping and heartbeat is a pipe write or read in the head, for
    every node.  At 256 nodes, 1 s each (plus telemetry) made ~770 head
    syscalls a second; on a head sharing its CPUs (the sandbox: every node
    on this machine) each cost ms, the run loop fell behind, pings to some
    agents came 11-15 s apart, and the agents stopped their jobs.  Past 64
    nodes the interval grows with the count, to at most a quarter of the
    timeout, so the head's steady work per second stays flat."""
    return min(max(1.0, nodes / STEADY_NODES), PING_MAX_S, max(1.0, timeout / 4))


#: How long an agent tolerates a silent head in its job's first seconds, from
#: ``STEADY_NODES`` nodes on (``start_grace``).
START_GRACE_S = 60.0


def start_grace(nodes: int) -> float:
    """Seconds after a job starts on a node during which its agent waits for a
    silent head as long as an agent with no job does (60 s), not ``--node-timeout``.

    Why: a head starting hundreds of nodes is at its busiest while the first
    nodes' jobs already run.  At 256 nodes on a loaded 2-core machine its
    pings to one agent came 12 s apart 30 s into the launch, that agent
    stopped its job as if the head were gone, and the run lost a node that
    was up.  A head that really dies closes its ssh channels (the agents
    stop at once); only a frozen or cut-off head is noticed later, and the
    head's own detection of a lost node is unchanged."""
    return START_GRACE_S if nodes >= STEADY_NODES else 0.0


def telemetry_interval(nodes: int) -> float:
    """Seconds between one node's telemetry samples (1 s up to 64 nodes, then growing, at most 5 s)."""
    return min(max(1.0, nodes / STEADY_NODES), TELEMETRY_MAX_S)
