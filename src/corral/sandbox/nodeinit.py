"""The init process of one sandbox node (stdlib only, Python 3.8+).

The head starts it as::

    setsid -f ip netns exec NS unshare --pid --fork --mount --uts --ipc \\
        --propagation private PYTHON -I -S nodeinit.py --node-dir DIR ...

so it runs as pid 1 of a fresh PID namespace, in the node's network
namespace, with its own mount, UTS and IPC namespaces.  From there it makes
the node look like a separate machine booted from the same image:

- hostname = node name;
- a fresh ``/proc`` (``ps`` shows only this node) and a private ``/run``
  (sshd's privilege-separation directory lives there);
- node-private ``~/.ssh``, ``/tmp``, ``/var/tmp``, ``/srv``, ``/home`` and
  ``/dev/shm``, bind-mounted from the node's state directory;
- a node-private ``/etc``: an overlay whose lower layer is the head's
  ``/etc`` (the shared image) and whose upper layer holds the node's own
  ``hosts``, ``passwd``, ``shadow``, ``group`` (from its state directory)
  and whatever the node changes until it stops.  Not bind mounts of single files:
  the kernel detaches a mount whose file is renamed over in another mount
  namespace, so a ``useradd`` on the head (it renames a new ``/etc/passwd``
  into place) would silently hand every node the head's real files;
- the sandbox state directory (head key, other nodes' files) hidden;
- a real OpenSSH ``sshd -D``.

Then it does what pid 1 must: reap orphans, and on SIGTERM stop every
process of the node before exiting (the kernel kills any straggler when pid 1
of a PID namespace exits).

It prints nothing but log lines on stderr, which the head sends to the
node's ``init.log``.  It must not import corral: it runs with ``-I -S``.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096

#: Where the node's state directory appears inside the node (private /run).
NODE_RUN = "/run/corral/node"
#: The upper layer of the node's /etc overlay (a tmpfs: its /etc changes last until it stops).
ETC_LAYERS = "/run/corral/etc"
#: Seconds processes get between SIGTERM and the kernel's SIGKILL at shutdown.
GRACE = 3.0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.mount.restype = ctypes.c_int


class Shutdown(Exception):
    """Raised by the signal handler to leave the reaping loop."""


def say(message: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} nodeinit[{socket.gethostname()}]: {message}\n")
    sys.stderr.flush()


def mount(source: str, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    rc = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def bind(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND)


def host_pid() -> int:
    """This process's pid in the root PID namespace (read before /proc is replaced)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("NSpid:"):
                return int(line.split()[1])
    return -1


def setup_mounts(args: argparse.Namespace) -> None:
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # Keep a handle on the node directory: /run, /tmp or /home may hide its path.
    fd = os.open(args.node_dir, os.O_RDONLY | os.O_DIRECTORY)
    # Shared-through paths (a checkout or venv under /tmp): keep handles too.
    shares = [(path, os.open(path, os.O_RDONLY | os.O_DIRECTORY)) for path in args.share
              if os.path.isdir(path)]
    mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    os.makedirs("/run/sshd", mode=0o755)
    os.makedirs(NODE_RUN, mode=0o700)
    bind(f"/proc/self/fd/{fd}", NODE_RUN)
    os.close(fd)
    private = [
        ("ssh", os.path.join(args.home, ".ssh")),
        ("tmp", "/tmp"),
        ("var-tmp", "/var/tmp"),
        ("srv", "/srv"),
    ]
    if args.private_home:
        private.append(("home", "/home"))
    for name, target in private:
        bind(os.path.join(NODE_RUN, name), target)
    overlay_etc()
    # The user's shell start-up files are the node's own, fresh from /etc/skel
    # like a newly installed machine: the head's (a pyenv or conda init, say)
    # would otherwise run in every node's login shell.
    for rc in (".bashrc", ".profile"):
        target = os.path.join(args.home, rc)
        if os.path.isfile(target):
            own = os.path.join(NODE_RUN, "rc" + rc)
            if not os.path.exists(own):
                skel = os.path.join("/etc/skel", rc)
                with open(own, "w") as out:
                    if os.path.isfile(skel):
                        with open(skel) as src:
                            out.write(src.read())
            bind(own, target)
    for path, share_fd in shares:
        os.makedirs(path, exist_ok=True)  # inside the node's private directory
        bind(f"/proc/self/fd/{share_fd}", path)
        os.close(share_fd)
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for path in args.hide:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=700,size=4k")


def overlay_etc() -> None:
    """Mount the node's own /etc: the head's as the lower layer, the node's files on top.

    The node reads the head's /etc wherever it has no file of its own, and
    every write (``useradd`` on the node, an edit of /etc/hosts) lands in
    the upper layer, never on the head.  Nothing the head does to its own
    /etc, renames included, can detach the node's account files.

    The upper layer is a tmpfs seeded from ``<node>/etc`` (which ``up``
    rewrites anyway): unmounting an overlay syncs its upper file system, and
    on the head's disk that sync can outlast ``stop`` by seconds.
    """
    os.makedirs(ETC_LAYERS, mode=0o755)
    mount("tmpfs", ETC_LAYERS, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    upper, work = os.path.join(ETC_LAYERS, "upper"), os.path.join(ETC_LAYERS, "work")
    shutil.copytree(os.path.join(NODE_RUN, "etc"), upper, symlinks=True)
    os.makedirs(work, mode=0o700)
    try:
        mount("overlay", "/etc", "overlay", 0, f"lowerdir=/etc,upperdir={upper},workdir={work}")
    except OSError as err:
        if err.errno == errno.ENODEV:
            raise OSError(err.errno, "this kernel has no overlayfs for the node's /etc (`modprobe "
                                     "overlay`, or a kernel built with CONFIG_OVERLAY_FS)") from None
        raise


def start_sshd(sshd: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sshd, "-D", "-e", "-f", os.path.join(NODE_RUN, "sshd_config")],
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )


def others() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and p != "1"]


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def shutdown() -> None:
    """SIGTERM every process of the node, wait a little, then let the kernel finish."""
    victims = others()
    say(f"stopping {len(victims)} process(es)")
    for pid in victims:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline:
        reap()
        if not any(_running(pid) for pid in others()):
            break
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _on_signal(signum: int, frame: object) -> None:
    raise Shutdown()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nodeinit")
    parser.add_argument("--node-dir", required=True)
    parser.add_argument("--hostname", required=True)
    parser.add_argument("--home", default="/root")
    parser.add_argument("--private-home", action="store_true")
    parser.add_argument("--share", action="append", default=[])
    parser.add_argument("--hide", action="append", default=[])
    parser.add_argument("--sshd", default="/usr/sbin/sshd")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if os.getpid() != 1:
        sys.stderr.write("nodeinit: must run as pid 1 of a new PID namespace (unshare --pid --fork)\n")
        return 2
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    pid = host_pid()
    try:
        socket.sethostname(args.hostname)
        setup_mounts(args)
        os.chdir(args.home)
        sshd = start_sshd(args.sshd)
        with open(os.path.join(NODE_RUN, "init.json.tmp"), "w") as fh:
            json.dump({"pid": pid, "sshd_pid_in_node": sshd.pid, "hostname": args.hostname}, fh)
        os.rename(os.path.join(NODE_RUN, "init.json.tmp"), os.path.join(NODE_RUN, "init.json"))
        say(f"up (pid {pid} on the head), sshd started")
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                signal.pause()
    except Shutdown:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        shutdown()
        say("stopped")
        return 0
    except OSError as err:
        say(f"failed: {err}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
