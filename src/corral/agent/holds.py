"""What the corral jobs on this node hold: GPUs and ports (stdlib only, Python 3.8+).

Shipped with the agent as ``corral_agent_holds``.  Several jobs share a
node: each must run on GPUs no other job of corral uses, and its rendezvous
port must be one no other job was just given (the kernel's free port is
free only until torchrun binds it, seconds later; two jobs started at the
same moment could be told the same one).

The registry is a private directory of this user on this node,
``<tmp>/corral-<uid>/holds`` (``private_dir``: 0700, ours, never a link;
``<tmp>`` is the agent's own temp dir, the same for every job of the user).
Each agent that holds something there writes one file,
``<run-id>.<agent-pid>.json`` (0600, ``O_EXCL | O_NOFOLLOW``), and keeps an
exclusive ``flock`` on it for as long as it lives.  A holding is believed
only while that lock is held: the kernel drops it when the agent exits,
SIGKILL and a crashed node included, so a holding never outlives its job.
A file whose lock can be taken is stale and removed.  Claims are made under
an exclusive ``flock`` of the directory itself, so two jobs started at the
same moment are served one after the other: the second sees the first's
GPUs and port.  Files are read only when they are regular files of this
user (the job's own processes run as the user too, so their contents are
still checked: sizes, types, names).

Limits: the registry is per user (another user's jobs are seen only as GPUs
busy with processes, through nvidia-smi), and per node (a job's port is
held on its node 0, its GPUs on every node).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import socket
import stat
import tempfile
import time

try:  # on a node, modules are installed under their wire names
    from corral_agent_private import private_dir
except ImportError:  # imported as part of the corral package (tests, head)
    from corral.agent.private import private_dir

try:
    import fcntl
except ImportError:  # pragma: no cover - not Linux
    fcntl = None

#: A holding file is small; anything bigger is not one of ours.
MAX_FILE = 64 << 10
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.json")
_ENTRY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_TEXT = re.compile(r"[A-Za-z0-9_.@:+-]{1,128}")

#: This agent's own holding: (fd with the lock, directory, file name), or None.
_MINE = None


def registry_dir(base=None) -> str:
    """``<tmp>/corral-<uid>/holds``: the agent's temp dir, never a job's TMPDIR
    (every job of the user on this node must find the same registry)."""
    base = base or tempfile.gettempdir()
    return os.path.join(base, "corral-%d" % os.getuid(), "holds")


def _lock_registry(path: str) -> int:
    """The registry directory, made private if missing, open and locked
    (exclusive); its fd.  A directory removed by the job that left last
    (between our mkdir and our lock) is made again."""
    base = os.path.dirname(os.path.dirname(path))
    for _ in range(5):
        try:
            private_dir(path, base)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = os.fstat(fd)
        if st.st_nlink > 0 and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return fd
        os.close(fd)  # removed while we waited for the lock: make it again
    raise OSError(errno.EAGAIN, "the registry %s keeps disappearing" % path)


def clean_holding(record) -> dict | None:
    """A holding read back, checked field by field; None when malformed."""
    if not isinstance(record, dict):
        return None
    out = {}
    for key in ("run_id", "user", "head", "node"):
        value = record.get(key)
        out[key] = value if isinstance(value, str) and _TEXT.fullmatch(value) else "?"
    since = record.get("since")
    out["since"] = float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else None
    pid = record.get("pid")
    out["pid"] = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
    gpus = record.get("gpus") or []
    if not isinstance(gpus, list) or len(gpus) > 1024:
        return None
    out["gpus"] = [g for g in gpus if isinstance(g, str) and _ENTRY.fullmatch(g)]
    ports = record.get("ports") or {}
    if not isinstance(ports, dict):
        return None
    out["ports"] = {k: v for k, v in list(ports.items())[:16]
                    if isinstance(k, str) and _TEXT.fullmatch(k) and isinstance(v, int)
                    and not isinstance(v, bool) and 0 < v < 65536}
    return out


def _read_live(dfd: int, prune: bool) -> list:
    """Every holding whose agent is alive; stale files removed when ``prune``
    (only under the registry's lock)."""
    live = []
    me = os.getpid()
    for name in sorted(os.listdir(dfd)):
        if not _NAME.fullmatch(name):
            continue
        if _MINE is not None and _MINE[2] == name:
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                         dir_fd=dfd)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_FILE:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # locked: its agent is alive
                data = os.read(fd, MAX_FILE + 1)
                try:
                    record = clean_holding(json.loads(data.decode("utf-8")))
                except ValueError:
                    record = None
                if record is not None and record["pid"] != me:
                    live.append(record)
                continue
            if prune:  # nobody holds it: its agent is gone (SIGKILL, a crash)
                try:
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    pass
        finally:
            os.close(fd)
    return live


def _port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _local_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        if 1024 <= low <= high <= 65535:
            return low, high
    except (OSError, ValueError):
        pass
    return 32768, 60999


def pick_port(held) -> int:
    """A port free on this host now and held by no live corral job: the
    kernel's pick first, then random ones from its ephemeral range (the
    kernel may hand out the same free port again and again)."""
    for _ in range(8):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("", 0))
            port = s.getsockname()[1]
        finally:
            s.close()
        if port not in held:
            return port
    low, high = _local_range()
    candidates = [p for p in range(low, high + 1) if p not in held]
    random.shuffle(candidates)
    for port in candidates[:2000]:
        if _port_free(port):
            return port
    raise OSError(errno.EADDRINUSE, "no free port in %d-%d that no corral job holds" % (low, high))


def claim(run_id, head="", gpus=(), port=None, want_port=False, base=None) -> dict:
    """Hold ``gpus`` (entries as CUDA_VISIBLE_DEVICES names them) and a port
    for this agent's job, unless another live job holds any of them.

    Returns ``{"held_by": [holding, ...]}`` (jobs holding some of ``gpus``),
    ``{"port_held_by": holding}`` (``port`` is another job's), or, when
    nothing conflicts, ``{"port": P}`` with the file written and locked
    until ``release`` or this process's end.  ``want_port``: pick one.
    """
    global _MINE
    if not _TEXT.fullmatch(run_id) or run_id.startswith("."):
        raise ValueError("run id %r is not a name corral makes" % run_id[:80])
    if fcntl is None:
        return {"unsupported": True, "port": pick_port(set()) if want_port else port}
    if _MINE is not None:
        release()
    path = registry_dir(base)
    dfd = _lock_registry(path)
    try:
        live = _read_live(dfd, prune=True)
        wanted = set(gpus or ())
        clash = [h for h in live if wanted & set(h["gpus"])]
        if clash:
            return {"held_by": clash}
        held_ports = {p: h for h in live for p in h["ports"].values()}
        if port is not None and int(port) in held_ports:
            return {"port_held_by": held_ports[int(port)], "port": int(port)}
        if port is None and want_port:
            port = pick_port(set(held_ports))
        try:
            import pwd

            user = pwd.getpwuid(os.getuid()).pw_name
        except (ImportError, KeyError):
            user = str(os.getuid())
        record = {"run_id": run_id, "user": user, "head": head, "node": socket.gethostname(),
                  "since": time.time(), "pid": os.getpid(), "gpus": list(gpus or ()),
                  "ports": {"master": int(port)} if port is not None else {}}
        name = "%s.%d.json" % (run_id, os.getpid())
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o600, dir_fd=dfd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(record).encode())
        _MINE = (fd, path, name)
        return {"port": port, "gpus": list(gpus or ())}
    finally:
        os.close(dfd)


def release() -> None:
    """Give up this agent's holding; the registry (and ``corral-<uid>``) go
    when nothing else is in them."""
    global _MINE
    mine, _MINE = _MINE, None
    if mine is None:
        return
    try:
        _release(*mine)
    except Exception:  # never in the way of the agent's teardown: the lock goes with the process
        pass


def _release(fd: int, path: str, name: str) -> None:
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        os.close(fd)
        return
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        try:
            os.unlink(name, dir_fd=dfd)
        except OSError:
            pass
        os.close(fd)
        _read_live(dfd, prune=True)  # stale holdings of killed agents go too
        try:
            os.rmdir(path)  # only when empty, under its lock: a claimer re-makes it
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass
    finally:
        os.close(dfd)


def holdings(base=None) -> list:
    """The live holdings on this node (for ``corral ps``); nothing is made."""
    path = registry_dir(base)
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return []
        return _read_live(dfd, prune=False)
    finally:
        os.close(dfd)
