"""GPU and node health: Xid messages, nvidia-smi -q counters and NCCL RAS status,
read from recorded text (tests/fixtures/gpuhealth/README.md), and the node side
reading its kernel log through the system tools' own interface (argv, exit code, text)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from corral.agent import health as agent_health
from corral.diagnose.gpuhealth import (
    DRAIN,
    IGNORE,
    RESET_GPU,
    RESTART_APP,
    node_health,
    parse_ras,
    parse_smi_q,
    parse_xids,
)

FIXTURES = Path(__file__).parent / "fixtures" / "gpuhealth"


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_each_xid_gets_nvidias_meaning_and_what_to_do() -> None:
    xids = parse_xids(text("dmesg.txt").splitlines())
    assert [(x.code, x.device) for x in xids] == [(63, "PCI:0000:10:1c"), (94, "PCI:0000:10:1c"),
                                                 (79, "PCI:0000:20:1c"), (154, "PCI:0000:20:1c")]
    assert [x.action for x in xids] == [RESET_GPU, RESTART_APP, DRAIN, DRAIN]  # 154: "to ... Node Reboot Required"
    assert xids[2].line() == ("Xid 79 on PCI:0000:20:1c (pid 123470, python3): GPU has fallen off the bus (no longer "
                              "reachable over PCIe); " + DRAIN)
    assert "pid" not in xids[0].line()  # pid='<unknown>': no process to name
    journal = parse_xids(text("journalctl.txt").splitlines())
    assert [x.code for x in journal] == [13, 13, 43, 48] and journal[3].action == RESET_GPU


def test_xid_154_follows_the_action_it_changed_to() -> None:
    back = "NVRM: Xid (PCI:0000:20:1c): 154, pid='<unknown>', name=<unknown>, GPU recovery action changed " \
           "from 0x1 (GPU Reset Required) to 0x0 (None)"
    assert parse_xids([back])[0].action == IGNORE


def test_nvidia_smi_q_counters_of_both_layouts() -> None:
    a100 = parse_smi_q(text("smi_q_a100.txt"))
    assert [(g.gpu, g.volatile_uncorrectable, g.remapped_uncorrectable, g.remap_pending) for g in a100] == [
        ("00000000:10:1C.0", 2, 1, True), ("00000000:20:1C.0", 0, 0, False)]
    assert a100[1].problems() == []
    assert any("pending" in p for p in a100[0].problems())
    (v100,) = parse_smi_q(text("smi_q_v100.txt"))
    assert (v100.volatile_uncorrectable, v100.aggregate_uncorrectable, v100.retired_dbe, v100.retirement_pending) == (
        0, 1, 1, True)


def test_ncclras_errors_and_warnings_and_nothing_for_a_healthy_job() -> None:
    found = parse_ras(text("ncclras_dead.txt"))
    assert found[0] == ("NCCL RAS errors: DEAD: 1 job process is considered dead (unreachable via the RAS network); "
                        "Process 3487984 on node 172.16.64.213 managing GPU 5")
    assert len(found) == 3 and found[2].startswith("NCCL RAS warnings: TIMEOUT")
    assert parse_ras(text("ncclras_ok.txt")) == []


def test_a_nodes_answer_explained_and_a_node_without_gpus_says_nothing() -> None:
    raw = {"gpu": True, "xid": {"lines": text("journalctl.txt").splitlines(), "error": None},
           "smi": {"text": text("smi_q_a100.txt"), "error": None}, "ras": {"text": text("ncclras_dead.txt")}}
    node = node_health("gpu07", raw)
    assert node is not None and node.worst == RESET_GPU
    lines = node.lines()
    assert lines[0].startswith("gpu07: Xid 13 on PCI:0000:b3:00") and lines[0].endswith("(x2)")
    assert any("NCCL RAS errors: DEAD" in ln for ln in lines)
    assert node_health("cpu1", {"gpu": False}) is None
    assert node_health("bad", ["not", "a", "dict"]) is None  # type: ignore[arg-type]


def _tool(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_node_names_why_the_kernel_log_could_not_be_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What journalctl and dmesg print for a user outside the journal groups with
    # kernel.dmesg_restrict=1 (the tools' own words and exit codes).
    _tool(tmp_path, "journalctl", "echo 'No journal files were opened due to insufficient permissions.' >&2; exit 1\n")
    _tool(tmp_path, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    got = agent_health.kernel_xids(since=1_700_000_000)
    assert got["lines"] == [] and "dmesg: read kernel buffer failed: Operation not permitted" in got["error"]
    assert "kernel.dmesg_restrict" in got["error"] and "insufficient permissions" in got["error"]


def test_the_node_keeps_only_xids_since_the_run_began(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No journal: dmesg's seconds since boot are compared with the run's start.
    _tool(tmp_path, "journalctl", "echo 'journalctl: command not found' >&2; exit 127\n")
    _tool(tmp_path, "dmesg", f"/bin/cat {FIXTURES / 'dmesg.txt'}\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    boot = agent_health._boot_time()
    assert boot is not None
    got = agent_health.kernel_xids(since=boot + 9000)  # between the Xid 63 (8312 s) and the 94 (9001 s)
    assert got["source"] == "dmesg" and [x.code for x in parse_xids(got["lines"])] == [94, 79, 154]
    assert len(agent_health.kernel_xids(since=None)["lines"]) == 4
