"""Preflight's pure parts: what the work dir's file system says about restarts."""

from __future__ import annotations

import os
from pathlib import Path

from corral.agent.probes import dir_identity, fstype
from corral.run.preflight import local_disk_warning

MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
40 22 0:45 / /shared rw,relatime shared:20 - nfs4 filer:/export rw
41 40 0:46 / /shared/scratch rw shared:21 - lustre 10.0.0.1@o2ib:/fs rw
42 22 0:47 / /my\\040data rw shared:22 - xfs /dev/sdb1 rw
"""


def test_fstype_is_the_longest_mount_point_above_the_path(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert fstype("/home/me/proj", str(info)) == "ext4"
    assert fstype("/shared/proj", str(info)) == "nfs4"
    assert fstype("/shared/scratch/run", str(info)) == "lustre"
    assert fstype("/sharedx", str(info)) == "ext4"  # a prefix of the name is not a parent
    assert fstype("/my data/x", str(info)) == "xfs"
    assert fstype("/x", str(tmp_path / "none")) is None
    assert fstype(str(tmp_path)) is not None  # this machine's own table
    assert dir_identity(str(tmp_path)) == dir_identity(str(tmp_path)) != dir_identity("/")


def _probe(fs: str | None, ident: list | None) -> dict:
    return {"workdir": {"path": "/proj", "exists": True, "fstype": fs, "identity": ident}}


def test_restarts_on_node_private_disks_are_warned_about() -> None:
    note = local_disk_warning({"n1": _probe("ext4", ["a", 1, 2]), "n2": _probe("xfs", ["b", 1, 2])})
    assert note and "/proj is on each node's own disk (ext4, xfs on n[1-2])" in note
    # shared storage, one node, an unknown file system: nothing to say
    assert local_disk_warning({"n1": _probe("nfs4", ["a", 1, 2]), "n2": _probe("nfs4", ["b", 1, 2])}) is None
    assert local_disk_warning({"n1": _probe("ext4", ["a", 1, 2])}) is None
    assert local_disk_warning({"n1": _probe("ext4", ["a", 1, 2]), "n2": _probe(None, None)}) is None
    # containers on one machine sharing a volume see the very same directory
    assert local_disk_warning({"n1": _probe("ext4", ["a", 1, 2]), "n2": _probe("ext4", ["a", 1, 2])}) is None


def test_a_workdir_that_is_a_link_to_nowhere_says_so(tmp_path: Path) -> None:
    # On the sandbox, /srv/proj on one node was a link to a directory removed
    # since: "working directory /srv/proj does not exist" hid why.
    from corral.agent.probes import preflight

    link = tmp_path / "proj"
    link.symlink_to(tmp_path / "gone")
    wd = preflight(workdir=str(link))["workdir"]
    assert wd["exists"] is False and wd["link_to"] == str(tmp_path / "gone")
    assert "link_to" not in preflight(workdir=str(tmp_path / "missing"))["workdir"]


def test_a_node_whose_host_name_is_loopback_is_given_gloos_interface() -> None:
    # Debian writes `127.0.1.1 <hostname>` to /etc/hosts: gloo advertises that
    # to the other nodes, whose ranks then fail with "connectFullMesh failed
    # ... Connection refused, remote=[127.0.1.1]" (only when it is not node 0).
    from corral.run.preflight import gloo_interface

    addresses = [{"name": "eth0", "address": "10.0.0.3", "prefix": 24},
                 {"name": "ib0", "address": "10.1.0.3", "prefix": 16}]
    debian = {"hostname_addresses": ["127.0.1.1"], "addresses": addresses, "env": {}}
    assert gloo_interface(debian, "10.0.0.3") == "eth0"
    assert gloo_interface(debian, "10.1.0.3") == "ib0"  # the rendezvous network's
    assert gloo_interface(dict(debian, hostname_addresses=[]), "10.0.0.3") == "eth0"  # gloo: 127.0.0.1
    assert gloo_interface(dict(debian, hostname_addresses=["10.0.0.3"]), "10.0.0.3") is None
    # gloo takes the first address: the 127.0.1.1 line above the real one breaks it too
    assert gloo_interface(dict(debian, hostname_addresses=["127.0.1.1", "10.0.0.3"]), "10.0.0.3") == "eth0"
    assert gloo_interface(dict(debian, hostname_addresses=["10.0.0.3", "127.0.1.1"]), "10.0.0.3") is None
    assert gloo_interface(dict(debian, env={"GLOO_SOCKET_IFNAME": "eth0"}), "10.0.0.3") is None


def test_one_machine_listed_under_two_names_is_refused() -> None:
    # `gpu2` and its IP address in one hostfile: two agents, two torchruns on
    # the same GPUs, one job directory; the ranks' output was even attributed
    # to the wrong entry.
    from corral.run.preflight import same_machine

    probes = {"gpu1": {"machine": ["boot-a", 1]}, "10.0.0.2": {"machine": ["boot-b", 1]},
              "gpu2": {"machine": ["boot-b", 1]}, "gpu3": {"machine": ["boot-b", 2]}, "old": {}}
    [err] = same_machine(probes)
    assert err.host == "10.0.0.2" and "10.0.0.2 and gpu2 are the same machine" in err.message
    assert "list each machine once" in err.hint
    assert same_machine({"a": {"machine": ["x", 1]}, "b": {"machine": ["x", 2]}}) == []  # containers


def test_the_probe_says_which_machine_it_is() -> None:
    from corral.agent.probes import machine_identity

    boot, netns = machine_identity()
    assert len(boot) == 36 and netns == os.stat("/proc/self/ns/net").st_ino
