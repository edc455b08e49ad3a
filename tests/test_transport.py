"""How an ssh failure is named (corral's ssh runs with LogLevel=ERROR)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from corral.model import Cluster, Host
from corral.transport.ssh import SSHTransport, classify_ssh_failure


def test_an_ssh_that_ends_without_a_word_is_explained() -> None:
    # `corral exec` on a node stopped or partitioned under the command
    # printed only "ssh failed: exit code 255".
    err = classify_ssh_failure(Host(name="gpu2"), 255, "")
    assert "connection closed while the command ran" in err.message
    assert "went down or rebooted" in err.hint and "`ssh gpu2 true`" in err.hint
    assert classify_ssh_failure(Host(name="gpu2"), 255, "boom").message == "gpu2: ssh failed: boom"


# ---- what the login shell on a node reads -------------------------------------------------

#: Words that mean something to one login shell or another inside or around quotes.
NASTY = ["plain", "two words", "it's", 'say "hi"', "a\\b", "a\\\\\\\\b", "back\\'slash", "hi!",
         "a!b", "!x", "$HOME", "`id`", "$(id)", "~", "*", "{a,b}", "%1", "=1", "=-", "x=1", "^a^b",
         "#c", "a;b", "a|b", "tab\there", "ü日本", "", "'", "\\", "-n"]
LOGIN_SHELLS = ["sh", "dash", "bash", "zsh", "fish", "tcsh", "csh"]


@pytest.mark.parametrize("shell", LOGIN_SHELLS)
def test_every_word_reaches_the_node_intact_whatever_its_login_shell(shell: str) -> None:
    # sshd runs the command line as `$SHELL -c LINE` with the user's login
    # shell.  shlex.quote is POSIX-only: fish reads \\ and \' inside single
    # quotes as escapes (a node whose login shell is fish got a\b for a\\b),
    # csh expands ! inside them ("b: Event not found.").
    path = shutil.which(shell)
    if path is None:
        pytest.skip(f"{shell} is not installed")
    cluster = Cluster(hosts=(Host(name="gpu1"),))
    line = SSHTransport(cluster, multiplex=False).argv(cluster.hosts[0], ["printf", "[%s]\\n", *NASTY])[-1]
    res = subprocess.run([path, "-c", line], check=False, capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"})
    assert res.stdout == "".join(f"[{w}]\n" for w in NASTY), res.stderr


def test_a_key_with_a_passphrase_and_no_agent_is_named(tmp_path, monkeypatch) -> None:
    # BatchMode skips a key it would have to ask a passphrase for, and the
    # server then says only "Permission denied": corral's hint was to install
    # the key, which was installed.
    if shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh-keygen")
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    locked, pem, plain = tmp_path / "locked", tmp_path / "pem", tmp_path / "plain"
    for path, extra in ((locked, ["-N", "secret"]), (pem, ["-N", "secret", "-m", "PEM", "-t", "rsa", "-b", "1024"]),
                        (plain, ["-N", ""])):
        subprocess.run(["ssh-keygen", "-q", "-f", str(path), *(extra if "-t" in extra else ["-t", "ed25519", *extra])],
                       check=True, capture_output=True)
    from corral.transport.ssh import _has_passphrase

    assert _has_passphrase(str(locked)) and _has_passphrase(str(pem)) and not _has_passphrase(str(plain))
    host = Host(name="gpu1")
    cluster = Cluster(hosts=(host,), ssh_options=(f"IdentityFile={locked}", "IdentitiesOnly=yes"))
    err = SSHTransport(cluster, multiplex=False).failure(host, 255, "root@gpu1: Permission denied (publickey).\n")
    assert err.kind == "auth-refused" and f"the key {locked} has a passphrase and no ssh-agent holds it" in err.message
    assert f"ssh-add {locked}" in err.hint
    cluster = Cluster(hosts=(host,), ssh_options=(f"IdentityFile={plain}", "IdentitiesOnly=yes"))
    err = SSHTransport(cluster, multiplex=False).failure(host, 255, "root@gpu1: Permission denied (publickey).\n")
    assert err.message == "gpu1: authentication refused (no accepted key)"


@pytest.mark.parametrize("said", [
    "bash: line 1: 119476: command not found", "sh: 1: 119476: not found", "zsh: command not found: 119476",
    "fish: Unknown command: 119476", "119476: Command not found."])
def test_a_login_shell_replaced_by_another_is_named(said: str) -> None:
    # `exec zsh` in ~/.bashrc: the command corral asked for never runs, and the
    # new shell reads corral's input as commands.  sync said "cannot run the
    # interpreter" (it was there); run waited 40 s for "no answer from the agent".
    err = classify_ssh_failure(Host(name="gpu2"), 127, said + "\n")
    assert err.kind == "login-shell" and "a start-up file starts another shell" in err.message
    assert "`ssh gpu2 echo ok`" in err.hint
    assert classify_ssh_failure(Host(name="gpu2"), 127, "bash: python3: command not found\n").kind == "no-python"


@pytest.mark.parametrize("kind", ["open", "link"])
def test_the_ssh_socket_dir_in_the_temp_dir_is_refused_when_another_user_made_it(kind: str, tmp_path, monkeypatch) -> None:
    """A long home directory name (~/.cache/corral/ssh over the socket path's
    room) and no XDG_RUNTIME_DIR: ssh's ControlMaster sockets go to
    $TMPDIR/corral-<uid>/ssh, where nobody made corral-<uid> first.  They
    went into nobody's directory (a socket there is a login to every node);
    now a named error."""
    import tempfile

    from attacker import prepare, shared_place

    from corral.errors import CorralError
    from corral.transport.ssh import control_dir

    home = tmp_path / ("a-rather-long-home-directory-name-" + "x" * 20)
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with shared_place() as tmp:
        monkeypatch.setenv("TMPDIR", str(tmp))
        monkeypatch.setattr(tempfile, "tempdir", None)
        root = tmp / f"corral-{os.getuid()}"
        prepare(kind, root)
        with pytest.raises(CorralError) as e:
            control_dir()
        assert f"{root} is not safe to use" in e.value.message and "nobody" in e.value.message, e.value.message
        assert not (root / "ssh").exists() and not (tmp / f"{root.name}.theirs" / "ssh").exists()
        # Once it is gone, the same fallback makes its own, private.
        shutil.rmtree(f"{root}.theirs", ignore_errors=True)
        os.unlink(root) if root.is_symlink() else shutil.rmtree(root)
        assert control_dir() == root / "ssh"
        assert all(os.lstat(d).st_mode & 0o777 == 0o700 and os.lstat(d).st_uid == os.geteuid()
                   for d in (root, root / "ssh"))


def test_a_nodes_endless_line_is_quoted_cut_in_an_error() -> None:
    # `corral exec`'s ssh failure quoted the last line of stderr whole: a
    # node (or its login shell) printing one 10 MB line made a 10 MB message.
    from corral.transport.local import LocalTransport
    from corral.transport.ssh import MAX_QUOTE

    line = "ssh: " + "x" * 10_000_000
    for err in (classify_ssh_failure(Host(name="gpu2"), 255, line),
                LocalTransport().failure(Host(name="gpu2", local=True), 1, line)):
        assert err.message.endswith(f"ssh: {'x' * (MAX_QUOTE - 5)}\u2026[{len(line) - MAX_QUOTE} more characters]")


@pytest.mark.sandbox
def test_the_head_locale_does_not_reach_the_nodes(sandbox, tmp_path) -> None:
    """The system ssh_config's `SendEnv LANG LC_*` (Debian's default; the nodes'
    sshd has `AcceptEnv LANG LC_*`) would carry any LC_ variable of the head to
    the ranks; only the documented environment travels."""
    import os
    import sys

    env = dict(os.environ, LC_CORRAL_SMUGGLED="head-value")
    res = subprocess.run(
        [sys.executable, "-m", "corral", "exec", "-c", str(sandbox.cluster_file), "--no-fold",
         "--", "env"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "PATH=" in res.stdout  # the nodes' environment was printed
    assert "LC_CORRAL_SMUGGLED" not in res.stdout
    # and the ranks, started by the node agent over its own ssh connection
    run = subprocess.run(
        [sys.executable, "-m", "corral", "run", "-c", str(sandbox.cluster_file), "--launcher",
         "command", "--fresh-ranks", "--workdir", "/tmp", "env"],
        capture_output=True, text=True, timeout=180, env=env, check=False, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "CORRAL_RUN_ID=" in run.stdout and "LC_CORRAL_SMUGGLED" not in run.stdout


def test_srun_step_holds_every_cpu_the_job_has_on_its_node(monkeypatch) -> None:
    # One agent task runs all of a node's ranks: a one-CPU step (srun's default,
    # or the job's --cpus-per-task for one rank) would bind them all to one CPU.
    from corral.model import Cluster, Host
    from corral.transport import SrunTransport, transport_for

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-2],cpu9")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "16(x2),4")
    hosts = tuple(Host(name=n) for n in ("gpu1", "gpu2", "cpu9"))
    cluster = Cluster(hosts=hosts, transport="srun")
    transport = transport_for(cluster, hosts[2])
    assert isinstance(transport, SrunTransport)
    argv = transport.argv(hosts[2], ["python3", "-c", "x y"])
    assert argv[0] == "srun" and argv[-4:] == ["--", "python3", "-c", "x y"]
    for opt in ("--nodes=1", "--ntasks=1", "--overlap", "--kill-on-bad-exit=1", "--nodelist=cpu9",
                "--cpus-per-task=4", "--jobid=77"):
        assert opt in argv
    assert "--cpus-per-task=16" in transport.argv(hosts[0], ["true"])
    assert transport_for(Cluster(hosts=hosts), hosts[0]).name == "ssh"
