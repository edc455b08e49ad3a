"""A node that corral run lost: no rank failed, the node went silent.

When a node stops answering (its agent's heartbeats stop: a network
partition, a frozen or powered-off host, sshd killed), ``corral run``
records ``failure.kind == "lost"`` in run.json, with the reason, and tears
the job down.  The other nodes' logs then show only that teardown (SIGTERM
to their launchers), which the rules rightly call a consequence; without a
finding of its own the report would point at nothing.  This module turns
run.json's record into that finding: the node, how long it was silent, the
last lines it wrote, and what to check on it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from corral.diagnose.logtext import MAX_LINE, open_log
from corral.diagnose.matcher import Diagnosis, MatchedLine
from corral.diagnose.prefilter import blocks

#: Id of the finding (it comes from run.json, so it is no rule in rules.toml).
NODE_LOST = "node-lost"
_SILENT = re.compile(r"no heartbeat for (?P<seconds>\d+(?:\.\d+)?) ?s\b")
#: Last lines shown per log of the lost node.
_TAIL = 2
_MAX_LINES = 8


def _tail(file: Path, origin: str, host: str, rank: int | None) -> list[MatchedLine]:
    """The last non-blank lines of one log (carriage-return overwrites split off).

    Read in blocks (newlines counted in C), so a multi-gigabyte rank log
    costs a pass at memory speed and only its last blocks are split.
    """
    last: deque[tuple[int, str]] = deque(maxlen=2)
    try:
        with open_log(file) as stream:
            for number, text in blocks(stream, MAX_LINE):
                last.append((number, text))
    except OSError:
        return []
    found: deque[tuple[int, str]] = deque(maxlen=_TAIL)
    for number, text in last:
        for i, raw in enumerate(text.split("\n")):
            shown = raw.split("\r")[-1].strip() or raw.strip()
            if shown:
                found.append((number + i, shown[:400]))
    return [MatchedLine(line=n, text=t, origin=origin, host=host, rank=rank) for n, t in found]


def lost_node(failure_host: str, reason: str | None, root: Path,
              logs: Sequence[tuple[Path, str | None, int | None]]) -> Diagnosis:
    """The finding for a node run.json records as lost (``failure.kind == "lost"``)."""
    host = failure_host
    why = reason or "it stopped answering"
    m = _SILENT.search(why)
    silence = f"no heartbeat for {float(m['seconds']):g} s" if m else why
    lines: list[MatchedLine] = []
    ranks: list[int] = []
    for file, h, rank in logs:
        if h != host:
            continue
        if rank is not None:
            ranks.append(rank)
        lines += _tail(file, str(file.relative_to(root)), host, rank)
    return Diagnosis(
        rule_id=NODE_LOST,
        title=f"{host} was lost: {silence} (network partition or frozen host)",
        category="network", category_label="network/NCCL",
        cause=(f"corral run stopped hearing from {host}: its node agent sends a heartbeat over the "
               f"ssh connection every second, and none came ({why}). No rank reported an error "
               "first: the node, or the network path to it, went away. The usual causes are a "
               "network partition (a link, switch or firewall rule between the head and the node), "
               "a host that froze (out of memory and swapping, a kernel hang or panic, a GPU that "
               "locked up the driver), sshd on the node killed or restarted, or the machine losing "
               "power or being preempted. The other nodes' errors below are corral stopping them."),
        fix=(
            f"Is {host} reachable from the head now: `ping {host}` and `ssh {host} uptime` "
            "(a short uptime means it rebooted; no answer means it is down or cut off).",
            f"If it answers, look for what froze it: `ssh {host} 'dmesg -T | tail -50'` and "
            "`journalctl -k -b -1` (kernel panic, hung task, Out of memory, NVIDIA Xid), and "
            "`free -h` / swap use while the job runs.",
            f"Check the network path: from another node `ping {host}`, the switch port and cabling, "
            "and any firewall or security-group change; a NAT or firewall that drops idle "
            "connections shows as all ssh sessions to the node dying at once.",
            f"Check sshd on {host}: `journalctl -u ssh -u sshd` around the time of the failure "
            "(restarted, killed by the OOM killer, MaxStartups throttling).",
            "Check power and the provider: the BMC event log (`ipmitool sel list`) or the cloud "
            "console for a stop, preemption or maintenance event.",
            "If the node is only slow to answer (heavy swap, a saturated link), raise "
            "`corral run --node-timeout` above the default 10 s; resume from the last checkpoint "
            "with `--max-restarts` once the node is back.",
        ),
        confidence=0.95, lines=tuple(lines[-_MAX_LINES:]), host=host, rank=None,
        hosts=(host,), ranks=tuple(sorted(ranks)), origin=None,
        captures={"host": host, "silence": silence},
    )
