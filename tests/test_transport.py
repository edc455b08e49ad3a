"""How an ssh failure is named (corral's ssh runs with LogLevel=ERROR)."""

from __future__ import annotations

from corral.model import Host
from corral.transport.ssh import classify_ssh_failure


def test_an_ssh_that_ends_without_a_word_is_explained() -> None:
    # `corral exec` on a node stopped or partitioned under the command
    # printed only "ssh failed: exit code 255".
    err = classify_ssh_failure(Host(name="gpu2"), 255, "")
    assert "connection closed while the command ran" in err.message
    assert "went down or rebooted" in err.hint and "`ssh gpu2 true`" in err.hint
    assert classify_ssh_failure(Host(name="gpu2"), 255, "boom").message == "gpu2: ssh failed: boom"
