"""`corral report RUN`: one self-contained HTML page about a run.

What it shows, from the run directory alone: the run's record (run.json),
its timeline per node and rank (start, first output, progress, failure, end,
restarts), per node telemetry plots (GPU utilisation and memory, network
throughput, CPU per rank), the stragglers, idle GPUs and saturated links
seen over the run, the failure and its diagnosis (``corral.diagnose``), and
the flight-recorder analysis when there is one (``corral diagnose``'s, and
any ``flightrec*.json`` of the run).

The page loads nothing: plots are inline SVG, there is no script, and a
Content-Security-Policy forbids anything else.  Everything read from the run
directory is untrusted (another user's copy, a rank's output): every string
is HTML-escaped, and numbers are formatted, never pasted.
"""

from __future__ import annotations

import json
import time
from html import escape
from pathlib import Path
from typing import Any

from corral.run.stragglers import Flag, flags
from corral.run.svgplot import Lane, Series, line_chart, timeline
from corral.run.telemetry import Sample, read_all

#: Longest flight-recorder file shown (bytes), and how often flags are looked for (seconds).
MAX_FLIGHTREC = 256 * 1024
FLAG_STEP_S = 5.0
#: Links plotted per node (the busiest over the run).
SHOWN_NICS = 4
#: Most shaded steps per timeline lane.
LANE_BUCKETS = 200

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table.kv td{padding:1px 12px 1px 0;vertical-align:top}
pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:400px;white-space:pre-wrap}
.chart,.timeline{display:block;margin:8px 0}
.title{font:bold 12px sans-serif}.axis{font:10px sans-serif;fill:#555}.legend{font:11px sans-serif}
.frame{fill:none;stroke:#bbb}.grid{stroke:#eee}.bar{fill:#dde8f3}
.flag{color:#b00}.muted{color:#777}
"""
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _num(value: Any) -> float | None:
    """A time from run.json: seconds since 1970, within reason (else None)."""
    return float(value) if type(value) in (int, float) and 0 < value < 1e11 else None


def _when(ts: float | None) -> str:
    try:
        return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "-"


def build(run_dir: Path) -> str:
    """The whole page for the run in ``run_dir``."""
    record = _record(run_dir)
    samples = read_all(run_dir, record).samples
    start = _num(record.get("started")) or min((s[0].at for s in samples.values() if s), default=0.0)
    last_at = max((s[-1].at for s in samples.values() if s), default=start)
    end = _num(record.get("ended")) or last_at
    span = max(end, last_at) - start or 1.0
    parts = [f"<h1>corral run {_e(record.get('run_id') or run_dir.name)}</h1>", _summary(record, start, end)]
    parts.append("<h2>Timeline</h2>" + timeline(_lanes(record, samples, start, end), span)
                 + '<p class="muted">Bars: when each rank sent telemetry; shade: its output rate; '
                   'green mark: first output; red: the failure; black: the end.</p>')
    parts.append(_restarts(record))
    parts.append("<h2>Telemetry</h2>" + (_plots(record, samples, start, span) if samples else
                                         '<p class="muted">No telemetry in this run directory (it ran with '
                                         '--no-telemetry, or ended before the first sample).</p>'))
    parts.append(_flags(samples))
    report, why = _diagnose(run_dir)
    parts.append(_diagnosis(record, report, why))
    parts.append(_flightrec(run_dir, report))
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            f"<title>corral run {_e(record.get('run_id') or run_dir.name)}</title><style>{_STYLE}</style></head>"
            "<body>" + "".join(p for p in parts if p) + "</body></html>\n")


def _record(run_dir: Path) -> dict:
    try:
        data = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _summary(record: dict, start: float, end: float) -> str:
    rows = [("status", record.get("status")), ("launcher", record.get("launcher")),
            ("program", " ".join(str(a) for a in [record.get("program") or "", *(record.get("args") or [])])),
            ("world size", record.get("world_size")), ("nodes", len(record.get("hosts") or [])),
            ("started", _when(start)), ("ended", _when(_num(record.get("ended")))),
            ("duration", f"{end - start:.1f} s"), ("attempts", record.get("attempts")),
            ("exit code", record.get("exit_code"))]
    return '<table class="kv">' + "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in rows
                                          if v not in (None, "")) + "</table>"


def _hosts(record: dict, samples: dict[str, list[Sample]]) -> list[tuple[str, list[int]]]:
    out: list[tuple[str, list[int]]] = []
    for h in record.get("hosts") or ():
        if isinstance(h, dict) and isinstance(h.get("name"), str):
            ranks = [r for r in h.get("ranks") or () if type(r) is int][:1024]
            out.append((h["name"], ranks))
    known = {h for h, _ in out}
    for host in sorted(samples):
        if host not in known:
            out.append((host, sorted({r.rank for s in samples[host] for r in s.ranks})))
    return out


def _lanes(record: dict, samples: dict[str, list[Sample]], start: float, end: float) -> list[Lane]:
    failure = record.get("failure") if isinstance(record.get("failure"), dict) else {}
    lanes = []
    for host, ranks in _hosts(record, samples):
        node_samples = samples.get(host, [])
        lanes.append(Lane(label=host, start=0.0, end=end - start,
                          marks=[(end - start, "end", f"run ended ({record.get('status')})")]))
        for rank in ranks:
            seen = [(s.at - start, r) for s in node_samples for r in s.ranks if r.rank == rank]
            marks: list[tuple[float, str, str]] = []
            first = next((t for t, r in seen if (r.lines_per_s or 0) > 0 or r.bar_rate), None)
            if first is not None:
                marks.append((first, "first-output", "first output"))
            if failure and failure.get("rank") == rank and failure.get("host") == host:
                marks.append((seen[-1][0] if seen else end - start, "failure", str(failure.get("description"))))
            lanes.append(Lane(label=f"  rank {rank}", start=seen[0][0] if seen else None,
                              end=seen[-1][0] if seen else None, marks=marks, activity=_activity(seen, end - start)))
    return lanes


def _activity(seen: list, span: float) -> list[tuple[float, float]]:
    """(seconds, 0..1) per bucket: the rank's output rate against its own highest."""
    if not seen:
        return []
    width = max(span / LANE_BUCKETS, 1.0)
    buckets: dict[int, float] = {}
    for t, r in seen:
        rate = r.bar_rate if r.bar_rate is not None else (r.lines_per_s or 0.0)
        buckets[int(t // width)] = max(buckets.get(int(t // width), 0.0), rate)
    top = max(buckets.values()) or 1.0
    return [(b * width, v / top * 0.8) for b, v in sorted(buckets.items()) if v > 0]


def _restarts(record: dict) -> str:
    restarts = [r for r in record.get("restarts") or () if isinstance(r, dict)]
    if not restarts:
        return ""
    return "<h3>Restarts</h3><ul>" + "".join(
        f"<li>after attempt {_e(r.get('attempt'))}: {_e(r.get('failure'))}</li>" for r in restarts) + "</ul>"


def _plots(record: dict, samples: dict[str, list[Sample]], start: float, span: float) -> str:
    out = []
    for host, _ in _hosts(record, samples):
        ss = samples.get(host)
        if not ss:
            continue
        out.append(f"<h3>{_e(host)}</h3>")
        gpus = sorted({g.index for s in ss for g in s.gpus})
        if gpus:
            out.append(line_chart("GPU utilisation", [
                Series(f"gpu {i}", [(s.at - start, g.util) for s in ss for g in s.gpus if g.index == i and g.util is not None])
                for i in gpus], unit="%", y_max=100, x_max=span))
            out.append(line_chart("GPU memory used", [
                Series(f"gpu {i}", [(s.at - start, g.mem_mib / 1024) for s in ss for g in s.gpus
                                    if g.index == i and g.mem_mib is not None]) for i in gpus], unit=" GiB", x_max=span))
        traffic: dict[str, float] = {}
        for s in ss:
            for n in s.nics:
                traffic[n.name] = traffic.get(n.name, 0.0) + (n.rx or 0) + (n.tx or 0)
        nics = sorted(sorted(traffic, key=lambda k: -traffic[k])[:SHOWN_NICS])  # the busiest links
        if nics:
            series = []
            for name in nics:
                series.append(Series(f"{name} rx", [(s.at - start, n.rx * 8 / 1e6) for s in ss for n in s.nics
                                                    if n.name == name and n.rx is not None]))
                series.append(Series(f"{name} tx", [(s.at - start, n.tx * 8 / 1e6) for s in ss for n in s.nics
                                                    if n.name == name and n.tx is not None]))
            out.append(line_chart("network throughput", series, unit=" Mb/s", x_max=span))
        ranks = sorted({r.rank for s in ss for r in s.ranks})
        if ranks:
            out.append(line_chart("CPU per rank", [
                Series(f"rank {k}", [(s.at - start, r.cpu) for s in ss for r in s.ranks if r.rank == k and r.cpu is not None])
                for k in ranks], unit="%", x_max=span))
    return "".join(out)


def _flags(samples: dict[str, list[Sample]]) -> str:
    """Every straggler, idle GPU and saturated link seen over the run (when first)."""
    if not samples:
        return ""
    first = min(s[0].at for s in samples.values() if s)
    last = max(s[-1].at for s in samples.values() if s)
    seen: dict[tuple[str, str, str], tuple[float, Flag]] = {}
    t = first
    while t <= last + FLAG_STEP_S:
        for f in flags(samples, min(t, last)):
            seen.setdefault((f.kind, f.host, f.what), (min(t, last) - first, f))
        t += FLAG_STEP_S
    if not seen:
        return '<h2>Flags</h2><p class="muted">No stragglers, idle GPUs or saturated links.</p>'
    return "<h2>Flags</h2><ul>" + "".join(
        f'<li class="flag">{_e(f.text())} <span class="muted">(first at {at:.0f} s)</span></li>'
        for at, f in sorted(seen.values(), key=lambda v: v[0])) + "</ul>"


def _diagnose(run_dir: Path) -> tuple[Any, str | None]:
    """``corral diagnose``'s reading of the run directory, or why there is none."""
    try:
        from corral.diagnose.rundir import diagnose_run

        return diagnose_run(run_dir), None
    except Exception as e:  # noqa: BLE001 - the page is still worth having without it
        return None, f"{type(e).__name__}: {e}"


def _diagnosis(record: dict, report: Any, why: str | None) -> str:
    failure = record.get("failure") if isinstance(record.get("failure"), dict) else None
    if failure is None and record.get("status") in ("succeeded", "running"):
        return ""
    out = ["<h2>Failure and diagnosis</h2>"]
    if failure:
        out.append(f"<p><b>{_e(failure.get('description') or failure.get('kind'))}</b></p>")
    if report is None:
        out.append(f'<p class="muted">The logs could not be diagnosed: {_e(why)}</p>')
        return "".join(out)
    if report.first_error is not None:
        fe = report.first_error
        out.append(f"<p>{_e(fe.summary)}</p><pre>{_e(chr(10).join(fe.traceback))}</pre>")
    for d in report.diagnoses:
        out.append(f"<h3>{_e(d.title)}</h3><p>{_e(d.cause)}</p><ol>"
                   + "".join(f"<li>{_e(step)}</li>" for step in d.fix) + "</ol>")
    if report.hang is not None:
        out.append(f"<pre>{_e(json.dumps(report.hang.to_dict(), indent=2, default=str))}</pre>")
    if len(out) == 1:
        out.append('<p class="muted">No known cause found in the logs.</p>')
    return "".join(out)


def _flightrec(run_dir: Path, report: Any) -> str:
    """The flight-recorder analysis: ``corral diagnose``'s (where it reads the
    ranks' dumps), and any ``flightrec*.json`` the run wrote."""
    out = []
    analysis = getattr(report, "flightrec", None)
    if analysis is not None:
        data = analysis.to_dict() if hasattr(analysis, "to_dict") else analysis
        out.append(f"<pre>{_e(json.dumps(data, indent=2, default=str))}</pre>")
    for path in sorted(run_dir.glob("flightrec*.json"))[:4]:
        if path.is_symlink() or not path.is_file():
            continue
        raw = b""
        try:
            raw = path.read_bytes()[:MAX_FLIGHTREC]
            text = json.dumps(json.loads(raw), indent=2)
        except (OSError, ValueError, RecursionError):
            text = raw.decode("utf-8", "replace")
        out.append(f"<h3>{_e(path.name)}</h3><pre>{_e(text)}</pre>")
    return ("<h2>Collective flight recorder</h2>" + "".join(out)) if out else ""
