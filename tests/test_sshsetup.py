"""`corral ssh setup / teardown / check`.

Pure parts (marked blocks, the node-side manifest, host-key hashing and
judging with the real ssh-keygen, the askpass broker with its real helper)
run anywhere.  The sandbox tests start from a sandbox of their own with
password-only test users on port 2222 (it changes node state) and check the
promises of docs/ssh.md from the outside: node files before and after,
/proc of every process while a password is in use, pdsh and DeepSpeed's
own runner from a node.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import PEAK_RSS_KIB, RESET_PEAK_RSS, ninja_path
from typing_extensions import Self

from corral.cli import cli
from corral.errors import HostError, PreflightError
from corral.hostrange import fold
from corral.model import Host
from corral.sshsetup import hostkeys, nodeside, plan, steps
from corral.sshsetup.askpass import PasswordBroker, is_password_prompt

REPO = Path(__file__).resolve().parents[1]
CORRAL = [sys.executable, "-m", "corral"]
ROOT = os.geteuid() == 0


# ---------------------------------------------------------------------------
# marked blocks and the node-side manifest (run here, with a private home)


def test_set_block_replaces_in_place_and_strip_restores_exactly() -> None:
    text = "ssh-rsa AAA user@laptop"  # no trailing newline: set_block adds one
    with_block, added = nodeside.set_block(text, "c1", ["k1", "k2"])
    assert (
        added
        and with_block == "ssh-rsa AAA user@laptop\n# corral begin c1\nk1\nk2\n# corral end c1\n"
    )
    again, added2 = nodeside.set_block(with_block + "tail\n", "c1", ["k3"])
    assert (
        not added2
        and again == "ssh-rsa AAA user@laptop\n# corral begin c1\nk3\n# corral end c1\ntail\n"
    )
    assert nodeside.strip_block(with_block, "c1", newline_added=True) == text
    two, _ = nodeside.set_block(with_block, "c2", ["x"])
    assert nodeside.block_lines(two, "c1") == ["k1", "k2"] and nodeside.block_lines(two, "c2") == [
        "x"
    ]
    assert nodeside.block_lines(nodeside.strip_block(two, "c1"), "c2") == ["x"]


def test_unterminated_block_is_an_error_not_a_guess() -> None:
    with pytest.raises(nodeside.NodeError):
        nodeside.find_block("# corral begin c1\nk1\n", "c1")


@pytest.fixture
def node_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "nodehome"
    home.mkdir()
    monkeypatch.setattr(nodeside, "home", lambda: str(home))
    return home


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else p.read_text()
    return out


def test_apply_is_idempotent_and_teardown_restores_the_home(node_home: Path) -> None:
    (node_home / ".ssh").mkdir(mode=0o700)
    (node_home / ".ssh" / "known_hosts").write_text("old.example ssh-ed25519 AAAA")  # no newline
    before = _snapshot(node_home)
    facts = nodeside.inspect("c1")
    assert (
        facts["public_key"].startswith("ssh-ed25519 ")
        and "generated ~/.ssh/id_ed25519" in facts["changes"]
    )
    blocks = {
        "authorized_keys": ["k-head", facts["public_key"]],
        "known_hosts": ["[n1]:2222 ssh-ed25519 B"],
    }
    assert nodeside.apply("c1", blocks)
    assert nodeside.apply("c1", blocks) == []  # second run: nothing to do
    assert oct((node_home / ".ssh" / "authorized_keys").stat().st_mode & 0o777) == "0o600"
    changes = nodeside.teardown("c1")
    assert any("id_ed25519" in c for c in changes)
    assert _snapshot(node_home) == before


def test_a_key_shared_by_two_cluster_ids_survives_the_first_teardown(node_home: Path) -> None:
    key = nodeside.inspect("a")["public_key"]
    nodeside.apply("a", {"authorized_keys": [key]})
    assert nodeside.inspect("b")["public_key"] == key  # reused, not regenerated
    nodeside.apply("b", {"authorized_keys": [key, "other"]})
    nodeside.teardown("a")
    assert (node_home / ".ssh" / "id_ed25519").exists()
    assert nodeside.block_lines((node_home / ".ssh" / "authorized_keys").read_text(), "b") == [
        key,
        "other",
    ]
    nodeside.teardown("b")
    assert not (node_home / ".ssh").exists()


def _verdict(known_hosts: Path) -> hostkeys.HostKeys:
    target = hostkeys.Target(
        host=Host(name="n1"), hostname="10.0.0.1", port=22, user="u", key_name="n1",
        known_hosts=(str(known_hosts),), global_known_hosts=(), hash_known_hosts=False,
    )
    return hostkeys.HostKeys(target=target, status="new", keys=(("ssh-ed25519", "AAAAC3Nz"),))


def test_head_known_hosts_created_by_setup_is_deleted_by_teardown(tmp_path: Path) -> None:
    kh = tmp_path / "dot-ssh" / "known_hosts"
    verdicts = {"n1": _verdict(kh)}
    steps.head_known_hosts(verdicts, "c1", dry_run=False)
    assert "n1 ssh-ed25519 AAAAC3Nz" in kh.read_text()
    steps.head_known_hosts(verdicts, "c1", dry_run=False)  # a second setup keeps the mark
    changes = steps.head_known_hosts(verdicts, "c1", dry_run=False, remove=True)
    assert not kh.exists(), kh.read_text()
    assert changes and "deleted" in changes[0]


def test_head_known_hosts_the_user_had_keeps_its_lines(tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_text("other ssh-ed25519 AAAAmine\n")
    verdicts = {"n1": _verdict(kh)}
    steps.head_known_hosts(verdicts, "c1", dry_run=False)
    steps.head_known_hosts(verdicts, "c1", dry_run=False, remove=True)
    assert kh.read_text() == "other ssh-ed25519 AAAAmine\n"
    kh.write_text("")  # an empty file the user had stays (empty) too
    steps.head_known_hosts(verdicts, "c1", dry_run=False)
    steps.head_known_hosts(verdicts, "c1", dry_run=False, remove=True)
    assert kh.exists() and kh.read_text() == ""


def test_an_existing_key_is_used_and_never_deleted(node_home: Path) -> None:
    ssh = node_home / ".ssh"
    ssh.mkdir(mode=0o700)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / "id_ed25519")], check=True
    )
    before = _snapshot(node_home)
    facts = nodeside.inspect("c1")
    assert (
        facts["changes"] == []
        and facts["public_key"] == (ssh / "id_ed25519.pub").read_text().strip()
    )
    nodeside.apply("c1", {"authorized_keys": ["x"]})
    nodeside.teardown("c1")
    assert _snapshot(node_home) == before


# ---------------------------------------------------------------------------
# host keys, with the real ssh-keygen


def _target(tmp_path: Path, port: int = 2222, hashed: bool = False) -> hostkeys.Target:
    return hostkeys.Target(
        host=Host(name="gpu1"),
        hostname="10.9.9.9",
        port=port,
        user="u",
        key_name="10.9.9.9",
        known_hosts=(str(tmp_path / "kh"),),
        global_known_hosts=(),
        hash_known_hosts=hashed,
    )


@pytest.mark.parametrize(("said", "maxstartups"), [
    # what ssh-keyscan said on the sandbox with `MaxStartups 1` in the node's sshd_config
    ("10.9.9.9: Connection closed by remote host", True),
    ("connect (`10.9.9.9'): Connection refused", False),
])
def test_a_host_whose_sshd_drops_the_key_scan_is_told_apart_from_one_that_is_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: str, maxstartups: bool) -> None:
    fake = tmp_path / "bin" / "ssh-keyscan"
    fake.parent.mkdir()
    (tmp_path / "said").write_text(said + "\n")
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'said'} >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(HostError) as e:
        asyncio.run(hostkeys.scan(_target(tmp_path)))
    assert e.value.host == "gpu1" and said in e.value.message
    assert ("MaxStartups" in e.value.hint) is maxstartups
    assert ("sshd listens on that port" in e.value.hint) is not maxstartups


def _keypair(tmp_path: Path, name: str) -> tuple[str, str]:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True
    )
    t, b, *_ = (tmp_path / f"{name}.pub").read_text().split()
    return t, b


def test_judge_new_known_changed_with_hashed_entries(tmp_path: Path) -> None:
    target = _target(tmp_path)
    good, other = _keypair(tmp_path, "h1"), _keypair(tmp_path, "h2")
    verdict = hostkeys.judge(target, [good])
    assert verdict.status == "new" and verdict.fingerprints[0].startswith("SHA256:")
    # What setup writes for a host whose ssh config says HashKnownHosts yes:
    # ssh-keygen -F must find it.
    lines = hostkeys.known_hosts_lines(["10.9.9.9"], 2222, (good,), hashed=True)
    assert lines[0].startswith("|1|")
    (tmp_path / "kh").write_text("\n".join(lines) + "\n")
    assert hostkeys.judge(target, [good]).status == "known"
    changed = hostkeys.judge(target, [other])
    assert changed.status == "changed"
    err = hostkeys.changed_error(changed)
    assert err.host == "gpu1" and "CHANGED" in err.message and "ssh-keygen -R" in (err.hint or "")


def test_known_hosts_patterns_use_brackets_for_other_ports() -> None:
    assert hostkeys.patterns(["n1", "10.0.0.1", "n1"], 2222) == ["[n1]:2222", "[10.0.0.1]:2222"]
    assert hostkeys.patterns(["n1"], 22) == ["n1"]


def test_plan_blocks_for_a_port_2222_cluster() -> None:
    target = hostkeys.Target(
        host=Host(name="n1", user="ml"),
        hostname="10.0.0.1",
        port=2222,
        user="ml",
        key_name="10.0.0.1",
        known_hosts=(),
        global_known_hosts=(),
        hash_known_hosts=False,
    )
    verdicts = {
        "n1": hostkeys.HostKeys(target=target, status="known", keys=(("ssh-ed25519", "AAAA"),))
    }
    facts = {
        "n1": {
            "public_key": "ssh-ed25519 NODE corral@n1",
            "hostnames": ["n1.local"],
            "has_block": {},
        }
    }
    peers = plan.peers(verdicts, facts)
    out = plan.blocks(
        "ssh-ed25519 HEAD me", peers, facts, want_ssh_config=True, want_etc_hosts=True
    )["n1"]
    assert out["authorized_keys"] == ["ssh-ed25519 HEAD me", "ssh-ed25519 NODE corral@n1"]
    assert out["known_hosts"] == ["[n1]:2222,[n1.local]:2222,[10.0.0.1]:2222 ssh-ed25519 AAAA"]
    assert out["ssh_config"] == [
        "Host n1 n1.local",
        "    HostName 10.0.0.1",
        "    Port 2222",
        "    User ml",
    ]
    assert out["etc_hosts"] == ["10.0.0.1\tn1 n1.local"]
    bare = plan.matrix_argv(peers[0], bare=True)
    assert bare[-2:] == ["n1", "true"] and "-p" not in bare and "BatchMode=yes" in bare


def _one_node(hostnames: list, public_key: str = "ssh-ed25519 AAAAC3Nz corral@n1"):
    target = hostkeys.Target(
        host=Host(name="n1"), hostname="10.0.0.1", port=22, user="ml", key_name="10.0.0.1",
        known_hosts=(), global_known_hosts=(), hash_known_hosts=False,
    )
    verdicts = {"n1": hostkeys.HostKeys(target=target, status="known",
                                        keys=(("ssh-ed25519", "AAAA"),))}
    return verdicts, {"n1": {"public_key": public_key, "hostnames": hostnames, "has_block": {}}}


@pytest.mark.parametrize(
    "reported",
    [
        "*",  # `Host *`: every node's ssh traffic to this one
        "n1\n    ProxyCommand touch /tmp/pwned",  # a directive of its own
        "-oProxyCommand=x",
        "gpu 1",
        "gpu?",
        "a,b",
        "x" * 300,
    ],
)
def test_a_node_reporting_a_bad_host_name_is_refused_before_any_block(reported: str) -> None:
    verdicts, facts = _one_node(["n1", reported])
    with pytest.raises(PreflightError) as err:
        plan.peers(verdicts, facts)
    assert err.value.problems[0].host == "n1"
    assert "not a valid host name" in err.value.message
    assert "nothing was written" in err.value.message


def test_a_node_reporting_a_key_with_options_or_two_lines_is_refused() -> None:
    for key in ("ssh-ed25519 AAAA a\nssh-rsa BBBB b", 'command="sh" ssh-ed25519 AAAA x'):
        verdicts, facts = _one_node(["n1"], public_key=key)
        with pytest.raises(PreflightError, match="not one OpenSSH public key line"):
            plan.peers(verdicts, facts)


def test_plain_reported_names_and_fqdns_still_make_blocks() -> None:
    verdicts, facts = _one_node(["n1", "n1.lab.example.com", "my_box", "10.0.0.1"])
    peers = plan.peers(verdicts, facts)
    assert peers[0].aliases == ("n1.lab.example.com", "my_box")


# ---------------------------------------------------------------------------
# the askpass broker, with its real helper program


def test_askpass_helper_gets_the_password_over_the_socket_only() -> None:
    secret = "s3cret-" + uuid.uuid4().hex

    async def go() -> tuple[
        subprocess.CompletedProcess, subprocess.CompletedProcess, dict, PasswordBroker
    ]:
        async with PasswordBroker({"n1": secret}, max_answers=1) as broker:
            env = broker.env_for("n1")
            assert oct(broker.socket_path.parent.stat().st_mode & 0o777) == "0o700"

            def helper(prompt: str) -> subprocess.CompletedProcess:
                return subprocess.run(
                    [str(broker.helper_path), prompt],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )

            first = await asyncio.to_thread(helper, "corral@n1's password: ")
            second = await asyncio.to_thread(helper, "corral@n1's password: ")  # over max_answers
            return first, second, env, broker

    first, second, env, broker = asyncio.run(go())
    assert first.returncode == 0 and first.stdout == secret + "\n"
    assert second.returncode != 0 and second.stdout == ""
    assert all(secret not in v for v in env.values())
    assert secret not in broker.helper_path.read_text() if broker.helper_path.exists() else True
    assert not broker.socket_path.parent.exists()  # removed on exit


def test_only_password_prompts_are_answered() -> None:
    assert is_password_prompt("corral@10.0.0.1's password: ") and is_password_prompt("Password:")
    assert not is_password_prompt("Enter passphrase for key '/root/.ssh/id_ed25519': ")
    assert not is_password_prompt(
        "Are you sure you want to continue connecting (yes/no/[fingerprint])?"
    )


def test_ssh_help_lists_the_subcommands() -> None:
    result = CliRunner().invoke(cli, ["ssh", "--help"])
    assert result.exit_code == 0
    for word in ("setup", "teardown", "check"):
        assert word in result.output
    setup_help = CliRunner().invoke(cli, ["ssh", "setup", "--help"]).output
    for flag in (
        "--accept-new",
        "--ssh-config",
        "--etc-hosts",
        "--password-stdin",
        "--same-password",
        "--dry-run",
    ):
        assert flag in setup_help


# ---------------------------------------------------------------------------
# on a sandbox of its own: password-only test users, sshd on 2222

PASSWORD = "pw-" + uuid.uuid4().hex[:16]


@pytest.fixture(scope="module")
def pw_sandbox(tmp_path_factory: pytest.TempPathFactory):
    if not ROOT:
        pytest.skip("the sandbox needs root (network/PID/mount namespaces); CI runs as root")
    from corral.sandbox import Sandbox

    tag = f"s{os.getpid()}"
    sb = Sandbox(
        name=f"{tag}-ssh", prefix=f"{tag}n", state_dir=tmp_path_factory.mktemp("pwsb") / "state"
    )
    try:
        sb.up(3, ssh_port=2222, password_auth=True, with_keys=True, password=PASSWORD)
        yield sb
    finally:
        sb.down()


@pytest.fixture(scope="module")
def head(pw_sandbox, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A head for the test user: its own key, an empty known_hosts, a cluster file."""
    d = tmp_path_factory.mktemp("head")
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "head", "-f", str(d / "id")],
        check=True,
    )
    (d / "known_hosts").write_text("")
    hosts = "".join(
        f'\n[[hosts]]\nname = "{n}"\naddress = "{a}"\n' for n, a in pw_sandbox.addresses.items()
    )
    (d / "corral.toml").write_text(
        f'[cluster]\nname = "mesh"\npython = "python3"\nuser = "corral"\nport = 2222\n'
        f'ssh_options = ["UserKnownHostsFile={d / "known_hosts"}"]\n{hosts}'
    )
    return {
        "dir": d,
        "cluster": d / "corral.toml",
        "identity": d / "id",
        "known_hosts": d / "known_hosts",
    }


_SNAP = r"""
import hashlib, json, os, sys
out = {}
for top in sys.argv[1:]:
    out[top] = ["top", os.path.exists(top)]
    if not os.path.exists(top):
        continue
    if os.path.isdir(top):
        walk = os.walk(top)
    else:
        walk = [(os.path.dirname(top), [], [os.path.basename(top)])]
    for dirpath, dirs, files in walk:
        for name in sorted(dirs) + sorted(files):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if os.path.isdir(p):
                out[p] = ["d", oct(st.st_mode & 0o7777)]
            elif os.path.exists(p):
                digest = hashlib.sha256(open(p, "rb").read()).hexdigest()
                out[p] = ["f", oct(st.st_mode & 0o7777), digest]
print(json.dumps(out, sort_keys=True))
"""


def node_state(sb, node: str) -> dict:
    """Everything setup may touch on a node: the test user's home, root's ~/.ssh, /etc/hosts."""
    proc = sb.exec(
        node,
        [
            sys.executable,
            "-I",
            "-c",
            _SNAP,
            "/home/corral",
            "/srv/home/corral",
            "/root/.ssh",
            "/etc/hosts",
        ],
        check=True,
    )
    return json.loads(proc.stdout)


def corral(
    *args: str, input: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CORRAL, *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


def run_in_pty(
    argv: list[str], answers: list[tuple[str, str]], *, timeout: float = 180
) -> tuple[int, str]:
    """Run ``argv`` on a terminal, typing each answer when its prompt appears."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.chdir(REPO)
        os.execvp(argv[0], argv)
    output, seen, pending = b"", 0, list(answers)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        output += data
        plain = re.sub(rb"\x1b\[[0-9;]*[A-Za-z]", b"", output)
        if pending and pending[0][0].encode() in plain[seen:]:
            seen = plain.index(pending[0][0].encode(), seen) + 1
            os.write(fd, pending.pop(0)[1].encode() + b"\r")
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), re.sub(
        r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode(errors="replace")
    )


class ProcWatch:
    """Reads every process's argv and environment while running: is ``secret`` ever there?"""

    def __init__(self, secret: str):
        self.secret = secret.encode()
        self.leaks: list[str] = []
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) == me:
                    continue
                for what in ("cmdline", "environ"):
                    try:
                        data = Path(f"/proc/{entry}/{what}").read_bytes()
                    except OSError:
                        continue
                    self.seen.add(int(entry))
                    if self.secret in data:
                        self.leaks.append(f"{entry} {what}: {data[:200]!r}")
            time.sleep(0.02)


@pytest.mark.sandbox
def test_first_contact_full_mesh_from_password_only_nodes(pw_sandbox, head) -> None:
    """On a terminal: fingerprints shown and confirmed, the password typed once
    and reused, a full mesh at the end; the password never in any process's
    argv or environment, on the head or in the nodes."""
    nodes = pw_sandbox.nodes
    before = {n: node_state(pw_sandbox, n) for n in nodes}
    pw_sandbox.__dict__["_before"] = before  # for the teardown test
    argv = [
        *CORRAL,
        "ssh",
        "setup",
        "-c",
        str(head["cluster"]),
        "--identity",
        str(head["identity"]),
        "--ssh-config",
    ]
    with ProcWatch(PASSWORD) as watch:
        rc, out = run_in_pty(
            argv,
            [("trust these keys", "y"), ("password for corral@", PASSWORD), ("same password", "y")],
        )
    assert rc == 0, out
    assert "SHA256:" in out and "first contact" in out
    assert (
        out.count("password for corral@") == 1 and "same password for" in out
    )  # asked once, reused
    assert "all 9 logins work" in out
    assert watch.leaks == [], watch.leaks
    assert len(watch.seen) > 20  # the watcher really looked (ssh, sshd, askpass helpers...)
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("corral-askpass-*"))
    # Every node has its own key; only public keys travelled.
    keys = {
        n: pw_sandbox.exec(
            n, ["cat", "/home/corral/.ssh/id_ed25519.pub"], check=True
        ).stdout.split()[1]
        for n in nodes
    }
    assert len(set(keys.values())) == 3
    for n in nodes:
        auth = pw_sandbox.exec(n, ["cat", "/home/corral/.ssh/authorized_keys"], check=True).stdout
        assert all(k in auth for k in keys.values())
        known = pw_sandbox.exec(n, ["cat", "/home/corral/.ssh/known_hosts"], check=True).stdout
        for peer, addr in pw_sandbox.addresses.items():
            assert f"[{peer}]:2222" in known and f"[{addr}]:2222" in known
        priv = pw_sandbox.exec(n, ["cat", "/home/corral/.ssh/id_ed25519"], check=True).stdout
        for other in nodes:
            if other != n:
                files = pw_sandbox.exec(
                    other, ["sh", "-c", "cat /home/corral/.ssh/* 2>/dev/null"]
                ).stdout
                assert priv.strip().splitlines()[3] not in files  # a line of secret material


@pytest.mark.sandbox
def test_rerun_is_a_noop_and_says_so(pw_sandbox, head) -> None:
    state = {n: node_state(pw_sandbox, n) for n in pw_sandbox.nodes}
    res = corral(
        "ssh", "setup", "-c", str(head["cluster"]), "--identity", str(head["identity"]), "--json"
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["changed"] is False and report["by_password"] == []
    assert report["matrix"]["ok"] is True
    assert {n: node_state(pw_sandbox, n) for n in pw_sandbox.nodes} == state
    text = corral("ssh", "setup", "-c", str(head["cluster"]), "--identity", str(head["identity"]))
    assert "nothing to do" in text.stdout


@pytest.mark.sandbox
def test_check_prints_the_matrix_and_etc_hosts_needs_root(pw_sandbox, head) -> None:
    res = corral(
        "ssh", "check", "-c", str(head["cluster"]), "--identity", str(head["identity"]), "--json"
    )
    assert res.returncode == 0, res.stderr
    matrix = json.loads(res.stdout)
    assert matrix["ok"] and set(matrix["cells"]) == set(pw_sandbox.nodes)
    state = {n: node_state(pw_sandbox, n) for n in pw_sandbox.nodes}
    denied = corral(
        "ssh",
        "setup",
        "-c",
        str(head["cluster"]),
        "--identity",
        str(head["identity"]),
        "--etc-hosts",
    )
    assert denied.returncode == 3
    # every node is refused the same way: said once, for the folded host set
    assert f"{fold(pw_sandbox.nodes)}: /etc/hosts is not writable for corral" in denied.stderr
    assert "run setup as root" in denied.stderr
    assert {n: node_state(pw_sandbox, n) for n in pw_sandbox.nodes} == state  # checked first


@pytest.mark.sandbox
def test_pdsh_works_from_a_node_with_no_manual_step(pw_sandbox, head) -> None:
    first = pw_sandbox.nodes[0]
    prefix = pw_sandbox.nodes[0][:-1]
    res = subprocess.run(
        [
            "ssh",
            "-i",
            str(head["identity"]),
            "-o",
            f"UserKnownHostsFile={head['known_hosts']}",
            "-o",
            "BatchMode=yes",
            "-p",
            "2222",
            f"corral@{pw_sandbox.addresses[first]}",
            f"pdsh -R ssh -w {prefix}[1-3] hostname",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"{n}: {n}" for n in pw_sandbox.nodes]


@pytest.mark.sandbox
def test_changed_host_key_is_an_error_naming_the_host(pw_sandbox, head, tmp_path: Path) -> None:
    victim = pw_sandbox.nodes[2]
    wrong = tmp_path / "wrong"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True)
    kh = tmp_path / "known_hosts"
    good = head["known_hosts"].read_text()
    fake = f"[{pw_sandbox.addresses[victim]}]:2222 " + " ".join(
        (tmp_path / "wrong.pub").read_text().split()[:2]
    )
    kh.write_text(fake + "\n")
    cluster = tmp_path / "corral.toml"
    cluster.write_text(head["cluster"].read_text().replace(str(head["known_hosts"]), str(kh)))
    state = {n: node_state(pw_sandbox, n) for n in pw_sandbox.nodes}
    res = corral(
        "ssh",
        "setup",
        "-c",
        str(cluster),
        "--identity",
        str(head["identity"]),
        "--accept-new",
        "--password-stdin",
        input=PASSWORD + "\n",
    )
    assert res.returncode == 3
    assert f"{victim}: its host key has CHANGED" in res.stderr
    assert {n: node_state(pw_sandbox, n) for n in pw_sandbox.nodes} == state  # nothing touched
    assert head["known_hosts"].read_text() == good


@pytest.mark.sandbox
def test_wrong_password_names_the_hosts(pw_sandbox, tmp_path: Path) -> None:
    kh = tmp_path / "kh"
    kh.write_text("")
    hosts = "".join(
        f'\n[[hosts]]\nname = "{n}"\naddress = "{a}"\n' for n, a in pw_sandbox.addresses.items()
    )
    cluster = tmp_path / "c.toml"
    cluster.write_text(
        f'[cluster]\nname = "other"\npython = "python3"\nuser = "corral"\nport = 2222\n'
        f'ssh_options = ["UserKnownHostsFile={kh}", "IdentitiesOnly=yes", '
        f'"IdentityFile={tmp_path}/none"]\n{hosts}'
    )
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "id")], check=True
    )
    res = corral(
        "ssh",
        "setup",
        "-c",
        str(cluster),
        "--identity",
        str(tmp_path / "id"),
        "--accept-new",
        "--password-stdin",
        input="not-the-password\n",
    )
    assert res.returncode == 3, res.stdout + res.stderr
    assert "password was refused" in res.stderr
    assert f"{fold(pw_sandbox.nodes)}: the password was refused" in res.stderr  # every host, said once


@pytest.mark.sandbox
def test_root_setup_with_etc_hosts_then_deepspeed_pdsh_runner(pw_sandbox, torch_extensions) -> None:
    """Root already has the head's key ("or already by key"); nodes know nothing
    of each other.  After setup, DeepSpeed's own runner (pdsh -R ssh) launches a
    2-node gloo job from the first node with no manual step (every rank imports
    DeepSpeed twice: two nodes are a multi-node job at two thirds of three's CPU)."""
    cluster = str(pw_sandbox.cluster_file)
    before = {n: node_state(pw_sandbox, n) for n in pw_sandbox.nodes}
    res = corral(
        "ssh", "setup", "-c", cluster, "--ssh-config", "--etc-hosts", "--id", "rootmesh", "--json"
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["matrix"]["ok"]
    for n in pw_sandbox.nodes:
        hosts = pw_sandbox.exec(n, ["cat", "/etc/hosts"], check=True).stdout
        assert "# corral begin rootmesh" in hosts
    script = (
        "import socket, torch, torch.distributed as dist, deepspeed\n"
        "deepspeed.init_distributed(dist_backend='gloo')\n"
        "t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} on {socket.gethostname()} sum={int(t.item())}',\n"
        "      flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    hostfile = "".join(f"{n} slots=1\n" for n in pw_sandbox.nodes[:2])
    for n in pw_sandbox.nodes:  # /srv is private to each node: the same files at the same path
        d = pw_sandbox.node_dir(n) / "srv" / "ds"
        d.mkdir(parents=True, exist_ok=True)
        (d / "tiny.py").write_text(script)
        (d / "hostfile").write_text(hostfile)
        # DeepSpeed's runner exports ./.deepspeed_env to every node: its CPU comm op is
        # built once, in the checkout's cache (visible on every node), not in the
        # machine's ~/.cache, where a build killed half-way leaves a lock for ever.
        # PATH: the venv's, as an activated one would be (conftest.ninja_path).
        (d / ".deepspeed_env").write_text(f"TORCH_EXTENSIONS_DIR={torch_extensions}\n"
                                          f"PATH={ninja_path('/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin')}\n")
    ds = str(Path(sys.executable).with_name("deepspeed"))
    run = pw_sandbox.exec(
        pw_sandbox.nodes[0],
        [
            "bash",
            "-c",
            (
                f"cd /srv/ds && DS_ACCELERATOR=cpu {ds} "
                f"--hostfile hostfile --master_port 29571 tiny.py"
            ),
        ],
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("sum=3") == 2, run.stdout[-3000:]
    down = corral("ssh", "teardown", "-c", cluster, "--id", "rootmesh")
    assert down.returncode == 0, down.stderr
    for n in pw_sandbox.nodes:
        after = node_state(pw_sandbox, n)
        assert {k: v for k, v in after.items() if k.startswith(("/root", "/etc"))} == {
            k: v for k, v in before[n].items() if k.startswith(("/root", "/etc"))
        }


_SETHOSTNAME = "import socket, sys; socket.sethostname(sys.argv[1])"


@pytest.mark.sandbox
@pytest.mark.parametrize("evil", ["*", "{victim}\n    ProxyCommand touch {mark}"])
def test_a_node_that_names_itself_a_pattern_or_a_directive_is_refused(pw_sandbox, evil) -> None:
    """The attack: one node's host name is `*` (its `Host *` block would take every
    node's ssh traffic) or carries a newline and a ProxyCommand (which the login
    check would run on the other nodes).  Setup names that node and writes nothing."""
    victim = pw_sandbox.nodes[1]
    mark = f"/tmp/pwned-{uuid.uuid4().hex[:8]}"
    evil = evil.format(victim=victim, mark=mark)
    before = {n: node_state(pw_sandbox, n) for n in pw_sandbox.nodes}
    pw_sandbox.exec(victim, [sys.executable, "-I", "-c", _SETHOSTNAME, evil], check=True)
    try:
        assert pw_sandbox.exec(victim, ["hostname"], check=True).stdout.startswith(evil[:1])
        res = corral("ssh", "setup", "-c", str(pw_sandbox.cluster_file), "--ssh-config",
                     "--etc-hosts", "--id", "evilname")
    finally:
        pw_sandbox.exec(victim, [sys.executable, "-I", "-c", _SETHOSTNAME, victim], check=True)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"{victim}: reports its host name as {evil!r}" in res.stderr
    for n in pw_sandbox.nodes:
        assert node_state(pw_sandbox, n) == before[n], n
        assert pw_sandbox.exec(n, ["test", "-e", mark]).returncode != 0
    assert pw_sandbox.exec(victim, ["hostname"], check=True).stdout.strip() == victim


@pytest.mark.sandbox
def test_teardown_restores_the_starting_state(pw_sandbox, head) -> None:
    before = pw_sandbox.__dict__.get("_before")
    if before is None:
        pytest.skip("needs the first-contact test to have run first")
    res = corral("ssh", "teardown", "-c", str(head["cluster"]), "--identity", str(head["identity"]))
    assert res.returncode == 0, res.stderr
    assert "deleted ~/.ssh/id_ed25519" in res.stdout
    for n in pw_sandbox.nodes:
        assert node_state(pw_sandbox, n) == before[n]
    assert head["known_hosts"].read_text() == ""
    # And the key no longer works (fresh connection, no multiplexing).
    probe = subprocess.run(
        [
            "ssh",
            "-i",
            str(head["identity"]),
            "-o",
            f"UserKnownHostsFile={head['known_hosts']}",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            "BatchMode=yes",
            "-o",
            "ControlPath=none",
            "-p",
            "2222",
            f"corral@{pw_sandbox.addresses[pw_sandbox.nodes[0]]}",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert probe.returncode == 255 and "Permission denied" in probe.stderr


def test_ssh_check_on_a_name_that_does_not_resolve_says_so() -> None:
    # It got the sshd/port-2222 hint, about a host nothing was ever dialled at.
    res = CliRunner().invoke(cli, ["ssh", "check", "-H", "gpu-typo.invalid", "--json"])
    assert res.exit_code == 3, res.output
    problem = json.loads(res.stdout)["error"]["problems"][0]
    assert problem["host"] == "gpu-typo.invalid"
    assert "'gpu-typo.invalid' does not resolve" in problem["hint"] and "2222" not in problem["hint"]


# ---------------------------------------------------------------------------
# one-shot calls read a bounded answer, whatever the node's login prints


_CHILD_CALL = r'''
import asyncio, json, sys
RESET_PEAK
from corral.model import Host
from corral.sshsetup.remote import call_node, remote_command

flood, forged = sys.argv[1], sys.argv[2]
host = Host(name="chatty")
# A login shell that prints 300 MB before the call runs (an `echo` loop in
# .bashrc, a compromised node), then the node's answer; or, forged, an answer
# line that is not an object, and no call at all.
then = ("echo '@@corral-result@@[1, 2]'" if forged == "forged" else 'exec "$0" "$@"')
argv = ["sh", "-c", flood + ' >&2; ' + flood + '; ' + then, *remote_command(sys.executable)]
src = "def f():\n    return {'ok': [1, 2]}\n"
try:
    value = asyncio.run(call_node(host, argv, "m", src, "f", {}, timeout=120))
    out = {"value": value}
except Exception as e:  # noqa: BLE001 - what the caller sees
    out = {"error": type(e).__name__, "message": str(e)[:300]}
out["rss_mb"] = PEAK_KIB / 1024
print(json.dumps(out))
'''.replace("RESET_PEAK", RESET_PEAK_RSS).replace("PEAK_KIB", PEAK_RSS_KIB)


@pytest.mark.parametrize("forged", ["answer", "forged"])
def test_a_login_shell_printing_without_end_does_not_grow_the_heads_memory(forged: str) -> None:
    """1 GB printed by a node's login shell during sync took the head to 2 GB
    (communicate() kept all of it); the answer is still found after it, and an
    answer that is not an object is a named protocol error, not a traceback."""
    flood = "head -c 300000000 /dev/zero | tr '\\0' x"
    proc = subprocess.run([sys.executable, "-c", _CHILD_CALL, flood, forged],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    if forged == "forged":
        assert out["error"] == "HostError" and "not an object" in out["message"], out
    else:
        assert out["value"] == {"ok": [1, 2]}, out
    assert out["rss_mb"] < 150, out  # was 300 MB x 2 (stdout and stderr kept whole)
