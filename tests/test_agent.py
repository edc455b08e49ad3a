"""The node agent's parts that need no network: line splitting, tree kill."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import pid_alive

from corral.agent.relay import LineSplitter
from corral.agent.session import AgentPool
from corral.model import Cluster, Host


def test_newlines_and_carriage_returns() -> None:
    sp = LineSplitter()
    lines, status = sp.feed(b"a\nb\r\n 10%|#\r 20%|##\r")
    assert lines == [(b"a", False), (b"b", False)] and status == b" 10%|#"  # the last '\r' may start '\r\n'
    lines, status = sp.feed(b" 30%|###\r100%|####\n")
    assert lines == [(b"100%|####", False)] and status is None
    lines, status = sp.feed(b"partial")
    assert lines == [] and sp.flush() == [(b"partial", False)]


def test_a_bar_drawn_below_the_cursor_is_a_status_not_blank_lines() -> None:
    """tqdm(position=rank), the usual one-bar-per-rank idiom: every redraw is
    N newlines, the bar, N cursor-ups.  It was N empty lines plus the bar as
    a line on every refresh (215 of 347 lines on 6 ranks); now it is a status,
    and what stays is the bar tqdm leaves at the end."""
    import io

    from tqdm import tqdm

    out = io.StringIO()
    for _ in tqdm(range(5), position=3, file=out, mininterval=0, miniters=1, ascii=True, desc="r3"):
        pass
    sp = LineSplitter()
    lines, statuses = [], []
    data = out.getvalue().encode()
    assert data.startswith(b"\n\n\n") and b"\x1b[A" in data  # what tqdm writes for position=3
    for i in range(0, len(data), 7):  # reads land anywhere
        got, status = sp.feed(data[i:i + 7])
        lines += got
        statuses += [status] if status else []
    lines += sp.flush()
    assert len(lines) == 1 and lines[0][0].startswith(b"r3: 100%|##########| 5/5"), lines
    assert statuses and all(b"\x1b" not in s and s.startswith(b"r3: ") for s in statuses), statuses
    # Empty lines a program prints are kept, in place.
    sp = LineSplitter()
    got, _ = sp.feed(b"a\n\n\nb\n\n")
    assert got + sp.flush() == [(b"a", False), (b"", False), (b"", False), (b"b", False), (b"", False)]


def test_huge_line_is_sent_in_pieces_marked_to_be_joined() -> None:
    sp = LineSplitter()
    line = ("\u00e9" * (150 * 1024)).encode()  # 2-byte characters: a cut could land mid-character
    pieces = []
    for i in range(0, len(line), 65536):
        got, _ = sp.feed(line[i:i + 65536])
        pieces += got
    got, _ = sp.feed(b"\r\nnext\n")
    pieces += got
    assert all(more for _, more in pieces[:-2]) and pieces[-2:][1] == (b"next", False)
    joined = b"".join(p for p, _ in pieces[:-1])
    assert joined == line and pieces[-2][1] is False
    for piece, _ in pieces[:-1]:
        piece.decode("utf-8")  # every piece is whole characters


def test_a_reads_lines_are_one_event_labelled_each_and_a_cut_line_still_goes_in_pieces() -> None:
    """The complete lines of one read are one ``lines`` event (bounded in
    count); a rank outside the plan has each line labelled; the pieces of a
    line too long for one event go alone, and the end of such a line, in the
    next batch, carries no second label."""
    from corral.agent.relay import MAX_BATCH, MAX_PARTIAL, Relay

    class Chan:
        def __init__(self) -> None:
            self.events: list[dict] = []

        def send(self, **ev: object) -> None:
            self.events.append(ev)

    chan = Chan()
    relay = Relay(chan, None, "log", "[rank 9] ")  # type: ignore[arg-type]
    relay.feed(b"".join(b"l%d\n" % i for i in range(MAX_BATCH + 5)))
    relay.feed(b"y" * (MAX_PARTIAL + 10))
    relay.feed(b"!\nz\n")
    kinds = [(e["ev"], len(e.get("ts", ())), e.get("more")) for e in chan.events]
    assert kinds == [("lines", MAX_BATCH, None), ("lines", 5, None), ("line", 0, 1), ("lines", 2, None)], kinds
    texts = [t for e in chan.events for t in _texts(e)]
    assert texts[:MAX_BATCH + 5] == ["[rank 9] l%d" % i for i in range(MAX_BATCH + 5)]
    assert texts[-1] == "[rank 9] z" and not texts[-2].startswith("[rank 9]")
    assert "".join(texts[-3:-1]) == "[rank 9] " + "y" * (MAX_PARTIAL + 10) + "!"


async def until_exit(events: list[dict], timeout: float) -> None:
    """Wait (up to ``timeout``) for the agent's ``exit`` event."""
    for _ in range(int(timeout / 0.05)):
        if any(e.get("ev") == "exit" for e in events):
            return
        await asyncio.sleep(0.05)


def _texts(ev: dict) -> list[str]:
    """The output lines an event carries (a ``line``, or a batch of them)."""
    return [ev["t"]] if ev.get("ev") == "line" else list(ev["ts"]) if ev.get("ev") == "lines" else []


def _local() -> Cluster:
    return Cluster(hosts=(Host(name="me", local=True, python=sys.executable),))


async def start(session, argv: list[str], cwd, tag: str = "t-0") -> None:
    """Start a job (no rank hook, no extra environment) on the agent."""
    await session.send(op="start", spec={"argv": argv, "env": {}, "cwd": str(cwd), "hook_source": "", "tag": tag})


async def wait_for_file(path, timeout: float = 10.0) -> None:
    """Wait until the job has written ``path`` (its pid)."""
    for _ in range(int(timeout / 0.05)):
        if path.exists() and path.read_text():
            return
        await asyncio.sleep(0.05)


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
            await start(s, [sys.executable, "-c", code], tmp_path)
            await wait_for_file(pidfile, 5.0)
            await s.send(op="stop", grace=0.5)
            await until_exit(events, 5.0)
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


def test_repeated_sigterm_still_stops_the_job(tmp_path) -> None:
    """A head that dies delivers several SIGTERMs (PR_SET_PDEATHSIG fires once
    per exiting thread): later ones must not end the agent's teardown early,
    leaving the job (here one that ignores SIGTERM) running."""
    events: list[dict] = []
    pidfile = tmp_path / "pid"
    code = ("import os,signal,time\nsignal.signal(signal.SIGTERM,signal.SIG_IGN)\n"
            f"open({str(pidfile)!r},'w').write(str(os.getpid()))\ntime.sleep(60)\n")

    async def main() -> int:
        pool = AgentPool(_local(), tag="t", on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            s = pool.sessions[0]
            await start(s, [sys.executable, "-c", code], tmp_path)
            await wait_for_file(pidfile)
            agent = int(s.hello["pid"])
            for _ in range(100):  # a burst, as a dying multi-threaded parent sends them
                try:
                    os.kill(agent, signal.SIGTERM)
                except ProcessLookupError:
                    break
                time.sleep(0.002)
            return agent
        finally:
            await pool.close()

    agent = asyncio.run(main())
    job = int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{job}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{job}"), "the agent died and left its job running"
        assert not os.path.exists(f"/proc/{agent}")
    finally:
        if os.path.exists(f"/proc/{job}"):
            os.kill(job, signal.SIGKILL)


@pytest.mark.parametrize("prewarmed", [False, True])
def test_a_launcher_does_not_outlive_an_agent_killed_with_sigkill(tmp_path, monkeypatch, prewarmed: bool) -> None:
    """Nothing can clean up after an agent that is SIGKILLed (by an admin, the
    OOM killer): its launcher gets SIGTERM from the kernel instead, fresh or
    prewarmed, and stops its own workers."""
    events: list[dict] = []
    pidfile = tmp_path / "pid"
    (tmp_path / "launcher_mod.py").write_text(
        "import os,time\nif __name__ == '__main__':\n"
        f"    open({str(pidfile)!r},'w').write(str(os.getpid()))\n    time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the agent's, and so the prewarmed process's

    async def main() -> None:
        pool = AgentPool(_local(), tag="t", on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            s = pool.sessions[0]
            argv = [sys.executable, "launcher_mod.py"]
            if prewarmed:  # the path torchrun takes: `python -m <module>`, imported ahead
                await s.send(op="prewarm", python=sys.executable, module="launcher_mod")
                argv = [sys.executable, "-m", "launcher_mod"]
                await asyncio.sleep(0.5)
            await start(s, argv, tmp_path)
            await wait_for_file(pidfile)
            agent = int(s.hello["pid"])
            if prewarmed:  # it was the prewarmed process that ran the job
                assert open(f"/proc/{int(pidfile.read_text())}/cmdline").read().split("\0")[1] == "-c"
            os.kill(agent, signal.SIGKILL)
        finally:
            await pool.close()

    asyncio.run(main())
    job = int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 5
        while pid_alive(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(job), "the launcher outlived its agent"
    finally:
        if pid_alive(job):
            os.kill(job, signal.SIGKILL)


def test_a_prewarmed_launcher_that_died_is_named_when_preloaded_ranks_were_asked_for(tmp_path, monkeypatch) -> None:
    """The job then runs fresh, and the user reads why (never silently)."""
    events: list[dict] = []
    (tmp_path / "launcher_mod.py").write_text("raise SystemExit('launcher_mod: broken at import')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    async def main() -> None:
        pool = AgentPool(_local(), tag="t", on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            s = pool.sessions[0]
            await s.send(op="prewarm", python=sys.executable, module="launcher_mod")
            await asyncio.sleep(1.0)
            await s.send(op="start", spec={"argv": [sys.executable, "-m", "launcher_mod"], "env": {},
                                           "cwd": str(tmp_path), "hook_source": "", "tag": "t-0",
                                           "preload": True})
            for _ in range(200):
                if any(e.get("ev") == "exit" for e in events):
                    break
                await asyncio.sleep(0.05)
        finally:
            await pool.close()

    asyncio.run(main())
    said = repr(events)
    assert "starting ranks as fresh interpreters: the prewarmed launcher exited: launcher_mod: broken at import" in said, said


# ---------------------------------------------------------------------------
# What the agent adds to a job's command and environment


def test_torchrun_log_dir_goes_into_the_jobs_temp_dir() -> None:
    from corral.agent.jobenv import elastic_log_dir

    argv = ["/py", "-m", "torch.distributed.run", "--nnodes=2", "train.py", "--log-dir", "mine"]
    out = elastic_log_dir(list(argv), {}, "/t/job/elastic")
    # right after the module: a --log-dir the user passes to torchrun (later) still wins,
    # and the script's own --log-dir (after the script) is the script's
    assert out == argv[:3] + ["--log-dir=/t/job/elastic"] + argv[3:]
    env = {"PET_LOG_DIR": "/keep/mine"}
    assert elastic_log_dir(list(argv), env, "/t/job/elastic") == argv  # torchrun reads it itself
    other = ["/py", "-u", "-m", "deepspeed.launcher.launch", "x.py"]
    assert elastic_log_dir(list(other), {}, "/t") == other
    assert elastic_log_dir(["bash", "-c", "true"], {}, "/t") == ["bash", "-c", "true"]


def test_accelerate_log_dir_flag_or_torchruns_variable(monkeypatch) -> None:
    from corral.agent import jobenv as node

    argv = ["/py", "-m", "accelerate.commands.launch", "--multi_gpu", "train.py"]
    monkeypatch.setattr(node, "_accelerate_has_log_dir", lambda: True)
    assert node.elastic_log_dir(list(argv), {}, "/t/e") == argv[:3] + ["--log_dir=/t/e"] + argv[3:]
    # accelerate < 0.31 has no --log_dir and passes torchrun's PET_* defaults through
    monkeypatch.setattr(node, "_accelerate_has_log_dir", lambda: False)
    env: dict = {}
    assert node.elastic_log_dir(list(argv), env, "/t/e") == argv and env == {"PET_LOG_DIR": "/t/e"}


def test_this_accelerate_takes_log_dir() -> None:
    import importlib.util

    import pytest

    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed")
    from corral.agent.jobenv import _accelerate_has_log_dir

    assert _accelerate_has_log_dir()


def test_configured_python_is_first_on_path() -> None:
    from corral.agent.jobenv import activate_python

    env = {"CORRAL_PYTHON": "/opt/venv/bin/python", "PATH": "/usr/bin:/bin"}
    activate_python(env)
    assert env["PATH"] == "/opt/venv/bin:/usr/bin:/bin"
    activate_python(env)  # idempotent
    assert env["PATH"] == "/opt/venv/bin:/usr/bin:/bin"
    env = {"CORRAL_PYTHON": "/usr/bin/python3", "PATH": "/usr/local/bin:/usr/bin"}
    activate_python(env)  # already there: system directories are not reordered
    assert env["PATH"] == "/usr/local/bin:/usr/bin"
    env = {"CORRAL_PYTHON": "python3", "PATH": "/usr/bin"}
    activate_python(env)  # a bare name: nothing to put first
    assert env["PATH"] == "/usr/bin"


def test_job_temp_dir_and_its_parent_are_removed_at_the_end(tmp_path, monkeypatch) -> None:
    """The agent's own tmp root goes too when nothing else is in it; another job's files never."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    root = tmp_path / f"corral-{os.getuid()}"
    events: list[dict] = []

    async def job(tag: str, code: str) -> None:
        pool = AgentPool(_local(), tag=tag, on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            await start(pool.sessions[0], [sys.executable, "-c", code], tmp_path, tag)
            await until_exit(events, 10.0)
        finally:
            await pool.close()

    code = "import os; print(sorted(os.listdir(os.path.dirname(os.environ['CORRAL_LOG_DIR']))))"
    asyncio.run(job("r1-1", code))
    assert [e["t"] for e in events if e.get("ev") == "line"] == ["['hook', 'logs']"]
    assert list(tmp_path.iterdir()) == []
    # A root that was there before (another job's directory in it) stays, with what is in it.
    (root / "other-job").mkdir(parents=True)
    events.clear()
    asyncio.run(job("r2-1", "pass"))
    assert [p.name for p in root.iterdir()] == ["other-job"]


def test_the_last_of_two_overlapping_jobs_removes_the_tmp_root(tmp_path, monkeypatch) -> None:
    """Job 1 makes ``corral-<uid>`` and ends first (job 2's directory is still
    in it); job 2, which found it there, removes it when it ends."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    root = tmp_path / f"corral-{os.getuid()}"
    events: list[dict] = []

    async def job(tag: str, seconds: float) -> None:
        pool = AgentPool(_local(), tag=tag, on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            await start(pool.sessions[0], [sys.executable, "-c", f"import time; time.sleep({seconds})"],
                        tmp_path, tag)
            for _ in range(int((seconds + 10) / 0.05)):
                if not (root / tag).exists() and any(e.get("ev") == "exit" for e in events):
                    break
                await asyncio.sleep(0.05)
        finally:
            await pool.close()

    async def both() -> None:
        first = asyncio.create_task(job("j1-1", 1.0))
        for _ in range(200):
            if (root / "j1-1").exists():
                break
            await asyncio.sleep(0.02)
        await asyncio.gather(first, job("j2-1", 2.5))

    asyncio.run(both())
    assert not root.exists(), list(root.iterdir())


def test_piece_cuts_never_split_a_character_and_survive_invalid_bytes() -> None:
    from corral.agent.relay import MAX_PARTIAL

    for unit in ("\U0001f525".encode(), b"\x80"):  # a 4-byte emoji; a stray continuation byte
        sp = LineSplitter()
        data = b"a" + unit * (MAX_PARTIAL // len(unit) + 10)
        pieces, _ = sp.feed(data)
        rest = sp.flush()
        assert b"".join(p for p, _ in pieces + rest) == data
        if unit != b"\x80":
            for piece, _ in pieces + rest:
                piece.decode("utf-8")


def test_accelerate_default_config_mode_is_read_where_accelerate_reads_it(tmp_path, monkeypatch) -> None:
    from corral.agent.probes import accelerate_default_mode

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert accelerate_default_mode() is None
    (tmp_path / "hf" / "accelerate").mkdir(parents=True)
    (tmp_path / "hf" / "accelerate" / "default_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n")
    assert accelerate_default_mode() == "DEEPSPEED"


def test_an_agent_that_never_answers_is_one_named_error_and_nothing_else(tmp_path) -> None:
    # A login that takes longer than the hello timeout (a `sleep` in the
    # node's ~/.bashrc): one HostError, and no "Future exception was never
    # retrieved" from asyncio once the killed connection ends.
    import gc

    from corral.agent.session import AgentSession
    from corral.errors import HostError
    from corral.transport.local import LocalTransport

    slow = tmp_path / "slowpython"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    errors: list[dict] = []

    async def go() -> str:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        s = AgentSession(host=Host(name="slow", python=str(slow)), transport=LocalTransport(), tag="t")
        try:
            await s.start(timeout=0.5)
        except HostError as e:
            message = e.message
        else:
            raise AssertionError("started")
        await asyncio.sleep(0.5)  # the killed process's end reaches the reader
        gc.collect()
        await asyncio.sleep(0)
        return message

    assert "no answer from the agent within" in asyncio.run(go())
    assert errors == []


def test_a_failed_job_whose_temp_dir_filled_up_says_so(tmp_path, monkeypatch) -> None:
    # Reproduced on the sandbox (a node's /tmp a tmpfs with a few KiB free):
    # the ranks died writing their output, their tracebacks unwritten, and the
    # summary said only "exited with code 1".  The agent adds a launcher line
    # with errno 28's words, which the diagnosis's disk-full rule knows.
    from corral.agent import node

    sent: list[dict] = []

    class Chan:
        def send(self, **ev) -> None:
            sent.append(ev)

    agent = node.Agent(Chan(), reader=None)
    agent.job_dir.path = str(tmp_path / "corral-0" / "r-1")
    (tmp_path / "corral-0" / "r-1").mkdir(parents=True)

    class Full:
        f_bavail, f_frsize = 0, 4096

    real_statvfs = os.statvfs
    monkeypatch.setattr(node.os, "statvfs", lambda p: Full() if str(p).startswith(str(tmp_path)) else real_statvfs(p))
    agent.say_if_tmp_full()
    [line] = sent
    assert line["ev"] == "line" and line["r"] is None
    assert "[Errno 28] No space left on device (0 bytes free on" in line["t"]
    assert str(tmp_path / "corral-0") in line["t"] and "TMPDIR" in line["t"]
    # With room to spare, nothing is said.
    sent.clear()
    monkeypatch.setattr(node.os, "statvfs", real_statvfs)
    agent.say_if_tmp_full()
    assert sent == []


def test_a_node_that_goes_down_mid_run_is_named_once_with_what_happened(tmp_path) -> None:
    # `corral sandbox stop` mid-run said "f5n2 was lost: f5n2: ssh failed:
    # exit code 255": the host twice, and nothing about what that means.
    from corral.agent.session import AgentSession
    from corral.transport.local import LocalTransport
    from corral.transport.ssh import classify_ssh_failure

    class SilentSsh(LocalTransport):  # ssh with LogLevel=ERROR: exit 255, no words
        def failure(self, host, returncode, stderr):
            return classify_ssh_failure(host, 255, "")

    events: list[dict] = []

    async def go() -> None:
        s = AgentSession(host=Host(name="gpu2", python=sys.executable), transport=SilentSsh(), tag="t",
                         on_event=lambda sess, ev: events.append(ev))
        await s.start(timeout=30)
        s.proc.kill()
        for _ in range(200):
            if any(e.get("ev") == "closed" for e in events):
                break
            await asyncio.sleep(0.05)
        await s.kill()

    asyncio.run(go())
    [closed] = [e for e in events if e.get("ev") == "closed"]
    assert not closed["error"].startswith("gpu2")
    assert closed["error"].startswith("its connection closed (ssh ended without a message): the node went down")


def test_a_start_refused_by_a_limit_of_the_node_says_which(monkeypatch) -> None:
    # Seen on the sandbox with `ulimit -n 10` in a node's ~/.bashrc: "cannot
    # start .../python: [Errno 24] Too many open files", and nothing on what
    # to change.
    import errno
    import resource

    from corral.agent.node import limit_note

    monkeypatch.setattr(resource, "getrlimit", lambda what: (10, 10))
    note = limit_note(OSError(errno.EMFILE, "Too many open files"))
    assert "`ulimit -n`, is 10" in note and "limits.conf" in note
    assert "`ulimit -u`, is 10" in limit_note(BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"))
    assert limit_note(FileNotFoundError(errno.ENOENT, "No such file")) == ""


def test_the_jobs_own_tmpdir_holds_its_directory(tmp_path, monkeypatch) -> None:
    # A node whose /tmp is full or small: `env = { TMPDIR = "/scratch/tmp" }`
    # for that host in the cluster file (what corral's messages advise) must
    # move the job's directory, not only the ranks' own temporary files.
    monkeypatch.setenv("TMPDIR", str(tmp_path / "agent"))
    (tmp_path / "agent").mkdir()
    (tmp_path / "job").mkdir()
    events: list[dict] = []

    async def job() -> None:
        pool = AgentPool(_local(), tag="r-1", on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            code = "import os; print(os.environ['CORRAL_LOG_DIR'])"
            await pool.sessions[0].send(op="start", spec={
                "argv": [sys.executable, "-c", code], "env": {"TMPDIR": str(tmp_path / "job")},
                "cwd": str(tmp_path), "hook_source": "", "tag": "r-1"})
            await until_exit(events, 10.0)
        finally:
            await pool.close()

    asyncio.run(job())
    [line] = [e["t"] for e in events if e.get("ev") == "line"]
    assert line == str(tmp_path / "job" / f"corral-{os.getuid()}" / "r-1" / "logs")
    assert list((tmp_path / "job").iterdir()) == [] and list((tmp_path / "agent").iterdir()) == []


def test_what_the_login_shell_prints_before_the_agent_is_kept_apart(tmp_path) -> None:
    from corral.agent.session import AgentSession
    from corral.transport.local import LocalTransport

    noisy = tmp_path / "python"
    noisy.write_text(f"#!/bin/sh\necho 'Welcome to gpu2'\nexec {sys.executable} \"$@\"\n")
    noisy.chmod(0o755)

    async def go() -> list[str]:
        s = AgentSession(host=Host(name="gpu2", python=str(noisy)), transport=LocalTransport(), tag="t")
        await s.start(timeout=30)
        try:
            return list(s.login_output)
        finally:
            await s.kill()

    assert asyncio.run(go()) == ["Welcome to gpu2"]


def test_a_failing_event_handler_does_not_end_the_session(tmp_path, caplog) -> None:
    # A bug in what handles events on the head (watch, console, logs: a full
    # runs disk was one) used to end the node's reader, and the node was then
    # declared lost while it was fine.  Now: one error message, and the
    # events keep coming.
    events: list[dict] = []

    def handler(s, e) -> None:
        if e.get("ev") == "line" and "first" in e.get("t", ""):
            raise OSError(28, "No space left on device")
        events.append(e)

    async def main() -> None:
        pool = AgentPool(_local(), tag="t", on_event=handler)
        await pool.open()
        try:
            s = pool.sessions[0]
            code = "import time\nprint('first', flush=True)\ntime.sleep(0.5)\nprint('second', flush=True)\n"
            await start(s, [sys.executable, "-c", code], tmp_path)
            await until_exit(events, 10.0)
            assert not s.closed
        finally:
            await pool.close()

    with caplog.at_level("ERROR"):
        asyncio.run(main())
    assert any(e.get("ev") == "line" and "second" in e.get("t", "") for e in events), events
    assert any(e.get("ev") == "exit" for e in events)
    failed = [r for r in caplog.records if "failed to handle an event" in r.getMessage()]
    assert len(failed) == 1 and "No space left on device" in failed[0].getMessage()


def test_a_temp_dir_python_fell_back_to_is_named() -> None:
    from corral.agent.jobdir import tmp_fallback_note

    note = tmp_fallback_note("/var/tmp", {}, {})
    assert note and "/tmp is not usable on this node" in note and "/var/tmp" in note
    assert tmp_fallback_note("/tmp", {}, {}) is None
    assert tmp_fallback_note("/scratch/job1", {}, {"TMPDIR": "/scratch/job1"}) is None  # chosen, not a fallback
    assert tmp_fallback_note("/scratch/x", {"TMPDIR": "/scratch/x"}, {}) is None


# ---- the node's own Python: 3.8 and up run the agent, older ones are named ----------------

def _node_side_sources() -> dict[str, str]:
    """Every file that runs on a node's interpreter, not the head's."""
    from importlib import resources

    from corral.agent.bundle import NODE_MODULES, PRELOAD_MODULES

    pkg = resources.files("corral")
    files = [f"agent/{f}" for f in {**NODE_MODULES, **PRELOAD_MODULES}.values()]
    files += ["agent/hook/sitecustomize.py", "sshsetup/nodeside.py", "sync/nodetree.py",
              "doctor/workloads/smoke_allreduce.py", "doctor/workloads/allreduce_perf.py"]
    return {f: pkg.joinpath(f).read_text() for f in files}


def test_node_side_code_is_python_38() -> None:
    # A node's python3 may be 3.8 (Ubuntu 20.04).  `def f() -> str | None` in a
    # module without postponed annotations raised TypeError there as the agent
    # started: doctor said "not reachable: ssh failed: TypeError: unsupported
    # operand type(s) for |".
    import ast

    for name, source in _node_side_sources().items():
        tree = ast.parse(source, name, feature_version=(3, 8))
        if any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
               and any(a.name == "annotations" for a in n.names) for n in tree.body):
            continue
        for node in ast.walk(tree):
            notes = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                notes = [a.annotation for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                                                node.args.vararg, node.args.kwarg) if a is not None]
                notes.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                notes = [node.annotation]
            for note in filter(None, notes):
                for part in ast.walk(note):
                    newer = isinstance(part, ast.BinOp) and isinstance(part.op, ast.BitOr) or (
                        isinstance(part, ast.Subscript) and isinstance(part.value, ast.Name)
                        and part.value.id in ("list", "dict", "tuple", "set", "frozenset", "type"))
                    assert not newer, (f"{name}:{note.lineno}: {ast.unparse(note)} is evaluated at "
                                       f"definition time: Python 3.8 cannot (add `from __future__ import annotations`)")


def _pythons(*versions: str) -> list[str]:
    """Interpreters of these versions found on this machine (PATH, pyenv)."""
    import glob
    import shutil

    found = []
    for v in versions:
        pyenv = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{v}.*/bin/python{v}")))
        path = pyenv[0] if pyenv else shutil.which(f"python{v}")
        if path:
            found.append(path)
    return found


@pytest.mark.parametrize("python", _pythons("3.8", "3.9") or [None])
def test_the_agent_runs_on_the_oldest_pythons_it_supports(python: str | None, tmp_path) -> None:
    if python is None:
        pytest.skip("no Python 3.8 or 3.9 on this machine")
    events: list[dict] = []

    async def main() -> None:
        pool = AgentPool(Cluster(hosts=(Host(name="old", local=True, python=python),)), tag="t",
                         on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            s = pool.sessions[0]
            probe = await s.call("probes.preflight", workdir=str(tmp_path), paths=["x.py"], want_port=True)
            assert probe["missing"] == ["x.py"]
            await start(s, [python, "-c", "import sys; print(sys.version_info[:2])"], tmp_path)
            await until_exit(events, 10.0)
        finally:
            await pool.close()

    asyncio.run(main())
    assert any(e.get("ev") == "exit" and e.get("code") == 0 for e in events), events


@pytest.mark.parametrize("python", _pythons("2.7", "3.6", "3.7") or [None])
def test_a_python_too_old_for_the_agent_is_named_with_the_fix(python: str | None) -> None:
    # Python 2 (CentOS 7's `python`) failed with "ssh failed: AttributeError:
    # 'file' object has no attribute 'buffer'"; 3.6/3.7 were named without
    # saying what to do.
    from corral.errors import PreflightError
    from corral.sshsetup.remote import call_node, gather_hosts, remote_command

    if python is None:
        pytest.skip("no Python older than 3.8 on this machine")
    host = Host(name="old", local=True, python=python)

    async def agent() -> None:
        await AgentPool(Cluster(hosts=(host,)), tag="t").open()

    with pytest.raises(PreflightError) as info:
        asyncio.run(agent())
    [err] = info.value.problems
    version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert err.message == f"old: corral needs Python 3.8+ on the node, found {version}"
    assert err.hint and "install Python 3.8+ on old" in err.hint and python in err.hint

    async def one_shot() -> list:
        work = lambda h: call_node(h, remote_command(h.python), "m", "def f():\n    return 1\n", "f", {})  # noqa: E731
        return (await gather_hosts([host], work))[1]

    [err] = asyncio.run(one_shot())
    assert f"found {version}" in err.message and err.hint and python in err.hint


def test_a_work_directory_in_the_home_directory_is_the_nodes_own(tmp_path, monkeypatch) -> None:
    # `workdir = "~/proj"` is accepted (homes differ between nodes), but the
    # agent took it literally: "working directory ~/proj does not exist".
    home = tmp_path / "home"
    (home / "proj").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    events: list[dict] = []

    async def main() -> None:
        pool = AgentPool(_local(), tag="t", on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            s = pool.sessions[0]
            probe = await s.call("probes.preflight", workdir="~/proj", paths=["x.py"])
            assert probe["workdir"]["exists"] and probe["missing"] == ["x.py"]
            await start(s, [sys.executable, "-c", "import os; open('here', 'w').write(os.getcwd())"], "~/proj")
            await until_exit(events, 10.0)
        finally:
            await pool.close()

    asyncio.run(main())
    assert (home / "proj" / "here").read_text() == str(home / "proj")


@pytest.mark.parametrize("kind", ["open", "link"])
def test_a_job_dir_root_another_user_made_first_is_refused_and_nothing_runs(kind: str, tmp_path) -> None:
    """Reproduced as a real attack: nobody made ``corral-<uid>`` first in the
    job's TMPDIR (mode 0777, or a link to its own directory), then swapped the
    job's directory for one with its own ``hook/sitecustomize.py``, which every
    rank imports.  The node now refuses to use it, says so (the head's line
    names the host), and starts nothing."""
    from attacker import prepare, shared_place

    from corral.agent.bundle import hook_source

    events: list[dict] = []
    ran = tmp_path / "ran"
    with shared_place() as tmp:
        root = tmp / f"corral-{os.getuid()}"
        prepare(kind, root)

        async def job() -> None:
            pool = AgentPool(_local(), tag="r-1", on_event=lambda s, e: events.append(e))
            await pool.open()
            try:
                await pool.sessions[0].send(op="start", spec={
                    "argv": [sys.executable, "-c", f"open({str(ran)!r}, 'w').close()"], "env": {"TMPDIR": str(tmp)},
                    "cwd": str(tmp_path), "hook_source": hook_source(), "tag": "r-1"})
                for _ in range(200):
                    if any(e.get("ev") in ("fatal", "exit") for e in events):
                        break
                    await asyncio.sleep(0.05)
            finally:
                await pool.close()

        asyncio.run(job())
        [fatal] = [e for e in events if e.get("ev") == "fatal"]
        assert fatal["t"].startswith(f"the job's directory: {root} is not safe to use"), fatal
        assert "nobody" in fatal["t"] and "TMPDIR" in fatal["t"]
        assert not ran.exists() and not any(e.get("ev") == "started" for e in events)
        theirs = root if kind == "open" else tmp / f"corral-{os.getuid()}.theirs"
        assert list(theirs.iterdir()) == []  # nothing written into their directory
        assert root.exists() or root.is_symlink()  # and nothing of theirs removed


def test_a_fresh_job_dir_is_private_whatever_the_umask(tmp_path) -> None:
    from attacker import shared_place

    events: list[dict] = []
    with shared_place() as tmp:
        async def job() -> None:
            pool = AgentPool(_local(), tag="r-1", on_event=lambda s, e: events.append(e))
            await pool.open()
            try:
                code = ("import os; d = os.path.dirname(os.environ['CORRAL_LOG_DIR']); print(*(oct(os.lstat(p).st_mode "
                        "& 0o7777) for p in (os.path.dirname(d), d, d + '/logs', d + '/hook', "
                        "d + '/hook/sitecustomize.py')))")
                await pool.sessions[0].send(op="start", spec={
                    "argv": [sys.executable, "-c", code], "env": {"TMPDIR": str(tmp)},
                    "cwd": str(tmp_path), "hook_source": "", "tag": "r-1"})
                await until_exit(events, 10.0)
            finally:
                await pool.close()

        old = os.umask(0)
        try:
            asyncio.run(job())
        finally:
            os.umask(old)
        assert [e["t"] for e in events if e.get("ev") == "line"] == ["0o700 0o700 0o700 0o700 0o600"]
        assert list(tmp.iterdir()) == []


def test_a_burst_of_output_is_a_few_frames_and_the_head_keeps_every_line_in_order(tmp_path) -> None:
    """Two ranks print 3,000 lines each at once.  The agent used to send a
    frame per line (the head's ceiling, some 70k lines/s, was the console's
    limit at 32 nodes x 8 ranks flooding); the complete lines of one read
    are now one frame, and the head's rank logs and console still get every
    line of each rank, in order, with nothing else in between."""
    import io

    from corral.agent.bundle import hook_source
    from corral.run.console import RunConsole
    from corral.run.logs import RunLogs
    from corral.run.plan import NodeFacts, RunSpec, build_plan
    from corral.run.runner import _LogSink
    from corral.run.watch import JobWatch

    n = 3000
    rank = f"import os, sys\nr = os.environ['RANK']\nsys.stdout.write(''.join('r%s line %d\\n' % (r, i) for i in range({n})))\n"
    launcher = ("import os, subprocess, sys\n"
                f"ps = [subprocess.Popen([sys.executable, '-c', {rank!r}], "
                "env=dict(os.environ, RANK=str(r))) for r in (0, 1)]\n"
                "sys.exit(max(p.wait() for p in ps))\n")
    cluster = Cluster(hosts=(Host(name="me", local=True, python=sys.executable, slots=2),))
    plan = build_plan(cluster, RunSpec(program="t.py", run_id="r-1", launcher="command"), {"me": NodeFacts()},
                      master_addr="127.0.0.1", master_port=1, head_env={}, head_cwd=str(tmp_path))
    console_out = io.StringIO()
    logs = RunLogs(tmp_path / "runs", "r-1")
    watch = JobWatch(plan, sinks=[_LogSink(logs), RunConsole(multi_host=False, out=console_out, color=False)])
    events: list[dict] = []

    def on_event(s, e: dict) -> None:
        events.append(e)
        watch.event(s.name, e)

    async def job() -> None:
        pool = AgentPool(cluster, tag="r-1", on_event=on_event)
        await pool.open()
        try:
            pool.sessions[0].ranks = range(0, 2)
            await pool.sessions[0].send(op="start", spec={
                "argv": [sys.executable, "-c", launcher], "env": {"WORLD_SIZE": "2"}, "ranks": [0, 2],
                "cwd": str(tmp_path), "hook_source": hook_source(), "tag": "r-1"})
            await until_exit(events, 30.0)
        finally:
            await pool.close()

    asyncio.run(job())
    logs.close()
    assert [e for e in events if e.get("ev") == "exit"][0]["code"] == 0
    frames = [e for e in events if e.get("ev") in ("line", "lines") and e.get("r") is not None]
    assert sum(len(_texts(e)) for e in frames) == 2 * n
    assert len(frames) <= 2 * n // 10, len(frames)  # a frame per read, not per line
    shown = console_out.getvalue().splitlines()
    for r in (0, 1):
        want = [f"r{r} line {i}" for i in range(n)]
        assert (logs.dir / "me" / f"rank{r}.log").read_text().splitlines() == want
        assert [ln[len(f"[r{r}] "):] for ln in shown if ln.startswith(f"[r{r}] ")] == want


def test_a_rank_cannot_speak_for_another_rank_or_one_outside_the_node(tmp_path) -> None:
    """Rank 0 writes rank 1's pid file (with its own pid) and a status saying
    rank 1 failed, and a log for rank 7 of a 2-rank node.  The agent used to
    report "rank 1 failed: FakeError" and relay rank 7's lines as rank 7's; now
    it believes only a pid of its own tree whose environment is not another
    rank's, a status that names the registered pid, and ranks of the node's
    plan (rank 7's lines are the node's own output, labelled)."""
    from corral.agent.bundle import hook_source

    events: list[dict] = []
    rank0 = (
        "import json, os, time\n"
        "d = os.environ['CORRAL_LOG_DIR']\n"
        "json.dump({'exc': 'FakeError: rank 1 failed', 'rank': 1, 'pid': os.getpid()}, open(d + '/rank1.status', 'w'))\n"
        "open(d + '/rank1.pid', 'w').write(str(os.getpid()))\n"
        "open(d + '/rank7.log', 'w').write('spoofed line\\n')\n"
        "time.sleep(1.0)  # alive while the agent looks at the pid it gave\n"
        "print('rank 0 done')\n"
        "raise ValueError('rank 0 real error')\n"
    )
    launcher = ("import os, subprocess, sys\n"
                f"sys.exit(subprocess.call([sys.executable, '-c', {rank0!r}], env=dict(os.environ, RANK='0')))\n")

    async def job() -> None:
        pool = AgentPool(_local(), tag="r-1", on_event=lambda s, e: events.append(e))
        await pool.open()
        try:
            pool.sessions[0].ranks = range(0, 2)  # the head's plan, as run.py sets it
            await pool.sessions[0].send(op="start", spec={
                "argv": [sys.executable, "-c", launcher], "env": {"WORLD_SIZE": "2"}, "ranks": [0, 2],
                "cwd": str(tmp_path), "hook_source": hook_source(), "tag": "r-1"})
            await until_exit(events, 20.0)
        finally:
            await pool.close()

    asyncio.run(job())
    assert [e for e in events if e.get("ev") == "exit"][0]["code"] == 1
    exits = {e["r"]: e for e in events if e.get("ev") == "rank_exit"}
    assert list(exits) == [0] and exits[0]["exc"] == "ValueError: rank 0 real error", exits  # its own: believed
    lines = [(e.get("r"), t) for e in events for t in _texts(e)]
    assert (0, "rank 0 done") in lines and not any(r == 7 for r, _ in lines), lines
    assert (None, "[rank 7] spoofed line") in lines, lines  # the node's own output, labelled
    warnings = " | ".join(e["t"] for e in events if e.get("ev") == "log" and e.get("level") == "warning")
    # (whichever the agent read first: rank 0's own pid file, or the one it wrote for rank 1)
    assert "rank1.pid" in warnings and ("is rank 0" in warnings or "already another rank's" in warnings), warnings


def test_a_rendezvous_check_frees_its_port_before_listen_stop_returns() -> None:
    """The head starts the job right after; a launcher that binds the port at
    once (as a fast job does) must not find preflight's listener still there."""
    import socket

    from corral.agent import probes

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert probes.listen_start(["127.0.0.1"], port, seconds=30)["bound"] == ["127.0.0.1"]
    assert probes.connect(["127.0.0.1"], port) == {"127.0.0.1": "ok"}
    assert probes.listen_stop(port)
    job = socket.socket()
    try:
        job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore
        job.bind(("127.0.0.1", port))
        job.listen()
    finally:
        job.close()


def test_the_rendezvous_connect_tries_each_address_as_long_as_the_head_asks() -> None:
    """At 256 nodes a SYN lost to a full queue made a 3 s try fail a node
    that could reach node 0; the head now asks for 8 s there (SYNs at 0, 1,
    3 and 7 s).  The probe's own ``timeout`` is shadowed by the head's call
    timeout, so the head passes ``each_s``."""
    import socket

    from corral.agent import probes

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)  # never accepted: once its queue is full, SYNs are dropped
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        time.sleep(0.3)
        t0 = time.monotonic()
        got = probes.connect(["127.0.0.1"], port, each_s=0.5)
        took = time.monotonic() - t0
    finally:
        for c in fillers:
            c.close()
        server.close()
    assert got["127.0.0.1"] != "ok"
    assert 0.4 < took < 2.5, took  # its own 0.5 s, not the 3 s default


def test_an_agent_with_no_job_waits_out_a_head_busy_connecting_hundreds_of_nodes() -> None:
    """At 256 nodes the head, connecting the rest, pinged the first agents
    11-15 s apart; they stopped (head silent) before any job had started,
    and the run lost a node that was up.  With no job to stop, an agent
    waits a minute; with one, ``head_timeout``."""
    events: list[dict] = []

    async def main() -> None:
        pool = AgentPool(_local(), tag="t", on_event=lambda s, e: events.append(e), head_timeout=1.0)
        await pool.open()
        try:
            s = pool.sessions[0]
            for task in s._tasks:
                if "_ping" in repr(task.get_coro()):
                    task.cancel()
            await asyncio.sleep(3.5)  # three and a half head timeouts of silence
            assert not s.closed, events
            probe = await s.call("probes.preflight", workdir="/", paths=[], timeout=30)  # and it still answers
            assert probe["python"]
        finally:
            await pool.close()

    asyncio.run(main())
    assert not [e for e in events if e.get("ev") == "closed" and "heard nothing" in (e.get("error") or "")]


def test_an_agent_that_stops_for_a_silent_head_is_named_so_not_as_a_crash(tmp_path) -> None:
    """A head too busy to ping (hundreds of nodes on a loaded machine): the
    agent stops its job as designed, and the head says that is why, rather
    than "ssh ended without a message"."""
    events: list[dict] = []

    async def main() -> None:
        pool = AgentPool(_local(), tag="t", on_event=lambda s, e: events.append(e), head_timeout=2.0)
        await pool.open()
        try:
            s = pool.sessions[0]
            await start(s, [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
            for task in s._tasks:  # the head goes silent (it still reads)
                if "_ping" in repr(task.get_coro()):
                    task.cancel()
            for _ in range(200):
                if any(e.get("ev") == "closed" for e in events):
                    break
                await asyncio.sleep(0.05)
        finally:
            await pool.close()

    asyncio.run(main())
    closed = [e for e in events if e.get("ev") == "closed"]
    assert closed, events
    assert "its agent stopped: it heard nothing from this machine for 2 s" in closed[0]["error"], closed
    assert "this machine's pings to it were up to" in closed[0]["error"]  # which side stalled


def test_a_job_just_started_on_hundreds_of_nodes_waits_out_a_head_still_starting_the_rest(tmp_path) -> None:
    """At 256 nodes on a loaded machine the head, still starting the other
    nodes, pinged one agent 12 s apart 30 s into the launch: that agent
    stopped its running job and the run lost a node that was up.  In a job's
    first ``start_grace`` seconds (from 64 nodes on) an agent waits for a
    silent head as an idle one does; after them, ``head_timeout`` again."""
    from corral.limits import start_grace

    assert start_grace(4) == 0.0 and start_grace(256) >= 30.0
    events: list[dict] = []

    async def main() -> float:
        pool = AgentPool(_local(), tag="t", on_event=lambda s, e: events.append(e), head_timeout=1.0,
                         start_grace=4.0)
        await pool.open()
        try:
            s = pool.sessions[0]
            await start(s, [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
            t0 = time.monotonic()
            for task in s._tasks:  # the head goes silent (it still reads)
                if "_ping" in repr(task.get_coro()):
                    task.cancel()
            await asyncio.sleep(2.5)  # 2.5 head timeouts: still inside the grace
            assert not any(e.get("ev") == "closed" for e in events), events
            for _ in range(200):
                if any(e.get("ev") == "closed" for e in events):
                    break
                await asyncio.sleep(0.05)
            return time.monotonic() - t0
        finally:
            await pool.close()

    took = asyncio.run(main())
    closed = [e for e in events if e.get("ev") == "closed"]
    assert closed and "heard nothing from this machine" in closed[0]["error"], events
    assert took >= 3.0  # after the grace, the silent head stopped the job as before
