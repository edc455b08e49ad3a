"""The head's cost per relayed line, without a cluster: a real agent relay
writes a burst of rank output into a real channel (a file), and the head's
own code (frame reader, frame checks, session dispatch, watch, rank logs,
console writer to a pipe drained by a thread) handles it.  Prints lines/s of
the head and the frames per line.  Usage:
    python bench/bench_flood_head.py [--ranks 64] [--lines 2000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import threading
import time
from pathlib import Path

from corral.agent.relay import Channel, Relay
from corral.agent.session import AgentSession
from corral.frames import FrameReader
from corral.model import Cluster, Host
from corral.run.console import RunConsole
from corral.run.logs import RunLogs
from corral.run.plan import NodeFacts, RunSpec, build_plan
from corral.run.runner import _LogSink
from corral.run.watch import JobWatch, node_notice


def agent_bytes(path: Path, ranks: int, lines: int, per_read: int) -> int:
    """What a node's relay sends for ``lines`` lines per rank, read
    ``per_read`` lines at a time (the tailer's 20 ms poll at flood)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    chan = Channel(fd)
    relays = [Relay(chan, r, "log") for r in range(ranks)]
    done = 0
    while done < lines:
        n = min(per_read, lines - done)
        for r, relay in enumerate(relays):
            relay.feed(b"".join(b"step %d rank %d loss 0.123456 lr 0.0003 some text to fill it\n" % (done + i, r)
                                for i in range(n)))
        done += n
    chan._f.close()
    return ranks * lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--per-read", type=int, default=40, help="lines each rank wrote between two polls")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    data_path = tmp / "frames"
    total = agent_bytes(data_path, a.ranks, a.lines, a.per_read)
    data = data_path.read_bytes()
    frames_sent = data.count(b"\n")
    host = Host(name="node01", slots=a.ranks)
    cluster = Cluster(hosts=(host,))
    plan = build_plan(cluster, RunSpec(program="t.py", run_id="r", launcher="command"), {"node01": NodeFacts()},
                      master_addr="10.0.0.1", master_port=1, head_env={}, head_cwd="/")
    rfd, wfd = os.pipe()
    drain = threading.Thread(target=lambda: [None for _ in iter(lambda: os.read(rfd, 1 << 20), b"")], daemon=True)
    drain.start()
    out = os.fdopen(wfd, "w")
    console = RunConsole(multi_host=True, out=out, color=False)
    logs = RunLogs(tmp / "runs", "r")
    watch = JobWatch(plan, sinks=[_LogSink(logs), console])

    def on_event(s: AgentSession, ev: dict) -> None:  # what the runner does with each event
        node_notice(s.name, ev, interrupted=False)
        watch.event(s.name, ev)

    session = AgentSession(host=host, transport=None, tag="r", on_event=on_event)  # type: ignore[arg-type]
    session.hello = {"ev": "hello", "proto": 1}
    session.ranks = range(0, a.ranks)
    reader = FrameReader()
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for i in range(0, len(data), 65536):
        for frame in reader.feed(data[i:i + 65536]):
            session._frame(frame)
    logs.flush()
    if prof:
        prof.disable()
    took = time.perf_counter() - t0
    console.close()
    logs.close()
    got = sum(p.read_bytes().count(b"\n") for p in (tmp / "runs").rglob("rank*.log"))
    print(f"lines {total:,}  frames {frames_sent:,} ({frames_sent / total:.3f} per line)  head {took:.2f} s "
          f"= {total / took:,.0f} lines/s  (rank logs got {got:,} lines)")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
