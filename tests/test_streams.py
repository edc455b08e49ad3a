"""Bounded reading of a child's output (corral.streams)."""

from __future__ import annotations

import asyncio

import pytest

from corral import streams


def _reader(data: bytes) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return r


def test_the_head_keeps_only_the_end_of_a_flood() -> None:
    """A node's login shell printing without end (1 GB measured at 2 GB of the
    head's memory during sync): the head keeps stderr's end, where the reason is."""
    async def go() -> bytes:
        return await streams.read_tail(_reader(b"noise\n" * 200_000 + b"rsync: the real reason\n"))

    tail = asyncio.run(go())
    assert len(tail) == streams.STDERR_TAIL and tail.endswith(b"rsync: the real reason\n")


def test_lines_are_cut_not_buffered_and_never_raise() -> None:
    """``async for`` over a StreamReader raised on a line over 64 KiB."""
    async def go() -> list[bytes]:
        data = b"a" * (3 * 1024 * 1024) + b"\n@@prog n1 5\nlast"
        return [line async for line in streams.bounded_lines(_reader(data), 1024 * 1024)]

    lines = asyncio.run(go())
    assert [len(x) for x in lines] == [1024 * 1024, len(b"@@prog n1 5"), 4]
    assert lines[1:] == [b"@@prog n1 5", b"last"]


def test_what_a_login_shell_prints_before_the_answer_is_dropped() -> None:
    mark = b"@@corral-result@@"

    async def go(data: bytes, limit: int = 1 << 20) -> bytes:
        return await streams.read_after_mark(_reader(data), mark, limit=limit)

    noise = b"welcome to the cluster\n" * 100_000  # 2.3 MB before the answer
    assert asyncio.run(go(noise + mark + b'{"value": 1}\n')) == mark + b'{"value": 1}\n'
    # the last mark counts; a mark split across two reads is found
    split = b"x" * (streams.CHUNK - 5) + mark + b"{}\n"
    assert asyncio.run(go(split + mark + b"[2]\n")) == mark + b"[2]\n"
    assert asyncio.run(go(split)) == mark + b"{}\n"
    # no mark: the end is kept, for the error message
    assert len(asyncio.run(go(noise))) <= streams.STDERR_TAIL + len(mark)
    with pytest.raises(streams.AnswerTooLarge):
        asyncio.run(go(mark + b"y" * 5_000_000, limit=1_000_000))
