"""The sandbox: a simulated multi-node cluster of namespaces with real sshd.

Pure helpers (names, rates, subnets, generated files) are tested without
root.  Everything marked ``sandbox`` builds real namespaces and talks to real
sshd; it checks the promises of docs/sandbox.md from the outside, with the
system's own tools (``ssh``, ``ip``, ``iperf3``), never through the sandbox's
own bookkeeping alone.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from corral.errors import SandboxError, UsageError
from corral.sandbox import Sandbox, files, netns, preflight, spec
from corral.sandbox.spec import SandboxSpec, UpRequest

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (network namespaces)")


def _spec(**kw) -> SandboxSpec:
    base = {"name": "unit", "prefix": "node", "nodes": 3, "subnet": "10.200.7.0/24"}
    base.update(kw)
    return SandboxSpec(**base)


# ---------------------------------------------------------------------------
# pure parts


@pytest.mark.parametrize(
    ("text", "bps"),
    [("200mbit", 200_000_000), ("1gbit", 10**9), ("1.5Gbit", 1_500_000_000), ("64kbit", 64_000)],
)
def test_parse_rate(text: str, bps: int) -> None:
    assert spec.parse_rate(text) == bps
    assert spec.parse_rate(spec.format_rate(bps)) == bps


@pytest.mark.parametrize("text", ["100mbps", "fast", "10", "-5mbit", "1bit"])
def test_parse_rate_rejects_ambiguous_or_bad_units(text: str) -> None:
    with pytest.raises(UsageError) as err:
        spec.parse_rate(text)
    assert text in err.value.message


@pytest.mark.parametrize("name", ["Upper", "has_underscore", "-lead", "x" * 40, ""])
def test_bad_sandbox_names_are_refused(name: str) -> None:
    with pytest.raises(UsageError):
        spec.check_name(name)


def test_interface_names_fit_linux_limit() -> None:
    sp = _spec(name="a-very-long-sandbox-name-here", nodes=spec.MAX_NODES)
    last = sp.node(spec.MAX_NODES)
    for ifname in (sp.bridge, sp.fast_bridge, last.veth, last.fast_veth):
        assert len(ifname) <= 15, ifname
    assert spec.tag_for("a") != spec.tag_for("b")


def test_addresses_are_readable_and_distinct() -> None:
    sp = _spec()
    assert sp.head_address() == "10.200.7.1"
    assert [sp.address(i) for i in (1, 2, 3)] == ["10.200.7.11", "10.200.7.12", "10.200.7.13"]


def test_pick_subnet_avoids_networks_in_use() -> None:
    first = spec.pick_subnet("demo", [])
    again = spec.pick_subnet("demo", [])
    assert first == again and first.subnet_of(spec.SUBNET_POOL)
    other = spec.pick_subnet("demo", [first])
    assert other != first and not other.overlaps(first)


def test_a_256_node_sandbox_gets_a_subnet_that_holds_every_node() -> None:
    small, large = spec.pick_subnet("demo", [], 4), spec.pick_subnet("demo", [], 256)
    assert small.prefixlen == 24 and large.prefixlen == 23
    sp = _spec(nodes=256, subnet=str(large))
    addresses = {sp.address(i) for i in range(1, 257)}
    assert len(addresses) == 256 and all(ipaddress.ip_address(a) in large for a in addresses)
    assert sp.head_address() not in addresses and str(large.broadcast_address) not in addresses
    with pytest.raises(UsageError, match="too small for 256 nodes"):
        spec.parse_subnet("10.77.0.0/24", 256)
    with pytest.raises(UsageError, match="1 to 500"):
        spec.check_nodes(501)


def test_pick_subnet_moves_to_spare_pools_then_gives_up_clearly() -> None:
    vpn = ipaddress.ip_network("10.0.0.0/8")
    spare = spec.pick_subnet("demo", [vpn])
    assert not spare.overlaps(vpn) and spare.subnet_of(spec.SPARE_POOLS[0])
    everything = [vpn, ipaddress.ip_network("172.16.0.0/12"), ipaddress.ip_network("192.168.0.0/16")]
    with pytest.raises(UsageError, match="overlaps") as err:
        spec.pick_subnet("demo", everything)
    assert "--subnet" in (err.value.hint or "")


def test_up_request_keeps_running_settings_and_reports_changes() -> None:
    running = _spec(with_keys=True, rate=50_000_000, ssh_port=2222)
    same = UpRequest().resolve("unit", running)
    assert same == running and running.differences(same) == []
    unshaped = UpRequest(rate=spec.UNSHAPED).resolve("unit", running)
    assert unshaped.rate is None and running.differences(unshaped) == []
    more = UpRequest(nodes=5, with_keys=False).resolve("unit", running)
    diffs = running.differences(more)
    assert any(d.startswith("nodes:") for d in diffs) and any(d.startswith("with_keys:") for d in diffs)


def test_hosts_blocks_are_replaced_and_stripped_per_sandbox() -> None:
    base = "127.0.0.1 localhost\n10.0.0.5 db\n"
    a = files.with_block(base, "a", [files.HostEntry(address="10.1.1.11", name="n1")])
    b = files.with_block(a, "b", [files.HostEntry(address="10.1.2.11", name="m1")])
    again = files.with_block(b, "a", [files.HostEntry(address="10.1.1.12", name="n1")])
    assert again.count("# corral-sandbox a begin") == 1 and "10.1.1.12\tn1" in again
    assert "10.1.1.11" not in again and "10.1.2.11\tm1" in again
    assert files.strip_blocks(again, "a") == files.strip_blocks(b, "a")
    assert files.strip_blocks(again) == base
    claimed = files.names_claimed(again, exclude="a")
    assert claimed == {"localhost": "/etc/hosts", "db": "/etc/hosts", "m1": "sandbox b"}


def test_accounts_unlock_root_for_keys_and_add_test_user() -> None:
    passwd = "root:x:0:0:root:/root:/bin/bash\n"
    shadow = "root:!locked:19000:0:99999:7:::\n"
    group = "root:x:0:\n"
    p, s, g = files.accounts(passwd, shadow, group, test_user=(2000, "/home/corral", "$6$x$y"))
    assert s.splitlines()[0].split(":")[1] == "*"
    assert "corral:x:2000:2000:corral sandbox test user:/home/corral:/bin/bash" in p
    assert "corral:$6$x$y:" in s and "corral:x:2000:" in g
    assert files.free_uid(p, g, start=2000) == 2001


def test_sshd_config_allows_passwords_only_for_the_test_user() -> None:
    plain = files.sshd_config(_spec(), run_dir="/run/x")
    assert "PasswordAuthentication no" in plain and "Match" not in plain
    assert "UsePAM no" in plain and "PermitRootLogin prohibit-password" in plain
    with_pw = files.sshd_config(_spec(password_auth=True, ssh_port=2222), run_dir="/run/x")
    assert "Port 2222" in with_pw
    assert with_pw.strip().endswith("Match User corral\n    PasswordAuthentication yes")


def test_cluster_files_log_in_as_the_only_reachable_user() -> None:
    assert _spec(with_keys=True).login_user == "root"
    assert _spec(password_auth=True).login_user == spec.TEST_USER
    assert _spec(password_auth=True, with_keys=True).login_user == "root"
    assert f"User {spec.TEST_USER}" in files.ssh_config(_spec(password_auth=True), Path("/s"))


def test_known_hosts_qualifies_non_default_ports() -> None:
    keys = {f"node{i}": f"ssh-ed25519 KEY{i} root@node{i}" for i in (1, 2, 3)}
    text = files.known_hosts(_spec(ssh_port=2222), keys)
    assert text.splitlines()[0] == "[node1]:2222,[10.200.7.11]:2222 ssh-ed25519 KEY1"
    assert files.known_hosts(_spec(), keys).splitlines()[1] == "node2,10.200.7.12 ssh-ed25519 KEY2"


def test_cluster_file_reads_back_through_the_inventory(tmp_path: Path) -> None:
    from corral.inventory.tomlfile import read_corral_toml

    sp = _spec(with_keys=True, slots=3, ssh_port=2222)
    path = tmp_path / "corral.toml"
    path.write_text(files.corral_toml(sp, tmp_path, sys.executable))
    cluster = read_corral_toml(path)
    assert cluster.names == ["node1", "node2", "node3"]
    host = cluster.host("node2")
    assert (host.address, host.port, host.user, host.slots) == ("10.200.7.12", 2222, "root", 3)
    assert host.python == sys.executable
    assert f"IdentityFile={tmp_path / 'id_ed25519'}" in cluster.ssh_options
    assert (tmp_path / "hostfile").exists() is False
    assert files.hostfile(sp).splitlines()[1:] == [f"node{i} slots=3" for i in (1, 2, 3)]


def test_cli_status_of_a_sandbox_that_is_not_up(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from corral.cli import cli

    state = tmp_path / "none"
    result = CliRunner().invoke(cli, ["sandbox", "status", "--json", "--name", "ghost", "--state-dir", str(state)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["exists"], data["up"], data["nodes"]) == (False, False, [])
    human = CliRunner().invoke(cli, ["sandbox", "status", "--name", "ghost", "--state-dir", str(state)])
    assert "not up" in human.output and "corral sandbox up 4" in human.output
    assert not state.exists()


def test_cli_up_rejects_bad_flags_before_touching_anything(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from corral.cli import cli

    state = tmp_path / "s"
    result = CliRunner().invoke(cli, ["sandbox", "up", "2", "--rate", "100mbps", "--state-dir", str(state)])
    assert result.exit_code == 2
    assert "--rate '100mbps'" in result.output and "HINT:" in result.output
    result = CliRunner().invoke(cli, ["sandbox", "up", "--name", "ghost", "--state-dir", str(state)])
    assert result.exit_code == 2 and "corral sandbox up N" in result.output
    assert not state.exists()


def test_missing_capabilities_are_named() -> None:
    assert preflight.missing_capabilities(0) == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]
    assert preflight.missing_capabilities(1 << 12 | 1 << 21) == []


def test_clear_error_without_root(tmp_path: Path) -> None:
    """As an unprivileged user, `up` names the missing capabilities and the fix."""
    argv = [sys.executable, "-m", "corral", "sandbox", "up", "2", "--name", "nopriv",
            "--state-dir", str(tmp_path / "state")]
    if ROOT:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is needed to drop root")
        argv = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all"] + argv
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/", check=False)
    assert proc.returncode == 3, proc.stderr
    assert "CAP_NET_ADMIN" in proc.stderr and "root" in proc.stderr and "HINT:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state").exists()


# ---------------------------------------------------------------------------
# the shared 4-node sandbox


def _ssh(sb: Sandbox, node: str, *cmd: str, timeout: int = 5, **opts: str) -> subprocess.CompletedProcess:
    argv = ["ssh", "-F", str(sb.ssh_config), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}"]
    for key, value in opts.items():
        argv += ["-o", f"{key}={value}"]
    return subprocess.run(argv + [node, *cmd], capture_output=True, text=True, timeout=timeout + 30,
                          stdin=subprocess.DEVNULL, check=False)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie waits for its parent, here the machine's
    init, to collect its exit status: nothing of it runs any more)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _ip_netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


@pytest.mark.sandbox
def test_every_node_answers_ssh_with_its_own_hostname(sandbox: Sandbox) -> None:
    for node in sandbox.nodes:
        proc = _ssh(sandbox, node, "hostname")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == node


@pytest.mark.sandbox
def test_names_resolve_on_the_head_for_plain_ssh_options(sandbox: Sandbox) -> None:
    """What `corral run` does: the name through /etc/hosts, options from corral.toml."""
    node = sandbox.nodes[1]
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={sandbox.known_hosts}", "-o", f"IdentityFile={sandbox.identity_file}",
            "-o", "IdentitiesOnly=yes", "-F", "/dev/null", f"root@{node}", "hostname"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == node


@pytest.mark.sandbox
def test_nodes_resolve_each_other_but_hold_no_keys(sandbox: Sandbox) -> None:
    first, second = sandbox.nodes[:2]
    code = f"import socket; print(socket.gethostbyname({second!r}))"
    resolved = sandbox.exec(first, [sys.executable, "-c", code], check=True).stdout.strip()
    assert resolved == sandbox.addresses[second]
    proc = sandbox.exec(first, ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                                "-o", "StrictHostKeyChecking=accept-new", second, "true"], timeout=30)
    assert proc.returncode == 255 and "Permission denied" in proc.stderr


@pytest.mark.sandbox
def test_ps_on_a_node_shows_only_that_nodes_processes(sandbox: Sandbox) -> None:
    first, second = sandbox.nodes[:2]
    marker = f"{600 + uuid.uuid4().int % 1000}.{os.getpid()}"  # a unique `sleep` argument
    started = _ssh(sandbox, second, f"setsid sleep {marker} >/dev/null 2>&1 < /dev/null & echo $!")
    assert started.returncode == 0, started.stderr
    try:
        out = _ssh(sandbox, first, "ps", "-e", "-o", "pid=,args=").stdout
        rows = [line.split(None, 1) for line in out.strip().splitlines()]
        pids = {int(pid): args for pid, args in rows}
        assert "nodeinit" in pids[1]
        assert len(pids) < 15, pids
        assert not any(marker in args for args in pids.values())
        assert marker in _ssh(sandbox, second, "ps", "-e", "-o", "args=").stdout
    finally:
        sandbox.exec(second, ["kill", started.stdout.strip()])  # its pid inside node2


@pytest.mark.sandbox
def test_private_directories_are_private(sandbox: Sandbox) -> None:
    first, second = sandbox.nodes[:2]
    mark = f"corral-private-{uuid.uuid4().hex[:8]}"
    paths = [f"/srv/proj/{mark}", f"/tmp/{mark}", f"/var/tmp/{mark}", f"/root/.ssh/{mark}", f"/home/{mark}"]
    script = "mkdir -p /srv/proj && " + " && ".join(f"echo x > {p}" for p in paths) + " && ls " + " ".join(paths)
    assert sandbox.exec(first, ["sh", "-c", script]).returncode == 0
    seen_on_second = sandbox.exec(second, ["sh", "-c", "ls " + " ".join(paths) + " 2>/dev/null"]).stdout
    assert seen_on_second.strip() == ""
    for path in paths:
        assert not os.path.exists(path), f"{path} leaked to the head"
    # The head's shared filesystem is visible in the node (the same "image").
    assert sandbox.exec(first, ["test", "-x", sys.executable]).returncode == 0
    # ...but the sandbox's own state (the head's private key) is not.
    assert sandbox.exec(first, ["test", "-e", str(sandbox.identity_file)]).returncode != 0


@pytest.mark.sandbox
def test_exec_passes_the_exit_code_through(sandbox: Sandbox) -> None:
    proc = sandbox.exec(sandbox.nodes[2], ["sh", "-c", "hostname; pwd; exit 7"])
    assert proc.returncode == 7
    assert proc.stdout.split() == [sandbox.nodes[2], "/root"]
    with pytest.raises(UsageError, match="no node"):  # a name the user typed: exit 2
        sandbox.exec("no-such-node", ["true"])


@pytest.mark.sandbox
def test_exec_timeout_kills_the_command_inside_the_node(sandbox: Sandbox) -> None:
    node = sandbox.nodes[2]
    marker = f"{700 + uuid.uuid4().int % 1000}.{os.getpid()}"
    with pytest.raises(subprocess.TimeoutExpired):
        sandbox.exec(node, ["sleep", marker], timeout=1)
    deadline = time.monotonic() + 5
    while marker in sandbox.exec(node, ["ps", "-e", "-o", "args="]).stdout:
        assert time.monotonic() < deadline, "the timed-out command still runs in the node"
        time.sleep(0.1)


@pytest.mark.sandbox
def test_cli_exec_passes_exit_code_and_output(sandbox: Sandbox) -> None:
    node = sandbox.nodes[0]
    proc = subprocess.run(
        [sys.executable, "-m", "corral", "sandbox", "exec", "--name", sandbox.name,
         "--state-dir", str(sandbox.state_dir), node, "--", "sh", "-c", "hostname; exit 5"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout.strip() == node


@pytest.mark.sandbox
def test_partition_makes_a_node_unreachable_and_heal_restores_it(sandbox: Sandbox) -> None:
    node, peer = sandbox.nodes[2], sandbox.nodes[0]
    sandbox.partition(node)
    try:
        assert _ssh(sandbox, node, "true", timeout=2).returncode == 255
        assert sandbox.status().node(node).link == "down"
        code = f"import socket; socket.create_connection(({sandbox.addresses[node]!r}, 22), 2)"
        assert sandbox.exec(peer, [sys.executable, "-c", code], timeout=30).returncode != 0
    finally:
        sandbox.heal(node)
    proc = _ssh(sandbox, node, "hostname")
    assert proc.returncode == 0 and proc.stdout.strip() == node


@pytest.mark.sandbox
def test_stop_kills_everything_on_the_node_and_up_restarts_it(sandbox: Sandbox) -> None:
    node = sandbox.nodes[3]
    ns = sandbox.status().node(node).netns
    assert _ssh(sandbox, node, "setsid sleep 600 >/dev/null 2>&1 < /dev/null &").returncode == 0
    before = _ip_netns_pids(ns)
    assert len(before) >= 3  # unshare, init, sshd (and the sleep)
    try:
        sandbox.stop(node)
        assert _ip_netns_pids(ns) == []
        assert [p for p in before if _running(p)] == []
        assert _ssh(sandbox, node, "true", timeout=2).returncode == 255
        assert sandbox.status().node(node).state == "stopped"
    finally:
        sandbox.up()
    assert _ssh(sandbox, node, "hostname").stdout.strip() == node


@pytest.mark.sandbox
def test_up_repairs_a_node_whose_sshd_died(sandbox: Sandbox) -> None:
    node = sandbox.nodes[1]
    # Inside the node the pid file is right (node pids); from the head it never is.
    sandbox.exec(node, ["sh", "-c", "kill $(cat /run/corral/node/sshd.pid)"], check=True)
    try:
        assert _ssh(sandbox, node, "true", timeout=2).returncode == 255
    finally:
        sandbox.up()
    assert _ssh(sandbox, node, "hostname").stdout.strip() == node


@pytest.mark.sandbox
def test_up_again_is_idempotent(sandbox: Sandbox) -> None:
    before = sandbox.status()
    after = sandbox.up(len(sandbox.nodes), with_keys=True)
    assert after.up
    assert [n.init_pid for n in after.nodes] == [n.init_pid for n in before.nodes]
    assert Path("/etc/hosts").read_text().count(f"# corral-sandbox {sandbox.name} begin") == 1
    with pytest.raises(SandboxError, match="already up with other settings"):
        sandbox.up(len(sandbox.nodes) + 1)


@pytest.mark.sandbox
def test_node_names_already_taken_are_refused(sandbox: Sandbox, tmp_path: Path) -> None:
    clash = Sandbox(name=f"{sandbox.name}x", prefix=sandbox.nodes[0][:-1], state_dir=tmp_path / "s")
    try:
        with pytest.raises(SandboxError, match=f"sandbox {sandbox.name}"):
            clash.up(1)
    finally:
        clash.down()


@pytest.mark.sandbox
def test_cli_status_json(sandbox: Sandbox) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "corral", "sandbox", "status", "--json", "--name", sandbox.name,
         "--state-dir", str(sandbox.state_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["up"] is True and data["with_keys"] is True
    assert [n["name"] for n in data["nodes"]] == sandbox.nodes
    assert all(n["state"] == "running" and n["link"] == "up" for n in data["nodes"])
    assert data["files"]["cluster_file"] == str(sandbox.cluster_file)
    cluster = sandbox.cluster()
    assert cluster.names == sandbox.nodes and cluster.path == str(sandbox.cluster_file)
    listed = subprocess.run([sys.executable, "-m", "corral", "sandbox", "list", "--json"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert sandbox.name in [row["name"] for row in json.loads(listed.stdout)["sandboxes"]]


# ---------------------------------------------------------------------------
# sandboxes of their own


@pytest.fixture
def own_sandbox(tmp_path: Path):
    """A fresh sandbox for one test (unique name and prefix), always removed."""
    if not ROOT:
        pytest.skip("the sandbox needs root")
    made: list[Sandbox] = []

    def make(suffix: str) -> Sandbox:
        tag = f"u{os.getpid()}{suffix}"
        sb = Sandbox(name=tag, prefix=f"{tag}n", state_dir=tmp_path / f"state-{suffix}")
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.down()


def _iperf(sb: Sandbox, client: str, server: str) -> float:
    """Measured throughput client -> server in Mbit/s (iperf3, 2 s)."""
    assert sb.exec(server, ["iperf3", "-s", "-1", "-D"]).returncode == 0
    deadline = time.monotonic() + 10
    while True:
        proc = sb.exec(client, ["iperf3", "-c", sb.addresses[server], "-t", "2", "-J"], timeout=60)
        if proc.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # the daemon is not listening yet
    assert proc.returncode == 0, proc.stdout[-500:]
    return json.loads(proc.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6


@pytest.mark.sandbox
def test_rate_limits_throughput_between_nodes(own_sandbox) -> None:
    if shutil.which("iperf3") is None:
        pytest.fail("iperf3 is needed to measure the link (make system-deps installs it)")
    sb = own_sandbox("r")
    sb.up(2, rate="50mbit")
    first, second = sb.nodes
    measured = _iperf(sb, first, second)
    assert 10 < measured < 75, measured
    sb.slow(first, "10mbit")
    slowed = _iperf(sb, first, second)
    assert 2 < slowed < 15, slowed
    assert sb.status().node(first).rate == 10_000_000


@pytest.mark.sandbox
def test_password_auth_first_contact_on_port_2222(own_sandbox, tmp_path: Path) -> None:
    sb = own_sandbox("p")
    sb.up(1, password_auth=True, ssh_port=2222)
    node = sb.nodes[0]
    askpass = tmp_path / "askpass.sh"
    askpass.write_text(f"#!/bin/sh\necho {spec.DEFAULT_PASSWORD}\n")
    askpass.chmod(0o755)
    env = dict(os.environ, SSH_ASKPASS=str(askpass), SSH_ASKPASS_REQUIRE="force", DISPLAY=":0")

    def login(user: str) -> subprocess.CompletedProcess:
        argv = ["setsid", "-w", "ssh", "-p", "2222", "-F", "/dev/null", "-o", "ConnectTimeout=5",
                "-o", "StrictHostKeyChecking=accept-new", "-o", f"UserKnownHostsFile={tmp_path / 'kh'}",
                "-o", "PreferredAuthentications=password", "-o", "PubkeyAuthentication=no",
                "-o", "NumberOfPasswordPrompts=1", f"{user}@{node}", "id -un; hostname; echo $HOME"]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60,
                              stdin=subprocess.DEVNULL, check=False)

    ok = login(spec.TEST_USER)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == [spec.TEST_USER, node, f"/home/{spec.TEST_USER}"]
    assert login("root").returncode == 255  # root: keys only, and there are none
    # Nothing was authorized without --with-keys: the head's key login fails too.
    assert sb.exec(node, ["sh", "-c", "ls -A /root/.ssh"]).stdout.strip() == ""
    assert sb.status().test_password == spec.DEFAULT_PASSWORD


@pytest.mark.sandbox
def test_down_leaves_no_namespace_interface_process_or_file(own_sandbox) -> None:
    sb = own_sandbox("d")
    sb.up(2, extra_nic=["fast", "decoy"], ssh_port=2222, with_keys=True)
    status = sb.status()
    namespaces = [n.netns for n in status.nodes]
    first = sb.nodes[0]
    addrs = sb.exec(first, ["ip", "-br", "addr"]).stdout
    assert "eth1" in addrs and "docker0" in addrs and "172.17.0.1/16" in addrs
    fast_peer = status.nodes[1].fast_address
    assert fast_peer and not ipaddress.ip_address(fast_peer) in ipaddress.ip_network(status.subnet)
    code = f"import socket; socket.create_connection(({fast_peer!r}, 2222), 3).close()"
    assert sb.exec(first, [sys.executable, "-c", code], timeout=30).returncode == 0  # via eth1
    assert _ssh(sb, first, "setsid sleep 600 >/dev/null 2>&1 < /dev/null &").returncode == 0
    # A process entered from outside the node's PID namespace counts too.
    outsider = subprocess.Popen(["ip", "netns", "exec", namespaces[1], "sleep", "600"],
                                start_new_session=True)
    deadline = time.monotonic() + 10
    while outsider.pid not in _ip_netns_pids(namespaces[1]):  # until `ip netns exec` has entered
        assert time.monotonic() < deadline and outsider.poll() is None
        time.sleep(0.05)
    pids = [p for ns in namespaces for p in _ip_netns_pids(ns)]
    assert len(pids) >= 8  # 2 x (unshare, init, sshd), the sleep on node1, the outsider

    removed = sb.down()

    outsider.wait(timeout=10)
    assert sorted(removed["namespaces"]) == sorted(namespaces)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert not any(ns in listed for ns in namespaces)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    assert spec.tag_for(sb.name) not in links and f"corral-sandbox:{sb.name}" not in links
    alive = [p for p in pids if _running(p)]
    assert alive == []
    assert f"corral-sandbox {sb.name}" not in Path("/etc/hosts").read_text()
    assert not sb.state_dir.exists()
    assert sb.down() == {"namespaces": [], "links": [], "hosts_block": False, "state_dir": None, "slurm": []}


@pytest.mark.sandbox
def test_down_cleans_up_after_a_crashed_up(own_sandbox) -> None:
    """Resources whose state file is gone (a crash mid-up) are found by name."""
    sb = own_sandbox("c")
    sb.up(1)
    node_ns = sb.status().nodes[0].netns
    (sb.state_dir / files.STATE_FILE).unlink()
    assert sb.status().exists is False
    sb.down()
    assert node_ns not in netns.netns_list()
    assert f"corral-sandbox {sb.name}" not in Path("/etc/hosts").read_text()


@needs_root
def test_state_dir_holding_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    sb = Sandbox(name=f"v{os.getpid()}", state_dir=tmp_path)
    with pytest.raises(SandboxError, match="not a sandbox's state directory"):
        sb.up(1)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------
# the head changing its own /etc (run in a private mount namespace whose /etc is
# a copy: the machine's real account files are never touched)

_HEAD_RENAMES_ETC = r'''
import json, os, subprocess, sys
from corral.sandbox import Sandbox

etc_copy, state, tag = sys.argv[1:4]
subprocess.run(["cp", "-a", "/etc", etc_copy], check=True)
subprocess.run(["mount", "--bind", etc_copy, "/etc"], check=True)  # this namespace's "head" /etc
sb = Sandbox(name=tag, prefix=tag + "n", state_dir=state)
node_write = (
    "import os\n"
    "text = open('/etc/passwd').read() + 'nodeonly:x:4242:4242::/nonexistent:/usr/sbin/nologin\\n'\n"
    "open('/etc/passwd.new', 'w').write(text)\n"
    "os.rename('/etc/passwd.new', '/etc/passwd')\n"
)
out = {}
try:
    sb.up(1)
    node = sb.nodes[0]
    cat = lambda path: sb.exec(node, ["cat", path], check=True).stdout
    out["node_before"] = cat("/etc/passwd")
    # useradd writes /etc/passwd+ and renames it over /etc/passwd (so does userdel, passwd).
    subprocess.run(["useradd", "-M", "-N", "-l", "-s", "/usr/sbin/nologin", "corraldetach"],
                   check=True, capture_output=True)
    out["head_passwd"] = open("/etc/passwd").read()
    out["node_after"] = cat("/etc/passwd")
    out["node_shadow_after"] = cat("/etc/shadow")
    sb.exec(node, [sys.executable, "-I", "-c", node_write], check=True)
    out["node_written"] = cat("/etc/passwd")
    out["head_after_node_write"] = open("/etc/passwd").read() + open("/etc/shadow").read()
finally:
    sb.down()
print(json.dumps(out))
'''


@pytest.mark.sandbox
@needs_root
def test_nodes_keep_their_account_files_when_the_head_renames_its_own(tmp_path: Path) -> None:
    """A `useradd` on the head replaces /etc/passwd by rename; the nodes must
    keep reading their own copy, and a node's write must never reach the head."""
    tag = f"v{os.getpid()}e"
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _HEAD_RENAMES_ETC,
         str(tmp_path / "etc"), str(tmp_path / "state"), tag],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert "corraldetach" in out["head_passwd"]  # the head's /etc did change (by rename)
    assert out["node_after"] == out["node_before"]
    assert "corraldetach" not in out["node_shadow_after"]
    assert "nodeonly" in out["node_written"]  # the node writes its own /etc
    assert "nodeonly" not in out["head_after_node_write"]
    assert "corraldetach" not in Path("/etc/passwd").read_text()  # the machine's files: untouched


def _venv_under(project: Path) -> Path:
    """A Python whose virtual environment and corral checkout live in ``project``
    (a clone under /var/tmp, as a user or a CI job makes): a bare venv that sees
    this checkout's dependencies and the copy of corral in ``project/src``."""
    shutil.copytree(REPO_ROOT / "src" / "corral", project / "src" / "corral",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", project / "pyproject.toml")
    venv = project / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    deps = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)]
    (site / "corral_test.pth").write_text("\n".join([str(project / "src"), *deps]) + "\n")
    return venv / "bin" / "python"


REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.sandbox
@needs_root
def test_a_project_under_var_tmp_is_not_shared_and_sync_copies_it(tmp_path: Path) -> None:
    """Only the interpreter is mounted through into the nodes, never the project
    around it: `corral sync` must send the project, the nodes' copies are their
    own, and doctor finds the synced working directory writable."""
    tag = f"v{os.getpid()}s"
    project = Path(f"/var/tmp/corral-{tag}-proj")
    shutil.rmtree(project, ignore_errors=True)
    sb = Sandbox(name=tag, state_dir=tmp_path / "state")
    try:
        python = _venv_under(project)
        (project / "train.py").write_text("print('hello from the project')\n")
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}

        def corral(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([str(python), "-m", "corral", *args], cwd=project, env=env,
                                  capture_output=True, text=True, timeout=240, check=False)

        # The test venv borrows this checkout's dependencies (its .pth): where the
        # checkout is itself in a node-private place (a CI clone under /tmp), they
        # are shared on purpose, as a user would share a venv kept there.
        deps = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)
                and p.startswith(("/tmp/", "/var/tmp/", "/srv/"))]
        share = [a for d in deps for a in ("--share", d)]
        up = corral("sandbox", "up", "2", "--with-keys", "--name", tag, "--prefix", f"{tag}n",
                    "--state-dir", str(tmp_path / "state"), *share)
        assert up.returncode == 0, up.stderr
        node = sb.nodes[0]
        # The interpreter runs on the node; the project is not there before a sync.
        assert sb.exec(node, [str(python), "-c", "import torch"]).returncode == 0
        assert sb.exec(node, ["test", "-e", str(project / "train.py")]).returncode == 1
        cluster = str(sb.cluster_file)
        synced = corral("sync", "-c", cluster, "--json")
        assert synced.returncode == 0, synced.stderr
        report = json.loads(synced.stdout)
        assert report["bytes_sent"] > 0
        assert all(r["bytes"] > 0 for r in report["nodes"].values())
        assert sb.exec(node, ["cat", str(project / "train.py")]).stdout == "print('hello from the project')\n"
        # The node's copy is its own: what a job writes there stays on the node.
        assert sb.exec(node, ["touch", str(project / "written-on-node")]).returncode == 0
        assert not (project / "written-on-node").exists()
        doctor = corral("doctor", "-c", cluster, "--no-smoke", "--no-ssh", "--no-links", "--no-torch", "--json")
        findings = json.loads(doctor.stdout)["findings"]
        assert not [f for f in findings if f["check"] == "system.workdir"], findings
    finally:
        sb.down()
        shutil.rmtree(project, ignore_errors=True)


def test_share_must_name_a_directory_inside_the_private_ones(tmp_path: Path) -> None:
    from corral.sandbox import node as node_mod

    with pytest.raises(UsageError, match=r"--share .*missing: not a directory"):
        node_mod.python_layout([str(tmp_path / "missing")])
    with pytest.raises(UsageError, match=r"--share /var/tmp: all of /var/tmp"):
        node_mod.python_layout(["/var/tmp"])


@pytest.mark.sandbox
def test_shared_directory_is_the_heads_on_every_node(own_sandbox, tmp_path: Path) -> None:
    """--share: a head directory under /tmp, seen (and written) by every node as is."""
    shared = tmp_path / "nfs"
    shared.mkdir()
    sb = own_sandbox("h")
    sb.up(2, share=[str(shared)])
    (shared / "from-head").write_text("head\n")
    for node in sb.nodes:
        assert sb.exec(node, ["cat", str(shared / "from-head")]).stdout == "head\n"
    assert sb.exec(sb.nodes[1], ["touch", str(shared / "from-node")]).returncode == 0
    assert (shared / "from-node").exists()
    (tmp_path / "not-shared").write_text("head only\n")  # the rest of /tmp stays private
    assert sb.exec(sb.nodes[0], ["test", "-e", str(tmp_path / "not-shared")]).returncode == 1
    with pytest.raises(SandboxError, match="shares"):
        sb.up(share=[])


def test_node_nsswitch_takes_host_names_from_files_only() -> None:
    head = "passwd: files systemd\nhosts:          files mdns4_minimal [NOTFOUND=return] dns\nnetworks: files\n"
    text = files.node_nsswitch(head)
    assert [l for l in text.splitlines() if l.startswith("hosts")] == ["hosts: files"]
    assert "passwd: files systemd" in text and "networks: files" in text
    assert files.node_nsswitch(None).splitlines()[-1] == "hosts: files"


#: Lines a sandbox run must not show: torchrun's OMP banner, c10d's failed
#: reverse lookups (nodes had no DNS), torch importing without numpy.
_NOISE = ("OMP_NUM_THREADS", "*****", "hostname of the client socket cannot be retrieved",
          "Failed to initialize NumPy")


@pytest.mark.sandbox
def test_a_torchrun_run_on_the_sandbox_shows_only_lines_that_matter(sandbox: Sandbox) -> None:
    scratch = REPO_ROOT / "scratch" / f"sb-{os.getpid()}-{uuid.uuid4().hex[:6]}"  # shared like NFS
    scratch.mkdir(parents=True)
    try:
        (scratch / "ar.py").write_text(
            "import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.ones(1)\n"
            "dist.all_reduce(t)\n"
            "print('sum', int(t.item()), flush=True)\n"
        )
        proc = subprocess.run([sys.executable, "-m", "corral", "run", "-c", str(sandbox.cluster_file), "ar.py"],
                              cwd=scratch, capture_output=True, text=True, timeout=240, check=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    world = 2 * len(sandbox.nodes)
    assert proc.stdout.count(f"sum {world}") == world
    both = proc.stdout + proc.stderr
    assert not [line for line in both.splitlines() if any(n in line for n in _NOISE)], both


def _as_user(user: str, *argv: str, home: Path) -> subprocess.CompletedProcess:
    """Run corral's CLI as ``user`` through the system Python (this session's
    interpreter may live under /root, which other users cannot read)."""
    deps = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), *deps])}
    return subprocess.run([shutil.which("runuser"), "-u", user, "--", "/usr/bin/python3", "-m", "corral", *argv],
                          env=env, capture_output=True, text=True, timeout=120, cwd="/", check=False)


@pytest.mark.sandbox
@needs_root
def test_a_sandbox_started_for_a_user_is_usable_by_that_user(tmp_path: Path) -> None:
    """`sudo corral sandbox up --for USER`: USER lists it, sees its real status,
    reads its cluster file and logs in to a node with its key."""
    if not os.path.exists("/usr/bin/python3") or shutil.which("runuser") is None:
        pytest.skip("needs /usr/bin/python3 and runuser")
    user = "nobody"
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, pwd.getpwnam(user).pw_uid, -1)
    os.chmod(tmp_path, 0o755)
    tag = f"v{os.getpid()}u"
    sb = Sandbox(name=tag, prefix=f"{tag}n")
    try:
        sb.up(2, with_keys=True, for_user=user)
        assert str(sb.state_dir).startswith("/var/lib/corral/sandbox/")
        listed = _as_user(user, "sandbox", "list", "--json", home=home)
        assert listed.returncode == 0, listed.stderr
        row = next(r for r in json.loads(listed.stdout)["sandboxes"] if r["name"] == tag)
        assert row["nodes"] == 2 and row["up"] is True, row
        status = _as_user(user, "sandbox", "status", "--name", tag, "--json", home=home)
        assert status.returncode == 0, status.stderr
        assert [n["state"] for n in json.loads(status.stdout)["nodes"]] == ["running", "running"]
        hosts = _as_user(user, "hosts", "-c", str(sb.cluster_file), "--json", home=home)
        assert hosts.returncode == 0, hosts.stderr
        login = subprocess.run(["runuser", "-u", user, "--", "ssh", "-F", str(sb.ssh_config), "-o", "BatchMode=yes",
                                sb.nodes[1], "hostname"], capture_output=True, text=True, timeout=60, check=False)
        assert login.stdout.strip() == sb.nodes[1], login.stderr
        # Inside the nodes, the sandboxes' state (head keys, every node's files) is hidden.
        assert sb.exec(sb.nodes[0], ["ls", "-A", "/var/lib/corral/sandbox"], check=True).stdout == ""
        # The nodes' own files (host keys, shadow) stay root's; nothing is the user's to change.
        shadow = sb.node_dir(sb.nodes[0]) / "etc" / "shadow"
        peek = subprocess.run([shutil.which("runuser"), "-u", user, "--", "cat", str(shadow)],
                              capture_output=True, text=True, timeout=30, check=False)
        assert peek.returncode != 0 and "Permission denied" in peek.stderr
        assert all(os.stat(p).st_uid == 0 for p in [sb.state_dir, *sb.state_dir.iterdir()]
                   if p.name != "id_ed25519")
    finally:
        sb.down()
    assert not sb.state_dir.exists()


def test_for_a_user_that_does_not_exist_is_a_usage_error() -> None:
    from corral.sandbox import access

    with pytest.raises(UsageError, match="--for no-such-user-x: no such user"):
        access.user("no-such-user-x")
    with pytest.raises(UsageError, match="--for root"):
        access.user("root")


@pytest.mark.sandbox
def test_partition_cli_names_the_heal_to_type_and_an_unknown_node_is_bad_input(sandbox: Sandbox) -> None:
    from click.testing import CliRunner

    from corral.cli import cli

    where = ["--name", sandbox.name, "--state-dir", str(sandbox.state_dir)]
    # No such node: a name the user typed (2), not an infrastructure failure (3).
    res = CliRunner().invoke(cli, ["sandbox", "partition", "nc9", *where])
    assert res.exit_code == 2 and "has no node 'nc9'" in res.output, res.output
    node = sandbox.nodes[1]
    res = CliRunner().invoke(cli, ["sandbox", "partition", node, *where])
    try:
        assert res.exit_code == 0, res.output
        # the hint was `corral sandbox heal`, without the NODE it needs
        assert f"`corral sandbox heal {node} --name {sandbox.name}` restores it" in res.output
    finally:
        sandbox.heal(node)


def test_a_large_sandbox_raises_the_packet_backlog_and_a_small_one_leaves_it(tmp_path: Path) -> None:
    """256 nodes' links overflowed the kernel's 1000-packet queue: a launch lost a node that was up."""
    from corral.sandbox import netns

    knob = tmp_path / "netdev_max_backlog"
    knob.write_text("1000\n")
    assert netns.ensure_packet_backlog(4, knob) is None
    assert knob.read_text() == "1000\n"
    assert netns.ensure_packet_backlog(256, knob) == (1000, 65536)
    assert knob.read_text() == "65536\n"
    assert netns.ensure_packet_backlog(64, knob) is None  # only ever raised
    assert knob.read_text() == "65536\n"


def test_a_large_sandbox_raises_the_shared_arp_table_limit_and_a_small_one_leaves_it(tmp_path: Path) -> None:
    """Every node's ARP entries share the head kernel's table (1,024 by default):
    at 32 nodes doctor's port check lost 730 of 992 connections to its overflow."""
    from corral.sandbox import netns

    (tmp_path / "gc_thresh3").write_text("1024\n")
    (tmp_path / "gc_thresh2").write_text("512\n")
    assert netns.ensure_neighbour_table(4, tmp_path) is None
    assert netns.ensure_neighbour_table(256, tmp_path) == (1024, 256 * 258)
    assert (tmp_path / "gc_thresh3").read_text() == (tmp_path / "gc_thresh2").read_text() == "66048\n"
    assert netns.ensure_neighbour_table(32, tmp_path) is None  # only ever raised
    assert (tmp_path / "gc_thresh3").read_text() == "66048\n"


@pytest.mark.sandbox
def test_up_with_mesh_lets_every_node_log_in_to_every_other(own_sandbox) -> None:
    sb = own_sandbox("m")
    argv = [sys.executable, "-m", "corral", "sandbox", "up", "3", "--mesh", "--json", "--name", sb.name,
            "--prefix", f"{sb.name}n", "--state-dir", str(sb.state_dir)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["mesh"] == 3
    for a in sb.nodes:
        for b in sb.nodes:
            got = sb.exec(a, ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", b, "hostname"], timeout=30)
            assert (got.returncode, got.stdout.strip()) == (0, b), (a, b, got.stderr)
    # without --mesh (and on a fresh sandbox) a node cannot log in to another
    other = own_sandbox("p")
    other.up(2)
    got = other.exec(other.nodes[0], ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", other.nodes[1],
                                      "hostname"], timeout=30)
    assert got.returncode == 255
