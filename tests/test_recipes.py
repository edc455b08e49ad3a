"""The reference recipes under examples/recipes/: each trains, resumes exactly and saves a usable model.

On the sandbox through ``corral run`` (4 nodes, gloo on CPU, tiny sizes),
as the issue asks: the loss falls; a run stopped at step k and resumed
gives bit-for-bit the same model at step n as an uninterrupted run; the
saved model loads into a plain model with no DDP and no corral.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "examples" / "recipes" / "gpt"
CORRAL = [sys.executable, "-m", "corral"]
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
        "--grad-accum", "2", "--dropout", "0.1", "--max-steps", "16", "--warmup", "4", "--log-every", "4", "--lr", "1e-2",
        "--eval-every", "100", "--eval-batches", "2", "--save-every", "100"]


def load_recipe():
    spec = importlib.util.spec_from_file_location("train_gpt", GPT / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def workdir() -> Path:
    """Under the repository: the sandbox shares it with every node, like NFS."""
    path = REPO / "scratch" / f"recipe-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def prepare(workdir: Path) -> Path:
    data = workdir / "data"
    subprocess.run([sys.executable, str(GPT / "prepare.py"), "--out", str(data), "--sentences", "3000"],
                   check=True, capture_output=True, text=True)
    return data


def losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^(?:\[[^]]*\] )?step (\d+) \| loss ([\d.]+)", stdout, re.M)}


def test_batches_depend_only_on_seed_rank_and_step(tmp_path: Path) -> None:
    gpt = load_recipe()
    data = prepare(tmp_path)
    tokens = gpt.Tokens(str(data / "train.bin"), 16)
    import torch

    a = tokens.batch(4, gpt.batch_seed(1, 0, 7, 0), torch.device("cpu"))
    b = tokens.batch(4, gpt.batch_seed(1, 0, 7, 0), torch.device("cpu"))
    other_rank = tokens.batch(4, gpt.batch_seed(1, 1, 7, 0), torch.device("cpu"))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], other_rank[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are the inputs shifted by one


def test_the_learning_rate_is_a_function_of_the_step() -> None:
    gpt = load_recipe()
    args = gpt.parse_args(["--data", "d", "--out", "o", "--lr", "1e-3", "--min-lr", "1e-4",
                           "--warmup", "10", "--max-steps", "100"])
    assert gpt.lr_at(0, args) == pytest.approx(1e-4) and gpt.lr_at(9, args) == pytest.approx(1e-3)
    assert gpt.lr_at(100, args) == pytest.approx(1e-4) and gpt.lr_at(55, args) < gpt.lr_at(20, args)


def test_a_missing_data_set_is_named_with_the_fix(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(GPT / "train_gpt.py"), "--data", str(tmp_path / "none"),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "train.bin not found" in res.stderr and "prepare.py" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.sandbox
@pytest.mark.timeout(900)
def test_gpt_recipe_learns_resumes_exactly_and_saves_a_plain_model(sandbox, workdir: Path) -> None:
    import torch

    data = prepare(workdir)

    def run(out: str, *extra: str) -> str:
        res = subprocess.run(CORRAL + ["run", "-c", str(sandbox.cluster_file), "-n", "1",
                                       str(GPT / "train_gpt.py"), "--data", str(data), "--out",
                                       str(workdir / out), *TINY, *extra],
                             cwd=workdir, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        return res.stdout

    whole = run("a")
    assert "training on 4 process(es)" in whole
    curve = losses(whole)
    assert curve.get(16, 99) < curve[1] * 0.8, whole
    stopped = run("b", "--stop-at", "8")
    assert "stopped at step 8" in stopped and not (workdir / "b" / "model.pt").exists()
    resumed = run("b", "--resume")
    assert "resumed at step 8" in resumed
    assert {s: v for s, v in losses(resumed).items() if s > 8} == {s: v for s, v in curve.items() if s > 8}

    gpt = load_recipe()
    a, b = gpt.load_model(str(workdir / "a" / "model.pt")), gpt.load_model(str(workdir / "b" / "model.pt"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), "resume is not exact"
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in sa)  # a plain model's keys
    x = torch.randint(0, 256, (1, 8))
    logits, _ = a.eval()(x)
    assert logits.shape == (1, 8, 256)
    assert not list((workdir / "a").glob("*.tmp.*"))  # checkpoints written atomically
