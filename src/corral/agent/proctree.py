"""The agent's process tree: who belongs to the job, and how it is stopped (stdlib only).

Shipped to nodes as ``corral_agent_proctree``.  The agent is a *child
subreaper*, so every process the workload creates stays in the agent's tree
even when its parent dies or calls setsid; stopping the job signals exactly
that tree, never a process found by name or pattern.
"""

from __future__ import annotations

import os
import signal
import time


def libc_prctl():
    """libc's ``prctl``, or None where it cannot be had (not Linux, no ctypes).

    Resolved ahead: a child between fork and exec (``_die_with_agent``) may
    only call it, not load a library."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except Exception:
        return None


def become_subreaper(prctl=None) -> bool:
    """Make orphaned descendants reparent to us (Linux >= 3.4).

    Without it, a worker whose launcher died would be reparented to init and
    escape both our tree walk and our cleanup.
    """
    prctl = prctl or libc_prctl()
    PR_SET_CHILD_SUBREAPER = 36
    try:
        return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:
        return False


def _ppid_map() -> dict:
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: split after the last ')'.
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) > 1:
            parents[int(name)] = int(rest[1])
    return parents


def descendants(root: int) -> list:
    """All live descendants of ``root`` (by parent links in /proc)."""
    if not os.path.isdir("/proc"):
        return []
    parents = _ppid_map()
    children: dict = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def _is_zombie(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2 :].split()[0] == b"Z"
    except OSError:
        return True


def _zombie_status(pid: int):
    """Exit status of a zombie (``/proc/<pid>/stat`` field 52), else None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2 :].split()
    if not rest or rest[0] != b"Z" or len(rest) < 50:
        return None
    return int(rest[49])


def signal_tree(sig: int) -> int:
    """Send ``sig`` to every live descendant of this agent; return how many."""
    n = 0
    for pid in descendants(os.getpid()):
        if _is_zombie(pid):
            continue
        try:
            os.kill(pid, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def _stat_fields(pid: int):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def reap_orphans(keep: set) -> None:
    """Reap zombie children that the workload's tree left to us (we are its subreaper).

    Only children outside the agent's own session: processes the agent itself
    starts (``subprocess.run`` in a ``call`` function) are reaped by their
    Popen, which would otherwise see a vanished child and report exit code 0.
    ``keep`` (the launcher's Popen) is left alone too.
    """
    me = os.getpid()
    my_session = os.getsid(0)
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in keep:
            continue
        fields = _stat_fields(pid)
        # fields: 0 state, 1 ppid, 2 pgrp, 3 session
        if not fields or fields[0] != b"Z" or int(fields[1]) != me or int(fields[3]) == my_session:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def kill_tree(grace: float, keep: set) -> None:
    """SIGTERM everything we started, then SIGKILL what is left after ``grace``."""
    if signal_tree(signal.SIGTERM) == 0:
        return
    if wait_gone(grace, keep):
        return
    for _ in range(50):
        if signal_tree(signal.SIGKILL) == 0:
            return
        time.sleep(0.05)
        reap_orphans(keep)


def wait_gone(timeout: float, keep: set) -> bool:
    """True once nothing this agent started is alive (within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reap_orphans(keep)
        if not [p for p in descendants(os.getpid()) if not _is_zombie(p)]:
            return True
        time.sleep(0.05)
    return False


def leftovers(settle: float = 1.0) -> list:
    """Command lines of this agent's live descendants (what a job left
    running), after giving the ones already on their way out (a DataLoader
    worker noticing its rank is gone) ``settle`` seconds to go."""
    deadline = time.monotonic() + settle
    while True:
        names = _live_commands()
        if not names or time.monotonic() >= deadline:
            return names
        reap_orphans(set())
        time.sleep(0.05)


def _live_commands() -> list:
    names = []
    for pid in descendants(os.getpid()):
        if _is_zombie(pid):
            continue
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        text = " ".join(a.decode("utf-8", "replace") for a in argv if a)
        if text:  # an empty command line: a process in the middle of exiting
            names.append(text[:60] + ("..." if len(text) > 60 else ""))
    return names
