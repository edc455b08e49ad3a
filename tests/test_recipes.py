"""The reference recipes under examples/recipes/: each trains, resumes exactly and saves a usable model.

On the sandbox through ``corral run`` (3 of its nodes, one rank each: more
than two ranks, where DDP's bucket order decides how gradients are summed,
at three quarters of the CPU time of four; gloo on CPU, tiny sizes),
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
from conftest import first_nodes_cluster

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


@pytest.fixture(scope="module")
def three(sandbox, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cluster file of the sandbox's first three nodes."""
    return first_nodes_cluster(sandbox, 3, tmp_path_factory.mktemp("three") / "corral.toml")


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


def learning_rates(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in
            re.findall(r"^(?:\[[^]]*\] )?step (\d+) \| loss [\d.]+ \| lr ([\d.e+-]+)", stdout, re.M)}


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


def test_a_resume_with_another_thread_count_says_it_is_not_bit_exact(tmp_path: Path) -> None:
    """On CPUs the thread count splits every sum: the checkpoint records it."""
    data = prepare(tmp_path)

    def run(threads: str, *extra: str) -> subprocess.CompletedProcess:
        res = subprocess.run([sys.executable, str(GPT / "train_gpt.py"), "--data", str(data),
                              "--out", str(tmp_path / "out"), *TINY, *extra],
                             env=dict(os.environ, OMP_NUM_THREADS=threads), capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        return res

    run("1", "--stop-at", "2")
    same = run("1", "--resume", "--stop-at", "3")
    assert "resumed at step 2" in same.stdout and "CPU threads" not in same.stdout
    other = run("2", "--resume")
    assert ("resume: the checkpoint was written with 1 CPU threads per rank, this run has 2" in other.stdout
            and "not bit for bit" in other.stdout), other.stdout


@pytest.mark.sandbox
@pytest.mark.timeout(900)
def test_gpt_recipe_learns_resumes_exactly_and_saves_a_plain_model(three: Path, workdir: Path) -> None:
    import torch

    data = prepare(workdir)

    def run(out: str, *extra: str) -> str:
        res = subprocess.run(CORRAL + ["run", "-c", str(three), "-n", "1",
                                       str(GPT / "train_gpt.py"), "--data", str(data), "--out",
                                       str(workdir / out), *TINY, *extra],
                             cwd=workdir, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        return res.stdout

    whole = run("a")
    assert "training on 3 process(es)" in whole
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


# ---------------------------------------------------------------------------
# accelerate, the transformers Trainer and DeepSpeed ZeRO-2/3 (examples/recipes/{accelerate,trainer,deepspeed})

RECIPES = REPO / "examples" / "recipes"
#: A GPT-2 of 2 layers x 32 wide on 32-token windows: seconds per run on 4 CPU ranks.
TINY_HF = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
           "--grad-accum", "2", "--max-steps", "12", "--warmup", "2", "--log-every", "2", "--lr", "1e-2",
           "--save-every", "100"]


def run_recipe(three: Path, workdir: Path, script: Path, out: str, *extra: str, env: tuple[str, ...] = ()) -> str:
    """One corral run of a recipe on three sandbox nodes, one rank each."""
    argv = CORRAL + ["run", "-c", str(three), "-n", "1"]
    for e in env:
        argv += ["--env", e]
    res = subprocess.run(argv + [str(script), "--data", str(workdir / "data"), "--out", str(workdir / out),
                                 *TINY_HF, *extra],
                         cwd=workdir, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "training on 3 process(es)" in res.stdout, res.stdout[-3000:]
    return res.stdout


def stop_and_resume(three: Path, workdir: Path, script: Path, *extra: str, env: tuple[str, ...] = ()) -> dict:
    """An uninterrupted run of 12 steps and one stopped at 6 and resumed: their losses after step 6."""
    prepare(workdir)
    whole = run_recipe(three, workdir, script, "a", *extra, env=env)
    curve = losses(whole)
    assert curve[12] < curve[1] * 0.8, whole  # it learns
    stopped = run_recipe(three, workdir, script, "b", "--stop-at", "6", *extra, env=env)
    assert "stopped at step 6" in stopped, stopped[-2000:]
    resumed = run_recipe(three, workdir, script, "b", "--resume", *extra, env=env)
    assert "resumed at step 6" in resumed, resumed[-2000:]
    return {"whole": {s: v for s, v in curve.items() if s > 6},
            "resumed": {s: v for s, v in losses(resumed).items() if s > 6}}


def hf_model(path: Path):
    """The saved model, loaded the way a user would: a plain GPT2LMHeadModel, no accelerate, no DeepSpeed."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(path)).eval()
    import torch

    logits = model(torch.randint(0, 256, (1, 8))).logits
    assert logits.shape == (1, 8, 256)
    return model


def assert_same_weights(a, b) -> None:
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"resume is not exact: {different[:5]}"


@pytest.mark.sandbox
def test_accelerate_recipe_learns_resumes_exactly_and_saves_a_plain_model(three: Path, workdir: Path) -> None:
    script = RECIPES / "accelerate" / "train_accelerate.py"
    curves = stop_and_resume(three, workdir, script, "--dropout", "0.1")
    assert curves["resumed"] == curves["whole"]
    assert_same_weights(hf_model(workdir / "a" / "model"), hf_model(workdir / "b" / "model"))
    assert not (workdir / "b" / "ckpt.tmp").exists()


@pytest.mark.sandbox
@pytest.mark.timeout(600)  # the first DeepSpeed test of a fresh checkout compiles DeepSpeed's CPU comm op
def test_accelerate_deepspeed_zero3_recipe_resumes_exactly_and_its_16bit_save_is_the_trained_model(
        three: Path, workdir: Path, torch_extensions: Path) -> None:
    """ZeRO-3 through accelerate's DeepSpeed plugin (on CPU, where accelerate drops it if told so)."""
    script = RECIPES / "accelerate" / "train_accelerate.py"
    config = str(RECIPES / "deepspeed" / "ds_zero3.json")
    curves = stop_and_resume(three, workdir, script, "--dropout", "0.1", "--deepspeed-config", config,
                             env=(f"TORCH_EXTENSIONS_DIR={torch_extensions}",))
    assert curves["resumed"] == curves["whole"]
    a, b = hf_model(workdir / "a" / "model"), hf_model(workdir / "b" / "model")
    assert_same_weights(a, b)
    # save_state under ZeRO-3: every rank wrote its own shard of the weights
    assert len(list((workdir / "a" / "ckpt" / "pytorch_model").glob("zero_pp_rank_*_model_states.pt"))) == 3
    assert_16bit_save_is_the_consolidated_checkpoint(a, workdir / "a" / "ckpt")


@pytest.mark.sandbox
def test_trainer_recipe_learns_resumes_exactly_and_saves_a_plain_model(three: Path, workdir: Path) -> None:
    script = RECIPES / "trainer" / "train_trainer.py"
    curves = stop_and_resume(three, workdir, script, "--dropout", "0.1")
    assert curves["resumed"] == curves["whole"]
    assert_same_weights(hf_model(workdir / "a" / "model"), hf_model(workdir / "b" / "model"))


def assert_16bit_save_is_the_consolidated_checkpoint(model, ckpt: Path) -> None:
    """zero_to_fp32 over the sharded checkpoint (each rank wrote its shard) gives the saved model."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    saved = model.state_dict()
    assert fp32.keys() <= saved.keys() and "transformer.wte.weight" in fp32
    assert all(torch.equal(fp32[k], saved[k]) for k in fp32)


@pytest.mark.sandbox
def test_deepspeed_zero3_recipe_resumes_exactly_and_its_16bit_save_is_the_trained_model(
        three: Path, workdir: Path, torch_extensions: Path) -> None:
    """ZeRO-3: every rank holds a shard of each weight; the 16-bit save must gather them."""
    script = RECIPES / "deepspeed" / "train_deepspeed.py"
    config = str(RECIPES / "deepspeed" / "ds_zero3.json")
    curves = stop_and_resume(three, workdir, script, "--dropout", "0.1", "--deepspeed-config", config,
                             env=(f"TORCH_EXTENSIONS_DIR={torch_extensions}",))
    assert curves["resumed"] == curves["whole"]
    a, b = hf_model(workdir / "a" / "model"), hf_model(workdir / "b" / "model")
    assert_same_weights(a, b)
    assert_16bit_save_is_the_consolidated_checkpoint(a, workdir / "a" / "ckpt")


@pytest.mark.sandbox
def test_deepspeed_zero2_recipe_learns_and_saves_the_trained_model(
        three: Path, workdir: Path, torch_extensions: Path) -> None:
    """ZeRO-2 with the default config (one run: its resume takes the same path as ZeRO-3's)."""
    prepare(workdir)
    out = run_recipe(three, workdir, RECIPES / "deepspeed" / "train_deepspeed.py", "a", "--dropout", "0.1",
                     env=(f"TORCH_EXTENSIONS_DIR={torch_extensions}",))
    curve = losses(out)
    assert "ZeRO-2" in out and curve[12] < curve[1] * 0.8, out[-2000:]
    lrs = learning_rates(out)  # DeepSpeed's warm-up from warmup_min_ratio 0 trained its first steps at lr 0
    assert lrs and all(lr > 0 for lr in lrs.values()), lrs
    assert "checked against the trained weights" in out
    assert_16bit_save_is_the_consolidated_checkpoint(hf_model(workdir / "a" / "model"), workdir / "a" / "ckpt")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["accelerate", "accelerate-zero2", "accelerate-zero3", "trainer",
                                    "deepspeed-zero2", "deepspeed-zero3"])
def test_recipes_on_one_gpu(recipe: str, tmp_path: Path, torch_extensions: Path) -> None:
    """On a GPU the recipes pick bf16 by themselves and still save a model that loads."""
    prepare(tmp_path)
    name, _, stage = recipe.partition("-zero")
    script = RECIPES / name / {"accelerate": "train_accelerate.py", "trainer": "train_trainer.py",
                               "deepspeed": "train_deepspeed.py"}[name]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(script),
            "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), *TINY_HF]
    if stage:
        argv += ["--deepspeed-config", str(RECIPES / "deepspeed" / f"ds_zero{stage}.json")]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(torch_extensions)}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    curve = losses(res.stdout)
    assert curve[12] < curve[1], res.stdout[-2000:]
    hf_model(tmp_path / "out" / "model")
