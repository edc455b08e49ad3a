"""`corral doctor` on a machine with NVIDIA GPUs: the GPU facts and an NCCL smoke test.

Marked ``gpu`` and skipped where torch sees no CUDA device (CI has none; the
CPU paths are covered by test_facts, test_checks and test_doctor).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
                       reason="needs a CUDA GPU and nvidia-smi"),
]


def _smi(*args: str) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`corral doctor --json` on this machine (the default cluster), smoke test included."""
    cwd = tmp_path_factory.mktemp("gpu-doctor")
    proc = subprocess.run([sys.executable, "-m", "corral", "doctor", "--json"], capture_output=True,
                          text=True, timeout=600, cwd=cwd, check=False)
    assert proc.stdout.strip(), proc.stderr
    data = json.loads(proc.stdout)
    data["_exit"] = proc.returncode
    return data


def _facts(report: dict) -> dict:
    [facts] = report["evidence"]["facts"].values()
    return facts


def test_gpus_and_driver_match_nvidia_smi(report: dict) -> None:
    facts = _facts(report)
    rows = [r.split(", ") for r in _smi("--query-gpu=index,name,memory.total,uuid,driver_version",
                                        "--format=csv,noheader,nounits").strip().splitlines()]
    assert [(g["index"], g["name"], g["memory_mib"], g["uuid"]) for g in facts["gpus"]] == \
        [(int(i), name, int(float(mem)), uuid) for i, name, mem, uuid, _ in rows]
    assert facts["driver"] == rows[0][4]
    assert facts["cuda_driver"] == re.search(r"CUDA Version:\s*([\d.]+)", _smi()).group(1)


def test_torch_cuda_build_and_nccl_version(report: dict) -> None:
    facts = _facts(report)
    assert facts["packages"]["torch_cuda"] == torch.version.cuda
    assert facts["packages"]["nccl"] == ".".join(str(x) for x in torch.cuda.nccl.version())
    assert facts["torch_import"]["cuda_available"] is True
    assert facts["torch_import"]["device_count"] == torch.cuda.device_count()


def test_smoke_test_runs_with_nccl(report: dict) -> None:
    smoke = report["evidence"]["smoke"]
    assert smoke["status"] == "ok", smoke
    assert (smoke["backend"], smoke["world_size"]) == ("nccl", torch.cuda.device_count())
    gpu_errors = [f for f in report["findings"] if f["check"].startswith("gpus.") and f["severity"] == "error"]
    assert gpu_errors == []
    assert report["_exit"] == (1 if report["errors"] else 0)
    assert Path(_facts(report)["python"]["path"]).exists()
