"""`corral top`: the live telemetry of a run, every node in one screen."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import click
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from corral import ui
from corral.cli.common import emit_json
from corral.errors import UsageError
from corral.run.history import RunRecord, default_root, find_run
from corral.run.stragglers import WINDOW_S, Flag, flags, latest
from corral.run.telemetry import FOLDER, Follower, Sample

#: How often the live view looks for new samples (seconds).
REFRESH_S = 1.0


@click.command(name="top")
@click.argument("run", required=False)
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where run directories are. Default: $CORRAL_RUNS_DIR, else ./runs.")
@click.option("--once", is_flag=True, help="Print one screen (the latest samples) and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the latest samples and flags as JSON and exit.")
@click.option("--speed", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Replay speed for a run that has ended (times real time).")
def top(run: str | None, runs_dir: Path | None, once: bool, as_json: bool, speed: float) -> None:
    """Show a run's GPUs, ranks and network links live, every node in one screen.

    RUN is a run id (or its prefix) or a run directory; default: the newest
    running run.  Each node samples once a second (per GPU utilisation,
    memory, power, temperature, SM clock, throttling; per rank CPU%, memory
    and progress; per link bytes/s) into runs/<id>/telemetry/.  Flagged:
    stragglers (a rank or GPU behind its peers for 5 s and more, see
    docs/telemetry.md), idle GPUs and saturated links.  A run that has ended
    is replayed (--speed).  Ctrl-C leaves.
    """
    record = find_run(runs_dir or default_root(Path.cwd()).path, run)
    if not isinstance(record.data, dict):
        raise UsageError(f"{record.dir / 'run.json'} is not a run's record (not a JSON object)",
                         hint="give the directory of a run `corral run` wrote; `corral runs` lists them")
    follower = Follower(record.dir, record.data)
    follower.poll()
    running = record.status == "running"
    if not follower.samples and not running:
        raise UsageError(f"run {record.run_id} has no telemetry ({record.dir / FOLDER} is empty or missing)",
                         hint="it ran with --no-telemetry, or ended before its first sample (one a second)")
    if as_json or once:
        end = _last(follower)
        if as_json:
            emit_json("top", snapshot(record, follower.samples, end))
        else:
            con = ui.console()
            if not con.is_terminal:
                con.width = max(con.width, 132)  # a pipe or a file: no 80-column wrap
            con.print(screen(record, follower.samples, end, record.status))
        return
    try:
        if running:
            _live(record, follower)
        else:
            _replay(record, follower, speed)
    except KeyboardInterrupt:
        pass


def _last(follower: Follower) -> float:
    return max((s[-1].at for s in follower.samples.values() if s), default=time.time())


def _live(record: RunRecord, follower: Follower) -> None:
    con = ui.console()
    last = screen(record, follower.samples, _last(follower), "running")
    with Live(last, console=con, screen=True, auto_refresh=False) as live:
        while True:
            time.sleep(REFRESH_S)
            follower.poll()
            current = find_run(record.dir.parent, str(record.dir))
            last = screen(record, follower.samples, _last(follower), current.status)
            live.update(last, refresh=True)
            if current.status != "running":
                break
    con.print(last)  # the run ended: its last screen stays on the terminal


def _replay(record: RunRecord, follower: Follower, speed: float) -> None:
    first = min(s[0].at for s in follower.samples.values() if s)
    last = _last(follower)
    started = time.monotonic()
    con = ui.console()
    with Live(console=con, screen=True, auto_refresh=False) as live:
        while True:
            cursor = min(first + (time.monotonic() - started) * speed, last)
            label = f"replay {cursor - first:.0f}/{last - first:.0f} s at {speed:g}x"
            shown = screen(record, follower.samples, cursor, label)
            live.update(shown, refresh=True)
            if cursor >= last:
                break
            time.sleep(min(REFRESH_S, 1.0 / speed * 2))
    con.print(shown)  # the end of the replay stays on the terminal


# -- what is shown -------------------------------------------------------------


def _plain(text: str) -> str:
    """A name from the run directory, without anything a terminal would act on."""
    return "".join(c for c in str(text) if c.isprintable())


def _n(value: float | None, fmt: str = "{:.0f}", unit: str = "") -> str:
    return "-" if value is None else fmt.format(value) + unit


def _rate(bps: float | None) -> str:
    if bps is None:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} B/s"


def _progress(r) -> str:
    if r.bar_rate is not None:
        return f"{r.bar_rate:.3g} {r.bar_unit}/s"
    return _n(r.lines_per_s, "{:.3g}", " lines/s")


def _hosts(record: RunRecord, by_host: dict[str, list[Sample]]) -> list[str]:
    order = [h["name"] for h in record.data.get("hosts") or () if isinstance(h, dict) and isinstance(h.get("name"), str)]
    return [h for h in order if h in by_host] + sorted(h for h in by_host if h not in order)


#: Links shown per node: the busiest, at most this many, and only with traffic (--json has all).
SHOWN_NICS = 4
QUIET_BPS = 1000.0


def _busy_nics(s: Sample, marks: dict) -> list:
    """A node's links worth a row: flagged ones, and the busiest few that carry anything."""
    ranked = sorted(s.nics, key=lambda n: -((n.rx or 0) + (n.tx or 0)))
    shown = [n for n in ranked if (s.host, n.name) in marks]
    shown += [n for n in ranked if n not in shown and (n.rx or 0) + (n.tx or 0) >= QUIET_BPS][:SHOWN_NICS]
    return sorted(shown, key=lambda n: n.name)


def screen(record: RunRecord, by_host: dict[str, list[Sample]], end: float, status: str) -> Group:
    """The whole view at moment ``end``: one row per GPU, rank and link of every node, then the flags."""
    found = flags(by_host, end)
    marks: dict[tuple[str, str], str] = {}
    for f in found:
        marks[(f.host, f.what)] = {"straggler": "STRAGGLER", "idle-gpu": "IDLE", "saturated-link": "SATURATED"}[f.kind]
    now = latest(by_host, end)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("NODE", "ITEM", "UTIL/CPU", "MEM", "POWER", "TEMP", "SM MHz", "PROGRESS", "RX", "TX", "FLAG"):
        table.add_column(col, justify="left" if col in ("NODE", "ITEM", "FLAG") else "right", no_wrap=True)
    for host in _hosts(record, by_host):
        s = now.get(host)
        if s is None:
            continue
        name = _plain(host)
        for g in s.gpus:
            mem = "-" if g.mem_mib is None else f"{g.mem_mib / 1024:.1f}/{_n(g.mem_total_mib and g.mem_total_mib / 1024, '{:.0f}')} G"
            throttled = " T" if g.throttle else ""
            table.add_row(name, f"gpu {g.index}", _n(g.util, unit="%"), mem, _n(g.power_w, unit=" W"),
                          _n(g.temp_c, unit=" C"), _n(g.sm_mhz) + throttled, "", "", "",
                          Text(marks.get((host, f"gpu {g.index}"), ""), style="bold red"))
        for r in s.ranks:
            table.add_row(name, f"rank {r.rank}", _n(r.cpu, unit="%"), _n(r.rss_mib and r.rss_mib / 1024, "{:.2f}", " G"),
                          "", "", "", _progress(r), "", "", Text(marks.get((host, f"rank {r.rank}"), ""), style="bold red"))
        for n in _busy_nics(s, marks):
            table.add_row(name, n.name, "", "", "", "", "", "", _rate(n.rx), _rate(n.tx),
                          Text(marks.get((host, n.name), ""), style="bold red"))
    ages = [time.time() - s.at for s in now.values()]  # (a live run: the head's clock, as ``at``)
    head = Text(f"corral top  run {_plain(record.run_id)}  {status}  {len(now)} node(s)"
                + (f"  newest sample {min(ages):.0f} s old" if ages and status == "running" else ""), style="bold")
    lines = [Text("  " + _plain(f.text()), style="red") for f in found] or [
        Text(f"  no stragglers, idle GPUs or saturated links in the last {WINDOW_S:.0f} s", style="dim")]
    # the flags first: on a screen shorter than the table, its end is what is cut
    return Group(head, *lines, Text(""), table)


def snapshot(record: RunRecord, by_host: dict[str, list[Sample]], end: float) -> dict:
    """``--json``: each node's latest sample and the flags at moment ``end``."""
    now = latest(by_host, end)
    return {
        "run_id": record.run_id,
        "status": record.status,
        "at": end,
        "nodes": [{"host": h, "age_s": round(end - now[h].at, 3),
                   "gpus": [dataclasses.asdict(g) for g in now[h].gpus],
                   "ranks": [dataclasses.asdict(r) for r in now[h].ranks],
                   "nics": [dataclasses.asdict(n) for n in now[h].nics]}
                  for h in _hosts(record, by_host) if h in now],
        "flags": [dataclasses.asdict(f) for f in flags(by_host, end)],
    }


__all__ = ["Flag", "screen", "snapshot", "top"]
