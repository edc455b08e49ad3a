"""Errors that name the host and what to do."""

from __future__ import annotations

from corral.errors import HostError, PreflightError


def test_the_same_preflight_problem_on_many_hosts_is_said_once() -> None:
    err = PreflightError([HostError(h, "train.py not found in /proj", hint="sync the project") for h in
                          ("g1", "g2", "g3")] + [HostError("g7", "unreachable", hint="check the address")])
    assert err.message.splitlines() == [
        "preflight failed on 4 host(s):",
        "  g[1-3]: train.py not found in /proj", "    hint: sync the project",
        "  g7: unreachable", "    hint: check the address"]


def test_a_host_with_two_problems_is_counted_once() -> None:
    err = PreflightError([HostError("g1", "train.py not found in /proj"), HostError("g2", "train.py not found in /proj"),
                          HostError("g2", "python3 cannot import torch"), HostError("g3", "train.py not found in /proj")])
    assert err.message.splitlines()[0] == "preflight failed on 3 host(s):"
