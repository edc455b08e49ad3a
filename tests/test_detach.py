"""Detached jobs (`run --detach`, attach, logs, stop, ps): a supervisor on node 0.

The sandbox tests check every failure path the way an operator would: by
listing the processes on every node afterwards.  Node 0 reaches the other
nodes with its own ssh setup; here the sandbox's key and known_hosts are put
in node 1's private ~/.ssh (what `corral ssh setup` does on a real cluster),
and taken out again afterwards.
"""

from __future__ import annotations

import contextlib
import json
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
from conftest import pid_alive

from corral.hostrange import fold
from corral.model import Cluster, Host
from corral.run.package import supervisor_package
from corral.run.supervisor import cluster_from_json, cluster_to_json, node0_view

REPO = Path(__file__).resolve().parents[1]
CORRAL = [sys.executable, "-m", "corral"]

#: Prints a step every 0.3 s (or argv[2] s) until told how many; with argv[3],
#: rank 1 is SIGKILLed at that step of the first attempt (a restart gets past it).
STEPS = """
    import os, signal, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    attempt = os.environ.get("CORRAL_ATTEMPT")
    for i in range(int(sys.argv[1])):
        print("step", i, "rank", dist.get_rank(), "attempt", attempt, flush=True)
        if len(sys.argv) > 3 and i == int(sys.argv[3]) and dist.get_rank() == 1 and attempt == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0.3)
    dist.destroy_process_group()
"""


def corral(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CORRAL + list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False)


def run_id_of(res: subprocess.CompletedProcess) -> str:
    found = re.search(r"run (\S+) is running, detached", res.stderr)
    assert found, res.stderr[-3000:]
    return found.group(1)


# ---------------------------------------------------------------------------
# what travels, what node 0 sees


def test_node0_sees_itself_locally_and_none_of_the_heads_files() -> None:
    cluster = Cluster(hosts=(Host(name="gpu1", address="10.0.0.1", port=2222, user="me",
                                  ssh_options=("IdentityFile=/home/me/.ssh/k",)),
                             Host(name="gpu2", ssh_options=("IdentityFile=/x", "Compression=yes"))),
                      ssh_options=("UserKnownHostsFile=/home/me/kh", "ServerAliveInterval=5"),
                      ssh_config="/home/me/ssh_config", env={"A": "1"})
    assert cluster_from_json(json.loads(json.dumps(cluster_to_json(cluster)))) == cluster
    seen = node0_view(cluster)
    assert seen.hosts[0].local and not seen.hosts[1].local
    assert seen.ssh_config is None
    assert seen.ssh_options == ("ControlMaster=no", "ServerAliveInterval=5")
    assert seen.hosts[1].ssh_options == ("Compression=yes",)


def test_the_package_is_the_same_for_the_same_files() -> None:
    data, digest = supervisor_package()
    supervisor_package.cache_clear()
    for kept in Path(os.environ["HOME"], ".cache/corral/pkg").glob("head-*.zip"):
        kept.unlink()  # built again, not read back
    again, digest2 = supervisor_package()
    assert digest == digest2 and data == again
    import io
    import zipfile

    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "corral/run/supervisor.py" in names and "rich/console.py" in names
    assert not any("__pycache__" in n for n in names)


def test_a_node_with_an_old_python_is_named_before_anything_starts(tmp_path: Path) -> None:
    """The node-side operations run on Python 3.8; the supervisor needs 3.10."""
    import glob

    found = sorted(glob.glob(os.path.expanduser("~root/.pyenv/versions/3.8*/bin/python3.8")))
    found += [p for p in ("/usr/bin/python3.8",) if os.access(p, os.X_OK)]
    old = found[0] if found else None
    if old is None:
        pytest.skip("no Python 3.8 here")
    from corral.errors import HostError
    from corral.run import detach
    from corral.run.options import RunOptions
    from corral.run.plan import RunSpec

    cluster = Cluster(hosts=(Host(name="localhost", local=True, python=old),))
    jobs = detach.list_jobs(cluster, cluster.hosts[0])  # 3.8 runs the node side
    assert isinstance(jobs, list)
    with pytest.raises(HostError) as err:
        detach.start(cluster, RunSpec(program="x.py"), RunOptions(runs_dir=tmp_path), head_env={},
                     head_cwd=str(tmp_path), on_line=lambda _: None)
    assert "needs Python 3.10+" in err.value.message and "3.8" in err.value.message
    assert "`python` for localhost" in (err.value.hint or "")


def test_unknown_run_is_named_with_how_to_look_on_the_nodes(tmp_path: Path) -> None:
    res = corral("logs", "20990101-nosuch")
    assert res.returncode == 2, res.stderr
    assert "no detached run '20990101-nosuch'" in res.stderr and "-c FILE" in res.stderr


# ---------------------------------------------------------------------------
# this machine: the supervisor is a local daemon


def test_stop_tears_a_detached_job_down_and_attach_then_shows_its_end(tmp_path: Path) -> None:
    script = tmp_path / "steps.py"
    script.write_text(textwrap.dedent(STEPS))
    # rank 1 is killed at its step 2; the supervisor restarts the job (--max-restarts), as attended
    res = corral("run", "--detach", "-n", "2", "--max-restarts", "1", str(script), "100000", "0.3", "2",
                 cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = run_id_of(res)
    stopped = False
    try:
        sup = json.loads(Path(os.environ["HOME"], ".local/state/corral/detached", run,
                              "supervisor.json").read_text())["pid"]
        # attach to the live job: its console; Ctrl-C detaches, says how to stop, and the job goes on
        follow = subprocess.Popen(CORRAL + ["attach", run, "--tail", "0"], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert follow.stdout is not None
        for line in follow.stdout:
            if re.search(r"\[r1\] step \d+ rank 1 attempt 2", line):
                break
        follow.send_signal(signal.SIGINT)
        _, err = follow.communicate(timeout=30)
        assert f"detached from run {run}; it goes on (`corral stop {run}` stops it" in err, err
        assert pid_alive(sup)
        # one host's logs; a rank the job does not have is named (it printed nothing, exit 0)
        host = re.search(r"\[(\S+)/r0\] step 0 rank 0", corral("logs", run, cwd=tmp_path).stdout)
        assert host, "no rank 0 step 0 in the logs"
        # A live job's rank logs are flushed every 0.5 s (its console at once): rank 1's
        # first line after the restart marker may take that long to be the last line.
        for _ in range(20):
            res = corral("logs", run, "--node", host.group(1), "--tail", "1", cwd=tmp_path)
            if sorted(re.findall(r"\[\S+/r(\d)\] step", res.stdout)) == ["0", "1"]:
                break
            time.sleep(0.25)
        assert res.returncode == 0 and sorted(re.findall(r"\[\S+/r(\d)\] step", res.stdout)) == ["0", "1"], res
        res = corral("logs", run, "--rank", "2", cwd=tmp_path)
        assert res.returncode == 2 and f"--rank 2: run {run} has no rank 2 (its ranks are 0-1)" in res.stderr, res
        res = corral("stop", run, cwd=tmp_path)
        stopped = True
        assert res.returncode == 130, res.stderr
        assert f"run {run} interrupted" in res.stderr
        assert not head_processes(run) and not head_processes(str(script))  # supervisor, agent, ranks
        assert not pid_alive(sup)
        again = corral("stop", run, cwd=tmp_path)
        assert again.returncode == 0 and "is not running" in again.stderr
        # attach to the finished job: its last lines, how it ended, its run directory brought back
        res = corral("attach", run[:12], cwd=tmp_path)
        assert res.returncode == 130, res.stderr
        assert "has ended" in res.stderr and f"run {run} interrupted" in res.stderr
        assert re.search(r"\[r1\] step \d+ rank 1", res.stdout), res.stdout  # the console's last lines
        # complete: every attempt's lines in every rank's log, the restart, the timings
        local = tmp_path / "runs" / run
        [log1] = local.glob("*/rank1.log")
        text = log1.read_text()
        assert "step 2 rank 1 attempt 1" in text and "step 0 rank 1 attempt 2" in text, text[-2000:]
        assert "----- corral: restart 1/1 -----" in text
        rec = json.loads((local / "run.json").read_text())
        assert rec["status"] == "interrupted" and rec["detached"] and rec["attempts"] == 2
        assert rec["restarts"][0]["attempt"] == 1 and "SIGKILL" in rec["restarts"][0]["failure"], rec["restarts"]
        assert rec["started"] < rec["ended"]
        runs = json.loads(corral("runs", "--json", cwd=tmp_path).stdout)["runs"]
        assert [r["status"] for r in runs if r["run_id"] == run] == ["interrupted"]
    finally:
        if not stopped:  # the test failed midway: the job would go on, unseen
            corral("stop", run, cwd=tmp_path)
        _forget(run)


def test_ps_lists_an_attended_job_from_what_its_agents_hold(tmp_path: Path) -> None:
    # `corral ps` listed detached jobs only: an attended run holding the
    # node's GPUs and a port (the one a second job is refused for) was not
    # there.  Now each node also says what live corral jobs hold there.
    import socket

    script = tmp_path / "steps.py"
    script.write_text(textwrap.dedent(STEPS))
    proc = subprocess.Popen(CORRAL + ["run", "-n", "2", str(script), "100000"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "step 0 rank 1" in line:
                break
        [run] = [p.name for p in Path(os.environ["CORRAL_RUNS_DIR"]).iterdir()]
        res = corral("ps", "--json", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        job = {j["run_id"]: j for j in json.loads(res.stdout)["jobs"]}[run]
        assert job["state"] == "attended" and job["head"] == socket.gethostname() and job["supervisor"] is None
        assert len(job["nodes"]) == 1 and len(job["ports"]) == 1 and job["since"], job
        res = corral("ps", cwd=tmp_path)
        assert re.search(rf"{run} .* attended from", res.stdout), res.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def _forget(run: str) -> None:
    """The job's directory on node 0 (this machine's, or a home the sandbox shares)."""
    shutil.rmtree(Path("/root" if os.geteuid() == 0 else os.path.expanduser("~"),
                       ".local/state/corral/detached", run), ignore_errors=True)
    shutil.rmtree(Path(os.environ["HOME"], ".local/state/corral/detached", run), ignore_errors=True)


# ---------------------------------------------------------------------------
# the sandbox: 4 nodes, 2 processes each, gloo


def leftovers(sandbox, node: str) -> list[str]:
    """Processes on a node other than its init, sshd and the ps itself, and
    corral's directories in its /tmp."""
    out = sandbox.exec(node, ["ps", "-eo", "pid=,args="]).stdout
    rest = [ln.strip() for ln in out.splitlines()
            if ln.split() and ln.split()[0] != "1" and not ln.strip().partition(" ")[2].startswith(
                ("sshd", "/usr/sbin/sshd", "ps "))]
    tmp = sandbox.exec(node, ["ls", "-A", "/tmp"]).stdout.split()
    return rest + [f"/tmp/{n}" for n in tmp if n.startswith(("corral-", "torchelastic_"))]


def assert_clean(sandbox, within: float, nodes: list[str] | None = None) -> None:
    deadline = time.monotonic() + within
    while True:
        left = {n: leftovers(sandbox, n) for n in (nodes or sandbox.nodes)}
        left = {n: p for n, p in left.items() if p}
        if not left:
            return
        assert time.monotonic() < deadline, f"left after {within:.0f}s: {left}"
        time.sleep(0.5)


@pytest.fixture
def node_ssh(sandbox):
    """Node 1 can ssh to the others (its own key and known_hosts), for the test only."""
    first = sandbox.nodes[0]
    sandbox.exec(first, ["sh", "-c", ("mkdir -p -m 700 /root/.ssh && cat > /root/.ssh/id_ed25519 "
                                      "&& chmod 600 /root/.ssh/id_ed25519")],
                 input=sandbox.identity_file.read_text(), check=True)
    sandbox.exec(first, ["sh", "-c", "cat > /root/.ssh/known_hosts"], input=sandbox.known_hosts.read_text(),
                 check=True)
    yield sandbox
    sandbox.exec(first, ["rm", "-f", "/root/.ssh/id_ed25519", "/root/.ssh/known_hosts"])


@pytest.fixture
def work(sandbox) -> Path:
    path = REPO / "scratch" / f"dt-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir(parents=True)
    (path / "steps.py").write_text(textwrap.dedent(STEPS))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def detached(sandbox, work: Path, *args: str) -> str:
    res = corral("run", "-c", str(sandbox.cluster_file), "--detach", *args, cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    return run_id_of(res)


def ps(sandbox, work: Path) -> dict[str, dict]:
    res = corral("ps", "-c", str(sandbox.cluster_file), "--all", "--json", cwd=work, timeout=60)
    return {j["run_id"]: j for j in json.loads(res.stdout)["jobs"]}


def wait_failed(work: Path, run: str, within: float) -> dict:
    """`corral runs` (which asks node 0 about a detached run) until the run has ended."""
    deadline = time.monotonic() + within
    while True:
        runs = json.loads(corral("runs", "--json", cwd=work).stdout)["runs"]
        rec = next((r for r in runs if r["run_id"] == run), {})
        if rec.get("status") not in (None, "running", "starting", "stopping"):
            return rec
        assert time.monotonic() < deadline, f"still {rec.get('status')} after {within}s"
        time.sleep(0.5)


def head_processes(marker: str) -> list[int]:
    """Processes on this machine whose command line holds ``marker`` (the
    sandbox's nodes are PID namespaces inside this one: theirs are left out)."""
    out = []
    mine = os.readlink("/proc/self/ns/pid")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if os.readlink(f"/proc/{pid}/ns/pid") != mine:
                continue
        except OSError:
            continue
        if marker.encode() in cmd and int(pid) != os.getpid():
            out.append(int(pid))
    return out


def supervisor_pid(sandbox, run: str) -> int:
    out = sandbox.exec(sandbox.nodes[0], ["ps", "-eo", "pid=,args="]).stdout
    pids = [int(ln.split()[0]) for ln in out.splitlines() if f"corral-supervisor {run}" in ln]
    assert len(pids) == 1, out
    return pids[0]


@pytest.mark.sandbox
def test_node0_that_cannot_reach_the_others_is_named_with_the_fix_before_anything_starts(sandbox, work: Path) -> None:
    res = corral("run", "-c", str(sandbox.cluster_file), "--detach", "steps.py", "3", cwd=work)
    first, others = sandbox.nodes[0], sandbox.nodes[1:]
    assert res.returncode == 3, res.stderr[-3000:]
    assert f"{first}, where the supervisor runs, cannot reach {fold(others)} over ssh" in res.stderr
    assert f"corral ssh setup -c {sandbox.cluster_file}" in res.stderr
    assert res.stderr.count("cannot reach") == 1  # said once, not once by the node and again here
    run = re.search(r"run (\S+): torchrun", res.stderr).group(1)
    _forget(run)
    assert json.loads(corral("runs", "--json", cwd=work).stdout)["runs"][0]["status"] == "failed"
    assert_clean(sandbox, within=5)


@pytest.mark.sandbox
def test_detached_job_outlives_its_head_and_a_lost_node_is_named_and_torn_down(node_ssh, work: Path) -> None:
    sandbox = node_ssh
    victim = sandbox.nodes[2]
    run = detached(sandbox, work, "steps.py", "100000", "0.2")
    try:
        # Everything of corral's on this machine goes: processes, ssh masters.
        for pid in head_processes(run) + head_processes(os.environ["HOME"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        follow = subprocess.Popen(CORRAL + ["logs", run, "--follow", "--rank", "5", "--tail", "1"], cwd=work,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        steps = []
        assert follow.stdout is not None
        for line in follow.stdout:
            steps += [int(m) for m in re.findall(r"step (\d+) rank 5", line)]
            if len(steps) >= 3:
                break
        follow.kill()
        assert steps == sorted(steps) and steps[-1] > steps[0], steps  # the job went on
        sandbox.partition(victim)
        t0 = time.monotonic()
        rec = wait_failed(work, run, within=30)
        assert rec["status"] == "failed" and victim in rec["failure"]["description"], rec
        others = [n for n in sandbox.nodes if n != victim]
        assert_clean(sandbox, within=max(1.0, 15 + 5 - (time.monotonic() - t0)), nodes=others)
        # the logs of the node that is down: kept on node 0, where the supervisor wrote them
        logs = corral("logs", run, "--tail", "1", cwd=work)
        assert logs.returncode == 0, logs.stderr
        assert f"[{victim}/r4] step" in logs.stdout and f"[{sandbox.nodes[0]}/r0] step" in logs.stdout
        sandbox.heal(victim)
        job = ps(sandbox, work)[run]
        assert job["state"] == "failed" and victim in job["failure"], job
    finally:
        sandbox.heal(victim)
        _forget(run)
    assert_clean(sandbox, within=15)


@pytest.mark.sandbox
def test_supervisor_killed_is_said_and_the_nodes_clean_up(node_ssh, work: Path) -> None:
    sandbox = node_ssh
    run = detached(sandbox, work, "steps.py", "100000", "0.2")
    try:
        sandbox.exec(sandbox.nodes[0], ["kill", "-9", str(supervisor_pid(sandbox, run))], check=True)
        assert_clean(sandbox, within=15)
        assert ps(sandbox, work)[run]["state"] == "died"
        res = corral("attach", run, cwd=work)
        assert res.returncode == 3, res.stderr
        assert "supervisor is gone without recording an end (killed)" in res.stderr
        assert "step" in res.stdout  # its last lines
    finally:
        _forget(run)


@pytest.mark.sandbox
def test_supervisors_node_lost_the_others_stop_and_its_logs_are_named(node_ssh, work: Path) -> None:
    sandbox = node_ssh
    first = sandbox.nodes[0]
    run = detached(sandbox, work, "steps.py", "100000", "0.2")
    try:
        deadline = time.monotonic() + 60
        while "step 0 rank 3" not in corral("logs", run, "--rank", "3", cwd=work).stdout:
            assert time.monotonic() < deadline, "rank 3 printed nothing within 60 s"
            time.sleep(0.5)
        assert corral("logs", run, "--sync", cwd=work).returncode == 0  # holds rank 3's step 0
        sandbox.partition(first)
        logs = subprocess.Popen(CORRAL + ["logs", run, "--rank", "3"], cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert_clean(sandbox, within=20, nodes=sandbox.nodes[1:])
        out, err = logs.communicate(timeout=60)
        res = subprocess.CompletedProcess(logs.args, logs.returncode, out, err)
        assert res.returncode == 3, res.stderr
        assert f"{first}, where run {run}'s supervisor and logs are, cannot be reached" in res.stderr
        assert "step 0 rank 3" in res.stdout  # the copy an earlier --sync made
    finally:
        sandbox.heal(first)
        _forget(run)
    assert_clean(sandbox, within=20)  # and node 1's supervisor tore down its own share


#: Runs until a file "release" appears in the work dir (rank 0 decides for every rank).
SHARED = """
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    while True:
        t = torch.tensor([1.0 if dist.get_rank() == 0 and os.path.exists("release") else 0.0])
        dist.all_reduce(t)
        if t.item():
            break
        time.sleep(0.2)
    print("finished", dist.get_rank(), flush=True)
"""


def _procs_of(sandbox, script: str) -> dict[str, int]:
    return {n: sum(script in line for line in leftovers(sandbox, n)) for n in sandbox.nodes}


@pytest.mark.sandbox
def test_two_detached_jobs_on_gpu_subsets_and_corral_stop_of_one(node_ssh, work: Path) -> None:
    """Two detached jobs on the same 4 nodes, GPUs 0,1 and 2,3 (CUDA_VISIBLE_DEVICES
    on CPU nodes): `corral ps` lists both with their GPUs and their own ports;
    `corral stop` of one leaves the other running on every node, to its end."""
    sandbox = node_ssh
    for name in ("share_a.py", "share_b.py"):
        (work / name).write_text(textwrap.dedent(SHARED))
    a = detached(sandbox, work, "--gpus", "0,1", "share_a.py")
    runs, ended = [a], set()
    try:
        b = detached(sandbox, work, "--gpus", "2-3", "share_b.py")
        runs.append(b)
        jobs = ps(sandbox, work)
        for run, gpus in ((a, ["0", "1"]), (b, ["2", "3"])):
            job = jobs[run]
            assert job["state"] == "running" and job["launcher"] == "torchrun" and job["user"], job
            assert job["nodes"] == sandbox.nodes and job["gpus"] == {n: gpus for n in sandbox.nodes}, job
            assert len(job["ports"]) == 1, job
        assert jobs[a]["ports"] != jobs[b]["ports"]
        res = corral("stop", b, cwd=work)
        assert res.returncode == 130 and f"run {b} interrupted" in res.stderr, res.stderr[-3000:]
        ended.add(b)
        assert not any(_procs_of(sandbox, "share_b.py").values()), "job b left processes"
        alive = _procs_of(sandbox, "share_a.py")
        assert all(n >= 2 for n in alive.values()), f"job a lost processes: {alive}"
        (work / "release").touch()
        assert wait_failed(work, a, within=60)["status"] == "succeeded"
        ended.add(a)
    finally:
        for run in runs:
            if run not in ended:  # the test failed midway
                corral("stop", run, cwd=work)
            _forget(run)
    assert_clean(sandbox, within=15)


def test_the_job_document_carries_every_field_of_the_spec_options_and_cluster() -> None:
    # The supervisor failed to start once a field was added that the codec
    # written by hand did not know (a nested RecoveryOptions, .deepspeed_env's
    # parsed values, GPU subsets): every field now travels by its type.
    from pathlib import Path

    from corral.interop.dsenv import DsEnv, DsValue
    from corral.run.jobcodec import from_json, to_json
    from corral.run.options import RunOptions
    from corral.run.plan import RunSpec
    from corral.run.recovery import RecoveryOptions

    cluster = Cluster(hosts=(Host(name="gpu1", gpus=(0, 1)), Host(name="gpu2", spare=True)), env={"A": "1"})
    spec = RunSpec(program="train.py", args=("--x", "1"), env={"B": "2"}, gpus=(2, 3), launcher="deepspeed",
                   ds_env=DsEnv(files=("./.deepspeed_env",),
                                values=(DsValue(name="P", raw="$P:/x", parts=(("var", "P"), ("lit", ":/x")),
                                                source="./.deepspeed_env:1"),)))
    options = RunOptions(runs_dir=Path("/r"), shown_ranks=frozenset({0, 3}),
                         recovery=RecoveryOptions(min_nodes=3, checkpoint_dir="/ck"))
    for obj, cls in ((cluster, Cluster), (spec, RunSpec), (options, RunOptions)):
        assert from_json(cls, json.loads(json.dumps(to_json(obj)))) == obj
    with pytest.raises(ValueError, match="unknown field"):
        from_json(RunOptions, {**to_json(options), "from_the_future": 1})


# ---------------------------------------------------------------------------
# a detached job's logs travel in batches of lines


def test_a_nodes_log_lines_go_in_batches_and_come_back_one_by_one(capsys) -> None:
    from corral.agent import jobs
    from corral.run.detach import _event, _lines

    lines = [f"step {i}" for i in range(2500)] + ["x" * 70000, "after"]
    jobs.emit_lines(lines, h="gpu1", r=3)
    raw = capsys.readouterr().out.splitlines()
    # 1,024 lines a batch, a line longer than a batch's characters alone
    assert [len(json.loads(r)["t"]) for r in raw] == [1024, 1024, 452, 1, 1]
    events = [e for r in raw for e in _lines(_event(r.encode()))]
    assert [e["t"] for e in events] == lines
    assert all(e == {"ev": "line", "h": "gpu1", "r": 3, "t": e["t"]} for e in events)
    jobs.emit_lines([])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("bad", [
    {"ev": "lines", "t": "one string"},
    {"ev": "lines", "t": ["ok", 3]},
    {"ev": "lines", "t": ["x"] * 5000},
    {"ev": "lines"},
])
def test_a_malformed_batch_from_a_node_is_dropped_whole(bad) -> None:
    from corral.run.detach import _event

    assert _event(json.dumps(bad).encode()) is None


def test_a_batch_is_printed_cleaned_line_by_line_with_its_label(capsys) -> None:
    from corral.cli.detached import print_lines

    # an OSC string left open (a window title) must not swallow the lines after it
    print_lines(["step 1 \x1b]0;pwned", "step 2 \x1b[31mred\x1b[0m", "step 3"], "[gpu1/r0] ")
    assert capsys.readouterr().out == "[gpu1/r0] step 1 \n[gpu1/r0] step 2 \x1b[31mred\x1b[0m\n[gpu1/r0] step 3\n"
    print_lines(["plain", "lines"])
    assert capsys.readouterr().out == "plain\nlines\n"
