"""Node-side facts and link probes, on this machine, through the real agent.

``corral.agent.facts`` and ``corral.agent.links`` run inside the agent on
every node; here they run inside a local agent (the same bootstrap and call
path as over ssh), so the schema the checks rely on is the one a node sends.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from pathlib import Path

import pytest

from corral.agent import facts as node_facts
from corral.agent import links as node_links
from corral.agent.session import AgentPool
from corral.model import Cluster, Host

TOP_KEYS = {
    "host", "hostname", "os", "kernel", "arch", "python", "packages", "driver", "cuda_driver",
    "gpus", "cuda_visible_devices", "interfaces", "infiniband", "shm_bytes", "disk_free_bytes",
    "workdir", "workdir_exists", "clock", "memlock", "env", "resolve", "errors",
}
PACKAGE_KEYS = {"torch", "torch_cuda", "nccl", "deepspeed", "accelerate", "transformers",
                "lightning", "numpy"}
KINDS = {"ethernet", "infiniband", "bridge", "veth", "docker", "loopback", "virtual", "other"}


def _local() -> Cluster:
    return Cluster(hosts=(Host(name="me", local=True, python=sys.executable),))


async def _call(fn: str, **args):
    pool = AgentPool(_local(), tag="test-facts")
    await pool.open()
    try:
        return await pool.sessions[0].call(fn, timeout=180, **args)
    finally:
        await pool.close()


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """facts.collect through a real local agent (torch imported in a child process)."""
    workdir = tmp_path_factory.mktemp("work")
    peers = [{"name": "localhost", "address": "127.0.0.1"}, {"name": "no-such-host.invalid"}]
    return asyncio.run(_call("facts.collect", workdir=str(workdir), peers=peers))


def test_collect_has_the_shared_schema(collected: dict) -> None:
    assert TOP_KEYS <= set(collected)
    assert set(collected["packages"]) >= PACKAGE_KEYS
    assert collected["python"]["path"] == sys.executable
    assert collected["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert collected["hostname"] == socket.gethostname()
    assert isinstance(collected["shm_bytes"], int) and collected["shm_bytes"] > 0
    assert isinstance(collected["disk_free_bytes"], int) and collected["workdir_exists"] is True
    assert isinstance(collected["gpus"], list) and isinstance(collected["infiniband"], list)
    assert isinstance(collected["errors"], list)
    assert collected["memlock"] == "unlimited" or isinstance(collected["memlock"], int)


def test_interfaces_are_typed_and_classified(collected: dict) -> None:
    ifaces = {i["name"]: i for i in collected["interfaces"]}
    assert ifaces["lo"]["kind"] == "loopback" and "127.0.0.1/8" in ifaces["lo"]["addresses"]
    for iface in ifaces.values():
        assert iface["kind"] in KINDS
        assert all("/" in a for a in iface["addresses"])
        assert iface["speed_mbps"] is None or iface["speed_mbps"] > 0
        assert isinstance(iface["up"], bool) and isinstance(iface["mtu"], int)


def test_torch_versions_come_from_the_import_and_metadata(collected: dict) -> None:
    import torch

    probe = collected["torch_import"]
    assert probe["ok"] and probe["version"] == torch.__version__
    assert collected["packages"]["torch"] == torch.__version__
    assert collected["packages"]["torch_cuda"] == torch.version.cuda
    assert probe["gloo_available"] is True


def test_names_resolve_and_routes_name_a_source(collected: dict) -> None:
    assert collected["resolve"]["localhost"] == ["127.0.0.1"]
    assert collected["resolve"]["no-such-host.invalid"] == []
    assert collected["routes"]["127.0.0.1"] == "127.0.0.1"


def test_env_reports_nccl_but_never_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("NCCL_API_KEY", "s3cret")
    monkeypatch.setenv("HOME_TOKEN_X", "no")
    env = node_facts._env()
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert "NCCL_API_KEY" not in env and "HOME_TOKEN_X" not in env


def test_a_broken_torch_is_a_fact_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch that raises on import (a real package directory on sys.path) is reported."""
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = node_facts._torch_import(60, [])
    assert probe["ok"] is False and "libcudart.so.12" in probe["error"]


@pytest.mark.parametrize(("name", "link_type", "info_kind", "bridge", "device", "kind"), [
    ("lo", "loopback", "", False, False, "loopback"),
    ("ib0", "infiniband", "ipoib", False, True, "infiniband"),
    ("docker0", "ether", "bridge", True, False, "docker"),
    ("br-3f2a9c1b7d4e", "ether", "bridge", True, False, "docker"),
    ("virbr0", "ether", "bridge", True, False, "bridge"),
    ("veth1a2b", "ether", "veth", False, False, "veth"),
    ("eth0", "ether", "veth", False, False, "veth"),  # a container's or sandbox node's NIC
    ("ens5", "ether", "", False, True, "ethernet"),
    ("bond0", "ether", "bond", False, False, "ethernet"),
    ("wg0", "none", "wireguard", False, False, "virtual"),
])
def test_interface_kind(name: str, link_type: str, info_kind: str, bridge: bool, device: bool,
                        kind: str) -> None:
    assert node_facts.interface_kind(name, link_type, info_kind, bridge, device) == kind


# ---------------------------------------------------------------------------
# links: the node side of the matrices


def test_listen_and_connect_classify_open_and_closed_ports() -> None:
    opened = node_links.listen(port=0, seconds=10)
    closed = node_links.free_port()
    try:
        out = node_links.connect([{"address": "127.0.0.1", "port": opened["port"]},
                                  {"address": "127.0.0.1", "port": closed}], wait=2)
    finally:
        assert node_links.unlisten(opened["port"])
    assert [t["result"] for t in out] == ["ok", "refused"]


def test_builtin_sender_measures_what_the_sink_received() -> None:
    sink = node_links.sink_start(omit=0.1, seconds=30)
    try:
        got = node_links.send("127.0.0.1", sink["port"], seconds=0.5, omit=0.1)
    finally:
        assert node_links.sink_stop(sink["port"])
    assert got["error"] is None and got["bps"] > 1e6 and got["bytes"] > 0


def test_sender_reports_a_refused_port() -> None:
    got = node_links.send("127.0.0.1", node_links.free_port(), seconds=0.2, omit=0)
    assert got["bps"] is None and got["error"] == "refused"


@pytest.mark.parametrize(("stderr", "kind"), [
    ("Host key verification failed.", "unknown-host-key"),
    ("root@10.0.0.3: Permission denied (publickey).", "permission-denied"),
    ("ssh: connect to host n3 port 22: Connection refused", "refused"),
    ("ssh: connect to host n3 port 22: Connection timed out", "timeout"),
    ("ssh: Could not resolve hostname n9: Name or service not known", "unresolved"),
    ("@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @", "changed-host-key"),
    ("ssh: connect to host n3 port 22: No route to host", "unreachable"),
    # the peer's sshd dropping logins beyond MaxStartups (sandbox, `MaxStartups 1`)
    ("Connection reset by 10.201.137.12 port 22", "closed"),
    ("Connection closed by 10.201.137.12 port 22", "closed"),
    ("kex_exchange_identification: read: Connection reset by peer", "closed"),
])
def test_ssh_failures_are_classified(stderr: str, kind: str) -> None:
    assert node_links.classify_ssh(stderr) == kind


def test_ssh_check_to_a_closed_port_is_refused() -> None:
    port = node_links.free_port()
    out = node_links.ssh_check([{"name": "127.0.0.1", "port": port, "user": None}], connect_timeout=3)
    assert out[0]["result"] == "refused", out


def test_scratch_files_are_written_and_removed_only_by_their_owner(tmp_path: Path) -> None:
    path = node_links.scratch_write({"smoke.py": "print(1)\n"})
    assert Path(path, "smoke.py").read_text() == "print(1)\n"
    assert node_links.scratch_remove(str(tmp_path)) is False and tmp_path.exists()
    assert node_links.scratch_remove(path) is True and not Path(path).exists()
    with pytest.raises(ValueError):
        node_links.scratch_write({"../evil": ""})


def test_probes_run_inside_the_real_agent() -> None:
    """The modules are shipped with the agent and answer through its call op."""
    async def main() -> tuple:
        pool = AgentPool(_local(), tag="test-links")
        await pool.open()
        try:
            s = pool.sessions[0]
            opened = await s.call("links.listen", port=0, seconds=10)
            res = await s.call("links.connect", targets=[{"address": "127.0.0.1", "port": opened["port"]}],
                               wait=2.0)
            await s.call("links.unlisten", port=opened["port"])
            clock = await s.call("facts.clock")
            return res, clock
        finally:
            await pool.close()

    res, clock = asyncio.run(main())
    assert res[0]["result"] == "ok" and isinstance(clock, float)


def test_a_listener_stops_by_itself() -> None:
    opened = node_links.listen(port=0, seconds=0.3)
    done = threading.Event()
    threading.Timer(1.0, done.set).start()
    done.wait()
    assert node_links.connect([{"address": "127.0.0.1", "port": opened["port"]}], wait=1)[0]["result"] == "refused"
    node_links.unlisten(opened["port"])


def test_tmp_fact_is_where_python_would_put_temporary_files(tmp_path, monkeypatch) -> None:
    from corral.agent import facts as node_facts

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    got = node_facts._tmp([])
    assert got["tmp_wanted"] == got["tmp_dir"] == str(tmp_path) and got["tmp_free_bytes"] > 0
    # A TMPDIR that cannot be used: Python moves on, and the fact says where.
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    got = node_facts._tmp([])
    assert got["tmp_wanted"] == str(tmp_path / "missing") and got["tmp_dir"] != got["tmp_wanted"]


def test_tmp_fact_follows_the_tmpdir_the_cluster_file_gives(tmp_path) -> None:
    from corral.agent import facts as node_facts

    got = node_facts._tmp([], str(tmp_path))
    assert got["tmp_wanted"] == got["tmp_dir"] == str(tmp_path) and got["tmp_free_bytes"] > 0
    got = node_facts._tmp([], str(tmp_path / "missing"))
    assert got["tmp_wanted"] == str(tmp_path / "missing") and not got["tmp_dir"].startswith("/")


def test_ssh_check_logs_in_a_few_at_a_time_in_the_given_order(tmp_path: Path, monkeypatch) -> None:
    # The mesh check must not hand every sshd N-1 logins at once (MaxStartups
    # drops them on >10 nodes).  A stand-in `ssh` on PATH records when each
    # login starts and ends; the first login to "n3" is dropped as sshd does
    # under MaxStartups, and is tried once more.
    log = tmp_path / "log"
    fake = tmp_path / "ssh"
    fake.write_text(f"""#!{sys.executable}
import os, sys, time
host = sys.argv[-3]
with open({str(log)!r}, "a") as f:
    f.write(f"start {{host}} {{time.monotonic()}}\\n")
time.sleep(0.3)
dropped = host == "n3" and not os.path.exists({str(tmp_path / "dropped")!r})
with open({str(log)!r}, "a") as f:
    f.write(f"end {{host}} {{time.monotonic()}}\\n")
if dropped:
    open({str(tmp_path / "dropped")!r}, "w").close()
    sys.stderr.write("kex_exchange_identification: Connection closed by remote host\\n")
    sys.exit(255)
print(sys.argv[-1])
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    targets = [{"name": f"n{i}"} for i in range(10)]
    out = node_links.ssh_check(targets, connect_timeout=5)
    assert [t["result"] for t in out] == ["ok"] * 10, out
    events = [line.split() for line in log.read_text().splitlines()]
    starts = [host for kind, host, _ in events if kind == "start"]
    assert set(starts[:4]) == {"n0", "n1", "n2", "n3"} and starts.count("n3") == 2  # the first four first
    running = peak = 0
    for kind, _, _ in sorted(events, key=lambda e: float(e[2])):
        running += 1 if kind == "start" else -1
        peak = max(peak, running)
    assert peak <= node_links.MESH_PARALLEL
