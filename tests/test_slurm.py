"""corral on a real Slurm cluster: the sandbox's munge + slurmctld + one slurmd per node.

The module's sandbox has no ssh key anywhere (no ``--with-keys``) and an
``ssh`` on PATH that only leaves a mark: everything here reaches the nodes
through Slurm (``salloc``/``sbatch`` + srun job steps) or not at all.
Every failure case is checked the way an operator would: ``squeue`` and the
process list of every node afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sandbox, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[1]
CORRAL = [sys.executable, "-m", "corral"]
NODES = 4


@pytest.fixture(scope="module")
def slurm_sandbox(tmp_path_factory: pytest.TempPathFactory):
    """A 4-node sandbox running Slurm, with no ssh keys; torn down after the module."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root (network/PID/mount namespaces); CI runs as root")
    if not shutil.which("slurmctld") and not os.path.exists("/usr/sbin/slurmctld"):
        pytest.skip("Slurm is not installed (make system-deps installs slurmctld, slurmd, slurm-client, munge)")
    from corral.sandbox import Sandbox

    tag = f"v{os.getpid()}l"
    base = tmp_path_factory.mktemp("slurm")
    sb = Sandbox(name=tag, prefix=f"{tag}n", state_dir=base / "state")
    shared = base / "shared"  # run directories and batch output: seen by the head and every node
    shared.mkdir()
    try:
        sb.up(NODES, share=[str(REPO), str(shared)], slurm=True)
        sb.shared = shared  # type: ignore[attr-defined]
        yield sb
    finally:
        sb.down()


@pytest.fixture
def env(slurm_sandbox, tmp_path: Path) -> dict[str, str]:
    """The head's environment: this sandbox's SLURM_CONF, this Python first on PATH
    (srun passes it to the nodes), and an ``ssh`` that only records that it ran."""
    trap = tmp_path / "bin"
    trap.mkdir()
    (trap / "ssh").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'ssh-was-used'}\nexit 255\n")
    (trap / "ssh").chmod(0o755)
    runs = slurm_sandbox.shared / f"runs-{time.monotonic_ns()}"
    out = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out.update(SLURM_CONF=str(slurm_sandbox.state_dir / "slurm" / "slurm.conf"),
               PATH=f"{trap}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               CORRAL_RUNS_DIR=str(runs))
    yield out
    assert not (tmp_path / "ssh-was-used").exists(), (tmp_path / "ssh-was-used").read_text()


@pytest.fixture
def workdir(slurm_sandbox) -> Path:
    path = slurm_sandbox.shared / f"w{time.monotonic_ns()}"
    path.mkdir()
    return path


def write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def squeue(env: dict[str, str], *args: str) -> str:
    return subprocess.run(["squeue", "-h", *args], env=env, capture_output=True, text=True,
                          timeout=20).stdout.strip()


def leftovers(sb, node: str) -> list[str]:
    """Processes on a node other than its init, sshd, munged, slurmd and the ps itself."""
    out = sb.exec(node, ["ps", "-eo", "pid=,args="]).stdout
    rest = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if pid == "1" or re.match(r"(/usr/sbin/)?(sshd|munged|slurmd)\b|ps ", args):
            continue
        rest.append(line.strip())
    return rest


def assert_clean(sb, env: dict[str, str], within: float, nodes: list[str] | None = None) -> None:
    """No job in the queue and no process of the run on any node."""
    deadline = time.monotonic() + within
    while True:
        left = {n: p for n in (nodes or sb.nodes) if (p := leftovers(sb, n))}
        queue = squeue(env)
        if not left and not queue:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"left behind: processes {left}, squeue {queue!r}")
        time.sleep(0.5)


def salloc_run(env: dict[str, str], args: list[str], cwd: Path, timeout: float = 180):
    return subprocess.run(["salloc", f"-N{NODES}", *CORRAL, "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def salloc_start(env: dict[str, str], args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(["salloc", f"-N{NODES}", *CORRAL, "run", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_lines(proc: subprocess.Popen, pattern: str, count: int, timeout: float = 120) -> list[str]:
    import threading

    lines: list[str] = getattr(proc, "_lines", None) or []
    if not hasattr(proc, "_lines"):
        proc._lines = lines  # type: ignore[attr-defined]
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        seen = [ln for ln in list(lines) if re.search(pattern, ln)]
        if len(seen) >= count:
            return seen
        assert time.monotonic() < deadline, f"only {seen} after {timeout}s"
        assert proc.poll() is None or time.monotonic() < deadline - timeout + 5, proc.stderr.read()
        time.sleep(0.1)


def child_corral(salloc_pid: int) -> int:
    """The pid of the ``corral run`` that salloc started."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == salloc_pid and b"corral" in cmd:
            return int(pid)
    raise AssertionError("no corral under salloc")


LOOP = """
    import time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    print("ready", dist.get_rank(), flush=True)
    for _ in range(100000):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.2)
"""


# ---------------------------------------------------------------------------
# the cluster


def test_sinfo_shows_every_node_idle_and_srun_reaches_each(slurm_sandbox, env) -> None:
    states = slurm_sandbox.slurm_node_states()
    assert states == {n: "idle" for n in slurm_sandbox.nodes}
    out = subprocess.run(["srun", f"-N{NODES}", "hostname"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split()) == sorted(slurm_sandbox.nodes)


# ---------------------------------------------------------------------------
# corral run inside an allocation


def test_train_ddp_in_salloc_over_srun_with_no_ssh_key(slurm_sandbox, env) -> None:
    res = salloc_run(env, ["examples/train_ddp.py", "--epochs", "1", "--no-progress"], REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"cluster: 4 hosts \S+ from Slurm allocation \d+", res.stderr)
    first, last = map(float, re.search(r"first loss ([\d.]+) \| final loss ([\d.]+)", res.stdout).groups())
    assert last < first * 0.7, (first, last)
    assert "training on 4 process(es)" in res.stdout
    assert_clean(slurm_sandbox, env, within=10)


@pytest.mark.parametrize("launcher,script", [
    # Lightning's SLURMEnvironment would take the agent step's SLURM_PROCID/SLURM_NTASKS
    # over corral's ranks (every node rank 0, or a hang): the agent leaves the step's out
    ("lightning", ["examples/launchers/lightning_train.py", "--devices", "1", "--num-nodes", str(NODES)]),
    ("accelerate", ["examples/launchers/accelerate_train.py"]),
])
def test_each_launchers_own_script_runs_in_salloc_over_srun(slurm_sandbox, env, launcher: str,
                                                            script: list[str]) -> None:
    res = salloc_run(env, ["-n", "1", "--launcher", launcher, *script], REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"from Slurm allocation \d+", res.stderr)
    assert f"{NODES} ranks on {NODES} node(s)" in res.stderr, res.stderr[-2000:]
    m = re.search(r"first loss ([\d.]+) \| final loss ([\d.]+)", res.stdout)
    assert m and float(m.group(2)) < float(m.group(1)), res.stdout[-2000:]
    assert_clean(slurm_sandbox, env, within=10)


def test_rank_crash_ends_the_step_and_the_job_and_is_named(slurm_sandbox, env, workdir: Path) -> None:
    write(workdir / "crash.py", """
        import time
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        for step in range(1000):
            dist.all_reduce(torch.ones(1))
            if dist.get_rank() == 2 and step == 3:
                raise RuntimeError("corrupt batch at step 3")
            time.sleep(0.1)
    """)
    res = salloc_run(env, ["crash.py"], workdir)
    assert res.returncode == 1, res.stderr[-3000:]
    node3 = slurm_sandbox.nodes[2]
    assert f"rank 2 on {node3} failed: RuntimeError: corrupt batch at step 3" in res.stderr
    assert_clean(slurm_sandbox, env, within=10)


def test_stopped_node_is_named_within_15s(slurm_sandbox, env, workdir: Path) -> None:
    write(workdir / "loop.py", LOOP)
    victim = slurm_sandbox.nodes[2]
    proc = salloc_start(env, ["loop.py"], workdir)
    try:
        wait_for_lines(proc, r"\] ready \d", NODES)
        slurm_sandbox.stop(victim)
        t0 = time.monotonic()
        proc.wait(timeout=60)
        err = proc.stderr.read()
        elapsed = time.monotonic() - t0
        assert proc.returncode == 3, err[-3000:]
        assert f"{victim} was lost" in err, err[-3000:]
        assert elapsed < 15 + 3, f"declared lost and torn down after {elapsed:.1f}s"
        others = [n for n in slurm_sandbox.nodes if n != victim]
        deadline = time.monotonic() + 10
        while any(leftovers(slurm_sandbox, n) for n in others) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not {n: p for n in others if (p := leftovers(slurm_sandbox, n))}
    finally:
        if proc.poll() is None:
            proc.kill()
        slurm_sandbox.up()  # boots the node again, its slurmd with it, and waits for idle
    assert_clean(slurm_sandbox, env, within=30)


def test_ctrl_c_ends_the_steps_and_leaves_nothing(slurm_sandbox, env, workdir: Path) -> None:
    write(workdir / "loop.py", LOOP)
    proc = salloc_start(env, ["loop.py"], workdir)
    try:
        wait_for_lines(proc, r"\] ready \d", NODES)
        assert squeue(env, "-s", "-o", "%i") != "", "no job step while the run goes on"
        os.kill(child_corral(proc.pid), signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode == 130, proc.stderr.read()[-3000:]
        assert_clean(slurm_sandbox, env, within=10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_exec_inside_an_allocation_runs_on_every_node_over_srun(slurm_sandbox, env) -> None:
    res = subprocess.run(["salloc", f"-N{NODES}", *CORRAL, "exec", "--", "hostname"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for node in slurm_sandbox.nodes:
        assert re.search(rf"^{node}$", res.stdout, re.M), res.stdout
    assert "srun:" not in res.stdout + res.stderr.replace("salloc:", "")


def test_max_restarts_opens_new_steps_and_succeeds(slurm_sandbox, env, workdir: Path) -> None:
    write(workdir / "job.py", """
        import os, sys
        print("attempt", os.environ["CORRAL_ATTEMPT"], "node", os.environ["NODE_RANK"], flush=True)
        if os.environ["CORRAL_ATTEMPT"] == "1" and os.environ["NODE_RANK"] == "2":
            sys.exit(7)
    """)
    res = salloc_run(env, ["--launcher", "command", "--ranks", "all", "--max-restarts", "1", "job.py"], workdir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(re.findall(r"attempt 2 node \d", res.stdout)) == NODES, res.stdout[-2000:]
    assert_clean(slurm_sandbox, env, within=10)


# ---------------------------------------------------------------------------
# corral submit


def submit_start(env: dict[str, str], args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*CORRAL, "submit", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_train_ddp_through_corral_submit(slurm_sandbox, env, workdir: Path) -> None:
    res = subprocess.run([*CORRAL, "submit", f"-N{NODES}", "-t", "10", str(REPO / "examples/train_ddp.py"),
                          "--epochs", "1", "--no-progress"], cwd=workdir, env=env, capture_output=True,
                         text=True, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    job = re.search(r"submitted job (\d+)", out).group(1)
    assert re.search(rf"job {job} running on \S+\[1-4\]", out), out[-3000:]
    assert re.search(r"cluster: 4 hosts \S+ from Slurm allocation " + job, out)
    assert "final loss" in out and f"job {job} completed (exit code 0)" in out
    assert (workdir / f"slurm-{job}.out").exists()
    assert_clean(slurm_sandbox, env, within=10)


def test_ctrl_c_on_submit_cancels_the_job_and_leaves_nothing(slurm_sandbox, env, workdir: Path) -> None:
    write(workdir / "loop.py", LOOP)
    proc = submit_start(env, ["--cancel-on-interrupt", f"-N{NODES}", "loop.py"], workdir)
    try:
        wait_for_lines(proc, r"\] ready \d", NODES)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode == 130, proc.stderr.read()[-3000:]
        assert "cancelled" in proc.stderr.read()
        assert_clean(slurm_sandbox, env, within=15)
    finally:
        if proc.poll() is None:
            proc.kill()


CHECKPOINTS = """
    import os, signal, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    asked = []
    signal.signal(signal.SIGUSR1, lambda s, f: asked.append(s))
    print("ready", dist.get_rank(), flush=True)
    step = 0
    while True:
        t = torch.tensor([len(asked)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if t.item():
            break
        step += 1
        time.sleep(0.2)
    if dist.get_rank() == 0:
        print("checkpointed at step", step, flush=True)
    dist.destroy_process_group()
"""


def test_the_time_limit_signal_reaches_every_rank_which_checkpoints(slurm_sandbox, env, workdir: Path) -> None:
    # Slurm's --signal=B:USR1@N goes to the batch shell N seconds before the
    # time limit; `scancel --batch --signal` sends the same signal the same way, now.
    write(workdir / "ck.py", CHECKPOINTS)
    proc = submit_start(env, ["--cancel-on-interrupt", f"-N{NODES}", "-t", "10", "ck.py"], workdir)
    try:
        wait_for_lines(proc, r"\] ready \d", NODES)
        job = squeue(env, "-o", "%i")
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=20)
        proc.wait(timeout=60)
        err = proc.stderr.read()
        assert proc.returncode == 0, err[-3000:]
        # The job's output (corral run's lines too) is the output file, followed on stdout.
        wait_for_lines(proc, r"SIGUSR1 received: forwarded to every rank", 1, timeout=5)
        wait_for_lines(proc, r"checkpointed at step \d+", 1, timeout=5)
        assert f"job {job} completed (exit code 0)" in err
        assert_clean(slurm_sandbox, env, within=10)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)


def test_down_leaves_no_daemon_socket_or_file(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not (shutil.which("slurmctld") or os.path.exists("/usr/sbin/slurmctld")):
        pytest.skip("needs root and Slurm")
    from corral.sandbox import Sandbox
    from corral.sandbox.slurm import munge_socket

    sb = Sandbox(name=f"v{os.getpid()}k", prefix=f"v{os.getpid()}k", state_dir=tmp_path / "state")
    try:
        st = sb.up(1, slurm=True)
        conf = Path(st.files["slurm_conf"])
        assert conf.is_file() and sb.slurm_node_states() == {sb.nodes[0]: "idle"}
        sock = Path(munge_socket(sb.spec))
        daemons = [int((conf.parent / f).read_text()) for f in ("slurmctld.pid", "munged.pid")]
    finally:
        removed = sb.down()
    assert sorted(removed["slurm"]) == ["munged", "slurmctld"]
    assert not any(Path(f"/proc/{pid}").exists() for pid in daemons)
    assert not sock.parent.exists() and not (tmp_path / "state").exists()
