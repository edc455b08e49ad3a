"""`corral doctor --fix-env`: the recommended environment lands where `corral run` reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.doctor.fixenv import write_env
from corral.errors import UsageError
from corral.inventory import load_cluster, parse_hosts_arg, read_cluster_file
from corral.model import Cluster, Host
from corral.run.plan import NodeFacts, RunSpec, build_plan

SAME = {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"}
TOML = """\
# our lab
[cluster]
user = "root"   # everyone logs in as root

[cluster.env]
NCCL_DEBUG = "WARN"
NCCL_IB_DISABLE = "1"

[[hosts]]
name = "gpu[1-3]"

[[hosts]]
name = "gpu4"
port = 2222
"""


def _env_of(path: Path) -> dict[str, dict[str, str]]:
    cluster = read_cluster_file(path)
    return {h.name: cluster.env_for(h) for h in cluster.hosts}


def test_one_value_for_every_host_goes_to_cluster_env(tmp_path: Path) -> None:
    path = tmp_path / "corral.toml"
    path.write_text(TOML)
    result = write_env(read_cluster_file(path), {f"gpu{i}": SAME for i in range(1, 5)}, cwd=tmp_path)
    assert (result.path, result.created, result.layout) == (path, False, "cluster")
    text = path.read_text()
    assert "# our lab" in text and "# everyone logs in as root" in text
    env = _env_of(path)
    assert env["gpu4"] == {"NCCL_DEBUG": "WARN", **SAME}
    assert result.changes == ("gpu[1-4]: GLOO_SOCKET_IFNAME=eth0 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=eth0",)


def test_different_interfaces_go_to_each_hosts_table(tmp_path: Path) -> None:
    path = tmp_path / "corral.toml"
    path.write_text(TOML)
    rec = {f"gpu{i}": SAME for i in range(1, 4)}
    rec["gpu4"] = {"NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "ens5"}  # it has InfiniBand
    result = write_env(read_cluster_file(path), rec, cwd=tmp_path)
    assert result.layout == "hosts"
    env = _env_of(path)
    assert env["gpu2"] == {"NCCL_DEBUG": "WARN", **SAME}
    # The stale cluster-wide NCCL_IB_DISABLE is gone: gpu4 has IB and must use it.
    assert env["gpu4"] == {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "ens5"}


def test_a_range_whose_hosts_differ_must_be_split(tmp_path: Path) -> None:
    path = tmp_path / "corral.toml"
    path.write_text(TOML)
    rec = {f"gpu{i}": SAME for i in range(1, 5)}
    rec["gpu2"] = {**SAME, "NCCL_SOCKET_IFNAME": "eno1"}
    before = path.read_text()
    with pytest.raises(UsageError) as err:
        write_env(read_cluster_file(path), rec, cwd=tmp_path)
    assert "[[hosts]] #1 (gpu[1-3])" in err.value.message and "split" in err.value.hint
    assert path.read_text() == before


def test_hostfile_gets_a_corral_toml_next_to_it(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    result = write_env(read_cluster_file(hostfile), {"node1": SAME, "node2": SAME}, cwd=tmp_path / "elsewhere")
    assert (result.path, result.created, result.layout) == (tmp_path / "corral.toml", True, "cluster")
    assert 'hostfile = "hosts"' in result.path.read_text()
    cluster = read_cluster_file(result.path)
    assert [h.slots for h in cluster.hosts] == [2, 2] and cluster.env_for(cluster.hosts[0]) == SAME
    with pytest.raises(UsageError) as err:  # never overwritten
        write_env(read_cluster_file(hostfile), {"node1": SAME, "node2": SAME}, cwd=tmp_path)
    assert "already exists" in err.value.message and "-c" in err.value.hint


def test_hostfile_with_per_host_values_becomes_hosts_tables(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nalice@node2:2\n")
    rec = {"node1": SAME, "node2": {**SAME, "NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "ens5"}}
    result = write_env(read_cluster_file(hostfile), rec, cwd=tmp_path)
    cluster = read_cluster_file(result.path)
    node2 = cluster.host("node2")
    assert (node2.user, node2.slots, cluster.env_for(node2)["NCCL_SOCKET_IFNAME"]) == ("alice", 2, "ens5")


def test_hosts_list_writes_corral_toml_in_the_current_directory(tmp_path: Path) -> None:
    cluster = parse_hosts_arg("a:1,b:1")
    result = write_env(cluster, {"a": SAME, "b": SAME}, cwd=tmp_path)
    assert result.path == tmp_path / "corral.toml"
    found, _ = load_cluster(cluster=None, hosts=None, cwd=tmp_path, environ={})
    assert found.env_for(found.host("b")) == SAME


def test_toml_with_a_hostfile_cannot_hold_per_host_values(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text("n1\nn2\n")
    path = tmp_path / "corral.toml"
    path.write_text('[cluster]\nhostfile = "hosts"\n')
    rec = {"n1": SAME, "n2": {**SAME, "NCCL_SOCKET_IFNAME": "ens5"}}
    with pytest.raises(UsageError) as err:
        write_env(read_cluster_file(path), rec, cwd=tmp_path)
    assert "[[hosts]]" in err.value.hint
    write_env(read_cluster_file(path), {"n1": SAME, "n2": SAME}, cwd=tmp_path)
    assert _env_of(path)["n2"] == SAME


def test_this_machine_has_no_file_to_write() -> None:
    local = Cluster(hosts=(Host(name="localhost", local=True),), source="this machine")
    with pytest.raises(UsageError) as err:
        write_env(local, {"localhost": SAME}, cwd=Path("/"))
    assert "corral run --env" in err.value.hint and "NCCL_SOCKET_IFNAME=eth0" in err.value.hint


def test_corral_run_plans_with_the_written_env(tmp_path: Path) -> None:
    path = tmp_path / "corral.toml"
    path.write_text(TOML)
    rec = {f"gpu{i}": SAME for i in range(1, 4)} | {"gpu4": {**SAME, "NCCL_SOCKET_IFNAME": "ens5",
                                                            "GLOO_SOCKET_IFNAME": "ens5"}}
    write_env(read_cluster_file(path), rec, cwd=tmp_path)
    cluster = read_cluster_file(path)
    plan = build_plan(cluster, RunSpec(program="train.py", nproc_per_node=1),
                      {h.name: NodeFacts() for h in cluster.hosts}, master_addr="10.0.0.1",
                      master_port=29500, head_env={}, head_cwd=str(tmp_path))
    assert [n.env["NCCL_SOCKET_IFNAME"] for n in plan.nodes] == ["eth0", "eth0", "eth0", "ens5"]
