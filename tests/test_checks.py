"""The doctor's checks: pure functions over recorded facts.

``tests/fixtures/facts/sandbox-4-nodes.json`` is the evidence ``corral
doctor --json`` recorded on a clean 4-node sandbox; every fault here is that
recording with one thing changed (a torch version, an interface, a port
result...), so each test says exactly which fact makes which finding, and
checks that it names the right hosts and the right fix.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from corral import ui
from corral.doctor.checks import (
    ERROR,
    OK,
    WARNING,
    ClockSample,
    Evidence,
    Finding,
    LinkProbe,
    PortProbe,
    SmokeOutcome,
    SshProbe,
    choose_nics,
    recommend_env,
    run_checks,
)
from corral.doctor.checks.nics import nccl_default, nccl_matches
from corral.hostrange import HostSet

FIXTURES = Path(__file__).parent / "fixtures" / "facts"
NODES = ["node1", "node2", "node3", "node4"]


def recorded() -> dict:
    return json.loads((FIXTURES / "sandbox-4-nodes.json").read_text())


def evidence(data: dict | None = None, **changes) -> Evidence:
    data = data or recorded()
    data.update(changes)
    return Evidence.from_json(data)


def findings(ev: Evidence, check: str, severity: str | None = None) -> list[Finding]:
    return [f for f in run_checks(ev) if f.check == check and (severity is None or f.severity == severity)]


def one(ev: Evidence, check: str, severity: str) -> Finding:
    found = findings(ev, check, severity)
    assert len(found) == 1, [f.message for f in run_checks(ev) if f.check == check]
    return found[0]


def iface(facts: dict, name: str) -> dict:
    return next(i for i in facts["interfaces"] if i["name"] == name)


def gpu_node(data: dict, host: str, *, n: int = 8, name: str = "NVIDIA H100 80GB HBM3",
             driver: str = "550.54.15", cuda_driver: str = "12.4", torch_cuda: str = "12.1",
             nccl: str = "2.20.5") -> None:
    """Make a recorded CPU node look like a GPU node (a derived, not recorded, variant)."""
    f = data["facts"][host]
    f["gpus"] = [{"index": i, "name": name, "memory_mib": 81559, "uuid": f"GPU-{host}-{i}"} for i in range(n)]
    f["driver"], f["cuda_driver"] = driver, cuda_driver
    f["packages"].update(torch="2.4.0+cu121", torch_cuda=torch_cuda, nccl=nccl)
    f["torch_import"].update(version="2.4.0+cu121", cuda=torch_cuda, nccl=nccl, cuda_available=True,
                             device_count=n)


# ---------------------------------------------------------------------------
# the clean recording


def test_clean_sandbox_has_no_errors() -> None:
    ev = evidence()
    out = run_checks(ev)
    assert [f for f in out if f.severity == ERROR] == []
    # The sandbox has no SSH mesh between nodes: a warning, not an error.
    assert [f.check for f in out if f.severity == WARNING] == ["connectivity.ssh"]
    assert {f.hosts for f in out if f.severity == OK} == {HostSet.of(NODES)}
    assert one(ev, "smoke.allreduce", OK).message.startswith("all-reduce across 4 ranks with gloo")


def test_recommended_env_per_host() -> None:
    env = recommend_env(evidence())
    assert env == {h: {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"}
                   for h in NODES}


def test_evidence_round_trips_through_json() -> None:
    ev = evidence()
    again = Evidence.from_json(json.loads(json.dumps(ev.to_json())))
    assert again == ev


# ---------------------------------------------------------------------------
# software


def test_another_torch_on_one_node_is_attributed_to_it() -> None:
    data = recorded()
    f4 = data["facts"]["node4"]
    f4["packages"]["torch"] = f4["torch_import"]["version"] = "2.3.1+cpu"
    f4["python"]["path"] = "/srv/other-venv/bin/python"
    found = one(evidence(data), "software.versions", ERROR)
    assert found.hosts == HostSet.of(["node4"])
    assert found.message == "torch differs: node[1-3]: torch 2.13.0+cpu / node4: torch 2.3.1+cpu"
    assert "torch==2.13.0" in found.hint and "/srv/other-venv/bin/python" in found.hint


def test_a_missing_package_on_one_node() -> None:
    data = recorded()
    data["facts"]["node2"]["packages"]["deepspeed"] = None
    found = one(evidence(data), "software.versions", ERROR)
    assert found.hosts == HostSet.of(["node2"]) and "node2: deepspeed not installed" in found.message


def test_minor_packages_only_warn() -> None:
    data = recorded()
    data["facts"]["node3"]["packages"]["numpy"] = "1.26.4"
    found = one(evidence(data), "software.versions", WARNING)
    assert found.hosts == HostSet.of(["node3"]) and "numpy" in found.message


def test_python_minor_mismatch_is_an_error_patch_a_warning() -> None:
    data = recorded()
    data["facts"]["node1"]["python"]["version"] = "3.10.12"
    assert one(evidence(data), "software.python", ERROR).hosts == HostSet.of(["node1"])
    data = recorded()
    data["facts"]["node1"]["python"]["version"] = "3.11.4"
    assert one(evidence(data), "software.python", WARNING).hosts == HostSet.of(["node1"])


def test_even_split_blames_every_host() -> None:
    data = recorded()
    for h in ("node3", "node4"):
        data["facts"][h]["packages"]["torch"] = "2.3.1"
    found = one(evidence(data), "software.versions", ERROR)
    assert found.hosts == HostSet.of(NODES)


def test_torch_that_does_not_import() -> None:
    data = recorded()
    data["facts"]["node3"]["torch_import"] = {"ok": False, "error": "ImportError: libcudnn.so.9: cannot open"}
    found = one(evidence(data), "software.torch", ERROR)
    assert found.hosts == HostSet.of(["node3"]) and "libcudnn" in found.message
    assert "import torch" in found.hint


# ---------------------------------------------------------------------------
# GPUs (derived from the CPU recording)


def test_cpu_cluster_says_so() -> None:
    assert "no GPUs" in one(evidence(), "gpus.count", OK).message


def test_gpu_cluster_consistent() -> None:
    data = recorded()
    for h in NODES:
        gpu_node(data, h)
        data["slots"][h] = 8
    ev = evidence(data)
    assert [f for f in run_checks(ev) if f.family == "gpus" and f.severity != OK] == []
    assert one(ev, "gpus.nccl", OK).message == "NCCL 2.20.5"


def test_slots_above_visible_gpus() -> None:
    data = recorded()
    for h in NODES:
        gpu_node(data, h)
        data["slots"][h] = 8
    data["facts"]["node2"]["cuda_visible_devices"] = "0,1,2,3"
    found = one(evidence(data), "gpus.count", ERROR)
    assert found.hosts == HostSet.of(["node2"])
    assert "slots=8 but only 4 GPU(s)" in found.message and "CUDA_VISIBLE_DEVICES=0,1,2,3" in found.message


def test_mixed_gpu_models_and_node_without_gpus() -> None:
    data = recorded()
    for h in NODES[:3]:
        gpu_node(data, h)
    gpu_node(data, "node2", name="NVIDIA A100-SXM4-40GB")
    ev = evidence(data)
    assert one(ev, "gpus.models", WARNING).hosts == HostSet.of(["node2"])
    assert one(ev, "gpus.count", ERROR).hosts == HostSet.of(["node4"])


def test_driver_too_old_for_torch_cuda_build() -> None:
    data = recorded()
    for h in NODES:
        gpu_node(data, h)
    gpu_node(data, "node3", cuda_driver="11.8", driver="520.61.05")
    ev = evidence(data)
    found = [f for f in findings(ev, "gpus.driver") if f.severity == ERROR]
    assert [f.hosts for f in found] == [HostSet.of(["node3"])]
    assert "CUDA 12.1 but the driver supports CUDA 11.8" in found[0].message
    assert one(ev, "gpus.driver", WARNING).message.startswith("NVIDIA driver differs")


def test_cpu_torch_on_a_gpu_node() -> None:
    data = recorded()
    for h in NODES:
        gpu_node(data, h)
    data["facts"]["node1"]["packages"]["torch_cuda"] = None
    data["facts"]["node1"]["torch_import"]["cuda"] = None
    found = [f for f in findings(evidence(data), "gpus.driver", ERROR)]
    assert [f.hosts for f in found] == [HostSet.of(["node1"])] and "CPU-only" in found[0].message


def test_nccl_versions_differ() -> None:
    data = recorded()
    for h in NODES:
        gpu_node(data, h)
    gpu_node(data, "node4", nccl="2.18.1")
    found = one(evidence(data), "gpus.nccl", ERROR)
    assert found.hosts == HostSet.of(["node4"]) and "node4: NCCL 2.18.1" in found.message


# ---------------------------------------------------------------------------
# system


def test_clock_skew_names_the_late_node() -> None:
    data = recorded()
    data["clock"]["node3"]["offset_s"] = -4.2
    found = one(evidence(data), "system.clock", WARNING)
    assert found.hosts == HostSet.of(["node3"]) and "behind" in found.message and "chrony" in found.hint


def test_docker_default_shm() -> None:
    data = recorded()
    data["facts"]["node2"]["shm_bytes"] = 64 << 20
    found = one(evidence(data), "system.shm", WARNING)
    assert found.hosts == HostSet.of(["node2"]) and "64.0 MiB (docker's default)" in found.message
    assert "--shm-size" in found.hint
    gpu_node(data, "node2")
    assert one(evidence(data), "system.shm", ERROR).hosts == HostSet.of(["node2"])


def test_missing_workdir_and_low_disk() -> None:
    data = recorded()
    data["facts"]["node1"]["workdir_exists"] = False
    data["facts"]["node4"]["disk_free_bytes"] = 2 << 30
    ev = evidence(data)
    assert one(ev, "system.workdir", WARNING).hosts == HostSet.of(["node1"])
    assert one(ev, "system.disk", WARNING).hosts == HostSet.of(["node4"])


# ---------------------------------------------------------------------------
# network


def test_docker0_decoy_is_skipped_and_pinned_by_the_hint() -> None:
    data = recorded()
    data["facts"]["node2"]["interfaces"].append({
        "name": "docker0", "addresses": ["172.17.0.1/16"], "state": "down", "up": True,
        "carrier": False, "speed_mbps": None, "mtu": 1500, "kind": "docker", "driver": "bridge"})
    ev = evidence(data)
    assert choose_nics(ev)["node2"].interface == "eth0"
    found = one(ev, "network.decoy", WARNING)
    assert found.hosts == HostSet.of(["node2"]) and "docker0 (172.17.0.1/16)" in found.message
    assert "NCCL_SOCKET_IFNAME=eth0" in found.hint and "GLOO_SOCKET_IFNAME=eth0" in found.hint
    assert "--fix-env" in found.hint
    # Once the variables are set (e.g. by --fix-env), it is only noted.
    data["env"]["node2"].update(NCCL_SOCKET_IFNAME="eth0", GLOO_SOCKET_IFNAME="eth0")
    assert one(evidence(data), "network.decoy", OK).hosts == HostSet.of(["node2"])


def test_an_address_every_node_shares_is_never_chosen() -> None:
    """libvirt's virbr0 is 192.168.122.1 everywhere: it 'reaches' every peer by subnet, falsely."""
    data = recorded()
    for h in NODES:
        data["facts"][h]["interfaces"].insert(1, {
            "name": "virbr0", "addresses": ["192.168.122.1/24"], "state": "up", "up": True,
            "carrier": True, "speed_mbps": 10000, "mtu": 1500, "kind": "bridge", "driver": "bridge"})
    ev = evidence(data)
    assert {c.interface for c in choose_nics(ev).values()} == {"eth0"}
    assert one(ev, "network.decoy", WARNING).hosts == HostSet.of(NODES)


def test_interface_names_may_differ_between_nodes() -> None:
    data = recorded()
    iface(data["facts"]["node4"], "eth0")["name"] = "ens5"
    ev = evidence(data)
    assert choose_nics(ev)["node4"].interface == "ens5"
    assert recommend_env(ev)["node4"]["NCCL_SOCKET_IFNAME"] == "ens5"
    assert recommend_env(ev)["node1"]["NCCL_SOCKET_IFNAME"] == "eth0"


def test_faster_of_two_interfaces_wins_and_the_other_is_named() -> None:
    data = recorded()
    for i, h in enumerate(NODES, start=1):
        iface(data["facts"][h], "eth0")["speed_mbps"] = 1000
        data["facts"][h]["interfaces"].append({
            "name": "ens6", "addresses": [f"10.99.0.{i}/24"], "state": "up", "up": True, "carrier": True,
            "speed_mbps": 100000, "mtu": 9000, "kind": "ethernet", "driver": None})
    choice = choose_nics(evidence(data))["node1"]
    assert (choice.interface, choice.address, choice.alternatives) == ("ens6", "10.99.0.1", ("eth0",))
    assert "eth0 also reaches every peer" in one(evidence(data), "network.interface", OK).message


def test_routed_network_uses_the_route() -> None:
    """No shared subnet (one /32 per node, L3 fabric): the kernel's route decides."""
    data = recorded()
    for h in NODES:
        addr = iface(data["facts"][h], "eth0")["addresses"][0].split("/")[0]
        iface(data["facts"][h], "eth0")["addresses"][0] = addr + "/32"
    ev = evidence(data)
    choice = choose_nics(ev)["node1"]
    assert (choice.interface, choice.method) == ("eth0", "route")


def test_no_interface_reaches_every_peer() -> None:
    data = recorded()
    node4 = data["facts"]["node4"]
    iface(node4, "eth0")["addresses"] = ["10.77.0.4/24"]
    node4["routes"] = {}
    for h in NODES:
        data["facts"][h]["routes"] = {}
    data["addresses"] = {}
    found = [f for f in findings(evidence(data), "network.interface", ERROR)]
    assert HostSet.of(["node4"]) in [f.hosts for f in found]
    assert "no network interface reaches every other node" in found[0].message


def test_socket_ifname_that_matches_nothing_or_the_wrong_interface() -> None:
    data = recorded()
    data["env"]["node3"]["NCCL_SOCKET_IFNAME"] = "ib"
    data["env"]["node1"]["GLOO_SOCKET_IFNAME"] = "lo"
    out = findings(evidence(data), "network.env", ERROR)
    by_host = {str(f.hosts): f for f in out}
    assert "NCCL_SOCKET_IFNAME=ib matches no interface" in by_host["node3"].message
    assert "selects lo, not eth0" in by_host["node1"].message
    assert "GLOO_SOCKET_IFNAME=eth0" in by_host["node1"].hint


@pytest.mark.parametrize(("spec", "expected"), [
    ("eth", ["eth0", "eth1"]), ("=eth0", ["eth0"]), ("^docker,lo", ["eth0", "eth1", "ib0"]),
    ("^=eth1", ["lo", "docker0", "eth0", "ib0"]), ("ib,eth1", ["eth1", "ib0"]),
])
def test_nccl_socket_ifname_syntax(spec: str, expected: list[str]) -> None:
    assert nccl_matches(spec, ["lo", "docker0", "eth0", "eth1", "ib0"]) == expected


def test_nccl_default_prefers_ib_then_anything_but_docker_and_lo() -> None:
    facts = {"interfaces": [
        {"name": "lo", "addresses": ["127.0.0.1/8"]}, {"name": "docker0", "addresses": ["172.17.0.1/16"]},
        {"name": "eno1", "addresses": ["192.168.1.5/24"]}, {"name": "ib0", "addresses": ["10.1.0.5/16"]}]}
    assert nccl_default(facts) == "ib0"
    facts["interfaces"].pop()
    assert nccl_default(facts) == "eno1"


def test_hostname_resolving_to_loopback_breaks_gloo() -> None:
    # A warning, not an error (which skipped the smoke test): corral run sets
    # GLOO_SOCKET_IFNAME on such a node by itself; other launchers do not.
    data = recorded()
    data["facts"]["node2"]["resolve"]["node2"] = ["127.0.1.1"]
    ev = evidence(data)
    found = one(ev, "network.hostname", WARNING)
    assert found.hosts == HostSet.of(["node2"]) and "GLOO_SOCKET_IFNAME=eth0" in found.hint
    assert "`corral run` sets GLOO_SOCKET_IFNAME" in found.message
    # Said once: node2 naming itself 127.0.1.1 is not also "node2 resolves differently" (an error).
    assert [f.severity for f in findings(ev, "network.resolve")] == [OK]
    # Above its real line too: gloo takes the first address getaddrinfo gives.
    data["facts"]["node2"]["resolve"]["node2"] = ["10.204.62.12", "127.0.1.1"]
    data["facts"]["node2"]["hostname_addresses"] = ["127.0.1.1", "10.204.62.12"]
    ev = evidence(data)
    assert "resolves to 127.0.1.1 (loopback) first" in one(ev, "network.hostname", WARNING).message
    assert [f.severity for f in findings(ev, "network.resolve")] == [OK]
    data["facts"]["node2"]["hostname_addresses"] = ["10.204.62.12", "127.0.1.1"]
    assert findings(evidence(data), "network.hostname") == []
    data["env"]["node2"]["GLOO_SOCKET_IFNAME"] = "eth0"
    assert findings(evidence(data), "network.hostname") == []


def test_a_node_resolving_a_peer_elsewhere() -> None:
    data = recorded()
    data["facts"]["node3"]["resolve"]["node1"] = ["10.9.9.9"]
    found = one(evidence(data), "network.resolve", ERROR)
    assert found.hosts == HostSet.of(["node3"]) and "node1 resolves differently" in found.message


def _ib(facts: dict, state: str = "ACTIVE", rate: str = "200 Gb/sec (4X HDR)") -> None:
    facts["infiniband"] = [{"device": "mlx5_0", "port": 1, "state": state, "phys_state": "LinkUp",
                            "rate": rate, "link_layer": "InfiniBand", "netdevs": ["ib0"]}]


def test_infiniband_disabled_by_the_environment() -> None:
    data = recorded()
    for h in NODES:
        _ib(data["facts"][h])
    data["env"]["node1"]["NCCL_IB_DISABLE"] = "1"
    ev = evidence(data)
    found = one(ev, "network.ib", WARNING)
    assert found.hosts == HostSet.of(["node1"]) and "NCCL_IB_DISABLE=1" in found.message
    assert "NCCL_IB_DISABLE" not in recommend_env(ev)["node1"]


def test_infiniband_on_some_nodes_only_and_at_a_lower_rate() -> None:
    data = recorded()
    for h in NODES[:3]:
        _ib(data["facts"][h])
    _ib(data["facts"]["node2"], rate="100 Gb/sec (4X EDR)")
    ev = evidence(data)
    assert one(ev, "network.ib", ERROR).hosts == HostSet.of(["node4"])
    assert one(ev, "network.ib", WARNING).hosts == HostSet.of(["node2"])


def test_mtu_and_negotiated_speed_mismatch() -> None:
    data = recorded()
    iface(data["facts"]["node1"], "eth0")["mtu"] = 9000
    iface(data["facts"]["node4"], "eth0")["speed_mbps"] = 1000
    ev = evidence(data)
    assert one(ev, "network.mtu", WARNING).hosts == HostSet.of(["node1"])
    assert one(ev, "network.speed", WARNING).hosts == HostSet.of(["node4"])


# ---------------------------------------------------------------------------
# connectivity


def test_blocked_port_names_both_ends() -> None:
    data = recorded()
    for p in data["ports"]:
        if p["src"] == "node2" and p["dst"] == "node3":
            p["result"] = "timeout"
    found = one(evidence(data), "connectivity.ports", ERROR)
    assert found.hosts == HostSet.of(["node2", "node3"])
    assert found.message.startswith("node2 -> node3: TCP port") and "a firewall" in found.message
    assert "allow TCP from node2 to node3" in found.hint


def test_ssh_mesh_missing_one_edge() -> None:
    data = recorded()
    data["ssh"] = [{"src": s, "dst": d, "result": "ok", "detail": ""} for s in NODES for d in NODES]
    data["ssh"][1].update(result="permission-denied", detail="root@node2: Permission denied (publickey).")
    found = one(evidence(data), "connectivity.ssh", ERROR)
    assert found.hosts == HostSet.of(["node1", "node2"]) and found.message.startswith("node1 -> node2")
    assert "authorized_keys" in found.hint


def test_ssh_logins_dropped_by_the_peers_sshd_point_at_maxstartups() -> None:
    data = recorded()
    data["ssh"] = [{"src": s, "dst": d, "result": "ok", "detail": ""} for s in NODES for d in NODES]
    for p in data["ssh"]:
        if p["dst"] == "node2" and p["src"] in ("node1", "node3"):
            p.update(result="closed", detail="Connection reset by 10.0.0.12 port 22")
    found = one(evidence(data), "connectivity.ssh", ERROR)
    assert found.message.startswith("node[1,3] -> node2: ssh fails (closed)")
    assert "MaxStartups" in found.hint


def test_no_ssh_mesh_at_all_is_only_a_warning() -> None:
    found = one(evidence(), "connectivity.ssh", WARNING)
    assert "corral ssh setup" in found.hint


def test_slow_node_is_singled_out() -> None:
    data = recorded()
    for p in data["links"]:
        if "node3" in (p["src"], p["dst"]):
            p["bps"] = 2e7
    found = one(evidence(data), "connectivity.links", WARNING)
    assert found.hosts == HostSet.of(["node3"]) and "every link to and from it is slow" in found.message


def test_one_slow_link_between_healthy_nodes() -> None:
    probes = [LinkProbe(src=s, dst=d, address="x", bps=1e9) for s in NODES for d in NODES if s != d]
    probes[0] = LinkProbe(src="node1", dst="node2", address="x", bps=1e8)
    ev = Evidence(hosts=tuple(NODES), facts=recorded()["facts"], links=tuple(probes))
    found = one(ev, "connectivity.links", WARNING)
    assert found.hosts == HostSet.of(["node1", "node2"]) and found.message.startswith("node1 -> node2")


def test_two_nodes_cannot_blame_a_node() -> None:
    probes = (LinkProbe(src="a", dst="b", address="x", bps=1e7), LinkProbe(src="b", dst="a", address="x", bps=1e7))
    ev = Evidence(hosts=("a", "b"), facts={"a": {}, "b": {}}, links=probes)
    assert all(f.severity == OK for f in findings(ev, "connectivity.links"))


def test_unreachable_host_is_an_error_and_the_rest_is_checked() -> None:
    data = recorded()
    del data["facts"]["node4"]
    data["unreachable"] = {"node4": "ssh: connect to host 10.0.0.14 port 22: Connection timed out"}
    ev = evidence(data)
    found = one(ev, "connectivity.agent", ERROR)
    assert found.hosts == HostSet.of(["node4"]) and "timed out" in found.message
    assert one(ev, "software.python", OK).hosts == HostSet.of(NODES[:3])


def test_smoke_failure_names_node_and_peer() -> None:
    smoke = SmokeOutcome(status="failed", backend="gloo", host="node2", rank=1,
                         message="rank 1 on node2 exited with code 1", peers=("node3",), log="/tmp/x")
    found = one(dataclasses.replace(evidence(), smoke=smoke), "smoke.allreduce", ERROR)
    assert found.hosts == HostSet.of(["node2", "node3"]) and "failed on node2 rank 1 (the other end: node3)" in found.message


def test_nccl_over_sockets_despite_infiniband() -> None:
    data = recorded()
    for h in NODES:
        _ib(data["facts"][h])
    data["smoke"].update(backend="nccl", nccl_net="Socket")
    found = one(evidence(data), "smoke.allreduce", WARNING)
    assert found.hosts == HostSet.of(NODES) and "over TCP sockets" in found.message
    data["smoke"]["nccl_net"] = "IB"
    assert "(NCCL used IB)" in one(evidence(data), "smoke.allreduce", OK).message


def test_a_crashing_check_becomes_a_finding() -> None:
    def broken(ev: Evidence) -> list[Finding]:
        raise KeyError("gpus")

    out = run_checks(evidence(), checks=(broken,))
    assert [(f.severity, f.check) for f in out] == [(ERROR, "test_checks.broken")]
    assert "KeyError" in out[0].message


def test_measurement_records_are_plain_data() -> None:
    ev = Evidence(hosts=("a",), facts={}, clock={"a": ClockSample(offset_s=0.1, uncertainty_s=0.01)},
                  ports=(PortProbe(src="a", dst="a", address="1.2.3.4", port=1, result="ok"),),
                  ssh=(SshProbe(src="a", dst="a", result="ok"),))
    assert Evidence.from_json(json.loads(json.dumps(ev.to_json()))) == ev


# ---------------------------------------------------------------------------
# the human report


def _rendered(monkeypatch: pytest.MonkeyPatch, node4_torch: str) -> str:
    """doctor's human report of the recording, node4 reporting ``node4_torch``."""
    from corral.cli.doctor import render
    from corral.doctor.examine import DoctorReport
    from corral.model import Cluster, Host

    data = recorded()
    data["facts"]["node4"]["packages"]["torch"] = node4_torch
    ev = evidence(data)
    report = DoctorReport(cluster=Cluster(hosts=tuple(Host(name=h) for h in NODES)), evidence=ev,
                          findings=tuple(run_checks(ev)), recommended_env=recommend_env(ev))
    buf = io.StringIO()
    monkeypatch.setattr(ui, "_out", Console(file=buf, width=200, highlight=False))
    monkeypatch.setattr(ui, "console", lambda: ui._out)
    render(report)
    return buf.getvalue()


def test_report_groups_by_host_set_and_prints_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _rendered(monkeypatch, "2.3.1+cpu")
    assert "torch differs: node[1-3]: torch 2.13.0+cpu / node4: torch 2.3.1+cpu" in text
    assert "hint: install torch==2.13.0" in text
    assert "node[1-4]   GLOO_SOCKET_IFNAME=eth0 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=eth0" in text
    assert "1 error(s)" in text


def test_a_finding_quoting_a_node_reaches_the_terminal_without_its_controls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node reports its facts (here a torch version carrying an OSC 52
    clipboard write and an OSC 0 title): the finding that quotes it is shown
    without them (rich's escape() kept ESC)."""
    text = _rendered(monkeypatch, "2.3.1\x1b]52;c;ZXZpbA==\x07\x1b]0;pwned\x07")
    assert "node4: torch 2.3.1" in text, text
    assert "\x1b" not in text and "\x07" not in text, repr(text)


def test_findings_are_json_friendly() -> None:
    out = [f.to_json() for f in run_checks(evidence())]
    assert json.loads(json.dumps(out)) == out and out[0]["host_list"]


def test_copy_is_not_shared() -> None:
    """Every test edits its own copy of the recording."""
    a, b = recorded(), recorded()
    a["facts"]["node1"]["hostname"] = "changed"
    assert b["facts"]["node1"]["hostname"] == "node1" and copy.deepcopy(b) == b


def test_read_only_workdir_and_a_full_or_unusable_tmp() -> None:
    # Reproduced on the sandbox: f5n2's /srv/proj bind-mounted read-only; its
    # /tmp a full tmpfs, so Python (and corral's job directory) moved to
    # /var/tmp, and with that full too, to the login directory.
    data = recorded()
    for h in NODES:
        data["facts"][h].update(workdir_writable=True, tmp_wanted="/tmp", tmp_dir="/tmp",
                                tmp_free_bytes=50 << 30)
    data["facts"]["node2"]["workdir_writable"] = False
    data["facts"]["node3"].update(tmp_dir="/root", tmp_free_bytes=50 << 30)
    data["facts"]["node4"]["tmp_free_bytes"] = 8 << 10
    ev = evidence(data)
    ro = one(ev, "system.workdir", WARNING)
    assert ro.hosts == HostSet.of(["node2"]) and "not writable" in ro.message and "dmesg" in ro.hint
    tmp = findings(ev, "system.tmp", WARNING)
    assert [f.hosts for f in tmp] == [HostSet.of(["node3"]), HostSet.of(["node4"])]
    assert tmp[0].message == "/tmp is not writable (full, read-only or missing): Python falls back to /root"
    assert tmp[1].message.startswith("only 8.0 KiB free in /tmp") and "TMPDIR" in tmp[1].hint


def test_facts_recorded_before_tmp_and_writability_were_collected_find_nothing() -> None:
    ev = evidence()
    assert findings(ev, "system.tmp") == [] and not findings(ev, "system.workdir", WARNING)


def test_a_tmpdir_from_the_cluster_file_that_is_missing_is_named() -> None:
    data = recorded()
    for h in NODES:
        data["facts"][h].update(tmp_wanted="/tmp", tmp_dir="/tmp", tmp_free_bytes=50 << 30)
    data["facts"]["node2"].update(tmp_wanted="/scratch/tmp", tmp_dir="(nothing: it is missing or not writable)",
                                  tmp_free_bytes=None)
    found = one(evidence(data), "system.tmp", WARNING)
    assert found.hosts == HostSet.of(["node2"])
    assert found.message == "/scratch/tmp is not writable (full, read-only or missing): a job cannot start there"
    assert found.hint.startswith("create it there")


def test_a_login_shell_that_prints_is_named() -> None:
    # Reproduced on the sandbox: `echo Welcome to f5n2` at the top of the
    # node's ~/.bashrc; corral run still worked, `corral sync` failed.
    data = recorded()
    data["facts"]["node3"]["login_output"] = ["Welcome to node3"]
    found = one(evidence(data), "connectivity.login", WARNING)
    assert found.hosts == HostSet.of(["node3"]) and "'Welcome to node3'" in found.message
    assert "case $- in *i*)" in found.hint
    assert findings(evidence(), "connectivity.login") == []
    # The hint named bash's files on a node whose login shell is fish or tcsh.
    data["facts"]["node3"]["shell"] = "/usr/bin/fish"
    found = one(evidence(data), "connectivity.login", WARNING)
    assert "~/.config/fish/config.fish inside `if status is-interactive`" in found.hint and "bashrc" not in found.hint
    data["facts"]["node3"]["shell"] = "/bin/tcsh"
    assert "if ($?prompt) then" in one(evidence(data), "connectivity.login", WARNING).hint


def test_gpu_health_before_launch_names_the_node_to_drain_and_the_gpu_to_reset() -> None:
    health_dir = Path(__file__).parent / "fixtures" / "gpuhealth"
    data = recorded()
    facts = data["facts"]
    facts["node1"]["gpu_health"] = {
        "gpu": True, "xid": {"lines": (health_dir / "dmesg.txt").read_text().splitlines(), "error": None},
        "smi": {"text": (health_dir / "smi_q_a100.txt").read_text(), "error": None}, "ras": {"text": ""}}
    facts["node2"]["gpu_health"] = {
        "gpu": True, "xid": {"lines": [], "error": "journalctl -k: No journal files were opened due to insufficient "
                                                  "permissions.; dmesg: read kernel buffer failed: Operation not permitted"},
        "smi": {"text": "", "error": None}, "ras": {"text": ""}}
    facts["node3"]["gpu_health"] = {"gpu": True, "xid": {"lines": [], "error": None},
                                    "smi": {"text": "", "error": None}, "ras": {"text": ""}}
    ev = evidence(data)
    errors = findings(ev, "gpus.health", ERROR)
    assert [f.hosts for f in errors] == [HostSet.of(["node1"])] * 2  # the Xid 79 and the 154 that asks for a reboot
    assert "Xid 79 on PCI:0000:20:1c" in errors[0].message
    warnings = [f.message for f in findings(ev, "gpus.health", WARNING)]
    assert any("Xid 63" in m for m in warnings) and any("pending" in m for m in warnings)
    assert any("kernel log not read" in m and "Operation not permitted" in m for m in warnings)
    assert one(ev, "gpus.health", OK).hosts == HostSet.of(["node3"])  # node4: no GPU health (no nvidia-smi)
