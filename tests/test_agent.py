"""The node agent's parts that need no network: line splitting, tree kill."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from corral.agent.relay import LineSplitter
from corral.agent.session import AgentPool
from corral.model import Cluster, Host


def test_newlines_and_carriage_returns() -> None:
    sp = LineSplitter()
    lines, status = sp.feed(b"a\nb\r\n 10%|#\r 20%|##\r")
    assert lines == [b"a", b"b"] and status == b" 10%|#"  # the last '\r' may start '\r\n'
    lines, status = sp.feed(b" 30%|###\r100%|####\n")
    assert lines == [b"100%|####"] and status is None
    lines, status = sp.feed(b"partial")
    assert lines == [] and sp.flush() == [b"partial"]


def test_huge_line_without_newline_is_sent_in_pieces() -> None:
    sp = LineSplitter()
    lines, _ = sp.feed(b"x" * (200 * 1024))
    assert lines and len(lines[0]) == 200 * 1024


def _local() -> Cluster:
    return Cluster(hosts=(Host(name="me", local=True, python=sys.executable),))


def test_agent_calls_and_stops_its_whole_tree(tmp_path) -> None:
    """stop kills a grandchild that setsid()s and ignores SIGTERM; nothing else."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    events: list[dict] = []
    pidfile = tmp_path / "pid"

    async def main() -> None:
        pool = AgentPool(_local(), tag="t", on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            s = pool.sessions[0]
            probe = await s.call("probes.preflight", workdir=str(tmp_path), paths=["x.py"], want_port=True)
            assert probe["missing"] == ["x.py"] and probe["workdir"]["exists"] and probe["port"] > 0
            code = ("import os,signal,subprocess,sys,time\n"
                    "p=subprocess.Popen([sys.executable,'-c','import os,signal,time;os.setsid();"
                    "signal.signal(signal.SIGTERM,signal.SIG_IGN);time.sleep(60)'])\n"
                    f"open({str(pidfile)!r},'w').write(str(p.pid))\ntime.sleep(60)\n")
            await s.send(op="start", spec={"argv": [sys.executable, "-c", code], "env": {}, "cwd": str(tmp_path),
                                           "hook_source": "", "tag": "t-0"})
            for _ in range(100):
                if pidfile.exists() and pidfile.read_text():
                    break
                await asyncio.sleep(0.05)
            await s.send(op="stop", grace=0.5)
            for _ in range(100):
                if any(e.get("ev") == "exit" for e in events):
                    break
                await asyncio.sleep(0.05)
        finally:
            await pool.close()

    try:
        asyncio.run(main())
        grandchild = int(pidfile.read_text())
        time.sleep(0.2)
        assert not os.path.exists(f"/proc/{grandchild}") or open(f"/proc/{grandchild}/stat").read().split(")")[1].split()[0] == "Z"
        assert bystander.poll() is None, "the agent killed a process that was not its own"
        assert any(e.get("ev") == "exit" for e in events)
    finally:
        bystander.kill()
        bystander.wait()
