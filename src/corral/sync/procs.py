"""Stopping what a sync started: rsync and ssh, with everything they started.

rsync and the chain's ssh run in sessions of their own (``start_new_session``:
ssh must never prompt on the user's terminal), so Ctrl-C on the terminal does
not reach them.  When the sync stops (Ctrl-C, SIGTERM, an error elsewhere)
the head stops each one's whole process group -- rsync *and* the ssh it
started -- and waits for them: a child left running would go on replacing
files on the nodes after corral has said it stopped.  On the node, the copy
sees its input end and removes its partial file.
"""

from __future__ import annotations

import asyncio
import os
import signal

#: Seconds between SIGTERM (rsync removes its partial file) and SIGKILL.
GRACE_S = 3.0

#: What the head keeps of an rsync's or a chain's stderr: its end, where the
#: reason is.  The rest is read and dropped (a node's login shell can print
#: without end; the head's memory must not follow it).
STDERR_TAIL = 64 * 1024

#: The longest line of a chain's answer the head reads; the rest of a longer
#: one is dropped as it arrives.
MAX_ANSWER_LINE = 1024 * 1024


async def read_tail(stream: asyncio.StreamReader, keep: int = STDERR_TAIL) -> bytes:
    """All of ``stream`` read, its last ``keep`` bytes kept."""
    tail = b""
    while True:
        chunk = await stream.read(256 * 1024)
        if not chunk:
            return tail
        tail = (tail + chunk)[-keep:]


async def bounded_lines(stream: asyncio.StreamReader, limit: int = MAX_ANSWER_LINE):
    """The lines of ``stream``, each cut at ``limit`` bytes (the rest of a
    longer line is read and dropped): ``async for`` over a StreamReader
    raises on a line over 64 KiB, and a node decides how long its lines are."""
    buf = b""
    dropping = False
    while True:
        chunk = await stream.read(256 * 1024)
        if not chunk:
            if buf and not dropping:
                yield buf
            return
        *done, buf = (buf + chunk).split(b"\n")
        for line in done:
            if not dropping:
                yield line[:limit]
            dropping = False
        if len(buf) > limit:
            if not dropping:
                yield buf[:limit]
            buf, dropping = b"", True


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def reap(proc: asyncio.subprocess.Process, *, grace: float = GRACE_S) -> None:
    """Stop ``proc`` (a session leader) and its process group; wait for ``proc``."""
    _killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), grace)
    except asyncio.TimeoutError:
        pass
    _killpg(proc.pid, signal.SIGKILL)  # the group may outlive its leader (ssh under rsync)
    await proc.wait()
