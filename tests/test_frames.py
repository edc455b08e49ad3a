"""What nodes send the head: read bounded, checked against a schema, or dropped.

The end-to-end attacks go through ``corral run`` on this machine: a rank
finds its node's agent and writes raw frames into the agent's channel to the
head (``/proc/<agent>/fd/N``), as any process of the job's user can.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import PEAK_RSS_KIB, RESET_PEAK_RSS

from corral.model import Host

CORRAL = [sys.executable, "-m", "corral"]

#: A rank that writes raw frames into its agent's channel to the head: the
#: agent is the ancestor holding the write end of a pipe the head holds too.
INJECT = r'''
import os, sys

def ppid(pid):
    with open("/proc/%d/stat" % pid) as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])

def cmdline(pid):
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        return f.read().split(b"\0")

def pipes(pid, writing):
    out = {}
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            with open("/proc/%d/fdinfo/%s" % (pid, fd)) as f:
                flags = int(f.read().split("flags:")[1].split()[0], 8)
        except OSError:
            continue
        if target.startswith("pipe:") and (not writing or flags & 3 == 1):
            out[target] = fd
    return out

chain, pid = [], os.getppid()
while pid > 1:
    chain.append(pid)
    if b"corral" in cmdline(pid) and b"run" in cmdline(pid):
        break
    pid = ppid(pid)
head = chain[-1]
shared = set(pipes(head, False))
channels = []
for pid in chain[:-1]:
    for target, fd in pipes(pid, True).items():
        if target in shared:
            channels.append("/proc/%d/fd/%s" % (pid, fd))
assert channels, "no agent channel found"
with open(channels[0], "wb", buffering=0) as chan:
    for frame in FRAMES:
        chan.write(frame)
print("injected", len(channels))
'''


def corral(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(CORRAL + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_a_rank_cannot_make_the_head_write_outside_the_run_dir_or_open_a_log_per_bogus_rank(
        tmp_path: Path) -> None:
    pwned = tmp_path / "PWNED"
    frames = [json.dumps({"ev": "line", "r": "/.." * 30 + str(pwned), "s": "out", "t": "pwned"})]
    frames += [json.dumps({"ev": "line", "r": 1000 + i, "s": "out", "t": "bogus"}) for i in range(300)]
    # batches: for a path as a rank, a rank outside the node, too many lines, a line that is not text
    frames += [json.dumps({"ev": "lines", "r": "/.." * 30 + str(pwned), "s": "out", "ts": ["pwned"] * 2}),
               json.dumps({"ev": "lines", "r": 7, "s": "out", "ts": ["bogus"] * 2}),
               json.dumps({"ev": "lines", "r": 0, "s": "out", "ts": ["bogus"] * 1025}),
               json.dumps({"ev": "lines", "r": 0, "s": "out", "ts": ["bogus", {"t": "bogus"}]})]
    (tmp_path / "evil.py").write_text("FRAMES = %r\n" % [(f + "\n").encode() for f in frames] + INJECT)
    res = corral(["run", "--launcher", "command", "--", sys.executable, "evil.py"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "injected 1" in res.stdout
    assert not pwned.with_suffix(".log").exists()
    assert not list(tmp_path.rglob("PWNED*"))
    [run_dir] = (tmp_path / "runs").iterdir()
    logs = sorted(p.name for p in run_dir.rglob("*.log"))
    assert logs == ["launcher.log", "rank0.log"] or logs == ["rank0.log"], logs
    assert "bogus" not in res.stdout and "pwned" not in res.stdout
    # One warning naming the node, then one summary with the count.
    errors = [ln for ln in res.stderr.splitlines() if "protocol error" in ln]
    assert len(errors) == 2, res.stderr[-3000:]
    [host] = [p.name for p in run_dir.iterdir() if p.is_dir()]  # the head's name for this machine
    assert f"{host}: protocol error: line event for rank '/../" in errors[0]
    assert "not one of this node's ranks (0-0)" in errors[0]
    assert f"{host}: 305 frames were dropped as protocol errors in all" in errors[1]


def _max_rss_kib(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``corral ARGS`` and return its own peak RSS (KiB, its children not counted)."""
    out = cwd / "rss"
    code = textwrap.dedent(f"""
        import atexit, runpy, sys
        {RESET_PEAK_RSS}
        atexit.register(lambda: open({str(out)!r}, "w").write(str({PEAK_RSS_KIB})))
        sys.argv = ["corral"] + {args!r}
        runpy.run_module("corral", run_name="__main__")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    return res, int(out.read_text())


def test_a_rank_printing_64_mib_without_a_newline_is_cut_and_the_head_stays_small(tmp_path: Path) -> None:
    mib = 64
    (tmp_path / "long.py").write_text(textwrap.dedent(f"""
        import os, sys
        chunk = b"x" * (1 << 20)
        for _ in range({mib}):
            os.write(1, chunk)
        os.write(1, b"\\nafter\\n")
    """))
    (tmp_path / "short.py").write_text("print('x' * 100)\nprint('after')\n")
    cmd = ["run", "--launcher", "command", "--", sys.executable]
    base, base_rss = _max_rss_kib(cmd + ["short.py"], tmp_path)
    assert base.returncode == 0, base.stderr[-3000:]
    res, rss = _max_rss_kib(cmd + ["long.py"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    [log] = [p for p in (tmp_path / "runs").rglob("rank0.log") if "x" * 1000 in p.read_text()[:2000]]
    lines = log.read_text().splitlines()
    cut = (mib << 20) - (1 << 20)
    assert lines[0] == "x" * (1 << 20) + f"\u2026[cut {cut} bytes]"
    assert lines[1] == "after"
    # The head held at most one line (1 MiB) of it at a time (it held 64 MiB
    # and more before: 8 MiB pieces, each kept whole in the rank's tail).
    assert rss - base_rss < 24 * 1024, (base_rss, rss)


def test_the_head_holds_a_node_that_skips_the_relay_to_the_same_bounds(tmp_path: Path) -> None:
    """A compromised node sends frames directly: a line in endless pieces, a
    frame with no newline, JSON nested past the parser's stack, a forged
    ``closed``, one rank's exit a thousand times; the head's reader on a
    real pipe drops them, counts them, and goes on."""
    from corral.agent.session import AgentSession
    from corral.frames import MAX_FRAME, MAX_LINE
    from corral.run.watch import JobWatch
    from corral.transport.local import LocalTransport

    piece = json.dumps({"ev": "line", "r": 0, "s": "log", "t": "y" * 60000, "more": 1})
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys
        w = lambda b: os.write(1, b)
        w(b'{{"ev":"hello","proto":1}}\\n')
        for _ in range(300):                       # an 18 MB line in pieces
            w(b'{piece}\\n')
        w(b'{{"ev":"line","r":0,"s":"log","t":"end"}}\\n')
        w(b'{{"ev":"line","r":null,"t":"' + b"z" * (2 * {MAX_FRAME}) + b'"}}\\n')   # over the frame limit
        w(b"[" * 200000 + b"\\n")                  # nested past the parser's stack
        w(b'{{"ev":"closed","error":"forged"}}\\n')  # only the head says a node is lost
        w(b'{{"ev":"rank_exit","r":0,"code":1}}\\n' * 1000)  # a rank exits once: 999 repeats
        w(b'{{"ev":"line","r":null,"t":"still here"}}\\n')
        sys.stdin.read()
    """))
    fake.chmod(0o755)
    events: list[dict] = []

    async def go() -> AgentSession:
        s = AgentSession(host=Host(name="gpu7", python=str(fake)), transport=LocalTransport(), tag="t",
                         on_event=lambda _, e: events.append(e), ranks=range(0, 1))
        await s.start(timeout=30)
        for _ in range(200):
            if any(e.get("t") == "still here" for e in events):
                break
            await asyncio.sleep(0.05)
        await s.kill()
        return s

    s = asyncio.run(go())
    assert [e["t"] for e in events if e.get("ev") == "line" and e["r"] is None] == ["still here"]
    assert not any(e.get("ev") == "closed" and e.get("error") == "forged" for e in events)
    assert s.protocol_errors is not None and s.protocol_errors.count == 3 + 999
    assert len([e for e in events if e.get("ev") == "rank_exit"]) == 1
    assert "over the limit" in s.protocol_errors.first
    # The head's own join holds the line to MAX_LINE and says what it cut.
    from corral.run.plan import LaunchPlan, NodePlan
    plan = LaunchPlan(run_id="r", launcher="command", master_addr="x", master_port=1, nodes=(NodePlan(
        host=Host(name="gpu7"), node_rank=0, nproc=1, first_rank=0, argv=(), env={}, cwd="/",
        pipe_rank=0, requires=None),))
    got: list[str] = []

    class Sink:
        def line(self, host, rank, stream, text):
            got.append(text)

        def status(self, host, rank, text):
            pass

    w = JobWatch(plan, sinks=[Sink()])
    for e in events:
        w.event("gpu7", e)
    [line] = got[:1]
    assert line.startswith("y" * MAX_LINE) and line.endswith(f"\u2026[cut {300 * 60000 + 3 - MAX_LINE - 64} bytes]")
    assert len(w.tails[0][0]) <= 4096


def test_every_field_of_a_frame_is_checked() -> None:
    from corral.frames import FrameError, check_frame

    def bad(frame: object, ranks: range | None = range(4, 8)) -> str:
        with pytest.raises(FrameError) as e:
            check_frame(json.dumps(frame).encode(), ranks)
        return str(e.value)

    ok = check_frame(b'{"ev":"line","r":5,"s":"err","t":"hi","extra":[1,2]}', range(4, 8))
    assert ok == {"ev": "line", "r": 5, "s": "err", "t": "hi"}  # unknown fields never pass
    assert check_frame(b'{"ev":"line","r":null,"t":"torchrun"}', None)["r"] is None
    assert "rank 3, not one of this node's ranks (4-7)" in bad({"ev": "line", "r": 3, "t": ""})
    assert "rank 5, not one of this node's ranks (none: no job planned)" in bad({"ev": "line", "r": 5, "t": ""},
                                                                                None)
    assert "rank True" in bad({"ev": "rank_exit", "r": True})
    assert "rank '5'" in bad({"ev": "status", "r": "5", "t": ""})
    assert "rank_exit event without its 'r' field" in bad({"ev": "rank_exit", "code": 1})
    assert "bad 's' field" in bad({"ev": "line", "r": None, "s": "../x", "t": ""})
    assert "bad 'code' field" in bad({"ev": "exit", "code": "1"})
    assert "bad 'code' field" in bad({"ev": "exit", "code": 10**30})
    assert "bad 'names' field" in bad({"ev": "killed", "n": 1, "names": [{}]})
    assert "unknown event type 'closed'" in bad({"ev": "closed"})
    assert "unknown event type None" in bad({"t": "x"})
    assert "not a JSON object" in bad([1])
    assert "bad 'grace' field" in bad({"ev": "killed", "n": 1, "grace": float("nan")})
    assert "bad 'grace' field" in bad({"ev": "killed", "n": 1, "grace": float("inf")})


def test_a_batch_of_lines_is_checked_as_strictly_as_one_line() -> None:
    """A ``lines`` frame (the complete lines of one read, one frame) carries
    up to ``MAX_BATCH`` strings of at most ``MAX_LINE`` each, for one rank
    of the node's plan; anything else is refused whole, as a line is."""
    from corral.agent import relay
    from corral.frames import MAX_BATCH, MAX_LINE, FrameError, check_frame

    def bad(frame: object, ranks: range | None = range(4, 8)) -> str:
        with pytest.raises(FrameError) as e:
            check_frame(json.dumps(frame).encode(), ranks)
        return str(e.value)

    assert relay.MAX_BATCH == MAX_BATCH
    ok = check_frame(json.dumps({"ev": "lines", "r": 5, "s": "log", "ts": ["a", "b"], "x": 1}).encode(), range(4, 8))
    assert ok == {"ev": "lines", "r": 5, "s": "log", "ts": ["a", "b"]}
    assert check_frame(b'{"ev":"lines","r":null,"ts":["x"]}', None) == {"ev": "lines", "r": None, "s": "out",
                                                                         "ts": ["x"]}
    assert "rank 3, not one of this node's ranks (4-7)" in bad({"ev": "lines", "r": 3, "ts": ["a"]})
    assert "rank '5'" in bad({"ev": "lines", "r": "5", "ts": ["a"]})
    assert "without its 'ts' field" in bad({"ev": "lines", "r": 5})
    assert "bad 'ts' field" in bad({"ev": "lines", "r": 5, "ts": []})
    assert "bad 'ts' field" in bad({"ev": "lines", "r": 5, "ts": "ab"})
    assert "bad 'ts' field" in bad({"ev": "lines", "r": 5, "ts": ["a", 1]})
    assert "bad 'ts' field" in bad({"ev": "lines", "r": 5, "ts": ["a", None]})
    assert "bad 'ts' field" in bad({"ev": "lines", "r": 5, "ts": ["a"] * (MAX_BATCH + 1)})
    assert "bad 'ts' field" in bad({"ev": "lines", "r": 5, "ts": ["a", "y" * (MAX_LINE + 1)]})
    assert "bad 's' field" in bad({"ev": "lines", "r": 5, "s": "../x", "ts": ["a"]})
    assert check_frame(json.dumps({"ev": "lines", "r": 4, "ts": ["a"] * MAX_BATCH}).encode(), range(4, 8))


def test_a_frame_over_the_limit_is_dropped_as_it_arrives() -> None:
    from corral.frames import FrameReader

    r = FrameReader(limit=1000)
    got: list[bytes | int] = []
    for _ in range(64):
        got += r.feed(b"a" * 4096)
        assert len(r._buf) <= 1000
    got += r.feed(b"tail\n{}\npartial")
    assert got == [64 * 4096 + 4, b"{}"]
    assert r.rest() == [b"partial"]


def test_the_node_relay_and_the_head_cut_lines_at_the_same_length() -> None:
    from corral.agent import relay
    from corral.frames import MAX_LINE

    assert relay.MAX_LINE == MAX_LINE
    sp = relay.LineSplitter()
    sent = 0
    for _ in range(40):
        pieces, _ = sp.feed("\u00e9".encode() * 32768)  # 64 KiB of 2-byte characters per read
        sent += sum(len(p) for p, _ in pieces)
        assert all(more for _, more in pieces)
    assert sent <= MAX_LINE
    pieces, _ = sp.feed(b"!\nnext\n")
    end = pieces[0][0].decode()
    assert pieces[0][1] is False and end.endswith("\u2026[cut %d bytes]" % (40 * 65536 + 1 - MAX_LINE))
    assert pieces[1] == (b"next", False)


def test_a_node_flooding_bad_frames_gets_one_warning_and_one_count() -> None:
    from corral.frames import ProtocolErrors

    errs = ProtocolErrors("gpu3")
    said = [errs.add(f"bad {i}") for i in range(1000)]
    assert [s for s in said if s] == [said[0]] and said[0].startswith("gpu3: protocol error: bad 0;")
    assert errs.summary() == "gpu3: 1000 frames were dropped as protocol errors in all (the first: bad 0)"


def test_a_rank_outside_the_plan_is_its_nodes_output_labelled_not_a_protocol_error(tmp_path: Path) -> None:
    # torchrun under --launcher command: its ranks are not the plan's (one
    # per node).  The node's agent relays them as the node's own output.
    (tmp_path / "outer.py").write_text(textwrap.dedent("""
        import os, subprocess, sys
        print("outer", flush=True)
        subprocess.run([sys.executable, "-c", "print('from inner rank 5')"], env=dict(os.environ, RANK="5"))
    """))
    res = corral(["run", "--launcher", "command", "--", sys.executable, "outer.py"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "protocol error" not in res.stderr, res.stderr[-3000:]
    [line] = [ln for ln in res.stdout.splitlines() if "from inner rank 5" in ln]
    assert line.endswith("] [rank 5] from inner rank 5") and not line.startswith("[r5]"), line
    [run_dir] = (tmp_path / "runs").iterdir()
    assert not list(run_dir.rglob("rank5.log"))
