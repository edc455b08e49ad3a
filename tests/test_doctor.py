"""`corral doctor` on a simulated cluster: a clean one passes, real faults are found.

The faults are made the way they happen on real machines, inside the nodes:
another Python environment on one node, a throttled link (tc), a docker0
bridge, a firewall rule (iptables), a missing authorized_keys line.  They
need a sandbox of their own (``lab``: 4 nodes with an SSH mesh between them),
so the session's shared sandbox is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomlkit

from corral.sandbox import Sandbox

pytestmark = pytest.mark.sandbox

ALT_ENV = "/srv/corral-alt-torch"
#: Another torch for one node, in a virtual environment of its own (node-private /srv).  The
#: environment sees the shared site-packages through a .pth, and shadows torch with a real
#: package directory (the shared torch's files, linked) whose version.py and dist-info say
#: 2.3.1+cpu: `import torch` and importlib.metadata both report it, as on a node that has it.
ALT_TORCH_SCRIPT = r"""
set -e
ALT={alt}
REAL=$({python} -c 'import os, torch; print(os.path.dirname(torch.__file__))')
{python} -m venv --without-pip "$ALT"
SITE=$("$ALT/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dirname "$REAL" > "$SITE/shared-env.pth"
mkdir "$SITE/torch" "$SITE/torch-2.3.1+cpu.dist-info"
for e in "$REAL"/*; do
  b=$(basename "$e")
  [ "$b" = version.py ] || [ "$b" = __pycache__ ] || ln -s "$e" "$SITE/torch/$b"
done
sed "s/^__version__ = .*/__version__ = '2.3.1+cpu'/" "$REAL/version.py" > "$SITE/torch/version.py"
printf 'Metadata-Version: 2.1\nName: torch\nVersion: 2.3.1+cpu\n' > "$SITE/torch-2.3.1+cpu.dist-info/METADATA"
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """4 nodes with keys for the head and an SSH mesh between them (every node trusts every node)."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root (network namespaces); CI runs as root")
    tag = f"d{os.getpid()}"
    sb = Sandbox(name=tag, prefix=f"{tag}n", state_dir=tmp_path_factory.mktemp("lab") / "state")
    try:
        sb.up(4, with_keys=True)
        _ssh_mesh(sb)
        yield sb
    finally:
        sb.down()


def _ssh_mesh(sb: Sandbox) -> None:
    keys = {}
    for n in sb.nodes:
        sb.exec(n, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", "/root/.ssh/id_ed25519"], check=True)
        keys[n] = sb.exec(n, ["cat", "/root/.ssh/id_ed25519.pub"], check=True).stdout.strip()
    known = "".join(
        f"{n},{sb.addresses[n]} {' '.join((sb.node_dir(n) / 'ssh_host_ed25519_key.pub').read_text().split()[:2])}\n"
        for n in sb.nodes)
    for n in sb.nodes:
        sb.exec(n, ["sh", "-c", "cat >> /root/.ssh/authorized_keys"], input="\n".join(keys.values()) + "\n",
                check=True)
        sb.exec(n, ["sh", "-c", "cat > /root/.ssh/known_hosts"], input=known, check=True)


def _doctor(cluster_file: Path, *args: str, cwd: Path | None = None) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "corral", "doctor", "-c", str(cluster_file), "--json", *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd, check=False)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _problems(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in report["findings"]:
        if f["severity"] != "ok":
            out.setdefault(f["check"], []).append(f)
    return out


def test_clean_lab_passes_with_exit_0_and_a_smoke_all_reduce(lab: Sandbox) -> None:
    code, report, stderr = _doctor(lab.cluster_file)
    assert code == 0, (stderr, _problems(report))
    assert report["errors"] == 0 and report["warnings"] == 0, _problems(report)
    smoke = report["evidence"]["smoke"]
    assert (smoke["status"], smoke["backend"], smoke["world_size"]) == ("ok", "gloo", 4)
    ssh = [f for f in report["findings"] if f["check"] == "connectivity.ssh"]
    assert [f["severity"] for f in ssh] == ["ok"]
    assert {h: e["NCCL_SOCKET_IFNAME"] for h, e in report["recommended_env"].items()} == \
        {n: "eth0" for n in lab.nodes}


def test_five_faults_are_found_and_attributed(lab: Sandbox, tmp_path: Path) -> None:
    n1, n2, n3, n4 = lab.nodes
    addr = lab.addresses
    firewall = ["INPUT", "-p", "tcp", "--syn", "-s", addr[n1], "!", "--dport", "22", "-j", "DROP"]
    key4 = lab.exec(n4, ["cat", "/root/.ssh/id_ed25519.pub"], check=True).stdout.strip()
    cluster_file = _with_python(lab.cluster_file, tmp_path, {n4: f"{ALT_ENV}/bin/python"})
    try:
        # n4: another torch, in its own virtual environment (the cluster file points at it)
        script = ALT_TORCH_SCRIPT.format(alt=ALT_ENV, python=sys.executable)
        lab.exec(n4, ["bash", "-c", script], check=True, timeout=120)
        # n3: its link throttled to a tenth of the others'
        lab.slow(n3, "20mbit")
        # n2: a docker0 bridge (same address docker gives it)
        docker0 = "ip link add docker0 type bridge && ip addr add 172.17.0.1/16 dev docker0"
        lab.exec(n2, ["sh", "-c", docker0 + " && ip link set docker0 up"], check=True)
        # n2's firewall drops new connections from n1, except ssh
        lab.exec(n2, ["iptables", "-I", *firewall], check=True)
        # n1 no longer trusts n4's key: the mesh misses the edge n4 -> n1
        drop = (f"grep -vF '{key4}' /root/.ssh/authorized_keys > /root/.ssh/ak; "
                "cat /root/.ssh/ak > /root/.ssh/authorized_keys; rm /root/.ssh/ak")
        lab.exec(n1, ["sh", "-c", drop], check=True)

        code, report, stderr = _doctor(cluster_file, "--no-smoke")
    finally:
        lab.exec(n1, ["sh", "-c", "cat >> /root/.ssh/authorized_keys"], input=key4 + "\n")
        lab.exec(n2, ["iptables", "-D", *firewall])
        lab.exec(n2, ["ip", "link", "del", "docker0"])
        lab.slow(n3, None)
        lab.exec(n4, ["rm", "-rf", ALT_ENV])

    assert code == 1, stderr
    problems = _problems(report)

    torch = [f for f in problems["software.versions"] if f["message"].startswith("torch differs")]
    assert [f["host_list"] for f in torch] == [[n4]]
    assert f"{n4}: torch 2.3.1+cpu" in torch[0]["message"] and "torch==2.13.0" in torch[0]["hint"]
    assert f"{ALT_ENV}/bin/python" in torch[0]["hint"]

    slow = [f for f in problems["connectivity.links"] if f["severity"] == "warning"]
    assert [f["host_list"] for f in slow] == [[n3]] and "slow" in slow[0]["message"]

    [decoy] = problems["network.decoy"]
    assert decoy["host_list"] == [n2] and "docker0 (172.17.0.1/16)" in decoy["message"]
    assert "NCCL_SOCKET_IFNAME=eth0" in decoy["hint"] and "--fix-env" in decoy["hint"]

    [port] = problems["connectivity.ports"]
    assert sorted(port["host_list"]) == sorted([n1, n2]) and port["message"].startswith(f"{n1} -> {n2}:")
    assert "timed out" in port["message"] and f"allow TCP from {n1} to {n2}" in port["hint"]

    [ssh] = problems["connectivity.ssh"]
    assert sorted(ssh["host_list"]) == sorted([n1, n4]) and ssh["message"].startswith(f"{n4} -> {n1}:")
    assert "permission-denied" in ssh["message"] and "authorized_keys" in ssh["hint"]

    # Nothing else is blamed: the blocked pair is not timed again by the link measurement.
    assert set(problems) == {"software.versions", "connectivity.links", "network.decoy",
                             "connectivity.ports", "connectivity.ssh"}, problems
    assert [f["severity"] for f in problems["connectivity.links"]] == ["warning"]


def test_fix_env_writes_per_host_interfaces_and_run_uses_them(lab: Sandbox, tmp_path: Path) -> None:
    """Interface names differ between nodes (n4 calls its NIC ens5): per-host env in [[hosts]]."""
    n4 = lab.nodes[3]
    cluster_file = tmp_path / "corral.toml"
    cluster_file.write_text(lab.cluster_file.read_text())
    rename = "ip link set eth0 down && ip link set eth0 name {0} && ip link set {0} up"
    lab.exec(n4, ["sh", "-c", rename.format("ens5")], check=True)
    try:
        code, report, stderr = _doctor(cluster_file, "--fix-env", "--no-smoke", "--no-links",
                                       "--no-ssh", "--no-torch")
    finally:
        lab.exec(n4, ["sh", "-c", "ip link set ens5 down && ip link set ens5 name eth0 && ip link set eth0 up"],
                 check=True)
    assert code == 0, (stderr, _problems(report))
    assert report["fix_env"]["layout"] == "hosts" and report["fix_env"]["path"] == str(cluster_file)
    doc = tomlkit.parse(cluster_file.read_text())
    assert "Written by `corral sandbox up`" in cluster_file.read_text()  # comments kept
    assert [str(h["env"]["NCCL_SOCKET_IFNAME"]) for h in doc["hosts"]] == ["eth0", "eth0", "eth0", "ens5"]

    proc = subprocess.run([sys.executable, "-m", "corral", "run", "-c", str(cluster_file), "--dry-run",
                           "--json", "train.py"], capture_output=True, text=True, timeout=60, check=True)
    plan = json.loads(proc.stdout)
    assert [(n["env"]["NCCL_SOCKET_IFNAME"], n["env"]["GLOO_SOCKET_IFNAME"], n["env"]["NCCL_IB_DISABLE"])
            for n in plan["nodes"]] == [("eth0", "eth0", "1")] * 3 + [("ens5", "ens5", "1")]


def _with_python(source: Path, tmp_path: Path, pythons: dict[str, str]) -> Path:
    doc = tomlkit.parse(source.read_text())
    for entry in doc["hosts"]:
        if str(entry["name"]) in pythons:
            entry["python"] = pythons[str(entry["name"])]
    out = tmp_path / "corral.toml"
    out.write_text(tomlkit.dumps(doc))
    return out


def test_smoke_test_names_the_link_that_fails(lab: Sandbox) -> None:
    """A firewall between two nodes that are not the rendezvous: the smoke test says which link.

    (`corral doctor` itself skips the smoke test once the port matrix has found
    the firewall; the library is called directly to see what the smoke test
    alone would report.)
    """
    import asyncio

    from corral.doctor.examine import DoctorOptions, examine
    from corral.doctor.smoke import smoke_test
    from corral.inventory import read_cluster_file

    _, n2, n3, _ = lab.nodes
    rules = {n2: ["INPUT", "-p", "tcp", "--syn", "-s", lab.addresses[n3], "!", "--dport", "22", "-j", "DROP"],
             n3: ["INPUT", "-p", "tcp", "--syn", "-s", lab.addresses[n2], "!", "--dport", "22", "-j", "DROP"]}
    cluster = read_cluster_file(lab.cluster_file)
    options = DoctorOptions(torch=False, links=False, ssh=False)
    report = asyncio.run(examine(cluster, options, head_env={}, head_cwd=os.getcwd()))
    try:
        for node, rule in rules.items():
            lab.exec(node, ["iptables", "-I", *rule], check=True)
        outcome = asyncio.run(smoke_test(cluster, report.evidence, head_env={}, head_cwd=os.getcwd(),
                                         timeout=90))
    finally:
        for node, rule in rules.items():
            lab.exec(node, ["iptables", "-D", *rule])
    kept = Path(outcome.log or "/nonexistent")
    while kept.name and not kept.name.startswith("corral-workload-"):
        kept = kept.parent
    if kept.name:
        shutil.rmtree(kept)  # the failed run's logs, kept for the user
    assert outcome.status == "failed" and outcome.log
    assert {outcome.host, *outcome.peers} == {n2, n3}
    assert f"cannot open a TCP connection to {n3 if outcome.host == n2 else n2}" in outcome.message


def test_doctor_with_no_node_reachable_exits_3(tmp_path: Path) -> None:
    # Every host refused (nothing listens on port 1): doctor exited 1, "errors
    # found", where the README's table (and docs/doctor.md) say 3: unreachable.
    from click.testing import CliRunner

    from corral.cli import cli

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 port=1\n127.0.0.2 port=1\n")
    res = CliRunner().invoke(cli, ["doctor", "-c", str(hostfile), "--no-smoke", "--json"])
    assert res.exit_code == 3, res.output
    report = json.loads(res.stdout)
    assert not report["ok"] and set(report["evidence"]["unreachable"]) == {"127.0.0.1", "127.0.0.2"}


def test_smoke_all_reduce_needs_no_numpy_on_the_node(tmp_path: Path) -> None:
    # torch's all_gather_object needs numpy: on a node without it the smoke
    # test failed with a bare "Numpy is not available".  The workload itself,
    # under torchrun, 2 ranks, with numpy hidden from every process.
    hidden = tmp_path / "no-numpy" / "numpy"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError('numpy is not installed on this node')\n")
    workload = Path(__file__).resolve().parents[1] / "src" / "corral" / "doctor" / "workloads" / "smoke_allreduce.py"
    env = {**os.environ, "PYTHONPATH": str(hidden.parent), "CORRAL_HOSTS": "here", "CORRAL_NODE_RANK": "0",
           "CORRAL_NODE_IPS": "127.0.0.1", "CORRAL_SMOKE_BACKEND": "gloo",
           "TMPDIR": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True, text=True)
    assert "numpy is not installed" in probe.stderr  # the node really has none
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(workload)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    [line] = [json.loads(l.split(" ", 1)[1]) for l in res.stdout.splitlines() if l.startswith("CORRAL_SMOKE {\"backend")]
    assert line["world_size"] == 2 and line["hosts"] == [os.uname().nodename] * 2


def test_large_clusters_test_each_node_against_a_few_peers_not_every_pair() -> None:
    """Every pair of 256 nodes is 65,280 connections (and as many ssh logins);
    each node tests node 0 and its peers at distances 1, 2, 4, ... instead."""
    from corral.doctor.examine import FULL_MESH_NODES, mesh_peers, mesh_words

    small = [f"n{i}" for i in range(4)]
    assert mesh_peers(small) == {a: [b for b in small if b != a] for a in small}
    names = [f"n{i}" for i in range(256)]
    peers = mesh_peers(names)
    assert all(a not in p and "n0" in p or a == "n0" for a, p in peers.items())
    assert max(len(p) for p in peers.values()) <= 17
    destinations = {b for p in peers.values() for b in p}
    assert destinations == set(names)  # every node is tested as a destination too
    assert sum(len(p) for p in peers.values()) < 256 * 17
    assert "every pair" in mesh_words(FULL_MESH_NODES)
    assert "65,280" in mesh_words(256) and "of its 255 peers" in mesh_words(256)
