"""The cluster model's own guard: hosts built by hand are checked like the readers' ones."""

from __future__ import annotations

import pytest

from corral.model import Cluster, Host


@pytest.mark.parametrize(
    "fields",
    [
        {"name": "-oProxyCommand=touch /tmp/x"},  # ssh would read it as an option
        {"name": "*"},
        {"name": "gpu1\nProxyCommand x"},
        {"name": "gpu1", "address": "10.0.0.1\nProxyCommand x"},
        {"name": "gpu1", "user": "root\n"},
        {"name": "gpu1", "port": 70000},
        {"name": "gpu1", "slots": 0},
        {"name": "x" * 1000},
    ],
)
def test_a_host_that_would_become_ssh_syntax_cannot_be_built(fields: dict) -> None:
    with pytest.raises(ValueError, match="host "):
        Host(**fields)


def test_plain_hosts_and_this_machine_under_any_name_are_fine() -> None:
    cluster = Cluster(hosts=(
        Host(name="gpu01.lab", address="10.0.0.1", user="ml", port=2222, slots=8),
        Host(name="fe80::1%eth0"),
        Host(name="odd name of this box", local=True),
    ))
    assert cluster.names[0] == "gpu01.lab"
    with pytest.raises(ValueError):
        cluster.hosts[0].with_(address="-x")
