"""`corral exec` through relay nodes (corral.transport.tree and relaynode)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.model import Host
from corral.transport import relaynode, tree
from corral.transport.fanout import TREE_MIN_HOSTS
from corral.transport.ssh import SSHTransport

CORRAL = [sys.executable, "-m", "corral"]
ROOT = os.geteuid() == 0


def test_hosts_split_into_about_sqrt_n_relay_groups_and_local_hosts_stay_here() -> None:
    hosts = [Host(name=f"n{i:03d}") for i in range(256)]
    groups = tree.groups(hosts)
    assert len(groups) == 16 and {len(g) for g in groups} == {16}
    assert [h for g in groups for h in g] == hosts  # every host once, in order
    four = tree.groups([Host(name="here", local=True)] + hosts[:4])
    assert [[h.name for h in g] for g in four] == [["here"], ["n000", "n001"], ["n002", "n003"]]


def _relay_job(members: int = 2) -> tree.RelayJob:
    """A relay job around a real process standing in for the relay's ssh, fed
    frames as a (possibly compromised) relay would send them."""
    hosts = [Host(name=f"m{i}") for i in range(members)]
    from corral.model import Cluster

    cluster = Cluster(hosts=tuple(hosts))
    transport = SSHTransport(cluster, multiplex=False)
    proc = subprocess.Popen(["sleep", "30"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    return tree.RelayJob(hosts[0], [tree.Member(h, transport, "m0") for h in hosts], proc, None)


def _settle(job: tree.RelayJob) -> dict:
    job.proc.wait(10)
    results: dict = {}
    back = job.settle(results, None, tree.Fallbacks())
    return {"back": [h.name for h in back], **{k: v for k, v in results.items()}}


def test_a_relays_frames_become_each_members_output_and_exit_code() -> None:
    job = _relay_job()
    lines: list = []
    frames = (b"login banner\n" + relaynode.READY + b"o 0 6\nhello\ne 1 4\noops" + b"O 1 7\n"
              + b"x 0 0\nx 1 3\nz 0 0\n")
    for i in range(0, len(frames), 5):  # in pieces, as pipes deliver them
        job.feed("out", frames[i : i + 5], lambda *a: lines.append(a))
    assert [m.rc for m in job.finished()] == [0, 3]
    job.proc.kill()
    r0 = job.members[0].result_for(0, None)
    r1 = job.members[1].result_for(3, None)
    assert (r0.stdout, r0.via, r1.stderr, r1.returncode, r1.stdout_cut) == ("hello\n", "m0", "oops", 3, 7)
    assert ("m0", "out", "hello") in lines and ("m1", "err", "oops") in lines


@pytest.mark.parametrize("bad", [
    b"o 9 1\nx",                       # a member the relay was not given
    b"o 0 999999\n",                   # a frame larger than any the relay sends
    b"q 0 1\nx",                       # an unknown kind
    b"x 0 300\n",                      # an exit code no process has
    b"o 0 -1\n",                       # not a count
    b"x 0 0\no 0 1\nx",                # output after the member's end
    b"o" * 100,                        # a header that never ends
])
def test_a_relay_that_breaks_the_frame_format_is_stopped_and_its_members_named(bad: bytes) -> None:
    job = _relay_job()
    job.feed("out", relaynode.READY + bad, None)
    assert job.broken and job.proc.wait(10) < 0  # killed
    out = _settle(job)
    assert out["back"] == []  # started: not run a second time
    named = out["m1"].error  # m1 never ended: named, with what the relay did
    assert out["m1"].returncode == 255 and "relay m0 stopped" in named.message and "it sent" in named.message


RELAY = """
import sys
from corral.transport import relaynode
relaynode.HOLD_S = 0.2
relaynode.relay({members!r}, "", sys.stdin.buffer)
"""


def test_the_relay_hands_back_only_members_ssh_could_not_log_in_to() -> None:
    # Stand-ins for the relay's ssh: what ssh prints when a login fails (also
    # after the relay stopped holding stderr back), and what a command that
    # ran prints when it exits 255 itself: that one is not run a second time.
    members = [
        {"argv": ["sh", "-c", "echo here"], "local": True},
        {"argv": ["sh", "-c", "sleep 0.5; echo 'ssh: connect to host n1 port 22: Connection timed out' >&2; "
                              "exit 255"]},
        {"argv": ["sh", "-c", "echo 'Host key verification failed.' >&2; exit 255"]},
        {"argv": ["sh", "-c", "echo 'Permission denied' >&2; exit 255"]},
        {"argv": ["sh", "-c", "echo ran; echo 'ssh: nothing' >&2; exit 255"]},
    ]
    proc = subprocess.run([sys.executable, "-c", RELAY.format(members=members)], input=b"",
                          capture_output=True, timeout=60, check=True)
    job = _relay_job(len(members))
    job.feed("out", proc.stdout, None)
    job.proc.kill()
    assert job.ended and not job.broken
    assert [m.rc for m in job.members] == [0, None, None, 255, 255]
    assert [bool(m.unreached) for m in job.members] == [False, True, True, False, False]
    assert "Connection timed out" in job.members[1].unreached
    assert job.members[3].text("err") == "Permission denied\n" and job.members[4].text("out") == "ran\n"


def test_endless_noise_before_the_relay_starts_is_bounded() -> None:
    job = _relay_job()
    for _ in range(20):
        job.feed("out", b"x" * 65536, None)
        if job.broken:
            break
    assert job.broken and "before it started" in job.broken and len(job.buf) < 100


def test_a_relay_that_never_started_hands_its_whole_group_back() -> None:
    job = _relay_job()
    job.proc.kill()
    out = _settle(job)
    assert out["back"] == ["m0", "m1"]


def test_auto_uses_relays_only_from_the_threshold_on() -> None:
    from corral.model import Cluster
    from corral.transport.fanout import run_everywhere

    # Below the threshold, auto never imports the tree (exec's start-up cost).
    code = ("import sys; from corral.model import Cluster, Host; "
            "from corral.transport.fanout import run_everywhere; "
            "run_everywhere(Cluster(hosts=(Host(name='localhost', local=True),)), 'true', tree=None); "
            "print('corral.transport.tree' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert res.stdout.strip() == "False"
    # Local hosts are never relayed, however many.
    many = Cluster(hosts=tuple(Host(name=f"l{i}", local=True) for i in range(3)))
    assert [r.via for r in run_everywhere(many, "true", tree=True)] == [None] * 3
    assert TREE_MIN_HOSTS >= 64


# -- on the sandbox: real sshd per node, relays logging in with their own keys --


@pytest.fixture(scope="module")
def mesh_sandbox(tmp_path_factory: pytest.TempPathFactory):
    """Four nodes that log in to each other (as with a shared home)."""
    if not ROOT:
        pytest.skip("the sandbox needs root (network/PID/mount namespaces); CI runs as root")
    from corral.sandbox import Sandbox
    from corral.sandbox.mesh import mesh

    tag = f"r{os.getpid()}"
    sb = Sandbox(name=f"{tag}-tree", prefix=f"{tag}n",
                 state_dir=tmp_path_factory.mktemp("treesb") / "state")
    try:
        sb.up(4, with_keys=True)
        mesh(sb)
        yield sb
    finally:
        sb.down()


def _exec(sb, *args: str, cluster: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CORRAL, "exec", "-c", str(cluster or sb.cluster_file), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def _rows(res: subprocess.CompletedProcess) -> dict:
    return {h["host"]: h for h in json.loads(res.stdout)["hosts"]}


def _forget_relay_connections(sb) -> None:
    """Relays keep a master connection to their members for a minute: end them."""
    for node in sb.nodes:
        sb.exec(node, ["sh", "-c", "pkill -f '^ssh: /tmp/[c]orral-relay'; true"])


CMD = "echo out $(hostname); echo err $(hostname) >&2; case $(hostname) in *n3) exit 4;; esac"


@pytest.mark.sandbox
def test_through_relays_every_node_answers_as_it_does_directly(mesh_sandbox) -> None:
    sb = mesh_sandbox
    direct = _rows(_exec(sb, "--tree", "off", "--json", "--", CMD))
    res = _exec(sb, "--tree", "on", "--json", "--", CMD)
    assert res.returncode == 4, res.stderr
    relayed = _rows(res)
    n1, n2, n3, n4 = sb.nodes
    assert {h: r["via"] for h, r in relayed.items()} == {n1: n1, n2: n1, n3: n3, n4: n3}
    assert {h: r["via"] for h, r in direct.items()} == dict.fromkeys(sb.nodes)
    for host in sb.nodes:
        for key in ("stdout", "stderr", "returncode", "error"):
            assert relayed[host][key] == direct[host][key], (host, key)
    assert relayed[n3]["returncode"] == 4 and relayed[n4]["stdout"] == f"out {n4}\n"
    # Live lines (pdsh-style) come through the relays as well.
    live = _exec(sb, "--tree", "on", "--no-fold", "--", CMD)
    assert sorted(ln for ln in live.stdout.splitlines()) == sorted(f"{h}: out {h}" for h in sb.nodes)


@pytest.mark.sandbox
def test_a_node_its_relay_cannot_log_in_to_is_reached_from_here(mesh_sandbox) -> None:
    sb = mesh_sandbox
    n1, n2 = sb.nodes[:2]
    _forget_relay_connections(sb)
    known = sb.node_dir(n1) / "ssh" / "known_hosts"
    saved = known.read_text()
    known.write_text("")  # n1 no longer knows n2's host key: ssh refuses, as it should
    try:
        res = _exec(sb, "--tree", "on", "--", "hostname")
        rows = _rows(_exec(sb, "--tree", "on", "--json", "--", "hostname"))
    finally:
        known.write_text(saved)
    assert res.returncode == 0, res.stderr
    assert f"{n1} -> {n2}: Host key verification failed" in res.stderr and "reached from here" in res.stderr
    assert rows[n2]["via"] is None and rows[n2]["stdout"] == f"{n2}\n"
    assert rows[n1]["via"] == n1


@pytest.mark.sandbox
def test_a_relay_that_cannot_start_has_its_group_reached_from_here(mesh_sandbox, tmp_path: Path) -> None:
    sb = mesh_sandbox
    n3, n4 = sb.nodes[2:]
    text = sb.cluster_file.read_text().replace(f'name = "{n3}"\n', f'name = "{n3}"\npython = "/nonexistent/python3"\n')
    bad = tmp_path / "corral.toml"
    bad.write_text(text)
    res = _exec(sb, "--tree", "on", "--", "hostname", cluster=bad)
    assert res.returncode == 0, res.stderr
    assert f"relay {n3} could not run" in res.stderr and "/nonexistent/python3" in res.stderr
    rows = _rows(_exec(sb, "--tree", "on", "--json", "--", "hostname", cluster=bad))
    assert (rows[n3]["via"], rows[n4]["via"], rows[n4]["stdout"]) == (None, None, f"{n4}\n")


def _sleepers(sb, mark: str) -> dict:
    return {n: sb.exec(n, ["sh", "-c", f"pgrep -f '[s]leep {mark}' || true"]).stdout.split() for n in sb.nodes}


@pytest.mark.sandbox
def test_ctrl_c_and_timeout_through_relays_leave_nothing_running(mesh_sandbox) -> None:
    sb = mesh_sandbox
    proc = subprocess.Popen([*CORRAL, "exec", "-c", str(sb.cluster_file), "--tree", "on", "--", "sleep 61"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(_sleepers(sb, "61").values()):
        time.sleep(0.2)
    assert all(_sleepers(sb, "61").values()), "the command did not start on every node"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert _sleepers(sb, "61") == {n: [] for n in sb.nodes}
    res = _exec(sb, "--tree", "on", "--timeout", "1", "--json", "--", "sleep 62")
    assert res.returncode == 124, res.stderr
    assert {r["returncode"] for r in _rows(res).values()} == {124}
    time.sleep(0.5)
    assert _sleepers(sb, "62") == {n: [] for n in sb.nodes}


@pytest.mark.sandbox
def test_a_relay_lost_mid_command_names_its_nodes_and_runs_nothing_twice(mesh_sandbox) -> None:
    sb = mesh_sandbox
    n1, n2, n3, n4 = sb.nodes
    proc = subprocess.Popen([*CORRAL, "exec", "-c", str(sb.cluster_file), "--tree", "on", "--json", "--",
                             "echo start >> /tmp/tree-runs; case $(hostname) in *n3|*n4) sleep 63;; esac; hostname"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_sleepers(sb, "63")[n] for n in (n3, n4)):
            time.sleep(0.2)
        # The relay's own process on n3 dies (an OOM kill, a node crash): its
        # members' channels close, so the command stops there too.
        sb.exec(n3, ["sh", "-c", "pkill -KILL -f '[_]r=getattr'"])
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = {h["host"]: h for h in json.loads(out)["hosts"]}
    assert proc.returncode == 3, err
    for host in (n3, n4):
        assert rows[host]["via"] == n3 and rows[host]["returncode"] == 255
        assert f"relay {n3} stopped while the command ran here" in rows[host]["error"]
    assert {rows[h]["stdout"] for h in (n1, n2)} == {f"{n1}\n", f"{n2}\n"}
    time.sleep(0.5)
    assert _sleepers(sb, "63") == {n: [] for n in sb.nodes}
    runs = {n: sb.exec(n, ["sh", "-c", "cat /tmp/tree-runs; rm -f /tmp/tree-runs"]).stdout for n in sb.nodes}
    assert runs == dict.fromkeys(sb.nodes, "start\n")  # n3 and n4 were not run a second time


@pytest.mark.sandbox
def test_a_relay_that_never_starts_is_stopped_and_its_group_reached_from_here(mesh_sandbox, monkeypatch) -> None:
    """A relay whose login shell reads corral's input as its own (``exec zsh``
    in ~/.bashrc) never says it started: without a limit, exec waited forever."""
    from dataclasses import replace

    from corral.transport.fanout import run_everywhere

    sb = mesh_sandbox
    n1, n2 = sb.nodes[:2]
    sb.exec(n1, ["sh", "-c", "printf '#!/bin/sh\\nexec cat >/dev/null\\n' >/tmp/swallow && chmod +x /tmp/swallow"])
    monkeypatch.setattr(tree, "START_GRACE_S", 1.0)
    cluster = sb.cluster()
    cluster = replace(cluster, hosts=tuple(h.with_(python="/tmp/swallow") if h.name == n1 else h
                                           for h in cluster.hosts))
    notices: list[str] = []
    try:
        results = {r.host: r for r in run_everywhere(cluster, "hostname", tree=True, connect_timeout=2,
                                                     on_notice=notices.append)}
    finally:
        sb.exec(n1, ["rm", "-f", "/tmp/swallow"])
    assert (results[n1].via, results[n1].stdout, results[n2].via, results[n2].stdout) == (None, f"{n1}\n", None, f"{n2}\n")
    assert any(f"relay {n1} could not run (it did not start in time" in n for n in notices), notices
    assert all(r.ok for r in results.values())
