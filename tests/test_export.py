"""`corral export FORMAT`: each file, fed to its own tool, reaches or launches the same job.

Unit tests check the files against what corral itself would do (``ssh -G``
on the exported ssh_config against corral's own, the .deepspeed_env against
``build_plan``'s environment, accelerate's own config reader); sandbox tests
feed them to the real tools (ssh -F, pdsh -w, deepspeed --hostfile,
accelerate launch --config_file).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomlkit
from click.testing import CliRunner

from corral.cli import cli
from corral.export import FORMATS

CORRAL = [sys.executable, "-m", "corral"]


def export(*argv: str, cwd: Path | None = None, env: dict | None = None):
    return subprocess.run(CORRAL + ["export", *argv], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False, env=env)


def _ssh_g(*argv: str) -> dict[str, list[str]]:
    out = subprocess.run(["ssh", "-G", *argv], capture_output=True, text=True, check=True).stdout
    fields: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        fields.setdefault(key, []).append(value)
    return fields


@pytest.fixture
def cluster_toml(tmp_path: Path) -> Path:
    path = tmp_path / "corral.toml"
    path.write_text(
        '[cluster]\nuser = "alice"\nport = 2222\nslots = 2\n'
        f'ssh_options = ["IdentityFile={tmp_path}/id_key", "ProxyJump=bastion.example", '
        f'"UserKnownHostsFile={tmp_path}/known_hosts"]\n'
        'env = { FOO = "bar baz" }\n'
        '[[hosts]]\nname = "gpu1"\naddress = "10.0.0.1"\n'
        '[[hosts]]\nname = "gpu2"\naddress = "10.0.0.2"\nport = 2200\n')
    return path


def test_ssh_config_reaches_every_node_as_corral_does(cluster_toml: Path, tmp_path: Path) -> None:
    """`ssh -G -F exported NODE` says what corral's own ssh says: address,
    user, port, key, ProxyJump, known_hosts."""
    out = tmp_path / "out.ssh"
    res = export("ssh-config", "-c", str(cluster_toml), "-o", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for name, address, port in (("gpu1", "10.0.0.1", "2222"), ("gpu2", "10.0.0.2", "2200")):
        theirs = _ssh_g("-F", str(out), name)
        ours = _ssh_g("-F", "/dev/null", "-p", port, "-l", "alice", "-o", f"IdentityFile={tmp_path}/id_key",
                      "-o", "ProxyJump=bastion.example", "-o", f"UserKnownHostsFile={tmp_path}/known_hosts",
                      "-o", f"HostName={address}", name)
        for key in ("hostname", "user", "port", "identityfile", "proxyjump", "userknownhostsfile"):
            assert theirs[key] == ours[key], (name, key)
    assert f"ssh -F {out} gpu1 true" in res.stderr


def test_a_host_name_that_would_start_an_ssh_config_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\nssh_options = ["ProxyCommand=nc \\"x\\" %p"]\n[[hosts]]\nname = "gpu1"\n')
    res = export("ssh-config", "-c", str(path), cwd=tmp_path)
    assert res.returncode == 2 and "cannot write" in res.stderr and "Traceback" not in res.stderr


def test_deepspeed_env_is_exactly_what_corral_would_send(cluster_toml: Path, tmp_path: Path) -> None:
    from corral.inventory import load_cluster
    from corral.run.plan import NodeFacts, RunSpec, build_plan

    env = dict(os.environ, NCCL_DEBUG="INFO", HF_TOKEN="not-sent")
    res = export("deepspeed", "-c", str(cluster_toml), "-o", str(tmp_path / "ds"), "-e", "MARK=1",
                 "--json", "train.py", "--lr", "3", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "corral.export/1"
    modes = {f["name"]: f["mode"] for f in doc["files"]}
    assert modes == {"hostfile": "0644", ".deepspeed_env": "0600", "ssh_config": "0644"}
    assert oct((tmp_path / "ds").stat().st_mode & 0o777) == "0o700"
    assert (tmp_path / "ds" / "hostfile").read_text().splitlines()[1:] == ["gpu1 slots=2", "gpu2 slots=2"]
    written = dict(line.split("=", 1) for line in (tmp_path / "ds" / ".deepspeed_env").read_text().splitlines())
    cluster, _ = load_cluster(cluster=str(cluster_toml), hosts=None, cwd=tmp_path, environ=env)
    plan = build_plan(cluster, RunSpec(program="train.py", launcher="deepspeed", env={"MARK": "1"}),
                      {h.name: NodeFacts(gpus=2) for h in cluster.hosts}, master_addr="10.0.0.1",
                      master_port=29500, head_env=env, head_cwd=str(tmp_path))
    sent = {k: v for k, v in plan.nodes[0].env.items()
            if not k.startswith("CORRAL_") and k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES",
                                                         "WORLD_SIZE")}
    assert written == sent
    assert written["NCCL_DEBUG"] == "INFO" and written["FOO"] == "bar baz" and "HF_TOKEN" not in written
    [command] = doc["commands"]
    assert "--master_addr=10.0.0.1" in command and "'--launcher_args=-l alice'" in command
    assert command.endswith("train.py --lr 3")


def test_deepspeed_env_refuses_what_deepspeeds_runner_would_change(tmp_path: Path) -> None:
    """DeepSpeed's runner puts a value with a `$` in double quotes for the
    node's shell, which expands it: the job would get another value."""
    res = export("deepspeed", "-H", "a:1,b:1", "-e", "PATHS=$HOME/x", cwd=tmp_path)
    assert res.returncode == 2 and "PATHS=" in res.stderr and "unchanged" in res.stderr
    path = tmp_path / "c.toml"
    path.write_text('[[hosts]]\nname = "a"\nslots = 1\nenv = { NCCL_SOCKET_IFNAME = "eth0" }\n'
                    '[[hosts]]\nname = "b"\nslots = 1\nenv = { NCCL_SOCKET_IFNAME = "ib0" }\n')
    res = export("deepspeed", "-c", str(path), cwd=tmp_path)
    assert res.returncode == 2 and "NCCL_SOCKET_IFNAME differs between a and b" in res.stderr
    res = export("torchrun", "-c", str(path), "t.py", cwd=tmp_path)  # one line per node: fine
    assert res.returncode == 0 and "NCCL_SOCKET_IFNAME=eth0" in res.stdout and "NCCL_SOCKET_IFNAME=ib0" in res.stdout


def test_what_else_deepspeeds_runner_would_send_is_said(tmp_path: Path, isolated_env: Path) -> None:
    (isolated_env / ".deepspeed_env").write_text("HF_HOME=/data/hf\n")
    env = dict(os.environ, DS_ENV_FILE="custom.env")
    res = export("deepspeed", "-H", "a:1,b:1", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert "DS_ENV_FILE=custom.env is set here" in res.stderr
    assert f"also sends {isolated_env / '.deepspeed_env'}" in res.stderr


def test_files_are_never_overwritten_without_force_and_never_half_written(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    (out / "hostfile").write_text("mine\n")
    res = export("deepspeed", "-H", "a:1,b:1", "-o", str(out), cwd=tmp_path)
    assert res.returncode == 2 and "already there" in res.stderr and "--force" in res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["hostfile"]  # nothing else written either
    assert (out / "hostfile").read_text() == "mine\n"
    # --force replaces a link at the destination, never the file it points to
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (out / ".deepspeed_env").symlink_to(victim)
    res = export("deepspeed", "-H", "a:1,b:1", "-o", str(out), "--force", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "keep\n" and not (out / ".deepspeed_env").is_symlink()
    assert (out / "hostfile").read_text().endswith("a slots=1\nb slots=1\n")
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_accelerate_configs_load_in_accelerate_and_say_each_nodes_rank(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    res = export("accelerate", "-H", "gpu1:4,gpu2:4,gpu3:4", "--master-port", "29555", "-o", str(tmp_path / "a"),
                 "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "checked with the installed accelerate" in res.stderr
    for rank in range(3):
        config = load_config_from_file(str(tmp_path / "a" / f"accelerate-node{rank}.yaml"))
        assert (config.machine_rank, config.num_machines, config.num_processes) == (rank, 3, 12)
        assert (config.main_process_ip, config.main_process_port) == ("gpu1", 29555)


def test_mpirun_line_starts_one_torchrun_per_node_with_the_jobs_environment(tmp_path: Path) -> None:
    res = export("mpi", "-H", "a:2,b:2", "-o", str(tmp_path / "m"), "-e", "MARK=a b", "train.py", "--x", "1",
                 cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    script = tmp_path / "m" / "mpirun.sh"
    assert oct(script.stat().st_mode & 0o777) == "0o600"
    [line] = [ln for ln in script.read_text().splitlines() if ln.startswith("mpirun ")]
    words = shlex.split(line)
    assert words[words.index("-np") + 1] == "2" and words[words.index("--map-by") + 1] == "ppr:1:node"
    sent = [words[i + 1] for i, w in enumerate(words) if w == "-x"]
    assert "MARK=a b" in sent and not [w for w in sent if w.startswith(("CORRAL_", "MASTER_", "NODE_RANK"))]
    tail = words[words.index("torch.distributed.run") + 1:]
    assert tail[:3] == ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d"]
    assert "--rdzv-endpoint=a:29500" in tail and tail[-3:] == ["train.py", "--x", "1"]


def test_torchrun_lines_run_the_job_each_on_its_node(tmp_path: Path) -> None:
    """Each line of `corral export torchrun`, run as written (here two
    "nodes" of this machine, by two names): torchrun's own rendezvous joins
    them into one job with corral's ranks and the job's environment."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "c.toml").write_text(f'[cluster]\npython = "{sys.executable}"\nslots = 1\n'
                                     '[[hosts]]\nname = "127.0.0.1"\n[[hosts]]\nname = "localhost"\n')
    (tmp_path / "who.py").write_text('import os\ne = os.environ\nprint("who", e["RANK"], e["WORLD_SIZE"], '
                                     'e["GROUP_RANK"], e["MASTER_ADDR"], e.get("MARK"), flush=True)\n')
    res = export("torchrun", "-c", "c.toml", "--master-port", str(port), "-e", "MARK=a b", "-o", "t.sh", "who.py",
                 cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in (tmp_path / "t.sh").read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 2
    procs = [subprocess.Popen(["sh", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for line in lines]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=120))
        finally:
            proc.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    said = sorted(ln for out, _ in outs for ln in out.splitlines() if ln.startswith("who "))
    assert said == ["who 0 2 0 127.0.0.1 a b", "who 1 2 1 127.0.0.1 a b"], outs


def test_slots_unknown_is_named_not_guessed(tmp_path: Path) -> None:
    res = export("torchrun", "-H", "gpu1,gpu2", "train.py", cwd=tmp_path)
    assert res.returncode == 2 and "gpu1 has no slots" in res.stderr and "--nproc-per-node" in res.stderr


def test_pdsh_list_is_folded_and_one_user(tmp_path: Path) -> None:
    res = export("pdsh", "-H", "alice@gpu01,alice@gpu02,alice@gpu03", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["wlist"], doc["user"]) == ("gpu[01-03]", "alice")
    res = export("pdsh", "-H", "alice@gpu01,bob@gpu02", cwd=tmp_path)
    assert res.returncode == 2 and "one user" in res.stderr


def test_every_format_is_a_subcommand_with_help() -> None:
    for name in FORMATS:
        res = CliRunner().invoke(cli, ["export", name, "--help"])
        assert res.exit_code == 0 and "--output" in res.output, name
    res = CliRunner().invoke(cli, ["export", "torchrun", "-H", "a:1"])
    assert res.exit_code == 2 and "needs the job" in res.output


# ---------------------------------------------------------------------------
# with the real tools, on the sandbox


def _two_nodes(sandbox, tmp_path: Path) -> Path:
    """A cluster file of the sandbox's first two nodes, one process each."""
    doc = tomlkit.parse(sandbox.cluster_file.read_text())
    doc["cluster"]["slots"] = 1
    hosts = tomlkit.aot()
    for entry in list(doc["hosts"])[:2]:
        hosts.append(entry)
    doc["hosts"] = hosts
    path = tmp_path / "two.toml"
    path.write_text(tomlkit.dumps(doc))
    return path


@pytest.fixture
def shared_dir(request: pytest.FixtureRequest) -> Path:
    """A directory at the same path on the head and every node (the
    checkout's pytest cache is mounted through, as torch_extensions is)."""
    path = request.config.cache.mkdir("export-roundtrip") / f"{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


_GLOO_SCRIPT = (
    "import os, socket, torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t)\n"
    "print(f'rank {dist.get_rank()} on {socket.gethostname()} sum={int(t.item())} mark={os.environ.get(\"MARK\")}',\n"
    "      flush=True)\n"
    "dist.destroy_process_group()\n"
)


@pytest.mark.sandbox
def test_ssh_config_and_pdsh_list_reach_the_sandbox_nodes(sandbox, tmp_path: Path) -> None:
    out = tmp_path / "pdsh"
    res = export("pdsh", "-c", str(sandbox.cluster_file), "-o", str(out), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    first = sandbox.nodes[0]
    ssh = subprocess.run(["ssh", "-F", str(out / "ssh_config"), "-o", "BatchMode=yes", first, "hostname"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert ssh.returncode == 0 and ssh.stdout.strip() == first, ssh.stderr
    env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS_APPEND=doc["pdsh_ssh_args_append"])
    user = ["-l", doc["user"]] if doc["user"] else []
    pdsh = subprocess.run(["pdsh", *user, "-w", doc["wlist"], "hostname"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert pdsh.returncode == 0, pdsh.stderr
    assert sorted(pdsh.stdout.splitlines()) == [f"{n}: {n}" for n in sandbox.nodes]


@pytest.mark.sandbox
def test_exported_deepspeed_files_run_the_job_under_deepspeeds_own_runner(
        sandbox, tmp_path: Path, shared_dir: Path) -> None:
    """`corral export deepspeed`, then plain `deepspeed --hostfile` (pdsh over
    ssh, from this machine): every rank joins and gets .deepspeed_env's MARK."""
    pytest.importorskip("deepspeed")
    (shared_dir / "tiny.py").write_text(_GLOO_SCRIPT)
    cluster = _two_nodes(sandbox, tmp_path)
    res = export("deepspeed", "-c", str(cluster), "-o", str(shared_dir), "--force", "--json", "--cpu",
                 "--master-port", "29573", "-e", "MARK=ds", "-e", "DS_ACCELERATOR=cpu", "tiny.py", cwd=shared_dir)
    assert res.returncode == 0, res.stderr
    [command] = json.loads(res.stdout)["commands"]
    ds_bin = str(Path(sys.executable).with_name("deepspeed"))
    command = command.replace(" deepspeed ", f" DS_ACCELERATOR=cpu {shlex.quote(ds_bin)} ", 1)
    run = subprocess.run(["bash", "-c", command], cwd=shared_dir, capture_output=True, text=True, timeout=280,
                         check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("sum=3 mark=ds") == 2, run.stdout[-3000:]


@pytest.mark.sandbox
def test_exported_accelerate_configs_run_the_job_on_each_node(sandbox, tmp_path: Path, shared_dir: Path) -> None:
    """`corral export accelerate`, then each node's exported line (accelerate
    launch --config_file its own file), started over the exported ssh_config."""
    pytest.importorskip("accelerate")
    (shared_dir / "tiny.py").write_text(_GLOO_SCRIPT)
    cluster = _two_nodes(sandbox, tmp_path)
    ssh = export("ssh-config", "-c", str(cluster), "-o", str(tmp_path / "ssh_config"), cwd=tmp_path)
    assert ssh.returncode == 0, ssh.stderr
    res = export("accelerate", "-c", str(cluster), "-o", str(shared_dir / "acc"), "--cpu", "--json",
                 "--master-port", "29574", "-e", "MARK=acc", "tiny.py", cwd=shared_dir)
    assert res.returncode == 0, res.stderr
    lines = json.loads(res.stdout)["commands"]
    assert len(lines) == 2 and all("accelerate.commands.launch --config_file" in line for line in lines)
    procs = [subprocess.Popen(["ssh", "-F", str(tmp_path / "ssh_config"), "-o", "BatchMode=yes", node, line],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node, line in zip(sandbox.nodes, lines)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
        outs.append((proc.returncode, out, err))
    for rc, out, err in outs:
        assert rc == 0, out[-2000:] + err[-2000:]
    assert sum(out.count("sum=3 mark=acc") for _, out, _ in outs) == 2, outs
