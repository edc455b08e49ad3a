"""Gathering the flight recorder dumps of a run's ranks into its run directory.

Nodes send each rank's dump as a ``flightrec`` event (``agent/flightrec.py``):
when asked (a hang, ``corral stacks``, a failure before teardown), and as a
failed job's ranks exit.  ``FlightDumps`` keeps the newest of each, writes
them to ``runs/<id>/flightrec/`` with ``index.json`` (rank, host, pid of
each), and has ``corral.diagnose.flightrec`` explain them.  The run loop
calls ``at_hang`` / ``at_failure`` (which add the GPU nodes' health) and
``save_report``; nothing else of it is there.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from corral.agent.session import AgentPool
from corral.diagnose.flightrec import DUMP_DIR, INDEX, MAX_DUMP, FlightReport, read_dir
from corral.run.nodehealth import health_lines

#: The only file names a dump may have (the rank hook's); anything else from a node is dropped.
_NAME = re.compile(r"rank(\d{1,7})\.(cpu|nccl)\.(json|pkl)")
#: How long a node waits for its ranks' dumps when asked (seconds).
DUMP_WAIT_S = 3.0


@dataclass(frozen=True)
class _Dump:
    host: str
    pid: int | None
    data: bytes


class FlightDumps:
    """The newest dump of each rank and kind, as nodes sent them."""

    def __init__(self) -> None:
        self.dumps: dict[str, _Dump] = {}

    def clear(self) -> None:
        self.dumps.clear()

    def take(self, host: str, ev: Mapping) -> None:
        """A ``flightrec`` event (already checked against its schema; ``r`` is
        one of ``host``'s ranks).  A name other than the hook's, or one that
        does not carry the event's rank, or data that does not decode, is dropped."""
        m = _NAME.fullmatch(str(ev.get("name", "")))
        if not m or int(m.group(1)) != ev.get("r"):
            return
        text = ev.get("data", "")
        if ev.get("fmt") == "pickle":
            try:
                data = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                return
        else:
            data = text.encode("utf-8")
        if len(data) <= MAX_DUMP:
            pid = ev.get("pid")
            self.dumps[m.group(0)] = _Dump(host=host, pid=pid if isinstance(pid, int) else None, data=data)

    def save(self, run_dir: Path) -> Path | None:
        """Write the dumps to ``run_dir/flightrec/`` (private files, never
        through a link) with their index; the folder, or None without dumps."""
        if not self.dumps:
            return None
        folder = run_dir / DUMP_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.is_symlink():
            return None
        index = []
        for name, d in sorted(self.dumps.items()):
            _write(folder / name, d.data)
            rank = int(_NAME.fullmatch(name).group(1))  # type: ignore[union-attr]
            index.append({"rank": rank, "host": d.host, "pid": d.pid, "file": name})
        _write(folder / INDEX, json.dumps({"dumps": index}, indent=1).encode())
        return folder


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(data)


async def request_dumps(pool: AgentPool, timeout: float = DUMP_WAIT_S, skip: frozenset[str] = frozenset()) -> None:
    """Ask every node for its live ranks' dumps; they arrive as events
    before each node's answer.  A node that does not answer is left out, and
    a node already lost (``skip``) is not asked: over srun its channel stays
    open and the call would wait for its whole timeout."""

    async def one(s) -> None:
        try:
            await s.call("node.flightrec", timeout=timeout + 10, wait=timeout)
        except Exception:  # noqa: BLE001 - a lost node has no dumps to give
            pass

    await asyncio.gather(*(one(s) for s in pool.sessions if not s.closed and s.name not in skip))


async def flight_report(pool: AgentPool, dumps: FlightDumps, run_dir: Path, world_size: int,
                        ) -> FlightReport | None:
    """Ask the live ranks for their dumps, then ``save_report``."""
    await request_dumps(pool)
    return save_report(dumps, run_dir, world_size)


def save_report(dumps: FlightDumps, run_dir: Path, world_size: int) -> FlightReport | None:
    """Save every dump into the run directory and explain them; None when no
    rank left a dump, or the dumps show nothing."""
    try:
        if dumps.save(run_dir) is None:
            return None
    except OSError:
        return None
    report = read_dir(run_dir, world_size)
    return None if report is None or report.empty and not report.unreadable else report


async def at_hang(pool: AgentPool, dumps: FlightDumps, run_dir: Path, world_size: int, *, enabled: bool,
                  stacks: Mapping[int, str], since: float) -> tuple[FlightReport | None, list[str]]:
    """A hang: the flight recorder's report (None when off or empty) and the
    lines to show, the GPU nodes' health after it (``run/nodehealth.py``)."""
    report = await flight_report(pool, dumps, run_dir, world_size) if enabled else None
    lines = report.lines(stacks) if report is not None else []
    return report, lines + await health_lines(pool, since)


async def at_failure(pool: AgentPool, *, enabled: bool, since: float,
                     lost: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """A failure, before the teardown: the live ranks' dumps are asked for
    (read by ``save_report`` once the job has ended) and the GPU nodes'
    health is read; its lines.  Nodes already ``lost`` are not asked."""
    if enabled:
        await request_dumps(pool, skip=lost)
    return tuple(await health_lines(pool, since, skip=lost))
