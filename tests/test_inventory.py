"""Inventory readers: hostfiles, -H, corral.toml, Slurm, ssh -G, this machine."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
from conftest import REPO

from corral.errors import HostError, InventoryError, UsageError
from corral.inventory import (
    count_gpus,
    load_cluster,
    local_cluster,
    parse_hosts_arg,
    read_cluster_file,
    read_corral_toml,
    read_hostfile,
    read_slurm,
    resolve_ssh,
)
from corral.model import Cluster, Host

FIX = Path(__file__).parent / "fixtures" / "inventory"


def _summary(cluster: Cluster) -> list[tuple]:
    return [(h.name, h.slots, h.user, h.port) for h in cluster.hosts]


# ---------------------------------------------------------------- hostfiles


def test_deepspeed_hostfile() -> None:
    cluster = read_hostfile(FIX / "deepspeed_hostfile")
    assert _summary(cluster) == [("worker-1", 4, None, None), ("worker-2", 4, None, None)]
    assert cluster.source == f"hostfile {FIX / 'deepspeed_hostfile'}"
    assert cluster.path == str(FIX / "deepspeed_hostfile")


def test_openmpi_hostfile() -> None:
    cluster = read_hostfile(FIX / "openmpi_hostfile")
    assert _summary(cluster) == [
        ("node01", 8, None, None),
        ("node02", 8, None, None),
        ("node03", 4, "alice", None),
        ("node04", None, "bob", 2222),
        ("node05", None, None, None),
    ]


def test_hostfile_ranges_and_colon_slots() -> None:
    cluster = read_hostfile(FIX / "ranges_hostfile")
    assert cluster.names == [
        "gpu01", "gpu02", "gpu03", "gpu07",
        "rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2",
    ]
    assert [h.slots for h in cluster.hosts] == [8, 8, 8, 8, 2, 2, 2, 2]


def test_mpich_machinefile() -> None:
    assert _summary(read_hostfile(FIX / "mpich_machinefile")) == [
        ("host1", 4, None, None), ("host2", 4, None, None)
    ]


def test_localhost_in_a_hostfile_is_this_machine(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("localhost slots=2\n127.0.0.1 port=2222\n")
    local, container = read_hostfile(f).hosts
    assert local.local and not container.local  # an sshd on a port is reached by ssh


@pytest.mark.parametrize(
    ("fixture", "line", "words"),
    [
        ("bad_slots_zero", 2, "slots must be a positive integer, got '0'"),
        ("bad_slots_text", 2, "slots must be a positive integer, got 'eight'"),
        ("bad_duplicate", 5, "duplicate host 'gpu1' (first defined on line 2)"),
        ("bad_range_reversed", 2, "goes backwards"),
        ("bad_range_unclosed", 3, "never closed"),
        ("bad_range_letters", 1, "bad range 'a-b'"),
        ("bad_unknown_key", 2, "unknown hostfile key 'slot'"),
        ("bad_garbage", 1, "unexpected 'garbage'"),
        ("bad_max_slots", 1, "max_slots=4 is less than slots=8"),
        ("bad_slots_twice", 1, "slots given twice"),
        ("bad_name", 1, "is not a valid host name"),
    ],
)
def test_hostfile_errors_name_file_and_line(fixture: str, line: int, words: str) -> None:
    with pytest.raises(InventoryError) as info:
        read_hostfile(FIX / fixture, label=fixture)
    assert info.value.message.startswith(f"{fixture}:{line}: ")
    assert words in info.value.message
    assert (info.value.path, info.value.line) == (fixture, line)


def test_unknown_key_suggests_the_right_one() -> None:
    with pytest.raises(InventoryError) as info:
        read_hostfile(FIX / "bad_unknown_key")
    assert info.value.hint == "did you mean 'slots'?"


def test_empty_and_missing_hostfiles() -> None:
    with pytest.raises(InventoryError, match="bad_empty: hostfile lists no hosts"):
        read_hostfile(FIX / "bad_empty", label="bad_empty")
    with pytest.raises(InventoryError, match="nope: hostfile not found") as info:
        read_hostfile(FIX / "nope", label="nope")
    assert info.value.hint


# ---------------------------------------------------------------- -H


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h1:4,h2:4", [("h1", 4, None, None), ("h2", 4, None, None)]),
        ("h1,h2", [("h1", None, None, None), ("h2", None, None, None)]),
        ("node[1-2]:8", [("node1", 8, None, None), ("node2", 8, None, None)]),
        ("alice@gpu1:2,gpu2", [("gpu1", 2, "alice", None), ("gpu2", None, None, None)]),
        ("alice@gpu[1-2]", [("gpu1", None, "alice", None), ("gpu2", None, "alice", None)]),
    ],
)
def test_hosts_arg(text: str, expected: list[tuple]) -> None:
    cluster = parse_hosts_arg(text)
    assert _summary(cluster) == expected
    assert cluster.source == f"--hosts {text}"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("h1:0", "--hosts item 1: slots after ':' in 'h1:0' must be a positive integer"),
        ("h1:4,h2:x", "--hosts item 2: slots after ':'"),
        ("h1,,h2", "--hosts: item 2 is empty"),
        ("h1,h1:2", "duplicate host 'h1'"),
        ("node[2-1]:8", "--hosts item 1: malformed host range"),
        ("node[1-2:8", "--hosts: malformed host range"),
        ("fe80::1:4", "IPv6"),
        ("h1:2 h2:2", "hosts are separated by commas, not spaces"),
        ("@h1", "expected USER@HOST"),
        ("a@b@c", "expected USER@HOST"),
    ],
)
def test_hosts_arg_errors(text: str, words: str) -> None:
    with pytest.raises(InventoryError) as info:
        parse_hosts_arg(text)
    assert words in info.value.message


# ---------------------------------------------------------------- corral.toml


def test_corral_toml_full() -> None:
    cluster = read_corral_toml(FIX / "corral.toml")
    assert cluster.name == "lab"
    assert cluster.env == {"NCCL_DEBUG": "WARN"}
    assert cluster.workdir == "/srv/project"
    assert cluster.ssh_options == ("IdentityFile=~/.ssh/lab",)
    g1, g2, g3 = cluster.hosts
    assert g1 == Host(name="gpu01", port=22, user="ubuntu", slots=8, labels=("a100",),
                      python="/opt/venv/bin/python")
    assert g2.name == "gpu02"
    assert g3 == Host(
        name="gpu03", address="10.0.0.3", port=2222, user="root", slots=4,
        python="/usr/bin/python3", workdir="/data/proj", env={"NCCL_SOCKET_IFNAME": "eth0"},
        ssh_options=("StrictHostKeyChecking=accept-new",),
    )
    assert cluster.env_for(g3) == {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "eth0"}
    assert cluster.workdir_for(g1) == "/srv/project"


def test_corral_toml_with_hostfile_applies_cluster_defaults() -> None:
    cluster = read_corral_toml(FIX / "with_hostfile.toml")
    # the hostfile's slots=4 wins over [cluster] slots = 2; user comes from [cluster]
    assert _summary(cluster) == [("worker-1", 4, "ubuntu", None), ("worker-2", 4, "ubuntu", None)]


@pytest.mark.parametrize(
    ("fixture", "line", "words"),
    [
        ("bad_unknown_key.toml", 3, "unknown key 'pyhton' in [cluster]"),
        ("bad_unknown_host_key.toml", 6, "unknown key 'slot' in [[hosts]] #2"),
        ("bad_type.toml", 2, "[cluster] port must be an integer, got '22'"),
        ("bad_syntax.toml", 3, "invalid TOML"),
        ("bad_address_range.toml", 6, "address is only valid for a single host"),
        ("bad_hostfile_and_hosts.toml", 2, "cannot both be given"),
        ("bad_duplicate.toml", 5, "duplicate host 'gpu2' (first defined on line 2)"),
        ("bad_slots.toml", 3, "slots must be a positive integer, got 0"),
        ("bad_env.toml", 5, "env NCCL_IB_DISABLE must be a string"),
        ("bad_ssh_option.toml", 2, "'-i ~/.ssh/key' is not an ssh option"),
        ("bad_relative_workdir.toml", 6, "workdir 'srv/proj' is relative"),
    ],
)
def test_corral_toml_errors_name_file_and_line(fixture: str, line: int, words: str) -> None:
    with pytest.raises(InventoryError) as info:
        read_corral_toml(FIX / fixture, label=fixture)
    assert info.value.message.startswith(f"{fixture}:{line}: "), info.value.message
    assert words in info.value.message


def test_corral_toml_did_you_mean_and_no_hosts() -> None:
    with pytest.raises(InventoryError) as info:
        read_corral_toml(FIX / "bad_unknown_key.toml")
    assert info.value.hint == "did you mean 'python'?"
    with pytest.raises(InventoryError, match="no hosts"):
        read_corral_toml(FIX / "bad_no_hosts.toml")


def test_corral_toml_ssh_config_is_resolved_and_checked(tmp_path: Path) -> None:
    (tmp_path / "ssh_cfg").write_text("Host *\n  Port 2200\n")
    (tmp_path / "c.toml").write_text('[cluster]\nssh_config = "ssh_cfg"\n[[hosts]]\nname = "a"\n')
    assert read_corral_toml(tmp_path / "c.toml").ssh_config == str(tmp_path / "ssh_cfg")
    (tmp_path / "d.toml").write_text('[cluster]\nssh_config = "missing"\n[[hosts]]\nname = "a"\n')
    with pytest.raises(InventoryError, match=r"d.toml:2: ssh_config file 'missing' not found"):
        read_corral_toml(tmp_path / "d.toml", label="d.toml")


def test_cluster_file_is_sniffed_without_toml_suffix() -> None:
    assert read_cluster_file(FIX / "toml_without_suffix").source.startswith("cluster file")
    assert read_cluster_file(FIX / "openmpi_hostfile").source.startswith("hostfile")


@pytest.mark.parametrize("example", ["corral.toml", "hostfile"])
def test_shipped_examples_load(example: str) -> None:
    cluster = read_cluster_file(REPO / "examples" / example)
    assert len(cluster.hosts) >= 5


# ---------------------------------------------------------------- Slurm


def test_slurm_allocation() -> None:
    env = {
        "SLURM_JOB_NODELIST": "gpu-[01-03,05],cpu1",
        "SLURM_TASKS_PER_NODE": "1(x5)",
        "SLURM_GPUS_PER_NODE": "a100:4",
        "SLURM_JOB_ID": "4242",
    }
    cluster = read_slurm(env)
    assert cluster.names == ["gpu-01", "gpu-02", "gpu-03", "gpu-05", "cpu1"]
    assert [h.slots for h in cluster.hosts] == [4] * 5
    assert cluster.source == "Slurm allocation 4242"


def test_slurm_tasks_per_node_wins_when_several() -> None:
    env = {"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_TASKS_PER_NODE": "2(x3),1",
           "SLURM_GPUS_ON_NODE": "8"}
    assert [h.slots for h in read_slurm(env).hosts] == [2, 2, 2, 8]
    assert [h.slots for h in read_slurm({"SLURM_JOB_NODELIST": "n1"}).hosts] == [None]


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"},
         "SLURM_TASKS_PER_NODE: '2(x2)' describes 2 nodes but the node list has 3"),
        ({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(3)"}, "not N or N(xK)"),
        ({"SLURM_JOB_NODELIST": "n[3-1]"}, "SLURM_JOB_NODELIST: malformed host range"),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_PER_NODE": "a100:x"}, "SLURM_GPUS_PER_NODE"),
        ({}, "not inside a Slurm allocation"),
    ],
)
def test_slurm_errors(env: dict[str, str], words: str) -> None:
    with pytest.raises(InventoryError) as info:
        read_slurm(env)
    assert words in info.value.message


# ---------------------------------------------------------------- ssh -G


@pytest.fixture
def ssh_config(tmp_path: Path) -> Path:
    if shutil.which("ssh") is None:
        pytest.skip("needs the OpenSSH client")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(
        "Host gpu1\n  HostName 10.1.2.3\n  Port 2222\n  User alice\n"
        "Host gpu2\n  HostName gpu2.example.org\n"
        "Host *\n  User carol\n"
    )
    return cfg


def test_resolve_ssh_fills_from_ssh_config(ssh_config: Path) -> None:
    cluster = Cluster(hosts=(
        Host(name="gpu1"),
        Host(name="gpu2", port=2200),
        Host(name="gpu3", user="dave", address="192.168.0.3"),
        Host(name="me", local=True),
    ))
    resolved = resolve_ssh(cluster, ssh_config_file=str(ssh_config))
    g1, g2, g3, me = resolved.hosts
    assert (g1.address, g1.port, g1.user) == ("10.1.2.3", 2222, "alice")
    assert (g2.address, g2.port, g2.user) == ("gpu2.example.org", 2200, "carol")
    assert (g3.address, g3.port, g3.user) == ("192.168.0.3", 22, "dave")  # set values kept
    assert me == cluster.hosts[3]  # local hosts are never resolved


def test_resolve_ssh_uses_cluster_config_and_option_order(ssh_config: Path) -> None:
    cluster = Cluster(
        hosts=(Host(name="gpu1", ssh_options=("Port=3000",)), Host(name="gpu3")),
        ssh_config=str(ssh_config),
        ssh_options=("Port=4000",),
    )
    g1, g3 = resolve_ssh(cluster).hosts
    # ssh keeps the first value: the host's options beat the cluster's and ssh_config's
    assert g1.port == 3000 and g1.user == "alice"
    assert g3.port == 4000 and g3.user == "carol"


def test_resolve_ssh_reports_bad_options(ssh_config: Path) -> None:
    cluster = Cluster(hosts=(Host(name="gpu1"), Host(name="gpu2")),
                      ssh_options=("NoSuchOption=1",), path="lab.toml")
    with pytest.raises(InventoryError) as info:
        resolve_ssh(cluster, ssh_config_file=str(ssh_config))
    assert "lab.toml: ssh cannot read its configuration for 'gpu1'" in info.value.message
    assert "nosuchoption" in info.value.message.lower()
    assert "and 1 more host" in info.value.message
    assert "ssh -G" in (info.value.hint or "")


def test_resolve_ssh_without_ssh_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no ssh client here
    with pytest.raises(HostError, match="ssh client is not installed"):
        resolve_ssh(Cluster(hosts=(Host(name="gpu1"),)))
    local = local_cluster(gpus=None, detect=False)
    assert resolve_ssh(local) is local  # nothing to resolve, ssh not needed


# ---------------------------------------------------------------- this machine


def test_local_cluster_without_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    cluster = local_cluster()
    (host,) = cluster.hosts
    assert host == Host(name=socket.gethostname(), address="127.0.0.1", local=True, slots=2,
                        python=sys.executable)  # the interpreter running corral (its venv has torch)
    assert cluster.is_local
    assert "2 CPU processes, no GPU found" in cluster.source


def test_count_gpus_reads_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)'\n"
        "echo '  MIG 1g.10gb Device 0: (UUID: MIG-cccc)'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # conftest hides GPUs from tests not marked gpu
    assert count_gpus() == 2
    assert local_cluster().hosts[0].slots == 2
    assert "2 GPU process(es)" in local_cluster().source
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert count_gpus() is None


@pytest.mark.parametrize(("visible", "gpus"), [
    ("1", 1), ("0,3", 2), ("3,2,1,0", 4), ("0,2,-1,1", 2), ("", None), ("-1", None),
    ("GPU-aaaa,GPU-bbbb", 2), ("7", None), ("0,7,1", 1), ("nvidia0", None),
])
def test_local_gpus_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                visible: str, gpus: int | None) -> None:
    # `CUDA_VISIBLE_DEVICES=0,1 corral run` on a 4-GPU machine is 2 processes, as
    # `torchrun --nproc-per-node gpu` would start (it used to start 4: ranks 2-3
    # then failed with "invalid device ordinal").  CUDA stops at the first entry
    # that names no device.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(4)))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert count_gpus() == gpus
    cluster = local_cluster()
    assert cluster.hosts[0].slots == (gpus or 2)
    assert f"CUDA_VISIBLE_DEVICES={visible!r}" in cluster.source
    assert ("no GPU visible" in cluster.source) == (gpus is None)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no nvidia-smi: nothing to hide
    assert "2 CPU processes, no GPU found)" in local_cluster().source


# ---------------------------------------------------------------- precedence


def _load(tmp_path: Path, *, cluster: str | None = None, hosts: str | None = None,
          environ: dict[str, str] | None = None) -> tuple[Cluster, str]:
    return load_cluster(cluster=cluster, hosts=hosts, cwd=tmp_path, environ=environ or {})


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no nvidia-smi: a CPU-only machine
    (tmp_path / "hosts").write_text("fromfile slots=1\n")
    (tmp_path / "env_hosts").write_text("fromenv slots=1\n")
    slurm = {"SLURM_JOB_NODELIST": "slurm[1-2]", "SLURM_JOB_ID": "7"}

    cluster, note = _load(tmp_path)
    assert cluster.is_local and note.startswith("no cluster given; using this machine")
    assert "2 CPU processes, no GPU found" in note

    cluster, note = _load(tmp_path, environ=slurm)
    assert cluster.names == ["slurm1", "slurm2"]
    assert note == "cluster: 2 hosts slurm[1-2] from Slurm allocation 7"

    (tmp_path / "corral.toml").write_text('[[hosts]]\nname = "fromtoml[1-2]"\n')
    cluster, note = _load(tmp_path, environ=slurm)
    assert cluster.names == ["fromtoml1", "fromtoml2"]
    assert note == ("cluster: 2 hosts fromtoml[1-2] from cluster file corral.toml "
                    "(found in the current directory)")

    env = {**slurm, "CORRAL_CLUSTER": "env_hosts"}
    cluster, note = _load(tmp_path, environ=env)
    assert cluster.names == ["fromenv"] and "$CORRAL_CLUSTER" in note

    cluster, note = _load(tmp_path, cluster="hosts", environ=env)
    assert cluster.names == ["fromfile"]
    assert note == "cluster: 1 host fromfile from hostfile hosts"

    cluster, note = _load(tmp_path, hosts="h[1-3]:2", environ=env)
    assert cluster.names == ["h1", "h2", "h3"] and "--hosts" in note


def test_hosts_and_cluster_together_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="-H/--hosts and -c/--cluster"):
        _load(tmp_path, cluster="hosts", hosts="a,b")


# ---------------------------------------------------------------- names, sizes, odd files


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ('[[hosts]]\nname = "a"\naddress = "10.0.0.1\\nProxyCommand x"\n', "address '10.0.0.1\\nProxyCommand x' is not"),
        ('[[hosts]]\nname = "a"\naddress = "-oProxyCommand=x"\n', "address '-oProxyCommand=x' is not"),
        ('[[hosts]]\nname = "a"\naddress = "*"\n', "address '*' is not"),
        ('[cluster]\nuser = "root\\n"\n[[hosts]]\nname = "a"\n', "'root\\n' is not a valid user name"),
        ('[[hosts]]\nname = "a"\nuser = "-l"\n', "'-l' is not a valid user name"),
        ('[[hosts]]\nname = "a"\nssh_options = ["User=x\\nProxyCommand y"]\n', "is not an ssh option"),
        ('[[hosts]]\nname = "a"\nslots = 99999999999999999999\n', "slots must be at most 4096"),
        ('[[hosts]]\nname = "a"\n[hosts.env]\n"A\\n" = "1"\n', "is not a valid environment variable"),
    ],
)
def test_corral_toml_refuses_names_that_would_become_ssh_syntax(
    tmp_path: Path, toml: str, words: str
) -> None:
    (tmp_path / "c.toml").write_text(toml)
    with pytest.raises(InventoryError) as info:
        read_corral_toml(tmp_path / "c.toml", label="c.toml")
    assert words in info.value.message
    assert info.value.line is not None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("gpu1 slots=99999999999999999999999999\n", "slots must be at most 4096"),
        ("gpu1:5000\n", "must be at most 4096"),
        ("gpu1 cores=" + "9" * 5000 + "\n", "must be a positive integer"),
        ("x" * 1_000_000 + "\n", "(1000000 characters) is not a valid host name"),
        ("gpu..1\n", "is not a valid host name"),
        ("gpu-.lab\n", "is not a valid host name"),
        ("gpu1:2:3:4\n", "is not a valid host name"),
    ],
)
def test_hostfile_bounds_numbers_and_names(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "h").write_text(text)
    with pytest.raises(InventoryError) as info:
        read_hostfile(tmp_path / "h", label="h")
    assert words in info.value.message
    assert len(info.value.message) < 400  # a megabyte name is not echoed back


def test_more_hosts_than_a_range_may_hold_are_refused(tmp_path: Path) -> None:
    (tmp_path / "h").write_text("n[1-65536] slots=1\nlast slots=1\n")
    with pytest.raises(InventoryError, match="h:2: more than 65536 hosts"):
        read_hostfile(tmp_path / "h", label="h")
    with pytest.raises(InventoryError, match="more than 65536 hosts"):
        parse_hosts_arg("a[1-65536],b")
    assert len(read_hostfile(FIX / "ranges_hostfile").hosts) == 8


def test_ip_literals_and_plain_names_still_pass(tmp_path: Path) -> None:
    (tmp_path / "h").write_text("fe80::1%eth0 slots=1\n10.0.0.7:2\nmy_box.lab.example.com\n")
    assert read_hostfile(tmp_path / "h").names == ["fe80::1%eth0", "10.0.0.7", "my_box.lab.example.com"]


def test_devices_fifos_and_huge_files_are_refused_without_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes: reading it would wait forever
    for path, words in ((Path("/dev/zero"), "is a device"), (Path("/dev/urandom"), "is a device"),
                        (fifo, "is a FIFO")):
        with pytest.raises(InventoryError, match=words):
            read_cluster_file(path)
        with pytest.raises(InventoryError, match=words):
            read_corral_toml(path)
    big = tmp_path / "big"
    big.write_bytes(b"# padding\n" * (1 << 20))
    with pytest.raises(InventoryError, match="larger than 8 MiB"):
        read_hostfile(big)


def test_deeply_nested_toml_is_an_error_not_a_recursion_traceback(tmp_path: Path) -> None:
    (tmp_path / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(InventoryError, match="nested too deeply"):
        read_corral_toml(tmp_path / "deep.toml", label="deep.toml")


def test_a_toml_header_line_of_spaces_is_read_in_linear_time(tmp_path: Path) -> None:
    # "[" and thousands of spaces (valid TOML inside a multi-line string): the
    # old header pattern backtracked for minutes on it
    (tmp_path / "c.toml").write_text('x = """\n[' + " " * 5000 + 'x\n"""\n')
    with pytest.raises(InventoryError, match="unknown key 'x'"):
        read_corral_toml(tmp_path / "c.toml")


# ---------------------------------------------------------------- fuzzing the readers

_FUZZ_SEED = 20261127
_FUZZ_CASES = 300
#: Bytes a mutation splices in: the syntax of every format, and what breaks parsers.
_FUZZ_PIECES = [
    "[", "]", "[[", "]]", "\n", "\r", "\t", " ", ",", "-", "@", ":", "=", "#", '"', "'", "*", "%",
    "\x00", "\u00e9", "{", "}", ".", "$", "\\", "0", "9" * 30, "[1-99999]", "[0-65535]",
    "slots=", "port=", "user@", "[[hosts]]\nname = ", "[cluster]\n", "=[" * 300, "[" * 3000,
    "x" * 5000, " " * 4000, '"""', "\n[hosts.env]\nA = ", "address = ", "[1-2][1-2][1-2]",
]


def _mutate(rng, text: str) -> str:
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        at = rng.randint(0, len(text))
        op = rng.random()
        if op < 0.45:
            text = text[:at] + rng.choice(_FUZZ_PIECES) + text[at:]
        elif op < 0.65:
            text = text[:at] + text[at + rng.randint(1, 20):]
        elif op < 0.85 and text:
            start = rng.randint(0, len(text) - 1)
            piece = text[start:start + rng.randint(1, 200)]
            text = text[:at] + piece * rng.randint(1, 50) + text[at:]
        else:
            text = text[:at] + chr(rng.randint(0, 0x2FF)) + text[at:]
    return text


class _CaseTookTooLong(Exception):
    pass


@pytest.mark.timeout(240)
def test_fuzzed_hostfiles_toml_and_host_lists_give_a_cluster_or_a_corral_error(
    tmp_path: Path,
) -> None:
    """A few hundred mutated inputs, each read in-process: every outcome is a
    Cluster or a CorralError naming the input; no other exception, no hang
    (each case gets 10 s of wall clock, then the case is reported)."""
    import random
    import signal

    from corral.errors import CorralError

    rng = random.Random(_FUZZ_SEED)
    files = [p for p in sorted(FIX.iterdir()) if p.is_file()]
    for p in files:  # [cluster] hostfile = "deepspeed_hostfile" is found next to the case
        shutil.copy(p, tmp_path / p.name)
    seeds = {
        "hosts": ["gpu[01-04]:8,alice@gpu05", "h1:4,h2:4", "a[1-2]-b[3-4]", "10.0.0.1,n2:2"],
        "hostfile": [p.read_text() for p in files if p.suffix != ".toml"],
        "toml": [p.read_text() for p in files if p.suffix == ".toml"],
    }
    # Mostly valid files (bad_* fixtures fail before the mutation matters).
    for kind in ("hostfile", "toml"):
        good = [t for p, t in zip([p for p in files if (p.suffix == ".toml") == (kind == "toml")],
                                  seeds[kind]) if not p.name.startswith("bad_")]
        seeds[kind] += good * 4
    bad: list[str] = []
    outcomes = {"cluster": 0, "error": 0}

    def alarm(signum: int, frame: object) -> None:
        raise _CaseTookTooLong

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        for i in range(_FUZZ_CASES):
            kind = ("hosts", "hostfile", "toml")[i % 3]
            text = _mutate(rng, rng.choice(seeds[kind]))
            signal.setitimer(signal.ITIMER_REAL, 10.0)
            try:
                if kind == "hosts":
                    found = parse_hosts_arg(text)
                else:
                    path = tmp_path / f"case{i}{'.toml' if kind == 'toml' else ''}"
                    path.write_bytes(text.encode("utf-8", "surrogatepass"))
                    found = read_cluster_file(path)
                assert isinstance(found, Cluster) and 0 < len(found.hosts) <= 65536
                assert all(h.slots is None or 0 < h.slots <= 4096 for h in found.hosts)
                outcomes["cluster"] += 1
            except CorralError as err:
                outcomes["error"] += 1
                assert err.message
                continue
            except _CaseTookTooLong:
                bad.append(f"case {i} ({kind}) did not finish in 10 s: {text[:300]!r}")
            except Exception as err:  # noqa: BLE001 - the point of the test
                bad.append(f"case {i} ({kind}): {type(err).__name__}: {err} on {text[:300]!r}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert not bad, "\n".join(bad[:10])
    assert outcomes["cluster"] >= 20 and outcomes["error"] >= 100, outcomes  # both paths exercised


# ---------------------------------------------------------------- trust for ./corral.toml

_CLONED = """[cluster]
user = "ml"

[[hosts]]
name = "gpu1"
ssh_options = [
  "IdentityFile=~/.ssh/lab",
  "ProxyCommand=sh -c 'touch /tmp/owned'",
]
"""


def test_a_found_corral_toml_that_runs_commands_needs_trust_once(tmp_path: Path) -> None:
    from corral.inventory import trust

    (tmp_path / "corral.toml").write_text(_CLONED)
    with pytest.raises(UsageError) as info:
        load_cluster(cluster=None, hosts=None, cwd=tmp_path, environ={})
    message = info.value.message
    assert "corral.toml:8: \"ProxyCommand=sh -c 'touch /tmp/owned'\"," in message
    assert "ssh runs ProxyCommand on this machine" in message
    assert "IdentityFile" not in message
    assert "corral hosts --trust" in (info.value.hint or "")
    # named by the user: no question
    assert load_cluster(cluster="corral.toml", hosts=None, cwd=tmp_path, environ={})[0].names == ["gpu1"]
    assert load_cluster(cluster=None, hosts=None, cwd=tmp_path,
                        environ={"CORRAL_CLUSTER": "corral.toml"})[0].names == ["gpu1"]
    store = trust.trust(tmp_path / "corral.toml", (tmp_path / "corral.toml").read_bytes())
    assert store == Path.home() / ".config" / "corral" / "trusted"
    assert oct(store.stat().st_mode & 0o777) == "0o600"
    assert load_cluster(cluster=None, hosts=None, cwd=tmp_path, environ={})[0].names == ["gpu1"]
    (tmp_path / "corral.toml").write_text(_CLONED.replace("owned", "owned2"))  # edited: ask again
    with pytest.raises(UsageError, match="makes this machine run commands"):
        load_cluster(cluster=None, hosts=None, cwd=tmp_path, environ={})


@pytest.mark.parametrize(
    ("toml", "line", "why"),
    [
        ('[cluster]\nssh_options = ["LocalCommand=x", "PermitLocalCommand=yes"]\n[[hosts]]\nname = "a"\n',
         2, "ssh runs PermitLocalCommand"),
        ('[cluster]\nssh_options = ["KnownHostsCommand=/bin/x %H"]\n[[hosts]]\nname = "a"\n',
         2, "ssh runs KnownHostsCommand"),
        ('[cluster]\nssh_config = "cfg"\n[[hosts]]\nname = "a"\n', 2, "an ssh config file"),
        ('[[hosts]]\nname = "localhost"\npython = "./evil.sh"\n', 3, "localhost is this machine"),
    ],
)
def test_every_kind_of_command_line_is_quoted(tmp_path: Path, toml: str, line: int, why: str) -> None:
    (tmp_path / "cfg").write_text("Match exec \"touch /tmp/x\"\n")
    (tmp_path / "corral.toml").write_text(toml)
    with pytest.raises(UsageError) as info:
        load_cluster(cluster=None, hosts=None, cwd=tmp_path, environ={})
    assert f"corral.toml:{line}: " in info.value.message and why in info.value.message


def test_a_found_corral_toml_that_only_says_where_to_connect_needs_no_trust(tmp_path: Path) -> None:
    (tmp_path / "corral.toml").write_text(
        '[cluster]\nssh_options = ["IdentityFile=~/.ssh/lab", "ProxyJump=bastion"]\n'
        'python = "/opt/venv/bin/python"\n[[hosts]]\nname = "gpu[1-2]"\n'
        '[[hosts]]\nname = "localhost"\nport = 2222\n'
    )
    assert load_cluster(cluster=None, hosts=None, cwd=tmp_path, environ={})[0].names == [
        "gpu1", "gpu2", "localhost"]


def test_a_trust_store_that_is_a_symlink_or_shared_is_not_believed(tmp_path: Path) -> None:
    from corral.inventory import trust

    (tmp_path / "corral.toml").write_text(_CLONED)
    data = (tmp_path / "corral.toml").read_bytes()
    store = trust.store_path()
    store.parent.mkdir(parents=True)
    planted = tmp_path / "planted"
    planted.write_text(f"{trust.digest(data)} {(tmp_path / 'corral.toml').resolve()}\n")
    store.symlink_to(planted)
    assert not trust.is_trusted(tmp_path / "corral.toml", data)
    store.unlink()
    planted.chmod(0o666)
    os.replace(planted, store)
    assert not trust.is_trusted(tmp_path / "corral.toml", data)
    store.chmod(0o600)
    assert trust.is_trusted(tmp_path / "corral.toml", data)


def test_a_found_corral_toml_that_is_not_a_file_is_named_not_skipped(tmp_path: Path) -> None:
    """A directory (or a link to one) named corral.toml in the working directory
    was skipped in silence and the run went to this machine alone."""
    (tmp_path / "corral.toml").mkdir()
    with pytest.raises(InventoryError, match="is a directory, not a file"):
        _load(tmp_path)
    (tmp_path / "corral.toml").rmdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "corral.toml").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InventoryError, match="is a directory, not a file"):
        _load(tmp_path)


def test_a_hosts_gpus_in_the_cluster_file(tmp_path: Path) -> None:
    path = tmp_path / "corral.toml"
    path.write_text('[[hosts]]\nname = "gpu[1-2]"\ngpus = "0-3"\n\n[[hosts]]\nname = "gpu3"\ngpus = "4, 6"\n'
                    '\n[[hosts]]\nname = "gpu4"\n')
    assert [h.gpus for h in read_corral_toml(path).hosts] == [(0, 1, 2, 3), (0, 1, 2, 3), (4, 6), None]
    for bad, words in (("3-1", "counts down"), ("0,0", "GPU 0 is listed twice"), ("a", "not a GPU index"),
                       ("0-99999", "past the largest index")):
        path.write_text(f'[[hosts]]\nname = "gpu1"\n\n[[hosts]]\nname = "gpu2"\ngpus = "{bad}"\n')
        with pytest.raises(InventoryError) as info:
            read_corral_toml(path, label="corral.toml")
        assert info.value.message.startswith(f"corral.toml:6: gpus '{bad}': "), info.value.message
        assert words in info.value.message


def test_spare_hosts_are_read_and_checked(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[[hosts]]\nname = "gpu[1-3]"\n\n[[hosts]]\nname = "gpu4"\nspare = true\n')
    cluster = read_corral_toml(tmp_path / "c.toml")
    assert [h.name for h in cluster.spares] == ["gpu4"]
    assert cluster.without_spares().names == ["gpu1", "gpu2", "gpu3"] and len(cluster.hosts) == 4
    (tmp_path / "c.toml").write_text('[[hosts]]\nname = "gpu1"\nspare = "yes"\n')
    with pytest.raises(InventoryError, match=r"c.toml:3: .*spare must be true or false"):
        read_corral_toml(tmp_path / "c.toml", label="c.toml")
    (tmp_path / "c.toml").write_text('[[hosts]]\nname = "gpu[1-2]"\nspare = true\n')
    with pytest.raises(InventoryError, match=r"c.toml:3: every host is a spare"):
        read_corral_toml(tmp_path / "c.toml", label="c.toml")
