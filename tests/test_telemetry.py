"""Live telemetry: what a node's agent samples (agent/telemetry.py) and the
run's telemetry files on the head (run/telemetry.py).

GPU rows are parsed from nvidia-smi's CSV query output in its documented
format (fixtures); processes, /proc and the files are real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.agent.telemetry import (
    CountingChannel,
    GpuReader,
    Telemetry,
    ib_counters,
    link_speed,
    parse_gpu_line,
    parse_net_dev,
    parse_rate,
)
from corral.frames import FrameError, check_frame
from corral.run.telemetry import Follower, TelemetryFiles, parse_lines

FIXTURES = Path(__file__).parent / "fixtures" / "telemetry"


class Sent:
    """A channel that keeps what is sent (the agent's ``Channel`` interface)."""

    broken = False

    def __init__(self) -> None:
        self.events: list[dict] = []

    def send(self, **event) -> None:
        self.events.append(event)


# -- GPUs ---------------------------------------------------------------------


def test_gpu_rows_from_an_nvidia_smi_query() -> None:
    rows = [parse_gpu_line(line) for line in (FIXTURES / "nvidia-smi-query.csv").read_text().splitlines()]
    assert rows[0] == [0, 98, 40512, 81559, 312.45, 67, 1980, 0]
    assert rows[2][7] == 0x20  # SW thermal slowdown
    assert rows[3][4] is None  # [N/A] power
    old = parse_gpu_line((FIXTURES / "nvidia-smi-query-old.csv").read_text())
    assert old == [4, 12, 300, 15360, None, 41, 1290, None]
    assert parse_gpu_line("Field \"x\" is not a valid field to query.") is None
    assert parse_gpu_line("999, 1, 2, 3, 4, 5, 6, 0x0") is None  # not a GPU index the head takes


def test_the_gpu_reader_falls_back_to_the_newer_throttle_field_name(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
case "$*" in
  *clocks_throttle_reasons*) echo 'Field "clocks_throttle_reasons.active" is not a valid field to query.' >&2; exit 2;;
esac
cat {FIXTURES / "nvidia-smi-query.csv"}
exit 0
""")
    smi.chmod(0o755)
    reader = GpuReader(str(smi))
    reader.start()
    reader.join(10)
    assert sorted(reader.latest) == [0, 1, 2, 3]
    assert reader.latest[2][6] == 1410


# -- network --------------------------------------------------------------------


def test_net_dev_and_infiniband_counters(tmp_path: Path) -> None:
    counters = parse_net_dev((FIXTURES / "proc-net-dev.txt").read_text())
    assert counters["eth0"] == (987654321, 123456789)
    assert "lo" not in counters and counters["enp65s0f0"] == (42, 17)
    port = tmp_path / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "counters" / "port_rcv_data").write_text("1000\n")
    (port / "counters" / "port_xmit_data").write_text("250\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    assert ib_counters(str(tmp_path)) == {"mlx5_0/1": (4000, 1000)}  # 4-byte words
    assert link_speed("mlx5_0/1", ib_root=str(tmp_path)) == 200000
    net = tmp_path / "net" / "eth0"
    net.mkdir(parents=True)
    (net / "speed").write_text("-1\n")
    assert link_speed("eth0", net_root=str(tmp_path / "net")) is None


def test_a_progress_bars_rate() -> None:
    assert parse_rate(" 45%|####5     | 450/1000 [00:10<00:12, 43.21it/s]") == (43.21, "it")
    assert parse_rate("epoch 1:  3%| | 3/100 [00:12<06:28,  4.00s/it]") == (0.25, "it")
    assert parse_rate("12.0M/40M [00:01<00:02, 9.5MB/s]") == (9.5e6, "B")
    assert parse_rate("step 7 loss 2.3") is None


# -- ranks ------------------------------------------------------------------------


def test_a_ranks_cpu_counts_the_processes_it_started_and_its_lines_are_counted() -> None:
    # the "rank" only waits; the child it started burns CPU (a DataLoader worker)
    rank = subprocess.Popen([sys.executable, "-c",
                             "import subprocess,sys;subprocess.run([sys.executable,'-c','while True: pass'])"])
    try:
        sent = Sent()
        tm = Telemetry(sent, smi="")
        tm.pids = lambda: {3: rank.pid}
        time.sleep(0.5)  # the "rank" has started its child and only waits from here on
        tm.sample()
        tm.chan.send(ev="line", r=3, s="log", t="step")
        tm.chan.send(ev="lines", r=3, s="log", ts=["step"] * 3)  # the lines of one read: one frame
        tm.chan.send(ev="status", r=3, s="log", t="10/100 [00:01<00:09, 9.80it/s]")
        time.sleep(1.0)
        row = tm.sample()["rank"][0]
    finally:
        for pid in _children(rank.pid):
            os.kill(pid, 9)
        rank.kill()
        rank.wait()
    r, cpu, rss, lps, rate, unit = row
    assert r == 3 and cpu >= 5 and rss > 1
    assert 2 <= lps <= 4.1  # 4 lines in about a second (3 of them in one frame)
    assert (rate, unit) == (9.8, "it")
    assert [e["ev"] for e in sent.events] == ["line", "lines", "status"]  # passed on unchanged


def _children(pid: int) -> list[int]:
    from corral.agent.proctree import descendants

    return descendants(pid)


def test_the_counting_channel_says_when_the_real_one_broke() -> None:
    sent = Sent()
    chan = CountingChannel(sent)
    sent.broken = True
    assert chan.broken


# -- the head's files ---------------------------------------------------------------


def _event(i: int, rank_range=range(0, 2)) -> dict:
    return {"ev": "tm", "t": 1000.0 + i, "rank": [[r, 50.0, 100.0, 10.0, None, None] for r in rank_range],
            "nic": [["eth0", 1e6, 2e6, 10000]], "gpu": [[0, 90, 1000, 80000, 300, 60, 1980, 0]]}


def test_a_nodes_file_is_bounded_and_keeps_the_runs_whole_span(tmp_path: Path) -> None:
    files = TelemetryFiles(tmp_path, max_bytes=8 * 1024)
    for i in range(600):
        files.write("node1", _event(i))
    files.close()
    path = tmp_path / "telemetry" / "node1.jsonl"
    assert path.stat().st_size <= 8 * 1024 + 400
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    samples, bad = parse_lines("node1", path.read_bytes())
    ts = [json.loads(line)["t"] for line in path.read_text().splitlines()]
    assert bad == 0 and ts[0] == 1000.0 and ts[-1] >= 1000.0 + 600 - 64  # the start and the end
    assert ts == sorted(ts) and len(samples) == len(ts) < 600


def test_bad_lines_and_links_in_the_telemetry_folder_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "telemetry"
    folder.mkdir()
    good = json.dumps({**_event(1), "at": 2000.0})
    bad_nic = json.dumps({**_event(2), "nic": [["eth0\x1b]0;owned\x07", 1, 2, None]], "at": 2001.0})
    bad_rank = json.dumps({**_event(3), "rank": [["0", 1, 2, 3, None, None]], "at": 2002.0})
    (folder / "node1.jsonl").write_text("\n".join([good, bad_nic, bad_rank, "not json", good]) + "\n")
    secret = tmp_path / "secret.jsonl"
    secret.write_text(good + "\n")
    (folder / "node2.jsonl").symlink_to(secret)
    f = Follower(tmp_path, {"hosts": [{"name": "node1"}]})
    f.poll()
    assert list(f.samples) == ["node1"] and len(f.samples["node1"]) == 2 and f.refused == 3
    # a file that grows is read on from where it was
    with open(folder / "node1.jsonl", "a") as out:
        out.write(json.dumps({**_event(9), "at": 2009.0}) + "\n" + good[:20])  # a half-written line waits
    assert f.poll() and len(f.samples["node1"]) == 3


def test_a_telemetry_frame_is_checked_where_it_enters() -> None:
    ok = check_frame(json.dumps(_event(0, range(4, 6))).encode(), range(4, 6))
    assert ok["rank"][0][0] == 4 and ok["gpu"][0][6] == 1980

    def refused(**change) -> bool:
        try:
            check_frame(json.dumps({**_event(0, range(4, 6)), **change}).encode(), range(4, 6))
        except FrameError:
            return True
        return False

    assert refused(rank=[[7, 1, 2, 3, None, None]])  # not this node's rank
    assert refused(gpu=[[0, 1, 2, 3, 4, 5, 6, 0]] * 65)  # more GPUs than a node has
    assert refused(gpu=[[0, True, 2, 3, 4, 5, 6, 0]])
    assert refused(nic=[["../../etc", 1, 2, None, 5]])
    assert refused(nic=[["eth0 <b>", 1, 2, None]])
    assert refused(rank=[[4, 1, 2, 3, 4.0, "it/s;rm"]])
    assert refused(t=float("nan")) and refused(t="now")


@pytest.mark.gpu
def test_real_gpu_figures_from_the_nodes_nvidia_smi() -> None:
    reader = GpuReader(shutil.which("nvidia-smi") or "nvidia-smi")
    reader.start()
    try:
        deadline = time.monotonic() + 20
        while not reader.latest and time.monotonic() < deadline:
            time.sleep(0.2)
        rows = dict(reader.latest)
    finally:
        reader.stop()
    assert rows, "nvidia-smi gave no GPU row"
    for index, (i, util, mem, total, power, temp, sm, throttle) in rows.items():
        assert i == index and 0 <= util <= 100 and 0 <= mem <= total and total > 1000
        assert temp is None or 0 < temp < 120
        assert sm is None or sm > 0
        assert throttle is None or throttle >= 0
    assert check_frame(json.dumps({"ev": "tm", "t": 1.0, "gpu": list(rows.values())}).encode(), None)


def test_nvidia_smi_never_outlives_a_killed_agent(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nwhile true; do cat {FIXTURES / 'nvidia-smi-query.csv'}; sleep 1; done\n")
    smi.chmod(0o755)
    agent = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from corral.agent.telemetry import GpuReader
r = GpuReader({str(smi)!r}); r.start()
while not r.latest: time.sleep(0.05)
print(r.proc.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    pid = int(agent.stdout.readline())  # type: ignore[union-attr]
    agent.kill()  # SIGKILL: no teardown code runs
    agent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    left = _alive(pid)
    if left:
        os.kill(pid, 9)  # (the test leaves nothing behind either)
    assert not left


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
