"""How an ssh failure is named (corral's ssh runs with LogLevel=ERROR)."""

from __future__ import annotations

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
