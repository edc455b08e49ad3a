"""The run's telemetry files: one compact JSON-lines file per node.

The head writes every node's ``tm`` event (checked by ``corral.frames``) as
it arrives, with the head's own time of arrival (``at``: nodes' clocks may
disagree), to ``runs/<id>/telemetry/<host>.jsonl``.  ``corral top`` follows
these files while the run goes on, and replays them after it;
``corral report`` plots them.

A file is bounded (``MAX_BYTES``): when it reaches the bound, every second
sample of it is dropped (the file is rewritten, then replaced) and later
samples are kept at half the rate, so a long run keeps its whole span at a
coarser step instead of losing its start.

Read back, every line is checked again against the event's schema: a run
directory is a place anyone with the user's rights (or a copied-in
directory) may have written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from corral.frames import FrameError, check_frame
from corral.run.logs import _safe

#: The folder of the run directory, and the bound on one node's file.
FOLDER = "telemetry"
MAX_BYTES = 32 * 2**20
#: Any rank a file may name (files carry no plan; run.json bounds ranks again).
_ANY_RANK = range(0, 1 << 20)


@dataclass(frozen=True, kw_only=True)
class Gpu:
    index: int
    util: float | None
    mem_mib: float | None
    mem_total_mib: float | None
    power_w: float | None
    temp_c: float | None
    sm_mhz: float | None
    throttle: int | None


@dataclass(frozen=True, kw_only=True)
class RankUse:
    rank: int
    cpu: float | None
    rss_mib: float | None
    lines_per_s: float | None
    bar_rate: float | None
    bar_unit: str | None


@dataclass(frozen=True, kw_only=True)
class Nic:
    name: str
    rx: float | None
    tx: float | None
    speed_mbit: float | None


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One node's sample; ``at``: when the head received it (its clock)."""

    host: str
    at: float
    gpus: tuple[Gpu, ...]
    ranks: tuple[RankUse, ...]
    nics: tuple[Nic, ...]


def sample_of(host: str, ev: dict, at: float) -> Sample:
    """A checked ``tm`` event as a ``Sample``."""
    return Sample(
        host=host, at=at,
        gpus=tuple(Gpu(index=g[0], util=g[1], mem_mib=g[2], mem_total_mib=g[3], power_w=g[4], temp_c=g[5],
                       sm_mhz=g[6], throttle=g[7]) for g in ev.get("gpu", ())),
        ranks=tuple(RankUse(rank=r[0], cpu=r[1], rss_mib=r[2], lines_per_s=r[3], bar_rate=r[4], bar_unit=r[5])
                    for r in ev.get("rank", ())),
        nics=tuple(Nic(name=n[0], rx=n[1], tx=n[2], speed_mbit=n[3]) for n in ev.get("nic", ())),
    )


class TelemetryFiles:
    """Writes each node's samples to its file, bounded (see the module docstring)."""

    def __init__(self, run_dir: Path, *, max_bytes: int = MAX_BYTES,
                 on_error: Callable[[str], None] | None = None):
        self.dir = Path(run_dir) / FOLDER
        self.max_bytes = max_bytes
        self.on_error = on_error
        self.error: str | None = None
        self._files: dict[str, IO[str]] = {}
        #: Per host: keep one sample in this many (doubles at each thinning), and the count.
        self._every: dict[str, int] = {}
        self._seen: dict[str, int] = {}

    def path(self, host: str) -> Path:
        return self.dir / f"{_safe(host)}.jsonl"

    def write(self, host: str, ev: dict) -> None:
        if self.error is not None:
            return
        self._seen[host] = seen = self._seen.get(host, 0) + 1
        if (seen - 1) % self._every.get(host, 1):
            return
        line = json.dumps({**ev, "at": round(time.time(), 3)}, separators=(",", ":")) + "\n"
        try:
            f = self._open(host)
            f.write(line)
            f.flush()
            if f.tell() >= self.max_bytes:
                self._thin(host)
        except OSError as e:
            self.error = f"cannot write the run's telemetry in {self.dir}: {e.strerror or e}"
            self.close()
            if self.on_error is not None:
                self.on_error(self.error)

    def _open(self, host: str) -> IO[str]:
        f = self._files.get(host)
        if f is None:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(self.path(host), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            f = self._files[host] = open(fd, "a", encoding="utf-8")
        return f

    def _thin(self, host: str) -> None:
        """Keep every second sample of the file; later ones at half the rate."""
        self._files.pop(host).close()
        path = self.path(host)
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with open(fd, "w", encoding="utf-8") as out:
                out.writelines(lines[::2])
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._every[host] = self._every.get(host, 1) * 2

    def close(self) -> None:
        for f in self._files.values():
            try:
                f.close()
            except OSError:
                pass
        self._files.clear()


def host_names(run_dir: Path, record: dict) -> dict[str, str]:
    """File stem -> host name, for the hosts run.json names (else the stem itself)."""
    names = {}
    for h in record.get("hosts") or ():
        if isinstance(h, dict) and isinstance(h.get("name"), str):
            names[_safe(h["name"])] = h["name"]
    return names


def parse_lines(host: str, data: bytes) -> tuple[list[Sample], int]:
    """The checked samples in ``data`` (whole lines only) and how many lines
    were refused (not a ``tm`` event, a bad field)."""
    out: list[Sample] = []
    bad = 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            ev = check_frame(raw, _ANY_RANK)
            at = json.loads(raw).get("at")
        except FrameError:
            bad += 1
            continue
        if ev.get("ev") != "tm" or type(at) not in (int, float) or not 0 < at < 1e11:
            bad += 1
            continue
        out.append(sample_of(host, ev, float(at)))
    return out, bad


class Follower:
    """Reads a run's telemetry files as they grow (and again from the start
    when one was thinned: a new file under the same name)."""

    def __init__(self, run_dir: Path, record: dict):
        self.dir = Path(run_dir) / FOLDER
        self.names = host_names(run_dir, record)
        self.samples: dict[str, list[Sample]] = {}
        self.refused = 0
        self._pos: dict[str, tuple[int, int]] = {}  # stem -> (inode, offset)

    def poll(self) -> bool:
        """Read what is new; True when anything was."""
        try:
            entries = sorted(p for p in self.dir.iterdir() if p.suffix == ".jsonl")
        except OSError:
            return False
        changed = False
        for path in entries:
            changed |= self._read(path)
        return changed

    def _read(self, path: Path) -> bool:
        stem = path.stem
        host = self.names.get(stem, stem)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False  # a symbolic link (not ours), or gone
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            inode, offset = self._pos.get(stem, (st.st_ino, 0))
            if inode != st.st_ino or st.st_size < offset:
                offset = 0
                self.samples[host] = []
            f.seek(offset)
            data = f.read(MAX_BYTES * 2)
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self._pos[stem] = (st.st_ino, offset + end)
        if not end:
            return False
        new, bad = parse_lines(host, data[:end])
        self.refused += bad
        self.samples.setdefault(host, []).extend(new)
        return bool(new)


def read_all(run_dir: Path, record: dict) -> Follower:
    """Every sample of a run (for a finished run, or one look at a live one)."""
    f = Follower(run_dir, record)
    f.poll()
    return f
