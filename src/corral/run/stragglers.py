"""What the telemetry of a run says at one moment: stragglers, idle GPUs, saturated links.

The definitions (also in docs/telemetry.md):

- a *window* is the ``WINDOW_S`` seconds up to a moment, on the head's clock;
  a rank's or GPU's figure in a window is the mean of its samples there;
- a rank is *behind* in a window when its progress (the rate of its
  progress bar, when all its peers have one in the same unit; else the lines
  it writes per second) or its CPU use is below ``BEHIND`` times the median
  of its peers' (the job's other ranks; CPU only where that median is
  ``BUSY_CPU`` % or more); a GPU is behind when its utilisation is below
  ``BEHIND`` times the median of the other GPUs' that are not idle;
- a *straggler* is behind *persistently*: in each of the ``PERSIST``
  windows ending at the moment and at each of the ``PERSIST - 1`` seconds
  before it, with at least ``MIN_SAMPLES`` samples in each;
- an *idle GPU* averaged under ``IDLE_UTIL`` % utilisation over a window;
- a *saturated link* carried ``SATURATED`` of its speed or more, either way,
  over a window (only links that report a speed: InfiniBand ports, most
  physical Ethernet; not virtual ones).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from corral.run.telemetry import Sample

WINDOW_S = 10.0
PERSIST = 5
MIN_SAMPLES = 5
BEHIND = 0.5
IDLE_UTIL = 5.0
BUSY_CPU = 25.0
SATURATED = 0.9


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One thing ``corral top`` and the report point at."""

    kind: str  # "straggler", "idle-gpu", "saturated-link"
    host: str
    what: str  # "rank 5", "gpu 1", "eth0"
    why: str

    def text(self) -> str:
        return f"{self.kind}: {self.what} on {self.host}: {self.why}"


def window(samples: Sequence[Sample], end: float, span: float = WINDOW_S) -> Sequence[Sample]:
    """The samples in (end - span, end]; ``samples`` in order of arrival."""
    hi = bisect.bisect_right(samples, end, key=_at)
    lo = bisect.bisect_right(samples, end - span, 0, hi, key=_at)
    return samples[lo:hi]


def _at(s: Sample) -> float:
    return s.at


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


@dataclass(frozen=True)
class _Figure:
    host: str
    what: str
    value: float
    count: int


def rank_figures(by_host: Mapping[str, Sequence[Sample]], end: float) -> dict[str, list[_Figure]]:
    """Per measure ("progress <unit>", "cpu"): every rank's mean in the window."""
    rows: dict[tuple[str, int], list] = {}
    for host, samples in by_host.items():
        for s in window(samples, end):
            for r in s.ranks:
                rows.setdefault((host, r.rank), []).append(r)
    units = {k: {r.bar_unit for r in v if r.bar_rate is not None} for k, v in rows.items()}
    common = set.intersection(*units.values()) if units else set()
    unit = sorted(common)[0] if len(common) == 1 else None
    out: dict[str, list[_Figure]] = {}
    for (host, rank), rs in rows.items():
        if unit is not None:
            prog = _mean(r.bar_rate for r in rs if r.bar_unit == unit)
            measure = f"progress {unit}/s"
        else:
            prog = _mean(r.lines_per_s for r in rs)
            measure = "progress lines/s"
        if prog is not None:
            out.setdefault(measure, []).append(_Figure(host, f"rank {rank}", prog, len(rs)))
        cpu = _mean(r.cpu for r in rs)
        if cpu is not None:
            out.setdefault("CPU %", []).append(_Figure(host, f"rank {rank}", cpu, len(rs)))
    return out


def gpu_figures(by_host: Mapping[str, Sequence[Sample]], end: float) -> dict[str, list[_Figure]]:
    rows: dict[tuple[str, int], list] = {}
    for host, samples in by_host.items():
        for s in window(samples, end):
            for g in s.gpus:
                rows.setdefault((host, g.index), []).append(g.util)
    figs = [_Figure(h, f"gpu {i}", m, len(v)) for (h, i), v in rows.items() if (m := _mean(v)) is not None]
    return {"GPU util %": figs} if figs else {}


#: Below these, a figure says nothing about speed: an idle GPU (flagged as
#: such) is no peer, and ranks mostly waiting (on I/O, on a GPU) are not
#: compared by CPU.
FLOOR = {"GPU util %": IDLE_UTIL, "CPU %": BUSY_CPU}


def behind(figures: Mapping[str, list[_Figure]]) -> dict[tuple[str, str], str]:
    """(host, what) -> why, for each rank or GPU behind its peers in this window."""
    out: dict[tuple[str, str], str] = {}
    for measure, figs in figures.items():
        floor = FLOOR.get(measure, 0.0)
        for f in figs:
            peers = [p.value for p in figs if p is not f and p.value >= floor]
            if not peers or f.count < MIN_SAMPLES or (floor and f.value < floor and measure != "CPU %"):
                continue
            median = statistics.median(peers)
            if median > 0 and median >= floor and f.value < BEHIND * median:
                key = (f.host, f.what)
                why = f"{measure} {f.value:.3g} vs its peers' median {median:.3g}"
                out[key] = f"{out[key]}; {why}" if key in out else why
    return out


def stragglers(by_host: Mapping[str, Sequence[Sample]], end: float) -> list[Flag]:
    """Ranks and GPUs behind their peers in every one of the last ``PERSIST`` windows."""
    found: dict[tuple[str, str], str] | None = None
    for step in range(PERSIST):
        t = end - step
        now = behind({**rank_figures(by_host, t), **gpu_figures(by_host, t)})
        if found is None:
            found = now  # the reasons said are the latest window's
        else:
            found = {k: v for k, v in found.items() if k in now}
        if not found:
            return []
    return [Flag(kind="straggler", host=h, what=w, why=f"{why} (for {PERSIST} s and more)")
            for (h, w), why in sorted((found or {}).items(), key=lambda kv: _order(kv[0]))]


def _order(key: tuple[str, str]) -> tuple:
    host, what = key
    kind, _, num = what.partition(" ")
    return (kind, int(num) if num.isdigit() else 0, host)


def idle_gpus(by_host: Mapping[str, Sequence[Sample]], end: float) -> list[Flag]:
    out = []
    for f in gpu_figures(by_host, end).get("GPU util %", []):
        if f.count >= MIN_SAMPLES and f.value < IDLE_UTIL:
            out.append(Flag(kind="idle-gpu", host=f.host, what=f.what,
                            why=f"{f.value:.0f}% utilisation over the last {WINDOW_S:.0f} s"))
    return out


def saturated_links(by_host: Mapping[str, Sequence[Sample]], end: float) -> list[Flag]:
    out = []
    for host, samples in by_host.items():
        rows: dict[str, list] = {}
        for s in window(samples, end):
            for n in s.nics:
                rows.setdefault(n.name, []).append(n)
        for name, ns in sorted(rows.items()):
            speed = next((n.speed_mbit for n in reversed(ns) if n.speed_mbit), None)
            if not speed or len(ns) < MIN_SAMPLES:
                continue
            busiest = max(_mean(n.rx for n in ns) or 0, _mean(n.tx for n in ns) or 0) * 8 / 1e6
            if busiest >= SATURATED * speed:
                out.append(Flag(kind="saturated-link", host=host, what=name,
                                why=f"{busiest:.0f} of its {speed:.0f} Mbit/s over the last {WINDOW_S:.0f} s"))
    return out


def flags(by_host: Mapping[str, Sequence[Sample]], end: float) -> list[Flag]:
    """Everything worth pointing at, at moment ``end`` (head's clock)."""
    return stragglers(by_host, end) + idle_gpus(by_host, end) + saturated_links(by_host, end)


def latest(by_host: Mapping[str, Sequence[Sample]], end: float) -> dict[str, Sample]:
    """Each node's last sample at or before ``end``."""
    out = {}
    for host, samples in by_host.items():
        i = bisect.bisect_right(samples, end, key=_at)
        if i:
            out[host] = samples[i - 1]
    return out
