"""The example scripts run, unchanged, under their own launchers, and learn.

Every run is a real multi-process job on this machine (gloo on CPU): the
reference script under torchrun and with no launcher at all, and one script
per launcher under that launcher.  Each subprocess runs in its own session
with a timeout; on timeout the whole process group is killed, so a hung
rendezvous never outlives the test.  Ports are picked free per test, so
parallel test runs do not collide.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ninja_path

REPO = Path(__file__).resolve().parents[1]
TRAIN_DDP = REPO / "examples" / "train_ddp.py"
LAUNCHERS = REPO / "examples" / "launchers"
PY = sys.executable

# "first loss 2.1024 | final loss 0.2833": the last line every example prints on rank 0.
LOSSES = re.compile(r"first loss (\d+\.\d+) \| final loss (\d+\.\d+)")
STEP_LINE = re.compile(r"^step\s+(\d+) \| epoch (\d+) \| loss (\d+\.\d+)", re.MULTILINE)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def tail(self, n: int = 40) -> str:
        """The end of both streams, for assertion messages."""
        out = "\n".join(self.stdout.splitlines()[-n:])
        err = "\n".join(self.stderr.splitlines()[-n:])
        return f"--- stdout (tail) ---\n{out}\n--- stderr (tail) ---\n{err}"

    def losses(self) -> tuple[float, float]:
        match = LOSSES.search(self.stdout)
        assert match, f"no 'first loss | final loss' line\n{self.tail()}"
        return float(match.group(1)), float(match.group(2))


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    argv: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 180
) -> Result:
    """Run argv in its own process group; kill the whole group if it overruns."""
    full_env = dict(os.environ)
    # (OMP_NUM_THREADS=1 comes from conftest); torchrun run by hand leaves its
    # torchelastic_* log dirs in $TMPDIR: keep them in the test's own dir
    tmp = cwd / "tmp"
    tmp.mkdir(exist_ok=True)
    full_env.update({"PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)})
    full_env.update(env or {})
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=full_env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"timed out after {timeout}s: {' '.join(argv)}\n{Result(-9, stdout, stderr).tail()}"
        )
    return Result(proc.returncode, stdout, stderr)


def torchrun(nproc: int = 2) -> list[str]:
    """torchrun on this machine; --standalone picks its own free rendezvous port."""
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def cpu_only() -> bool:
    """Whether the ranks a test starts see no GPU: conftest hides them from tests
    not marked `gpu` (this process's torch may have seen them before that)."""
    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not torch.cuda.is_available()


# -----------------------------------------------------------------------------
# examples/train_ddp.py


def test_train_ddp_two_processes_learns(tmp_path: Path) -> None:
    res = run([*torchrun(2), str(TRAIN_DDP), "--epochs", "2", "--no-progress"], tmp_path)
    assert res.returncode == 0, res.tail()
    assert "training on 2 process(es)" in res.stdout, res.tail()
    first, final = res.losses()
    # 8 classes: an untrained model starts near ln 8 = 2.08; two epochs get well below half of it.
    assert abs(first - math.log(8)) < 0.3, res.tail()
    assert final < 0.5 * first, res.tail()
    steps = [int(m.group(1)) for m in STEP_LINE.finditer(res.stdout)]
    assert steps[0] == 1 and steps[-1] == 256, res.tail()  # 16384 samples / 128 per step x 2 epochs
    # Only rank 0 prints: every step line appears once.
    assert len(steps) == len(set(steps)), res.tail()


def test_train_ddp_resume_continues_where_it_stopped(tmp_path: Path) -> None:
    ckpt = tmp_path / "out" / "ckpt.pt"
    base = [*torchrun(2), str(TRAIN_DDP), "--no-progress", "--ckpt", str(ckpt)]

    first_run = run([*base, "--epochs", "1"], tmp_path)
    assert first_run.returncode == 0, first_run.tail()
    assert ckpt.is_file() and not Path(f"{ckpt}.tmp").exists()  # written atomically
    scratch_loss, stopped_loss = first_run.losses()

    resumed = run([*base, "--epochs", "2", "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.tail()
    assert f"resumed from {ckpt} at epoch 1, step 128" in resumed.stdout, resumed.tail()
    steps = [(int(m.group(1)), int(m.group(2))) for m in STEP_LINE.finditer(resumed.stdout)]
    assert steps[0] == (129, 1), resumed.tail()  # the step and epoch counters continue
    assert steps[-1] == (256, 1), resumed.tail()
    resumed_first, _ = resumed.losses()
    # The weights continue too: the first loss after resuming is near where the first run
    # stopped, nowhere near the from-scratch loss.
    assert resumed_first < 0.5 * scratch_loss, resumed.tail()
    assert resumed_first < 1.5 * stopped_loss, resumed.tail()


def test_train_ddp_runs_without_a_launcher(tmp_path: Path) -> None:
    res = run([PY, str(TRAIN_DDP), "--epochs", "1", "--no-progress"], tmp_path)
    assert res.returncode == 0, res.tail()
    assert "training on 1 process(es)" in res.stdout, res.tail()
    first, final = res.losses()
    assert final < 0.5 * first, res.tail()


def test_train_ddp_half_configured_launch_fails_with_hint(tmp_path: Path) -> None:
    res = run([PY, str(TRAIN_DDP), "--epochs", "1"], tmp_path, env={"WORLD_SIZE": "2"}, timeout=60)
    assert res.returncode == 2, res.tail()
    assert "MASTER_ADDR" in res.stderr and "\nHINT: " in res.stderr, res.tail()


def test_train_ddp_resume_without_checkpoint_fails_with_hint(tmp_path: Path) -> None:
    res = run(
        [PY, str(TRAIN_DDP), "--resume", "--ckpt", str(tmp_path / "nope.pt")], tmp_path, timeout=60
    )
    assert res.returncode == 2, res.tail()
    assert "no checkpoint at" in res.stderr and "\nHINT: " in res.stderr, res.tail()


# -----------------------------------------------------------------------------
# examples/launchers/: each script under its own launcher, 2 processes


def assert_learned(res: Result) -> None:
    assert res.returncode == 0, res.tail()
    first, final = res.losses()
    assert final < 0.1 * first, res.tail()  # the regression is easy: the loss falls >10x
    assert len(LOSSES.findall(res.stdout)) == 1, res.tail()  # printed by rank 0 only


def test_torchrun_example(tmp_path: Path) -> None:
    res = run([*torchrun(2), str(LAUNCHERS / "torchrun_ddp.py"), "--epochs", "2"], tmp_path)
    assert_learned(res)


def accelerate_argv(port: int) -> list[str]:
    return [
        PY,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port),
        str(LAUNCHERS / "accelerate_train.py"),
        "--epochs",
        "2",
    ]


@pytest.mark.slow
def test_accelerate_example(tmp_path: Path) -> None:
    # Without GPUs, ACCELERATE_USE_CPU=1 is what joins the processes into one gloo group.
    env = {"ACCELERATE_USE_CPU": "1"} if cpu_only() else {}
    res = run(accelerate_argv(free_port()), tmp_path, env=env)
    assert_learned(res)
    assert "2 process(es)" in res.stdout, res.tail()


@pytest.mark.slow
@pytest.mark.skipif(not cpu_only(), reason="the trap exists only on machines without GPUs")
def test_accelerate_example_refuses_to_train_alone_on_cpu(tmp_path: Path) -> None:
    """`accelerate launch --multi_gpu` on a CPU-only machine without ACCELERATE_USE_CPU
    starts 2 processes that each train alone; the example stops with a hint instead."""
    res = run(accelerate_argv(free_port()), tmp_path)
    assert res.returncode != 0, res.tail()
    assert "HINT: on a machine without GPUs, set ACCELERATE_USE_CPU=1" in res.stderr, res.tail()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_example_under_its_per_node_launcher(tmp_path: Path, torch_extensions: Path) -> None:
    # What the `deepspeed` runner executes on each node: launch.py with a base64 world_info.
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    argv = [
        PY,
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={world_info}",
        "--node_rank=0",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(LAUNCHERS / "deepspeed_train.py"),
        "--epochs",
        "2",
        "--deepspeed",
        "--deepspeed_config",
        str(LAUNCHERS / "ds_config_zero2.json"),
    ]
    # On CPU DeepSpeed JIT-compiles a shared-memory comm op (~1 min) into TORCH_EXTENSIONS_DIR,
    # or into $HOME/.cache, which is a fresh directory per test: keep it in pytest's cache,
    # built by the ninja every such test uses (conftest.ninja_path).
    res = run(argv, tmp_path, env={"TORCH_EXTENSIONS_DIR": str(torch_extensions), "PATH": ninja_path()},
              timeout=540)
    assert_learned(res)


@pytest.mark.slow
def test_lightning_example_spawns_its_own_second_process(tmp_path: Path) -> None:
    argv = [PY, str(LAUNCHERS / "lightning_train.py"), "--devices", "2", "--epochs", "2"]
    if cpu_only():
        argv += ["--accelerator", "cpu"]
    res = run(argv, tmp_path, env={"MASTER_PORT": str(free_port())})
    assert_learned(res)
    assert "Starting with 2 processes" in res.stdout + res.stderr, res.tail()


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def test_make_demo_installs_what_torch_needs_to_import_quietly() -> None:
    """torch imports without numpy but warns "Failed to initialize NumPy" on
    every import (every rank of `make demo`): the demo installs numpy, at the
    version the test suite runs with."""
    no_numpy = subprocess.run([PY, "-c", "import sys; sys.modules['numpy'] = None; import torch"],
                              capture_output=True, text=True, timeout=120, check=False)
    assert "Failed to initialize NumPy" in no_numpy.stderr  # what the demo's ranks printed
    demo, test = _pins(REPO / "requirements-demo.txt"), _pins(REPO / "requirements-test.txt")
    assert "torch" in demo
    assert demo.get("numpy") == test["numpy"]
    assert all(test.get(name) == version for name, version in demo.items())


@pytest.mark.slow
def test_train_ddp_runs_on_any_world_size(tmp_path: Path) -> None:
    """The reference script failed on a 3-node sandbox (6 ranks): "--batch-size 128
    does not split evenly".  It runs on 1, 2, 3, 5 and 6 ranks; an uneven split
    drops the remainder and says so once."""
    for world in (1, 2, 3, 5, 6):
        res = run([PY, "-m", "corral", "run", "-n", str(world), "--runs-dir", str(tmp_path / "runs"),
                   str(TRAIN_DDP), "--epochs", "1", "--samples", "1536", "--no-progress"], tmp_path)
        assert res.returncode == 0, (world, res.tail())
        local = 128 // world
        assert f"training on {world} process(es)" in res.stdout, res.tail()
        assert f"global batch {local * world} = {world} x {local} |" in res.stdout, res.tail()
        notes = res.stdout.count("does not split evenly")
        assert notes == (0 if 128 % world == 0 else 1), (world, res.tail())
        assert f"{1536 // (local * world)} steps/epoch" in res.stdout, res.tail()
