"""`corral run` end to end on this machine: real agent, real torchrun, gloo.

These go through the same plan -> transport -> agent path as a remote node
(the local transport only skips ssh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import pid_alive

CORRAL = [sys.executable, "-m", "corral"]


def corral(args: list[str], cwd: Path, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CORRAL + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kw)


def write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def wait_for_lines(proc: subprocess.Popen, marker: str, count: int) -> None:
    """Read the run's output until ``marker`` has been printed ``count`` times."""
    seen = 0
    for line in proc.stdout:  # type: ignore[union-attr]
        seen += marker in line
        if seen == count:
            return


def interrupt(proc: subprocess.Popen, timeout: float) -> int:
    """Ctrl-C the run; its exit code once it has stopped."""
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=timeout)
    return proc.returncode


def stop_when_ready(args: list[str], cwd: Path, sig: int, on_ready=None) -> tuple[str, float]:
    """Start ``corral run ARGS``, send ``sig`` once both ranks printed "ready";
    its whole output and the seconds from the signal to its exit (130 checked)."""
    proc = subprocess.Popen(CORRAL + ["run", "--ranks", "all", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_lines(proc, "ready", 2)
        if on_ready is not None:
            on_ready()
        started = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - started
        assert proc.returncode == 130, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out, elapsed


CHATTY = """
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for i in range(200):
        # long lines, written as fast as possible by both ranks at once
        print(f"rank {rank} line {i} " + "x" * 300)
    for i in range(20):
        sys.stderr.write(f"\\rprogress {i}/20"); sys.stderr.flush()
    sys.stderr.write("\\n")
    dist.barrier()
    dist.destroy_process_group()
"""


def test_lines_carry_their_rank_and_never_merge(tmp_path: Path) -> None:
    write(tmp_path / "chatty.py", CHATTY)
    res = corral(["run", "chatty.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[r")]
    body = [ln for ln in lines if " line " in ln]
    assert len(body) == 400, f"expected 200 lines from each of 2 ranks, got {len(body)}"
    for ln in body:
        m = re.fullmatch(r"\[r(\d)\] rank (\d) line (\d+) x{300}", ln)
        assert m, f"merged or unprefixed line: {ln[:120]!r}"
        assert m.group(1) == m.group(2), f"line of rank {m.group(2)} labelled r{m.group(1)}"
    # torchrun is started ahead (prewarmed) yet runs exactly as `python -m` would:
    # runpy has nothing to warn about ("found in sys.modules ...").
    assert "RuntimeWarning" not in res.stdout + res.stderr, res.stdout[-2000:]
    # A carriage-return progress bar does not flood stdout when it is not a tty.
    progress = [ln for ln in res.stdout.splitlines() if "progress" in ln]
    assert len(progress) <= 4, progress


def test_run_directory_layout(tmp_path: Path) -> None:
    write(tmp_path / "chatty.py", CHATTY)
    res = corral(["run", "--json", "chatty.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)  # stdout is the result alone: the ranks' lines go to stderr
    assert "[r1] rank 1 line 0" in res.stderr
    run_dir = Path(result["run_dir"])
    assert run_dir.parent == tmp_path / "runs"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "succeeded" and record["exit_code"] == 0
    assert record["world_size"] == 2 and record["launcher"] == "torchrun"
    host_dirs = [p for p in run_dir.iterdir() if p.is_dir() and p.name not in ("telemetry", "flightrec")]
    assert len(host_dirs) == 1
    files = sorted(p.name for p in host_dirs[0].iterdir())
    # launcher.log only when the launcher printed something (torchrun is quiet
    # since it no longer prints its OMP_NUM_THREADS banner)
    assert [f for f in files if f != "launcher.log"] == ["rank0.log", "rank1.log"], files
    rank1 = (host_dirs[0] / "rank1.log").read_text()
    assert rank1.count("rank 1 line") == 200 and "rank 0 line" not in rank1
    # The full text keeps the progress redraws.
    assert "progress 19/20" in rank1


def test_a_very_long_line_stays_one_line_in_the_rank_log(tmp_path: Path) -> None:
    # 300,000 characters, multi-byte ones included: more than one event's worth
    write(tmp_path / "long.py", """
        import json, os, sys
        rank = os.environ["RANK"]
        sys.stdout.write(json.dumps({"rank": rank, "v": "\u00e9x" * 150000}, ensure_ascii=False) + "\\n")
        print("after", rank)
    """)
    res = corral(["run", "--ranks", "all", "long.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    run = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()][0]
    [host_dir] = [d for d in run.glob("*/") if d.name != "telemetry"]  # (the nodes' samples)
    lines = (host_dir / "rank1.log").read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0]) == {"rank": "1", "v": "\u00e9x" * 150000}
    assert lines[1] == "after 1"


def test_failing_rank_exit_code_and_summary(tmp_path: Path) -> None:
    write(tmp_path / "fail.py", """
        import os, sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            def load_batch():
                raise KeyError("missing_column")
            try:
                load_batch()
            except KeyError:
                print("giving up", flush=True)
                sys.exit(7)
        time.sleep(60)  # rank 0 would wait forever; corral must stop it
    """)
    t0 = time.monotonic()
    res = corral(["run", "fail.py"], tmp_path)
    assert res.returncode == 7, (res.returncode, res.stderr)
    assert time.monotonic() - t0 < 50, "the surviving rank was not stopped"
    assert "rank 1" in res.stderr and "exited with code 7" in res.stderr
    assert "giving up" in res.stderr  # the tail of the failed rank's log
    record = json.loads(next((tmp_path / "runs").glob("*/run.json")).read_text())
    assert record["failure"]["rank"] == 1 and record["failure"]["exit_code"] == 7


def test_a_rank_that_left_early_is_named_instead_of_blaming_its_peer(tmp_path: Path) -> None:
    write(tmp_path / "early.py", """
        import sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            sys.exit(0)          # done early: one rank had less work
        time.sleep(2)
        dist.barrier()           # loses its peer
    """)
    res = corral(["run", "early.py"], tmp_path)
    assert res.returncode != 0
    assert "rank 0 on " in res.stderr and "had already exited without an error" in res.stderr
    assert "Likely cause: A peer rank went away" not in res.stderr  # the echo is not the cause


def test_ranks_that_left_early_are_named_in_one_sentence(tmp_path: Path) -> None:
    """`if rank != 0: sys.exit(0)` then a barrier on rank 0: every other rank
    left early.  One folded sentence names them all (it was one sentence per
    rank, cut at three)."""
    write(tmp_path / "early.py", """
        import sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() != 0:
            sys.exit(0)          # "only rank 0 saves"
        time.sleep(2)
        dist.barrier()           # ... but rank 0 still syncs
    """)
    res = corral(["run", "-n", "4", "early.py"], tmp_path)
    assert res.returncode != 0
    assert res.stderr.count("had already exited without an error") == 1, res.stderr
    assert "ranks 1-3 on " in res.stderr, res.stderr


def test_a_multi_line_exception_is_one_line_in_the_summary(tmp_path: Path) -> None:
    write(tmp_path / "multi.py", """
        raise RuntimeError("checkpoint failed on 3 ranks:\\n" + "\\n".join(f"  rank {i}: " + "x" * 300 for i in range(3)))
    """)
    res = corral(["run", "-n", "1", "multi.py"], tmp_path)
    assert res.returncode == 1
    [line] = [ln for ln in res.stderr.splitlines() if "FAILED" in ln]
    assert "failed: RuntimeError: checkpoint failed on 3 ranks: ..." in line and "xxx" not in line
    assert "rank 2: xxx" in res.stderr  # the whole message is still in the traceback tail


def test_an_mp_spawn_workers_error_is_the_headline(tmp_path: Path) -> None:
    """torch.multiprocessing.spawn re-raises a worker's error as ProcessRaisedException
    with the worker's traceback as text: the summary names the worker's error."""
    write(tmp_path / "spawny.py", """
        import torch.multiprocessing as mp

        def work(i):
            if i == 1:
                raise ValueError(f"bad shard 7 in worker {i}")

        if __name__ == "__main__":
            mp.spawn(work, nprocs=2)
    """)
    res = corral(["run", "-n", "1", "spawny.py"], tmp_path)
    assert res.returncode == 1
    [line] = [ln for ln in res.stderr.splitlines() if "FAILED" in ln]
    assert "failed: ValueError: bad shard 7 in worker 1 (in mp.spawn process 1)" in line, line
    assert "ProcessRaisedException" not in line


def test_a_hang_in_a_rendezvous_the_script_chose_is_explained(tmp_path: Path) -> None:
    write(tmp_path / "ownport.py", """
        import os, socket
        import torch.distributed as dist
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        os.environ["MASTER_PORT"] = str(port)   # as older repos do: overrides the launcher's store
        dist.init_process_group("gloo")
    """)
    res = corral(["run", "--hang-timeout", "8", "ownport.py"], tmp_path, timeout=120)
    assert res.returncode == 124, res.stderr
    assert "still connecting to a rendezvous store: corral's is 127.0.0.1:" in res.stderr
    assert "init_method='env://'" in res.stderr


def test_a_native_crash_shows_where_in_the_program_it_happened(tmp_path: Path) -> None:
    write(tmp_path / "segv.py", """
        import ctypes, os
        def decode_batch():
            return ctypes.string_at(0)
        if os.environ["RANK"] == "1":
            decode_batch()
    """)
    res = corral(["run", "segv.py"], tmp_path)
    assert res.returncode == 139, res.stderr  # 128 + SIGSEGV
    assert "rank 1 on " in res.stderr and "killed by SIGSEGV" in res.stderr
    assert "Fatal Python error: Segmentation fault" in res.stderr
    assert 'segv.py", line 4 in decode_batch' in res.stderr


def test_traceback_tail_of_uncaught_exception(tmp_path: Path) -> None:
    write(tmp_path / "boom.py", """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        def step():
            raise ValueError("loss is nan at step 3")
        if dist.get_rank() == 0:
            step()
        dist.barrier()
    """)
    res = corral(["run", "boom.py"], tmp_path)
    assert res.returncode != 0
    assert "rank 0" in res.stderr and "ValueError: loss is nan at step 3" in res.stderr
    assert "Traceback (most recent call last)" in res.stderr
    assert 'line 5, in step' in res.stderr


def test_ctrl_c_leaves_no_process(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    write(tmp_path / "stubborn.py", f"""
        import os, subprocess, sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        # A grandchild in its own session that ignores SIGTERM: the hardest case.
        child = subprocess.Popen([sys.executable, "-c",
            "import os,signal,time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        with open(os.path.join({str(pids)!r}, f"{{os.getpid()}}-{{child.pid}}"), "w"):
            pass
        print("ready", flush=True)
        time.sleep(600)
    """)
    # -X faulthandler: a corral that does not end is made to dump every
    # thread's stack (SIGABRT) into the failure message.
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler"] + CORRAL[1:] + ["run", "stubborn.py"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(pids.iterdir())) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "ranks never started"
            time.sleep(0.2)
        recorded = [int(p) for name in os.listdir(pids) for p in name.split("-")]
        assert all(pid_alive(p) for p in recorded)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        while any(pid_alive(p) for p in recorded) and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        left = [p for p in recorded if pid_alive(p)]
        assert not left, f"processes of the run still alive 5 s after Ctrl-C: {left}"
        # corral itself ends once its agents have reported (2.7 s here when
        # quiet); 25 s more is for a loaded CI machine, under corral's own
        # hard limit for a node that does not stop (2 x grace + 8 s).
        try:
            proc.wait(timeout=25)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"corral still running 30 s after Ctrl-C:\n{out[-3000:]}\n{err[-12000:]}") from None
        assert proc.returncode == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # ... and neither is the agent.
    agents = subprocess.run(["pgrep", "-f", "corral-agent"], capture_output=True, text=True).stdout.split()
    mine = [a for a in agents if Path(f"/proc/{a}/cwd").exists() and str(tmp_path) in os.readlink(f"/proc/{a}/cwd")]
    assert not mine


def test_a_second_ctrl_c_still_leaves_nothing_behind(tmp_path: Path) -> None:
    # Two Ctrl-C in a row (a user who does not wait) drop the channels at
    # once.  On this machine the agent is the head's own child: it must still
    # run its teardown (a process the job left in the background, the job's
    # temporary directory), not be SIGKILLed with its job half-stopped.
    tmp = Path(tempfile.mkdtemp(prefix="c2", dir="/tmp"))  # the node's $TMPDIR, short for sockets
    marker = f"corral-test-{os.getpid()}-{time.monotonic_ns()}"
    write(tmp_path / "helper.py", f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", {marker!r}],
                         start_new_session=True)   # a tensorboard-like helper, in the background
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen(CORRAL + ["run", "-n", "1", "helper.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 90
        for line in proc.stdout:  # type: ignore[union-attr]
            if "ready" in line:
                break
            assert time.monotonic() < deadline, "the rank never started"
        jobs = list((tmp / f"corral-{os.getuid()}").glob("*-1"))
        assert len(jobs) == 1, jobs
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=40)
        assert proc.returncode == 130
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False).stdout.split()
        assert not left, f"the job's background process outlived a double Ctrl-C: {left}"
        assert not jobs[0].exists(), f"the job's temporary directory was left: {sorted(jobs[0].rglob('*'))}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["pkill", "-f", marker], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("fresh", [False, True], ids=["preloaded", "fresh-ranks"])
def test_ctrl_c_reaches_the_script_as_keyboard_interrupt(tmp_path: Path, fresh: bool) -> None:
    """As with torchrun in a terminal: SIGINT reaches the ranks once (through
    their launcher), so a script's `except KeyboardInterrupt` that takes a
    while (saving a checkpoint) and its `finally` block run to the end."""
    write(tmp_path / "ckpt.py", """
        import os, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        try:
            print("ready", flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            time.sleep(1.0)  # writing the last checkpoint: a second SIGINT would cut it short
            open(f"interrupted-{rank}", "w").close()
        finally:
            open(f"finally-{rank}", "w").close()
    """)
    extra = ["--fresh-ranks"] if fresh else []
    proc = subprocess.Popen(CORRAL + ["run", "--ranks", "all", *extra, "ckpt.py"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_lines(proc, "ready", 2)
        assert interrupt(proc, timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in tmp_path.glob("*-[01]")) == [
        "finally-0", "finally-1", "interrupted-0", "interrupted-1"]


def test_sigterm_reaches_each_rank_once_and_waits_for_its_checkpoint(tmp_path: Path) -> None:
    """corral stopped by SIGTERM (a scheduler preempting the job): as under
    torchrun, every rank gets one SIGTERM (through its launcher, not a second
    one from corral) and time to save its checkpoint (torchrun waits 30 s;
    corral's old 3 s grace killed a 5 s save)."""
    write(tmp_path / "preempt.py", """
        import os, signal, sys, time
        import torch.distributed as dist
        got = []
        signal.signal(signal.SIGTERM, lambda *a: got.append(1))
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        print("ready", flush=True)
        while not got:
            time.sleep(0.05)
        time.sleep(5)  # a large state dict to a slow disk
        with open(f"ckpt-{rank}", "w") as f:
            f.write(str(len(got)))
        sys.exit(0)
    """)
    out, _ = stop_when_ready(["preempt.py"], tmp_path, signal.SIGTERM)
    assert {p.name: p.read_text() for p in tmp_path.glob("ckpt-*")} == {"ckpt-0": "1", "ckpt-1": "1"}, out


def test_a_rank_killed_after_the_grace_of_an_interrupt_is_named(tmp_path: Path) -> None:
    """A rank that outlives --grace after Ctrl-C is killed, and the user is
    told so with the option that gives it more time."""
    write(tmp_path / "slow.py", """
        import signal, time
        import torch.distributed as dist
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        dist.init_process_group("gloo")
        print("ready", flush=True)
        time.sleep(600)
    """)
    out, _ = stop_when_ready(["--grace", "1", "slow.py"], tmp_path, signal.SIGINT)
    assert "still running 1 s after the stop signal were killed" in out and "--grace SECONDS" in out, out


def test_ctrl_c_leaves_nothing_within_10_s_even_of_ranks_that_ignore_it(tmp_path: Path) -> None:
    """The default grace after Ctrl-C fits issue 4's promise: zero processes of
    the run within 10 s, also when every rank ignores SIGINT and SIGTERM."""
    write(tmp_path / "deaf.py", """
        import os, signal, time
        import torch.distributed as dist
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dist.init_process_group("gloo")
        open(f"pid-{os.environ['RANK']}", "w").write(str(os.getpid()))
        print("ready", flush=True)
        time.sleep(600)
    """)
    pids: list[int] = []
    out, elapsed = stop_when_ready(["deaf.py"], tmp_path, signal.SIGINT,
                                   on_ready=lambda: pids.extend(int(p.read_text()) for p in tmp_path.glob("pid-*")))
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids), out
    assert elapsed < 10, f"corral took {elapsed:.1f} s to leave nothing behind"
    assert "still running 7 s after the stop signal were killed" in out, out


def test_a_process_the_job_left_running_is_stopped_and_named(tmp_path: Path) -> None:
    marker = f"corral-leftover-{os.getpid()}"
    write(tmp_path / "bg.py", f"""
        import os, subprocess
        if os.environ["RANK"] == "0":
            subprocess.Popen(["bash", "-c", "exec -a {marker} sleep 300"])  # never waited for
    """)
    res = corral(["run", "bg.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"stopping 1 process(es) it left running ({marker} 300)" in res.stdout
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1


def test_dry_run_prints_plan_and_starts_nothing(tmp_path: Path) -> None:
    res = corral(["run", "--dry-run", "--json", "-n", "3", "--env", "FOO=bar", "train.py", "--lr", "3"], tmp_path)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["world_size"] == 3
    node = plan["nodes"][0]
    assert node["argv"][1:4] == ["-m", "torch.distributed.run", "--nnodes=1"]
    assert "--nproc-per-node=3" in node["argv"] and node["argv"][-3:] == ["train.py", "--lr", "3"]
    assert node["env"]["FOO"] == "bar" and node["env"]["MASTER_ADDR"] == "127.0.0.1"
    assert not (tmp_path / "runs").exists()


def test_dry_run_shows_the_port_it_has_not_chosen_yet(tmp_path: Path) -> None:
    """corral picks the master port on node 0 at launch: a dry run says so, not port 0."""
    res = corral(["run", "--dry-run", "-n", "2", "--launcher", "command", "--", "python", "x.py",
                  "--port", "$MASTER_PORT"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "argv: python x.py --port <port>" in res.stdout
    assert re.search(r"MASTER_PORT\s+<port>", res.stdout) and not re.search(r"MASTER_PORT\s+0\b", res.stdout)
    res = corral(["run", "--dry-run", "--json", "-n", "2", "--master-port", "29555", "x.py"], tmp_path)
    node = json.loads(res.stdout)["nodes"][0]
    assert "--master-port=29555" in node["argv"] and node["env"]["MASTER_PORT"] == "29555"


def test_missing_script_is_named_before_anything_starts(tmp_path: Path) -> None:
    # Missing here too, where the nodes would look: a typo, so bad input (2)
    # before connecting; it was 3, "infrastructure", with "sync the project".
    (tmp_path / "train.py").write_text("print('hi')\n")
    res = corral(["run", "trian.py"], tmp_path)
    assert res.returncode == 2, res.stderr
    assert f"trian.py: no such file in {tmp_path}" in res.stderr and "did you mean train.py?" in res.stderr
    assert "corral sync" not in res.stderr and "connecting" not in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()
    # On the nodes only (another working directory there): left to their preflight, which names it (3).
    res = corral(["run", "--workdir", str(tmp_path), "nope.py"], tmp_path)
    assert res.returncode == 3 and "nope.py not found" in res.stderr and "corral sync" in res.stderr


def test_missing_workdir_is_named(tmp_path: Path) -> None:
    res = corral(["run", "--workdir", str(tmp_path / "absent"), "train.py"], tmp_path)
    assert res.returncode == 3
    assert "absent does not exist" in res.stderr
    assert "corral sync" in res.stderr


def test_ranks_beyond_the_world_are_refused_before_anything_starts(tmp_path: Path) -> None:
    write(tmp_path / "ok.py", "open('started', 'w').close()\n")
    res = corral(["run", "-n", "2", "--ranks", "0,5-6", "ok.py"], tmp_path)
    assert res.returncode == 2, res.stderr
    assert "--ranks names ranks 5-6, but this run has 2 rank(s) (ranks 0-1)" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "started").exists() and not (tmp_path / "runs").exists()


def test_another_launchers_rank_variables_do_not_reach_the_ranks(tmp_path: Path) -> None:
    """corral inside an sbatch/srun step: the local node must not hand the
    step's SLURM_PROCID/SLURM_NTASKS (Lightning reads them first) to the ranks."""
    write(tmp_path / "env.py", """
        import json, os
        keys = ["SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "SLURM_JOB_ID", "RANK", "FROM_FLAG"]
        print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
    """)
    env = dict(os.environ, SLURM_PROCID="7", SLURM_NTASKS="8", OMPI_COMM_WORLD_RANK="5", SLURM_JOB_ID="4242")
    res = corral(["run", "--ranks", "all", "--env", "FROM_FLAG=1", "env.py"], tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    seen = [json.loads(line.split("ENV ", 1)[1]) for line in res.stdout.splitlines() if "ENV " in line]
    assert sorted(e["RANK"] for e in seen) == ["0", "1"]
    for e in seen:
        assert (e["SLURM_PROCID"], e["SLURM_NTASKS"], e["OMPI_COMM_WORLD_RANK"]) == (None, None, None)
        assert (e["SLURM_JOB_ID"], e["FROM_FLAG"]) == ("4242", "1")


def test_an_accelerate_script_under_torchrun_on_cpu_trains_as_one_job(tmp_path: Path) -> None:
    """`Accelerator()` (what the transformers Trainer builds on) under the
    default torchrun launcher on a machine without GPUs: one world of 2, not
    2 worlds of 1 each training its own copy (accelerate's distributed type is
    NO on CPU unless ACCELERATE_USE_CPU is set)."""
    pytest.importorskip("accelerate")
    write(tmp_path / "acc.py", """
        from accelerate import Accelerator
        acc = Accelerator()
        print(f"ACC {acc.process_index}/{acc.num_processes} {acc.distributed_type}", flush=True)
    """)
    res = corral(["run", "--ranks", "all", "-n", "2", "acc.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    seen = sorted(line.split("ACC ", 1)[1] for line in res.stdout.splitlines() if "ACC " in line)
    if not any("cuda" in s.lower() or "GPU" in s for s in seen):
        assert seen == ["0/2 DistributedType.MULTI_CPU", "1/2 DistributedType.MULTI_CPU"], res.stdout


def test_an_unknown_option_before_the_script_is_refused_at_once(tmp_path: Path) -> None:
    res = corral(["run", "--nproc_per_node", "2", "train.py"], tmp_path)
    assert res.returncode == 2 and "no such option: --nproc_per_node" in res.stderr
    assert "use -n / --nproc-per-node" in res.stderr and "connecting" not in res.stderr
    res = corral(["run", "--max-restart", "2", "train.py"], tmp_path)
    assert res.returncode == 2 and "did you mean --max-restarts" in res.stderr


def test_bad_env_flag_is_a_usage_error(tmp_path: Path) -> None:
    res = corral(["run", "--env", "NOT_SET_ANYWHERE_XYZ", "train.py"], tmp_path)
    assert res.returncode == 2
    assert "NOT_SET_ANYWHERE_XYZ is not set on this machine" in res.stderr
    res = corral(["run", "--env", "MASTER_PORT=1", "train.py"], tmp_path)
    assert res.returncode == 2 and "set by corral" in res.stderr


def test_max_restarts_reruns_the_job(tmp_path: Path) -> None:
    marker = tmp_path / "attempts"
    write(tmp_path / "flaky.py", f"""
        import os, sys
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            with open({str(marker)!r}, "a") as f:
                f.write("x")
        dist.barrier()
        n = len(open({str(marker)!r}).read())
        if n < 2 and dist.get_rank() == 1:
            sys.exit(5)
        print("attempt", n, "ok", "CORRAL_ATTEMPT", os.environ["CORRAL_ATTEMPT"], "of", os.environ["CORRAL_MAX_RESTARTS"])
        dist.barrier()
    """)
    res = corral(["run", "--max-restarts", "2", "flaky.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert marker.read_text() == "xx"
    assert "attempt 2 ok CORRAL_ATTEMPT 2 of 2" in res.stdout  # the script can tell it is resuming
    assert "restarting the job" in res.stdout
    # the success does not hide the failure it recovered from
    assert "succeeded" in res.stderr and "after 1 restart(s) (attempt 1: rank 1 on " in res.stderr
    listed = subprocess.run(CORRAL + ["runs", "--json"], cwd=tmp_path, capture_output=True, text=True, check=True)
    [record] = json.loads(listed.stdout)["runs"]
    assert record["status"] == "succeeded" and record["attempts"] == 2
    assert record["restarts"][0]["attempt"] == 1 and "rank 1 on " in record["restarts"][0]["failure"]


def test_restarts_only_what_a_restart_can_get_past(tmp_path: Path) -> None:
    """A rank killed by a signal (the OOM killer) is restarted; a Python
    exception once more; the same exception at the same place again ends the
    restarts, said once.  An error in the program itself is not restarted."""
    write(tmp_path / "job.py", """
        import os, signal
        attempt = int(os.environ["CORRAL_ATTEMPT"])
        print("attempt", attempt, flush=True)
        if attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("shard 7 is empty")
    """)
    res = corral(["run", "--launcher", "command", "--max-restarts", "5", "job.py"], tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    assert [ln for ln in res.stdout.splitlines() if "attempt" in ln and "job.py" not in ln][-1].endswith("attempt 3")
    said = [ln for ln in res.stdout.splitlines() if "not restarting" in ln]
    assert said == ["corral: not restarting (3 of --max-restarts 5 unused): ValueError: shard 7 is empty at "
                    "job.py:7 again, as in attempt 2: the same exception at the same place, where a restart "
                    "would fail once more"], res.stdout[-3000:]
    [record] = [json.loads(p.read_text()) for p in Path(os.environ["CORRAL_RUNS_DIR"]).glob("*/run.json")]
    assert record["attempts"] == 3 and record["not_restarted"] == said[0].removeprefix("corral: ")
    assert "killed by SIGKILL" in record["restarts"][0]["failure"]

    write(tmp_path / "job.py", "import datasetz\n")
    res = corral(["run", "--launcher", "command", "--max-restarts", "5", "job.py"], tmp_path)
    assert res.returncode == 1 and "restarting the job" not in res.stdout, res.stdout[-3000:]
    assert ("not restarting (5 of --max-restarts 5 unused): ModuleNotFoundError: No module named 'datasetz' "
            "at job.py:1, an error in the program itself that a restart runs into again") in res.stdout


def test_min_nodes_needs_restarts_and_enough_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from corral.cli import cli

    write(tmp_path / "job.py", "print('hi')\n")
    monkeypatch.chdir(tmp_path)
    for args, words in ((["--min-nodes", "1"], "--min-nodes needs --max-restarts N"),
                        (["--max-restarts", "1", "--min-nodes", "2"], "--min-nodes 2, but the job starts on 1 node(s)"),
                        (["--checkpoint-dir", "~/ckpt"], "'~' would reach the script unexpanded")):
        res = CliRunner().invoke(cli, ["run", *args, "job.py"])
        assert res.exit_code == 2 and words in res.output, res.output


# ---------------------------------------------------------------------------
# What a run leaves on its node, and what it finds there


def tmp_listing(tmp: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))


@pytest.fixture
def node_tmp():
    """A private, short $TMPDIR for the run (the head's control socket lives there too,
    and a unix socket path must stay under 108 bytes)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="crt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_node_temp_files_are_removed_after_failure_and_restart(tmp_path: Path, node_tmp: Path,
                                                               launcher: str) -> None:
    # torchrun (also inside `accelerate launch`) would leave /tmp/torchelastic_*/none_*/attempt_0/<rank>
    # behind after every run; the agent gives it the job's own directory instead, which goes at the end.
    before = tmp_listing(node_tmp)
    marker = tmp_path / "attempts"
    write(tmp_path / "flaky.py", f"""
        import os, sys
        import torch.distributed as dist
        dist.init_process_group("gloo")
        err = os.environ["TORCHELASTIC_ERROR_FILE"]
        print("error file", err.startswith(os.environ["CORRAL_LOG_DIR"].rsplit("/", 1)[0] + "/elastic/"))
        if dist.get_rank() == 0:
            with open({str(marker)!r}, "a") as f:
                f.write("x")
        dist.barrier()
        if len(open({str(marker)!r}).read()) < 2 and dist.get_rank() == 1:
            sys.exit(5)  # the first attempt fails
        dist.barrier()
        dist.destroy_process_group()
    """)
    res = corral(["run", "--launcher", launcher, "--max-restarts", "1", "flaky.py"], tmp_path,
                 env={**os.environ, "TMPDIR": str(node_tmp)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restarting the job" in res.stdout and res.stdout.count("error file True") == 4, res.stdout[-3000:]
    # What remains is the head's own control-socket directory (this machine is the head too).
    uid = os.getuid()
    assert tmp_listing(node_tmp) == before + [f"corral-{uid}", f"corral-{uid}/ctl"]


def test_ctrl_c_leaves_no_node_temp_files(tmp_path: Path, node_tmp: Path) -> None:
    write(tmp_path / "loop.py", """
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen(CORRAL + ["run", "loop.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(node_tmp)})
    try:
        wait_for_lines(proc, "ready", 2)
        assert any(p.name.startswith("torchelastic_") or p.name == "elastic" for p in node_tmp.rglob("*"))
        assert interrupt(proc, timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    uid = os.getuid()
    assert tmp_listing(node_tmp) == [f"corral-{uid}", f"corral-{uid}/ctl"]


def _local_cluster(path: Path, **host: str) -> Path:
    lines = ['[[hosts]]', 'name = "localhost"'] + [f'{k} = "{v}"' for k, v in host.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_command_launcher_gets_the_configured_python(tmp_path: Path) -> None:
    cluster = _local_cluster(tmp_path / "corral.toml", python=sys.executable)
    venv_bin = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p.rstrip("/") != venv_bin)
    res = corral(["run", "-c", str(cluster), "--launcher", "command", "bash", "-c",
                  'echo "python=$CORRAL_PYTHON"; echo "found=$(command -v python)"'],
                 tmp_path, env={**os.environ, "PATH": path})
    assert res.returncode == 0, res.stderr
    assert f"python={sys.executable}" in res.stdout
    assert f"found={venv_bin}/python" in res.stdout, res.stdout
    # ... and --dry-run shows it, for every launcher.
    for launcher in ("command", "torchrun"):
        res = corral(["run", "-c", str(cluster), "--dry-run", "--json", "--launcher", launcher, "x.py"], tmp_path)
        assert json.loads(res.stdout)["nodes"][0]["env"]["CORRAL_PYTHON"] == sys.executable


def test_a_node_with_another_copy_of_the_script_is_named(tmp_path: Path) -> None:
    # The node's working directory holds its own copy (as after an earlier `corral sync`);
    # the script here was edited since.  A warning, not a failure.
    head, node = tmp_path / "head", tmp_path / "node"
    head.mkdir(), node.mkdir()
    write(node / "train.py", 'print("old copy")\n')
    write(head / "train.py", 'print("new copy")\n')
    cluster = _local_cluster(tmp_path / "corral.toml", python=sys.executable, workdir=str(node))
    res = corral(["run", "-c", str(cluster), "--launcher", "command", "train.py"], head)
    assert res.returncode == 0, res.stderr
    assert "old copy" in res.stdout
    assert "train.py on localhost is not the same as here" in res.stderr and "--sync" in res.stderr
    write(node / "train.py", 'print("new copy")\n')
    res = corral(["run", "-c", str(cluster), "--launcher", "command", "train.py"], head)
    assert res.returncode == 0 and "not the same" not in res.stderr, res.stderr



class _Messages:
    """A RunView that keeps corral's own messages (library API)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def line(self, host: str, rank: int | None, stream: str, text: str) -> None: ...
    def status(self, host: str, rank: int | None, text: str) -> None: ...
    def message(self, text: str) -> None:
        self.messages.append(text)

    def stopping(self) -> None: ...
    def close(self) -> None: ...


def test_a_quiet_job_without_hang_timeout_is_told_where_its_ranks_are(tmp_path: Path) -> None:
    # No --hang-timeout: after `quiet_notice` seconds without output corral
    # says where the ranks are (here: one rank out of the collective) and the
    # job goes on -- quiet training is not a failure.
    import asyncio

    from corral.inventory import local_cluster
    from corral.run.options import RunOptions
    from corral.run.plan import RunSpec
    from corral.run.runner import Runner

    write(tmp_path / "quiet.py", """
        import time
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            time.sleep(3600)      # loading a shard that never comes
        dist.all_reduce(torch.ones(1))
    """)
    view = _Messages()
    runner = Runner(local_cluster(gpus=0), RunSpec(program="quiet.py", nproc_per_node=2),
                    RunOptions(runs_dir=tmp_path / "runs", quiet_notice=6), view=view,
                    head_env=os.environ, head_cwd=str(tmp_path))

    async def run_until_told():
        task = asyncio.create_task(runner.run())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("elsewhere" in m for m in view.messages):
            await asyncio.sleep(0.5)
        still_running = not task.done()
        runner.interrupt()
        return still_running, await task

    still_running, result = asyncio.run(run_until_told())
    said = "\n".join(view.messages)
    assert "no rank has written anything for" in said and "the job goes on" in said, said
    assert "rank 1 elsewhere than the others" in said, said
    assert still_running and result.status == "interrupted", said
    assert list((tmp_path / "runs").glob("*/stacks-*.txt"))


def test_a_run_that_succeeds_after_a_caught_traceback_says_so(tmp_path: Path) -> None:
    # The script catches its own error (a missing data file) and exits 0: the
    # run succeeded, but the summary names the rank and the exception.
    write(tmp_path / "caught.py", """
        import os, traceback
        if os.environ["RANK"] == "1":
            try:
                open("/nonexistent/shard-1.bin")
            except OSError:
                traceback.print_exc()
        print("done", flush=True)
    """)
    res = corral(["run", "caught.py"], tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "note: rank 1 on" in res.stderr and "printed a traceback and the run still exited 0" in res.stderr
    assert "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/shard-1.bin'" in res.stderr
    res = corral(["run", "--json", "caught.py"], tmp_path, timeout=120)
    caught = json.loads(res.stdout[res.stdout.index("{\n"):])["caught"]
    assert [(c["rank"], c["exception"].split(":")[0]) for c in caught] == [(1, "FileNotFoundError")]
    assert Path(caught[0]["log"]).is_file()


def test_a_run_id_whose_directory_exists_is_an_error_that_starts_nothing(tmp_path: Path) -> None:
    # Two runs that drew the same id (same second, same random part) must not
    # share a run directory; the second one stops before starting anything,
    # with a message, not a FileExistsError traceback.
    import asyncio

    from corral.errors import CorralError
    from corral.model import Cluster, Host
    from corral.run.options import RunOptions
    from corral.run.plan import RunSpec, new_run_id
    from corral.run.runner import Runner

    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", new_run_id())
    marker = tmp_path / "started"
    spec = RunSpec(program="touch", args=(str(marker),), launcher="command", workdir=str(tmp_path))
    (tmp_path / "runs" / spec.run_id).mkdir(parents=True)
    runner = Runner(Cluster(hosts=(Host(name="localhost", local=True, python=sys.executable),)), spec,
                    RunOptions(runs_dir=tmp_path / "runs"), head_env=dict(os.environ), head_cwd=str(tmp_path))
    with pytest.raises(CorralError) as e:
        asyncio.run(runner.run())
    assert "already exists: another corral run has the same id" in e.value.message
    assert e.value.exit_code == 3 and not marker.exists()
    assert list((tmp_path / "runs" / spec.run_id).iterdir()) == []


def test_processes_per_node_follow_the_jobs_cuda_visible_devices(tmp_path: Path) -> None:
    # A host without `slots` gets one process per GPU its ranks will see: a
    # cluster file's CUDA_VISIBLE_DEVICES for that host (or --env) cuts the
    # node's nvidia-smi list, as it does for the job (it used to start one per
    # listed GPU: 4 here, and ranks 1-3 failed with "invalid device ordinal").
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write(bin_dir / "nvidia-smi", "#!/bin/sh\n" + "".join(
        f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(4)))
    (bin_dir / "nvidia-smi").chmod(0o755)
    write(tmp_path / "who.py", "import os\nprint('seen', os.environ['LOCAL_WORLD_SIZE'], "
                               "repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n")
    write(tmp_path / "corral.toml", f'[[hosts]]\nname = "localhost"\npython = "{sys.executable}"\n'
                                    'env = { CUDA_VISIBLE_DEVICES = "2" }\n')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # this machine's own: all four
    # named with -c: a found corral.toml whose python runs here needs trust first
    res = corral(["run", "-c", "corral.toml", "--fresh-ranks", "who.py"], tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.findall(r"seen \d+ .*", res.stdout) == ["seen 1 '2'"]
    res = corral(["run", "-c", "corral.toml", "--fresh-ranks", "--env", "CUDA_VISIBLE_DEVICES=0,1", "who.py"],
                 tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.findall(r"seen \d+ .*", res.stdout) == ["seen 2 '0,1'"] * 2


def test_gpus_picks_a_subset_names_a_gpu_the_node_lacks_and_warns_of_busy_ones(tmp_path: Path) -> None:
    # A node with 4 GPUs (nvidia-smi's list) where something corral did not
    # start computes on GPU 1: --gpus 1,3 runs 2 ranks on those two, says GPU
    # 1 is busy, and run.json records what the job held; --gpus 3-5 is an
    # error naming the GPUs that are not there, before anything starts.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stranger = subprocess.Popen(["sleep", "120"])
    write(bin_dir / "nvidia-smi", "#!/bin/sh\ncase \"$1\" in\n  -L)\n" + "".join(
        f"    echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(4))
        + f"    ;;\n  --query-compute-apps*) echo 'GPU-1, {stranger.pid}, /usr/bin/python3, 30000' ;;\nesac\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    write(tmp_path / "who.py", "import os\nprint('seen', os.environ['LOCAL_WORLD_SIZE'], "
                               "os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # this machine's own: all four
    try:
        res = corral(["run", "--fresh-ranks", "--gpus", "1,3", "who.py"], tmp_path, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        assert re.findall(r"seen \d+ .*", res.stdout) == ["seen 2 1,3"] * 2
        assert f"GPU 1: pid {stranger.pid} python3, 30000 MiB" in res.stderr, res.stderr
        (record,) = (tmp_path / "runs").glob("*/run.json")
        data = json.loads(record.read_text())
        assert data["hosts"][0]["gpus"] == ["1", "3"] and data["ports"] == {"master": data["master_port"]}
        res = corral(["run", "--fresh-ranks", "--gpus", "3-5", "who.py"], tmp_path, env=env)
        assert res.returncode == 3 and "seen" not in res.stdout
        assert re.search(r": has no GPU 4,5 \(--gpus asks for 3,4,5; nvidia-smi there lists GPUs 0-3\)", res.stderr), \
            res.stderr
    finally:
        stranger.kill()
        stranger.wait()


def test_telemetry_is_recorded_per_node_unless_turned_off(tmp_path: Path) -> None:
    write(tmp_path / "steps.py", """\
        import time
        for i in range(25):
            print("step", i, flush=True)
            time.sleep(0.1)
        """)
    for flags, expect in (([], True), (["--no-telemetry"], False)):
        runs = tmp_path / f"runs{len(flags)}"
        res = corral(["run", "--runs-dir", str(runs), "--launcher", "command", *flags, sys.executable, "steps.py"],
                     tmp_path)
        assert res.returncode == 0, res.stderr
        (run,) = runs.iterdir()
        files = list((run / "telemetry").glob("*.jsonl")) if (run / "telemetry").exists() else []
        assert bool(files) == expect, files
        if expect:
            samples = [json.loads(line) for line in files[0].read_text().splitlines()]
            assert samples and all(s["ev"] == "tm" and s["at"] > 0 for s in samples)
            assert any(r[0] == 0 and (r[3] or 0) > 0 for s in samples for r in s.get("rank", [])), samples
