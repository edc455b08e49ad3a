"""Driving rsync from the head to one node, over corral's ssh.

rsync gets exactly the files that differ (``--files-from``, NUL-separated),
so its own quick check (size and mtime) can never skip a file corral's hash
comparison found different (``--ignore-times``); within a file it still uses
its delta algorithm, so a small change to a large file sends little.  Its
remote shell is corral's ssh argv (``-e``), so the user's ssh config, ports,
keys and ControlMaster all apply.  ``--info=progress2`` gives the bytes sent
so far, which the head turns into one progress bar.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable, Sequence

from corral import streams
from corral.errors import HostError, UsageError
from corral.model import Cluster, Host
from corral.sync import procs
from corral.transport.ssh import SSHTransport, classify_ssh_failure, quiet_login_hint

log = logging.getLogger(__name__)

#: -l symlinks as symlinks, -p permissions, -t mtimes, -s arguments through the protocol.
BASE_FLAGS = (
    "-lpts",
    "--ignore-times",
    "--from0",
    "--files-from=-",
    "--info=progress2",
    "--no-human-readable",
)
_PROGRESS = re.compile(rb"^\s*([\d,]+)\s+\d+%")


def rsh_word(word: str) -> str:
    """Quote one word for rsync's ``-e`` string (rsync splits it, honouring quotes)."""
    if word and not re.search(r"[\s'\"]", word):
        return word
    if "'" not in word:
        return f"'{word}'"
    if '"' not in word:
        return f'"{word}"'
    raise UsageError(f"ssh option {word!r} has both kinds of quotes: rsync cannot be given it")


def rsh(cluster: Cluster, host: Host, *, connect_timeout: float = 10.0) -> str:
    """corral's ssh command line for ``host``, without the host, as rsync's ``-e``."""
    argv = SSHTransport(cluster, connect_timeout=connect_timeout).base_argv(host)
    assert argv[-1] == host.name
    return " ".join(rsh_word(w) for w in argv[:-1])


def argv(cluster: Cluster, host: Host, source_root: str, dest_root: str) -> list[str]:
    src = source_root.rstrip("/") + "/"
    dest = dest_root.rstrip("/") + "/"
    if host.local:
        return ["rsync", *BASE_FLAGS, src, os.path.expanduser(dest)]
    # rsync leaves a leading `~` of the remote path to the node's shell: its home.
    return ["rsync", *BASE_FLAGS, "-e", rsh(cluster, host), src, f"{host.name}:{dest}"]


def parse_progress(line: bytes) -> int | None:
    m = _PROGRESS.match(line)
    return int(m.group(1).replace(b",", b"")) if m else None


async def send(
    cluster: Cluster,
    host: Host,
    source_root: str,
    dest_root: str,
    paths: Sequence[str],
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """rsync ``paths`` (relative to ``source_root``) to ``dest_root`` on ``host``."""
    if not paths:
        return
    cmd = argv(cluster, host, source_root, dest_root)
    log.debug("%s: %s", host.name, cmd)
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise HostError(
            "this machine",
            "rsync is not installed here",
            hint="apt-get install rsync (or your distribution's package)",
        ) from None
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None

    async def feed() -> None:
        assert proc.stdin is not None
        proc.stdin.write("\0".join(paths).encode("utf-8", "surrogateescape") + b"\0")
        try:
            await proc.stdin.drain()
        finally:
            proc.stdin.close()

    async def progress() -> None:
        assert proc.stdout is not None
        buf = b""
        last = 0
        while True:
            chunk = await proc.stdout.read(4096)
            if not chunk:
                break
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            for line in lines:
                n = parse_progress(line)
                if n is not None and n > last and on_bytes is not None:
                    on_bytes(n - last)
                    last = n

    try:
        _, _, err = await asyncio.gather(feed(), progress(), streams.read_tail(proc.stderr))
        rc = await proc.wait()
    except BaseException:  # Ctrl-C, SIGTERM: rsync and its ssh stop with corral
        await procs.reap(proc)
        raise
    if rc != 0:
        raise failure(host, rc, err.decode(errors="replace"))


def failure(host: Host, rc: int, stderr: str) -> HostError:
    """Name an rsync failure: ssh's errors first, then rsync's own."""
    text = stderr.strip()
    if re.search(r"rsync: (command )?not found|rsync: No such file", text) or rc == 127:
        return HostError(
            host.name,
            "rsync is not installed there",
            hint=f"install rsync on {host.name} (apt-get install rsync)",
            kind="no-rsync",
        )
    if rc == 255 or "connection unexpectedly closed" in text and "ssh:" in text:
        err = classify_ssh_failure(host, 255, text)
        if err.kind == "ssh-failed" and re.search(r"unexplained error \(code 255\)|Broken pipe", text):
            # ssh ended without a word of its own (corral runs it with
            # LogLevel=ERROR, which keeps "Timeout, server not responding"
            # and "closed by remote host" quiet): the link died mid-copy.
            return HostError(
                host.name,
                "the connection was lost in the middle of the copy (the node went down or rebooted, "
                "or the network to it failed)",
                hint=f"check that {host.name} is up and reachable (`ssh {host.name} true`), then sync "
                     "again: files already copied are not sent twice",
                kind="lost",
            )
        return err
    if "protocol version mismatch" in text or "is your shell clean" in text:
        # The classic: a banner or `echo` in a shell start-up file of the
        # login user lands in rsync's protocol stream.
        return HostError(
            host.name,
            f"rsync failed (exit {rc}): the login shell there writes to stdout, "
            "which garbles rsync's protocol (\"protocol version mismatch -- is your shell clean?\")",
            hint=quiet_login_hint(host.name),
            kind="rsync",
        )
    full = re.search(r'write failed on "([^"]+)": (No space left on device|Disk quota exceeded)', text)
    if full:
        # The receiver's own line: the sender's last word is a "Broken pipe".
        why = "the disk is full" if full.group(2).startswith("No space") else "the disk quota is exceeded"
        return HostError(
            host.name,
            f"{why}: cannot write {full.group(1)} ({full.group(2)})",
            hint=f"free space on {host.name} (`df -h` there), or sync to another disk (--to); rsync "
                 "removed its partial file",
            kind="nospace",
        )
    lines = [
        l for l in text.splitlines() if l.strip() and not l.startswith("rsync error: some files")
    ]
    last = lines[-1] if lines else f"exit code {rc}"
    hint = "check free space and permissions of the destination there"
    if "Permission denied" in text:
        hint = "the login user cannot write there: pick a writable --to, or fix ownership"
    elif "No space left" in text or "Disk quota exceeded" in text:
        hint = f"the disk there is full: free space on {host.name} (`df -h` there), or sync to another disk (--to)"
    elif "Read-only file system" in text:
        hint = ("the destination is on a read-only file system there (a read-only mount, or one the "
                "kernel remounted read-only after disk errors: `dmesg` on it); pick a writable --to")
    return HostError(host.name, f"rsync failed (exit {rc}): {last}", hint=hint, kind="rsync")
