"""Read log lines the way they really arrive: coloured, prefixed, overwritten.

Logs reach diagnosis from many launchers, each decorating lines its own way:
torch's ``[rank3]:``, torchrun's ``--tee`` ``[default0]:``, corral's
``[node2/r3]``, ``[r3]`` and ``[node2]``, pdsh's ``node1: `` and ``pdsh@head: node1:``,
mpirun's ``[1,3]<stdout>:``, srun's ``5: ``, Ray's ``(Worker pid=7)``, NeMo-Run's
``job/0 [default1]:[rank1]:``, NCCL's
own ``host:pid:tid [dev]``, pids, dmesg and log timestamps in brackets.  This
module strips ANSI colour and those prefixes (remembering the host and rank
they name; a bracketed number is never a host) and splits carriage-return
overwrites (tqdm) so every regex sees the message itself.  It streams, and
caps line length, so a multi-gigabyte log costs constant memory; logs written
as UTF-16 (Windows PowerShell) are decoded by their byte-order mark.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

#: Longest line kept; real error lines are far shorter, runaway progress bars are not.
MAX_LINE = 8192

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\n]*\x07|\x1b[@-Z\\-_]")

# A token that can only be a host name: an IPv4 address, or a lowercase name
# whose first label holds a digit or a dash (node1, gpu-03, ip-10-0-0-1).
# Python exception names (ValueError, torch.distributed.DistBackendError) and
# ordinary words never qualify, which keeps "RuntimeError: ..." from being
# read as output of a host called RuntimeError.
_HOSTTOKEN = r"(?:\d{1,3}(?:\.\d{1,3}){3}|[a-z][a-z0-9]*[0-9-][a-z0-9-]*(?:\.[a-z0-9-]+)*)"

# (regex, what its groups mean).  Tried in order, repeatedly, at line start.
_PREFIXES: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p)
    for p in (
        r"^pdsh@[\w.-]+: (?P<host>[\w.-]+): ",  # pdsh's own messages about a host
        r"^\[(?P<host>[\w.-]+)/r(?P<rank>\d+)\][:\s]\s?",  # corral: [node2/r3]
        r"^(?P<host>[A-Za-z0-9][\w.-]*)/r(?P<rank>\d+)(?:\s*[|:]\s?|\s)",  # corral: node2/r3 |
        r"^\[r(?P<rank>\d+)\][:\s]\s?",  # corral: [r3]
        r"^\[\s*\d+\.\d+\]\s?",  # kernel (dmesg) timestamp: [2059991.491436]
        r"^\[\d+\] ",  # a process id: [80746] [rank0]: ...
        r"^\[\d{4}-\d\d-\d\d[ T][\d:.,]+\] ",  # a timestamp: [2026-03-13 22:26:02]
        r"^\[(?P<host>[a-z0-9][\w.-]*)\] ",  # corral: [node2] (launcher output)
        r"^\[rank(?P<rank>\d+)\]:\s?",  # torch: [rank3]:
        r"^\[rank: (?P<rank>\d+)\]\s?",  # Lightning: [rank: 1]
        r"^\[\d+,(?P<rank>\d+)\]<std(?:out|err)>:",  # mpirun --tag-output
        r"^\[(?P<host>[\w.-]*[A-Za-z][\w.-]*):(?P<local>\d+)\]:",  # [host:localrank]:
        # torchrun --tee / torchelastic: [default0]:, [trainer0|0]:
        r"^\[[A-Za-z_]+(?P<local>\d+)(?:\|\d+)?\]:\s?",
        # NeMo-Run (Slurm / local executors): "<job name>/<task index> [default0]:[rank0]: ...";
        # the name is the job's, not a host, and the index is the task's, not a rank
        r"^[A-Za-z][\w.-]*/\d+ (?=\[)",
        r"^\((?:\w+ )?pid=\d+(?:, ip=[\d.]+)?\)\s*",  # Ray: (RayWorker pid=12), (pid=12)
        r"^\d+: ",  # srun --label task number
        rf"^(?P<host>{_HOSTTOKEN}): ",  # pdsh / clush: node1: ...
    )
)
# Message headers that name the host (or rank) without being removable prefixes:
# NCCL's "host:pid:tid [dev] ", srun's "srun: error: host: task 3: ..." and
# slurmstepd's "*** JOB 42 ON host CANCELLED ...".
_HOST_HEADERS: tuple[re.Pattern[str], ...] = (
    re.compile(r"^(?P<host>[\w.-]+):\d+:\d+ \[\d+\] "),
    re.compile(r"^srun: error: (?P<host>\w[\w.-]*): tasks? [\d,-]+: "),
    re.compile(r"^slurmstepd: error: \*\*\* (?:JOB|STEP) \S+ ON (?P<host>\w[\w.-]*) CANCELLED"),
)
# torch's glog header with the (default group's) rank: "[E ProcessGroupNCCL.cpp:737] [Rank 1] ".
# "[PG 1 Rank 0]" is a rank within another process group, not the global rank.
_RANK_HEADER = re.compile(
    r"^\[[EWIF]\d*(?: [\d:.]+)?(?: \d+)? [\w./-]+\.(?:cpp|cc|hpp|h):\d+\] "
    r"\[(?:PG (?:ID )?0\b[^\]]*? )?Rank (?P<rank>\d+)\]"
)
_NOT_HOSTS = re.compile(
    r"^(?:rank|step|epoch|iter|batch|loss)\d*$|^(?:info|warn|warning|error|debug|critical|notice)$"
    r"|^\d+(?:\.\d+)?$"  # a number (a pid, a timestamp) is not a host; an IPv4 address is
    # a tool naming itself ("nvidia-container-cli: initialization error", "ssh-keygen: ..."):
    # dashed words without a digit, ending as tool names do
    r"|^[a-z]+(?:-[a-z]+)*-(?:cli|ctl|runtime|hook|toolkit|smi|keygen|keyscan|add|copy-id|get|cache"
    r"|compose|daemon|server|client|launcher|wrapper|helper|agent)$"
)


@dataclass(frozen=True, kw_only=True)
class LogLine:
    """One physical line (or one carriage-return segment of it), cleaned."""

    number: int  # 1-based line number in the source
    text: str  # message with ANSI and launcher prefixes removed: what rules match
    shown: str  # the line as a human should see it (ANSI removed, prefixes kept)
    host: str | None = None
    rank: int | None = None
    local_rank: int | None = None


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def parse(raw: str, number: int) -> list[LogLine]:
    """Clean one raw line into the segments a rule should see."""
    if len(raw) > MAX_LINE:
        raw = raw[:MAX_LINE]
    raw = strip_ansi(raw.rstrip("\n"))
    segments = [s for s in raw.split("\r") if s.strip()] or [raw]
    return [_parse_segment(seg, number) for seg in segments if seg.strip()]


def _parse_segment(seg: str, number: int) -> LogLine:
    text = seg.strip()
    host = rank = local = None
    for _ in range(4):  # prefixes stack: "[alphagpu12:5]:[rank5]:[E213 ...]"
        for rx in _PREFIXES:
            m = rx.match(text)
            if not m:
                continue
            groups = m.groupdict()
            candidate = groups.get("host")
            if candidate and _NOT_HOSTS.match(candidate):
                continue
            host = host or candidate
            if groups.get("rank") is not None and rank is None:
                rank = int(groups["rank"])
            if groups.get("local") is not None and local is None:
                local = int(groups["local"])
            text = text[m.end():].lstrip()
            break
        else:
            break
    if host is None:
        for rx in _HOST_HEADERS:
            m = rx.match(text)
            if m and not _NOT_HOSTS.match(m.group("host")):
                host = m.group("host")
                break
    if rank is None:
        m = _RANK_HEADER.match(text)
        if m:
            rank = int(m.group("rank"))
    return LogLine(number=number, text=text, shown=seg.rstrip(), host=host, rank=rank,
                   local_rank=local)


def iter_raw(stream: IO[str]) -> Iterator[tuple[int, str]]:
    """(line number, raw line) of a text file; memory stays bounded by ``MAX_LINE``."""
    number = 0
    while True:
        raw = stream.readline(MAX_LINE * 4)
        if not raw:
            return
        number += 1
        if len(raw) == MAX_LINE * 4 and not raw.endswith("\n"):
            # a runaway line: keep its head, skip the rest without storing it
            while True:
                more = stream.readline(MAX_LINE * 4)
                if not more or more.endswith("\n"):
                    break
        yield number, raw


def iter_lines(stream: IO[str]) -> Iterator[LogLine]:
    """Stream a text file as cleaned lines; memory stays bounded by ``MAX_LINE``."""
    for number, raw in iter_raw(stream):
        yield from parse(raw, number)


def iter_text(text: str) -> Iterator[LogLine]:
    for number, raw in enumerate(text.split("\n"), start=1):
        yield from parse(raw, number)


_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"),
)


def sniff_encoding(head: bytes) -> str:
    """The encoding of a log from its first bytes: a byte-order mark, else UTF-8.

    Windows PowerShell's ``>`` and ``Out-File`` write UTF-16 with a BOM; read
    as UTF-8 every character would be followed by a NUL and no rule could
    match.  BOM-less UTF-16 (NULs in every other byte of ASCII text) is
    recognised too.
    """
    for bom, name in _BOMS:  # UTF-32 LE before UTF-16 LE: its BOM starts with UTF-16's
        if head.startswith(bom):
            return name
    sample = head[:4096]
    if len(sample) >= 16 and sample.count(0) * 3 >= len(sample):
        odd, even = sample[1::2].count(0), sample[0::2].count(0)
        if odd > 3 * even:
            return "utf-16-le"
        if even > 3 * odd:
            return "utf-16-be"
    return "utf-8"


def open_log(path: str | Path) -> IO[str]:
    """Open a log as text in the encoding it was written in (see :func:`sniff_encoding`)."""
    with open(path, "rb") as raw:
        head = raw.read(4096)
    return open(path, encoding=sniff_encoding(head), errors="replace", newline="")
