"""`corral report`: one self-contained HTML page, checked in a real headless browser."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corral.run.logs import _safe
from corral.run.report import build

CORRAL = [sys.executable, "-m", "corral"]
HOSTILE = '<script>alert("x")</script><img src=http://evil.example/x.png>'


def failed_run(root: Path) -> Path:
    """A run directory as `corral run` leaves it after rank 3 failed, with
    telemetry written by the head's own writer, and hostile text wherever a
    node or a rank could put some."""
    run = root / "20260101-120000-abcdef"
    run.mkdir(parents=True)
    hosts = [{"name": "node1", "ranks": [0, 1]}, {"name": f"node2{HOSTILE}", "ranks": [2, 3]}]
    folder = run / "telemetry"
    folder.mkdir()
    for host in hosts:
        lines = []
        for i in range(20):
            lines.append({
                "ev": "tm", "t": 1000.0 + i, "at": 1000.0 + i,
                "gpu": [[g, 90 - 60 * (host["ranks"][0] == 2), 30000 + 100 * i, 81559, 300, 60, 1980, 0] for g in range(2)],
                "rank": [[r, 95.0, 2000.0, 5.0 if i > 3 else 0.0, None, None] for r in host["ranks"]],
                "nic": [["eth0", 1e6 * i, 2e6, 10000], ["mlx5_0/1", 5e9, 5e9, 200000]]})
        # as the head's writer names and fills it (run/telemetry.py), times chosen
        (folder / f"{_safe(host['name'])}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / _safe(hosts[1]["name"])).mkdir()
    (run / _safe(hosts[1]["name"]) / "rank3.log").write_text(
        "step 1\nTraceback (most recent call last):\n  File \"/w/train.py\", line 9, in <module>\n"
        f"    boom()\nRuntimeError: CUDA out of memory. {HOSTILE}\n")
    (run / "run.json").write_text(json.dumps({
        "run_id": run.name, "launcher": "torchrun", "program": "train.py", "args": [HOSTILE], "world_size": 4,
        "status": "failed", "exit_code": 1, "started": 995.0, "ended": 1021.0, "attempts": 2,
        "restarts": [{"attempt": 1, "failure": f"rank 1 failed {HOSTILE}"}], "hosts": hosts,
        "failure": {"host": hosts[1]["name"], "rank": 3, "kind": "exit", "exception": f"RuntimeError: {HOSTILE}",
                    "description": f"rank 3 on node1 failed: RuntimeError: {HOSTILE}"}}))
    (run / "flightrec.json").write_text(json.dumps({"summary": f"rank 5 never entered all_reduce #40 {HOSTILE}"}))
    return run


def test_the_page_escapes_everything_from_the_run_directory(tmp_path: Path) -> None:
    page = build(failed_run(tmp_path))
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;" in page
    assert re.search(r"Content-Security-Policy\" content=\"default-src 'none'", page)
    assert page.count("<polyline") >= 6  # GPU util and memory, network, CPU per node
    points = [len(p.split()) for p in re.findall(r'<polyline[^>]* points="([^"]*)"', page)]
    assert min(points) >= 15  # every line drawn through the run's samples
    assert "straggler: gpu 0 on node2" in html.unescape(page)  # 30% where its peers run at 90%
    assert "rank 5 never entered all_reduce #40" in page  # the flight recorder's analysis
    assert "CUDA out of memory" in page  # the diagnosis of the failed rank's log
    assert 'class="mark mark-failure"' in page  # where the failed rank is on the timeline


def test_without_telemetry_or_flight_recorder_the_page_says_so(tmp_path: Path) -> None:
    run = failed_run(tmp_path)
    shutil.rmtree(run / "telemetry")
    (run / "flightrec.json").unlink()
    page = build(run)
    assert "No telemetry in this run directory" in page and "flight recorder" not in page.lower()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed (scripts/system-deps.sh)")
def test_the_report_renders_in_a_headless_browser_with_its_plots(tmp_path: Path) -> None:
    run = failed_run(tmp_path / "runs")
    done = subprocess.run(CORRAL + ["report", str(run)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    page = run / "report.html"
    assert str(page) in done.stdout
    assert oct(page.stat().st_mode & 0o777) == "0o600"
    shot = tmp_path / "report.png"  # the test's artefact
    browser = [_chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0",
               f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2400"]
    seen = subprocess.run(browser + [f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                          timeout=120)
    assert shot.stat().st_size > 10_000, seen.stderr[-2000:]
    console = [ln for ln in seen.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln
               or "Refused to" in ln or "net::ERR" in ln]
    assert console == []
    dom = subprocess.run(browser + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<polyline") >= 6 and dom.count("<svg") >= 5
    assert "<script" not in dom and "Timeline" in dom


def test_a_run_record_of_the_wrong_shapes_still_gives_a_page(tmp_path: Path) -> None:
    run = failed_run(tmp_path)
    (run / "run.json").write_text(json.dumps({
        "hosts": [{"name": 5, "ranks": "ab"}, {"name": "h", "ranks": [1, "2", True]}], "status": {"a": 1},
        "failure": {"rank": "1", "host": ["x"]}, "restarts": [1, {"attempt": {}}], "started": 1e308, "ended": -5}))
    page = build(run)
    assert page.endswith("</html>\n") and "<polyline" in page
    (run / "run.json").write_text("[1, 2]")
    assert build(run).endswith("</html>\n")
