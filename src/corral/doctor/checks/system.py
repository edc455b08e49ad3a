"""System checks: clocks, /dev/shm, disk space, locked-memory limits, unreadable facts."""

from __future__ import annotations

import os
import statistics

from corral.doctor.checks.base import (
    ERROR,
    OK,
    WARNING,
    Evidence,
    Finding,
    group_hosts,
    human_bytes,
)
from corral.hostrange import HostSet

#: Clock skew (seconds) beyond which logs, certificates and rendezvous keep-alives disagree.
MAX_SKEW_S = 1.0
#: /dev/shm below this breaks NCCL's shared-memory transport and DataLoader workers.
MIN_SHM_BYTES = 1 << 30
#: Free space in the working directory below which checkpoints will not fit.
MIN_DISK_BYTES = 10 << 30
#: Free space in the temporary directory below which the ranks' output files
#: (corral's job directory) and torch's caches fill it during a run.
MIN_TMP_BYTES = 256 << 20


def clock_skew(ev: Evidence) -> list[Finding]:
    """Node clocks within ``MAX_SKEW_S`` of each other (measured against the head)."""
    if len(ev.clock) < 2:
        return []
    median = statistics.median(c.offset_s for c in ev.clock.values())
    off: dict[str, float] = {}
    for host, c in ev.clock.items():
        delta = c.offset_s - median
        if abs(delta) - c.uncertainty_s > MAX_SKEW_S:
            off[host] = delta
    if not off:
        spread = max(c.offset_s for c in ev.clock.values()) - min(c.offset_s for c in ev.clock.values())
        return [Finding(check="system.clock", severity=OK, hosts=HostSet.of(ev.clock),
                        message=f"clocks agree within {max(spread, 0.001):.3f}s")]
    return [Finding(
        check="system.clock", severity=WARNING, hosts=HostSet.of([h]),
        message=f"clock is {abs(d):.1f}s {'ahead of' if d > 0 else 'behind'} the other nodes",
        hint=f"synchronise {h}'s clock (chrony or systemd-timesyncd: `timedatectl status`); "
             "skewed clocks confuse logs, TLS and rendezvous keep-alives",
    ) for h, d in off.items()]


def shm(ev: Evidence) -> list[Finding]:
    """/dev/shm of at least 1 GiB (docker's default is 64 MiB)."""
    sizes = {h: ev.facts[h].get("shm_bytes") for h in ev.reachable}
    small = {h: s for h, s in sizes.items() if s is not None and s < MIN_SHM_BYTES}
    missing = HostSet.of(h for h, s in sizes.items() if s is None)
    out: list[Finding] = []
    for size, hosts in group_hosts(small):
        gpu = any(ev.facts[h].get("gpus") for h in hosts)
        out.append(Finding(
            check="system.shm", severity=ERROR if gpu else WARNING, hosts=hosts,
            message=f"/dev/shm is only {human_bytes(size)}"
                    + (" (docker's default)" if size == 64 << 20 else ""),
            hint="give the container more shared memory (`docker run --shm-size=16g` or "
                 "`--ipc=host`; Kubernetes: an emptyDir with medium: Memory on /dev/shm); NCCL "
                 "and DataLoader workers need it",
        ))
    if missing:
        out.append(Finding(check="system.shm", severity=WARNING, hosts=missing,
                           message="/dev/shm is missing",
                           hint="mount a tmpfs on /dev/shm; NCCL and DataLoader workers use it"))
    if not out and sizes:
        least = min(s for s in sizes.values() if s is not None)
        out.append(Finding(check="system.shm", severity=OK, hosts=HostSet.of(sizes),
                           message=f"/dev/shm at least {human_bytes(least)}"))
    return out


def workdir(ev: Evidence) -> list[Finding]:
    """The working directory exists and has room for checkpoints."""
    out: list[Finding] = []
    missing: dict[str, str] = {}
    readonly: dict[str, str] = {}
    low: dict[str, int] = {}
    for h in ev.reachable:
        f = ev.facts[h]
        if f.get("workdir") and f.get("workdir_exists") is False:
            missing[h] = f["workdir"]
        if f.get("workdir") and f.get("workdir_writable") is False:
            readonly[h] = f["workdir"]
        free = f.get("disk_free_bytes")
        if free is not None and free < MIN_DISK_BYTES:
            low[h] = free
    for path, hosts in group_hosts(missing):
        out.append(Finding(
            check="system.workdir", severity=WARNING, hosts=hosts,
            message=f"working directory {path} does not exist",
            hint="`corral sync` copies the project there (or `corral run --sync`); or set "
                 "`workdir` in the cluster file",
        ))
    for path, hosts in group_hosts(readonly):
        out.append(Finding(
            check="system.workdir", severity=WARNING, hosts=hosts,
            message=f"working directory {path} is not writable (a read-only mount, or the login "
                    "user lacks permission)",
            hint="a job that writes checkpoints or logs there will fail: remount it read-write (a file system "
                 "the kernel remounted read-only after disk errors shows in `dmesg`), fix its "
                 "ownership, or choose another `workdir`",
        ))
    for h, free in low.items():
        out.append(Finding(
            check="system.disk", severity=WARNING, hosts=HostSet.of([h]),
            message=f"only {human_bytes(free)} free in {ev.facts[h].get('workdir')}",
            hint="free some space or choose another `workdir`: checkpoints of large models need "
                 "tens of GiB",
        ))
    frees = [ev.facts[h].get("disk_free_bytes") for h in ev.reachable]
    if not out and any(x is not None for x in frees):
        least = min(x for x in frees if x is not None)
        out.append(Finding(check="system.disk", severity=OK, hosts=HostSet.of(ev.reachable),
                           message=f"working directory present, at least {human_bytes(least)} free"))
    return out


def tmp(ev: Evidence) -> list[Finding]:
    """The temporary directory (where corral puts a job's files on each node)
    is the one asked for, and has room."""
    out: list[Finding] = []
    moved: dict[str, str] = {}
    low: dict[str, int] = {}
    for h in ev.reachable:
        f = ev.facts[h]
        wanted, got, free = f.get("tmp_wanted"), f.get("tmp_dir"), f.get("tmp_free_bytes")
        if wanted and got and os.path.normpath(wanted) != os.path.normpath(got):
            moved[h] = (f"{wanted} is not writable (full, read-only or missing): "
                        + (f"Python falls back to {got}" if got.startswith("/") else "a job cannot start there"))
        elif free is not None and free < MIN_TMP_BYTES:
            low[h] = free
    for why, hosts in group_hosts(moved):
        out.append(Finding(
            check="system.tmp", severity=WARNING, hosts=hosts, message=why,
            hint="a job's files (corral's job directory with the ranks' output, torch's caches) land "
                 "there instead; free space in it, or set TMPDIR to a writable local directory in "
                 "the cluster file's `env`" if "falls back" in why else
                 "create it there (writable by the login user), or change TMPDIR in the cluster "
                 "file's `env`",
        ))
    for h, free in low.items():
        out.append(Finding(
            check="system.tmp", severity=WARNING, hosts=HostSet.of([h]),
            message=f"only {human_bytes(free)} free in {ev.facts[h].get('tmp_dir')}",
            hint="corral puts each job's directory there (the ranks' output as they write it): a full "
                 "one stops ranks mid-run, their last words unwritten; free space, or set TMPDIR in "
                 "the cluster file's `env`",
        ))
    return out


def memlock(ev: Evidence) -> list[Finding]:
    """RDMA pins memory: with InfiniBand, ``ulimit -l`` must be unlimited."""
    limited = {}
    for h in ev.reachable:
        f = ev.facts[h]
        value = f.get("memlock")
        if f.get("infiniband") and isinstance(value, int) and value < (64 << 30):
            limited[h] = value
    return [Finding(
        check="system.memlock", severity=WARNING, hosts=hosts,
        message=f"locked-memory limit is {human_bytes(value)} on nodes with InfiniBand",
        hint="set `* - memlock unlimited` in /etc/security/limits.conf (containers: "
             "`--ulimit memlock=-1`); NCCL over IB fails or slows down otherwise",
    ) for value, hosts in group_hosts(limited)]


def collection_errors(ev: Evidence) -> list[Finding]:
    """Facts a node could not report (so some checks had less to go on)."""
    out = []
    for h in ev.reachable:
        for err in ev.facts[h].get("errors") or []:
            out.append((h, str(err)))
    by_error: dict[str, list[str]] = {}
    for h, err in out:
        by_error.setdefault(err, []).append(h)
    return [Finding(check="system.facts", severity=WARNING, hosts=HostSet.of(hosts),
                    message=f"could not collect: {err}") for err, hosts in by_error.items()]


CHECKS = (clock_skew, shm, workdir, tmp, memlock, collection_errors)
