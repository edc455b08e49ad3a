"""`corral top`: a run's telemetry on one screen, live (tmux reads it) and replayed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socketserver
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

CORRAL = [sys.executable, "-m", "corral"]
REPO = Path(__file__).resolve().parents[1]


def finished_run(root: Path) -> Path:
    """A run that ended, with 30 s of telemetry from 4 nodes; node3's ranks
    wrote a line a second where the others wrote ten."""
    run = root / "20260101-120000-abcdef"
    (run / "telemetry").mkdir(parents=True)
    hosts = [{"name": f"node{n}", "ranks": [2 * n - 2, 2 * n - 1]} for n in range(1, 5)]
    for h in hosts:
        lines = []
        for i in range(30):
            lps = 1.0 if h["name"] == "node3" else 10.0
            lines.append(json.dumps({"ev": "tm", "t": 5000.0 + i, "at": 1000.0 + i,
                                     "rank": [[r, 30.0, 900.0, lps, None, None] for r in h["ranks"]],
                                     "nic": [["eth0", 2e6, 1e6, None]]}))
        (run / "telemetry" / f"{h['name']}.jsonl").write_text("\n".join(lines) + "\n")
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "status": "succeeded", "hosts": hosts}))
    return run


def test_top_json_of_a_finished_run_names_the_straggling_node(tmp_path: Path) -> None:
    run = finished_run(tmp_path)
    done = subprocess.run(CORRAL + ["top", str(run), "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [n["host"] for n in out["nodes"]] == ["node1", "node2", "node3", "node4"]
    assert out["nodes"][2]["ranks"][0] == {"rank": 4, "cpu": 30.0, "rss_mib": 900.0, "lines_per_s": 1.0,
                                           "bar_rate": None, "bar_unit": None}
    assert {(f["kind"], f["host"], f["what"]) for f in out["flags"]} == {
        ("straggler", "node3", "rank 4"), ("straggler", "node3", "rank 5")}
    once = subprocess.run(CORRAL + ["top", str(run), "--once"], capture_output=True, text=True, timeout=60)
    rows = [ln for ln in once.stdout.splitlines() if "STRAGGLER" in ln]
    assert [ln.split()[:3] for ln in rows] == [["node3", "rank", "4"], ["node3", "rank", "5"]]


def test_a_run_without_telemetry_is_named(tmp_path: Path) -> None:
    run = finished_run(tmp_path)
    shutil.rmtree(run / "telemetry")
    done = subprocess.run(CORRAL + ["top", str(run), "--once"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "has no telemetry" in done.stderr and "--no-telemetry" in done.stderr


# -- live, on the sandbox ----------------------------------------------------------

FETCH = """\
    # Each step fetches its batch (64 KiB) from a data server, as ranks
    # reading a network store do; the ranks do not wait for each other.
    import os, socket, sys, time
    host, port = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["RANK"])
    deadline = time.time() + 240
    step = 0
    while time.time() < deadline:
        with socket.create_connection((host, port), timeout=60) as s:
            got = 0
            while got < 65536:
                data = s.recv(65536)
                if not data:
                    break
                got += len(data)
        print(f"rank {rank} step {step}", flush=True)
        step += 1
        time.sleep(0.05)
"""


class _Batches(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            self.request.sendall(b"x" * 65536)
        except OSError:
            pass


def _tmux(sock: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.sandbox
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/system-deps.sh)")
def test_top_shows_the_throttled_node_as_the_straggler_live(sandbox, tmp_path: Path) -> None:
    work = REPO / "scratch" / f"top-{os.getpid()}-{time.monotonic_ns()}"
    work.mkdir(parents=True)
    (work / "fetch.py").write_text(textwrap.dedent(FETCH))
    server = socketserver.ThreadingTCPServer((sandbox.head_address, 0), _Batches)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    runs = tmp_path / "runs"
    slow = sandbox.nodes[2]
    sock = f"corral-top-{os.getpid()}"
    proc = subprocess.Popen(CORRAL + ["run", "-c", str(sandbox.cluster_file), "--runs-dir", str(runs), "-n", "2",
                                      "--ranks", "all", "fetch.py", sandbox.head_address, str(server.server_address[1])],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started: set[str] = set()
        for line in proc.stdout:  # type: ignore[union-attr]
            m = re.search(r"rank (\d+) step", line)
            if m:
                started.add(m.group(1))
            if len(started) == 8:
                break
        assert len(started) == 8, "the job did not start"
        sandbox.slow(slow, "512kbit")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
        run_id = next(runs.iterdir()).name
        # (a detached session may keep tmux's default 80 columns whatever -x says)
        assert _tmux(sock, "new-session", "-d", "-x", "180", "-y", "60", "-s", "top",
                     " ".join(["env", "COLUMNS=180", "LINES=60", *CORRAL, "top", "--runs-dir", str(runs),
                               run_id])).returncode == 0
        flagged: set[tuple[str, str]] = set()
        screen = ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            time.sleep(2)
            screen = _tmux(sock, "capture-pane", "-p", "-t", "top").stdout
            flagged = set(re.findall(r"straggler: rank (\d+) on (\S+):", screen))
            if flagged and all(h == slow for _, h in flagged) and len(flagged) == 2:
                break
        record = json.loads((runs / run_id / "run.json").read_text())
        slow_ranks = {str(r) for h in record["hosts"] if h["name"] == slow for r in h["ranks"]}
        assert flagged == {(r, slow) for r in slow_ranks}, screen
        assert all(re.search(rf"^{re.escape(slow)}\s+rank {r}\b.*STRAGGLER", screen, re.M) for r in slow_ranks), screen
        for node in sandbox.nodes:  # telemetry from every node
            assert (runs / run_id / "telemetry" / f"{node}.jsonl").stat().st_size > 0
    finally:
        _tmux(sock, "kill-server")
        sandbox.slow(slow, None)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.shutdown()
        server.server_close()
        shutil.rmtree(work, ignore_errors=True)
