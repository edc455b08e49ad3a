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
