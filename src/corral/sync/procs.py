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
