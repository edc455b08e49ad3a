"""Reading a child's output when a node decides how much there is.

A node's login shell can print without end (an ``echo`` loop in .bashrc, a
compromised node), and what ssh or rsync relay from it reaches the head's
pipes.  These readers keep what the head needs -- the end of stderr, where
the reason is; lines cut at a bound; the answer after a marker -- and read
and drop the rest, so the head's memory never follows a node's output.
"""

from __future__ import annotations

import asyncio

#: Bytes read at a time.
CHUNK = 256 * 1024

#: What the head keeps of a child's stderr: its end, where the reason is.
STDERR_TAIL = 64 * 1024


class AnswerTooLarge(Exception):
    """The answer after the marker passed its bound."""


async def read_tail(stream: asyncio.StreamReader, keep: int = STDERR_TAIL) -> bytes:
    """All of ``stream`` read, its last ``keep`` bytes kept."""
    tail = b""
    while True:
        chunk = await stream.read(CHUNK)
        if not chunk:
            return tail
        tail = (tail + chunk)[-keep:]


async def bounded_lines(stream: asyncio.StreamReader, limit: int):
    """The lines of ``stream``, each cut at ``limit`` bytes (the rest of a
    longer line is read and dropped): ``async for`` over a StreamReader
    raises on a line over 64 KiB, and a node decides how long its lines are."""
    buf = b""
    dropping = False
    while True:
        chunk = await stream.read(CHUNK)
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


async def read_after_mark(stream: asyncio.StreamReader, mark: bytes, *, limit: int,
                          keep: int = STDERR_TAIL) -> bytes:
    """``stream`` from its last ``mark`` on (at most ``limit`` bytes, else
    ``AnswerTooLarge``); without a mark, its last ``keep`` bytes.  What a
    login shell prints before the answer is read and dropped."""
    buf = b""
    found = False
    while True:
        chunk = await stream.read(CHUNK)
        if not chunk:
            return buf
        start = max(0, len(buf) - len(mark) + 1)  # a mark may straddle two chunks
        buf += chunk
        at = buf.rfind(mark, start)
        if at >= 0:
            buf, found = buf[at:], True
        elif not found:
            buf = buf[-(keep + len(mark)):]
        if found and len(buf) > limit:
            raise AnswerTooLarge(f"{len(buf)} bytes")
