"""The node's registry of what corral jobs hold (corral/agent/holds.py): real
processes, real flocks, a real other user for the shared-place cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from attacker import prepare, shared_place

from corral.agent import holds
from corral.agent.private import UnsafePlace

#: Another agent: holds GPUs (and a port) in the registry under ``base`` until killed.
HOLDER = """
import json, sys, time
from corral.agent import holds
got = holds.claim("20261127-101010-aaaaaa", head="laptop", gpus=json.loads(sys.argv[2]), want_port=True,
                  base=sys.argv[1])
print(json.dumps(got), flush=True)
time.sleep(600)
"""


def holder(base: Path, gpus: list[str]) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(base), json.dumps(gpus)], stdout=subprocess.PIPE,
                            text=True)
    return proc, json.loads(proc.stdout.readline())


@pytest.fixture(autouse=True)
def _released():
    yield
    holds.release()


def test_gpus_another_job_holds_are_refused_naming_it_and_freed_when_its_agent_is_killed(tmp_path: Path) -> None:
    proc, got = holder(tmp_path, ["0", "1"])
    try:
        assert got["gpus"] == ["0", "1"] and got["port"]
        refused = holds.claim("20261127-111111-bbbbbb", gpus=["1", "2"], base=str(tmp_path))
        (h,) = refused["held_by"]
        assert h["run_id"] == "20261127-101010-aaaaaa" and h["head"] == "laptop" and h["pid"] == proc.pid
        assert h["user"] == "root" and h["gpus"] == ["0", "1"] and h["since"]
        assert holds.claim("20261127-111111-bbbbbb", gpus=["2", "3"], base=str(tmp_path)) == {
            "port": None, "gpus": ["2", "3"]}
        holds.release()
    finally:
        proc.kill()  # SIGKILL: no release, the file stays, its lock goes
        proc.wait()
    registry = Path(holds.registry_dir(str(tmp_path)))
    assert [p.name for p in registry.iterdir()] == [f"20261127-101010-aaaaaa.{proc.pid}.json"]
    got = holds.claim("20261127-111111-bbbbbb", gpus=["1"], base=str(tmp_path))
    assert got["gpus"] == ["1"]  # the killed job's holding was stale: removed, not obeyed
    assert [p.name for p in registry.iterdir()] == [f"20261127-111111-bbbbbb.{os.getpid()}.json"]
    holds.release()
    assert not registry.parent.exists()  # corral-<uid> goes with the last holding


def test_a_port_another_job_holds_is_never_handed_out(tmp_path: Path) -> None:
    proc, got = holder(tmp_path, [])
    try:
        taken = got["port"]
        refused = holds.claim("20261127-111111-bbbbbb", port=taken, base=str(tmp_path))
        assert refused["port_held_by"]["run_id"] == "20261127-101010-aaaaaa"
        # The kernel's pick is the held port as long as nothing binds it: the registry's
        # pick is another one, whatever the kernel says.
        assert holds.pick_port({taken}) != taken
        got = holds.claim("20261127-111111-bbbbbb", want_port=True, base=str(tmp_path))
        assert got["port"] != taken
    finally:
        proc.kill()
        proc.wait()


def test_a_file_in_the_registry_that_no_live_agent_locks_is_not_believed(tmp_path: Path) -> None:
    registry = Path(holds.registry_dir(str(tmp_path)))
    holds.claim("20261127-111111-bbbbbb", base=str(tmp_path))
    holds.release()
    registry.mkdir(mode=0o700, parents=True, exist_ok=True)
    fake = {"run_id": "x", "user": "root", "since": 1, "pid": 1, "gpus": ["0"], "ports": {"master": 1}}
    (registry / "x.1.json").write_text(json.dumps(fake))
    assert holds.holdings(str(tmp_path)) == []
    assert holds.claim("20261127-111111-bbbbbb", gpus=["0"], base=str(tmp_path))["gpus"] == ["0"]
    assert not (registry / "x.1.json").exists()


@pytest.mark.parametrize("kind", ["open", "link", "foreign"])
def test_a_registry_another_user_made_first_is_refused(kind: str) -> None:
    with shared_place() as base:
        prepare(kind, base / f"corral-{os.getuid()}")
        with pytest.raises(UnsafePlace):
            holds.claim("20261127-111111-bbbbbb", gpus=["0"], base=str(base))
