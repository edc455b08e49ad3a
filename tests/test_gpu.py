"""On a GPU machine: `corral run` trains with NCCL on every GPU (marked `gpu`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


def test_train_ddp_with_nccl_on_every_gpu(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "corral", "run", "--json", str(REPO / "examples/train_ddp.py"),
                          "--epochs", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["status"] == "succeeded"
    log = next((tmp_path / "runs").glob("*/*/rank0.log")).read_text()
    first, last = map(float, re.search(r"first loss ([\d.]+) \| final loss ([\d.]+)", log).groups())
    assert last < first
    assert "nccl" in log.lower()  # the script reports its backend


def test_dry_run_uses_one_process_per_gpu(tmp_path: Path) -> None:
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    res = subprocess.run([sys.executable, "-m", "corral", "run", "--dry-run", "--json", "t.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert f"--nproc-per-node={gpus}" in res.stdout
