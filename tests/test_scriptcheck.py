"""A script that starts its own workers is named before it hangs under torchrun."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from corral.run.scriptcheck import (
    lightning_note,
    lightning_shape,
    local_rank_only,
    local_rank_problem,
    module_for,
    relative_import_line,
    self_launch,
    self_launch_note,
)

CORRAL = [sys.executable, "-m", "corral"]

#: The PyTorch DDP tutorial's shape (getting-started guide): its own
#: MASTER_ADDR/MASTER_PORT, a rank argument from mp.spawn, no RANK read.
TUTORIAL = """
import os
import torch.distributed as dist
import torch.multiprocessing as mp

def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def demo_basic(rank, world_size):
    setup(rank, world_size)
    dist.destroy_process_group()

if __name__ == "__main__":
    world_size = 2
    mp.spawn(demo_basic, args=(world_size,), nprocs=world_size, join=True)
"""

#: detectron2's tools/train_net.py shape.
DETECTRON2 = """
from detectron2.engine import default_argument_parser, launch

def main(args):
    return args

if __name__ == "__main__":
    args = default_argument_parser().parse_args()
    launch(main, args.num_gpus, num_machines=args.num_machines, machine_rank=args.machine_rank,
           dist_url=args.dist_url, args=(args,))
"""

#: pytorch/examples imagenet main.py shape: spawns only with
#: --multiprocessing-distributed, else reads RANK/WORLD_SIZE as torchrun sets them.
IMAGENET = """
import os
import torch.multiprocessing as mp

def main(args):
    if args.dist_url == "env://" and args.world_size == -1:
        args.world_size = int(os.environ["WORLD_SIZE"])
    if args.multiprocessing_distributed:
        mp.spawn(main_worker, nprocs=4, args=(4, args))
    else:
        main_worker(0, 4, args)

def main_worker(gpu, ngpus, args):
    if args.dist_url == "env://" and args.rank == -1:
        args.rank = int(os.environ["RANK"])
"""


@pytest.mark.parametrize(("source", "line", "call"), [
    (TUTORIAL, 17, "mp.spawn"),
    (DETECTRON2, 9, "launch"),
    ("import torch\ntorch.multiprocessing.spawn(print, nprocs=2)\n", 2, "torch.multiprocessing.spawn"),
    ("from torch.multiprocessing import start_processes as sp\nsp(print, nprocs=2, start_method='fork')\n",
     2, "sp"),
    ("from torch import multiprocessing as tmp\n\n\ntmp.spawn(print)\n", 4, "tmp.spawn"),
])
def test_scripts_that_start_their_own_workers(source: str, line: int, call: str) -> None:
    found = self_launch(textwrap.dedent(source))
    assert found is not None and (found.line, found.call) == (line, call)


@pytest.mark.parametrize("source", [
    IMAGENET,  # reads RANK / WORLD_SIZE when torchrun runs it
    TUTORIAL.replace("import os", "import os\nimport accelerate"),  # a framework that reads the env
    TUTORIAL.replace("def setup", "parser.add_argument('--local_rank', type=int)\ndef setup"),
    "import multiprocessing as mp\nmp.Pool(4).map(print, range(4))\n",  # a worker pool, not ranks
    "import torch.multiprocessing as mp\nmp.set_start_method('spawn')\n",  # no spawn call
    "def spawn(x):\n    pass\nspawn(1)\n",  # a function of its own named spawn
    "this is not python (\n",
])
def test_scripts_left_alone(source: str) -> None:
    assert self_launch(textwrap.dedent(source)) is None


def test_note_only_when_the_launcher_starts_several_processes(tmp_path: Path) -> None:
    (tmp_path / "tut.py").write_text(TUTORIAL)
    note = self_launch_note("tut.py", tmp_path, launcher="torchrun", nproc=8)
    assert note and note.startswith("tut.py:17 starts its own worker processes (mp.spawn)")
    assert "--launcher command tut.py" in note and "8 processes per node" in note
    assert self_launch_note("tut.py", tmp_path, launcher="torchrun", nproc=1) is None
    assert self_launch_note("tut.py", tmp_path, launcher="command", nproc=8) is None
    assert self_launch_note("missing.py", tmp_path, launcher="torchrun", nproc=8) is None


def test_run_names_the_self_launching_script_before_it_starts(tmp_path: Path) -> None:
    # The tutorial would hang under torchrun with 2 processes (4 workers, one
    # rendezvous for 2); the script here exits at once, so only the notice is
    # under test, and that the run still goes ahead (it is advice, not a refusal).
    (tmp_path / "tut.py").write_text(TUTORIAL.replace("    mp.spawn(", "    print('started', flush=True)\n    0 and mp.spawn("))
    res = subprocess.run(CORRAL + ["run", "--nproc-per-node", "2", "tut.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "tut.py:18 starts its own worker processes (mp.spawn)" in res.stderr
    assert (res.stdout + res.stderr).count("started") == 2


def test_dry_run_shows_the_note(tmp_path: Path) -> None:
    (tmp_path / "tut.py").write_text(TUTORIAL)
    res = subprocess.run(CORRAL + ["run", "--dry-run", "--nproc-per-node", "2", "tut.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert "tut.py:17 starts its own worker processes (mp.spawn)" in " ".join(res.stdout.split())


def test_one_process_per_node_without_a_node_rank(tmp_path: Path) -> None:
    # --launcher command on several nodes: a spawning script that is told
    # nothing of its node would train on each node on its own.
    (tmp_path / "tut.py").write_text(TUTORIAL)
    (tmp_path / "train_net.py").write_text(DETECTRON2)
    note = self_launch_note("tut.py", tmp_path, launcher="command", nproc=1, nnodes=4)
    assert note and "on 4 nodes each node would start a job of its own" in note
    assert "--machine-rank '$NODE_RANK'" in note
    # detectron2 told its node rank on the command line, as docs/run.md shows
    told = ("train_net.py", "--num-machines", "$NNODES", "--machine-rank", "$NODE_RANK")
    assert self_launch_note("python", tmp_path, launcher="command", nproc=1, nnodes=4, args=told) is None
    untold = ("train_net.py", "--num-gpus", "8")
    note = self_launch_note("python3", tmp_path, launcher="command", nproc=1, nnodes=2, args=untold)
    assert note and note.startswith("train_net.py:9 starts its own worker processes (launch)")
    assert self_launch_note("tut.py", tmp_path, launcher="command", nproc=1, nnodes=1) is None


def test_the_script_of_a_command_launcher_run() -> None:
    from corral.run.scriptcheck import script_and_args

    assert script_and_args("command", "python3", ("train_net.py", "--x")) == ("train_net.py", ("--x",))
    assert script_and_args("command", "/opt/venv/bin/python3.11", ("a.py",)) == ("a.py", ())
    assert script_and_args("command", "bash", ("-c", "python a.py")) == ("bash", ("-c", "python a.py"))
    assert script_and_args("torchrun", "train.py", ("--lr", "1")) == ("train.py", ("--lr", "1"))
    assert script_and_args("command", "python", ("-m", "pkg")) == ("python", ("-m", "pkg"))


def test_a_relative_import_at_the_top_level_is_found() -> None:
    assert relative_import_line("import os\nfrom .model import Net\n") == 2
    assert relative_import_line("from . import utils\n") == 1
    # guarded, or inside a function: the script may work both ways
    assert relative_import_line("try:\n    from .m import a\nexcept ImportError:\n    from m import a\n") is None
    assert relative_import_line("def f():\n    from .m import a\n") is None
    assert relative_import_line("from os import path\n") is None
    assert relative_import_line("from .m import (\n") is None  # does not parse: Python will say


def test_the_module_of_a_file_and_where_to_run_it(tmp_path: Path) -> None:
    pkg = tmp_path / "proj" / "pkg" / "sub"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent):
        (d / "__init__.py").write_text("")
    (pkg / "train.py").write_text("")
    assert module_for(pkg / "train.py", tmp_path / "proj") == ("pkg.sub.train", tmp_path / "proj")
    assert module_for(pkg / "train.py", tmp_path / "elsewhere") == ("pkg.sub.train", tmp_path / "proj")
    (tmp_path / "loose.py").write_text("")
    assert module_for(tmp_path / "loose.py", tmp_path / "elsewhere") is None


# -- a script that joins the job itself, then spawns helpers ---------------

#: init_process_group over env:// (RANK/WORLD_SIZE from torchrun), then
#: mp.spawn'd data helpers that are not ranks.
ENV_INIT_THEN_SPAWN = """
import torch.distributed as dist
import torch.multiprocessing as mp

def helper(i):
    pass

if __name__ == "__main__":
    dist.init_process_group("gloo")
    mp.spawn(helper, nprocs=2)
"""


@pytest.mark.parametrize("init", [
    'dist.init_process_group("gloo")',
    'dist.init_process_group(backend="gloo", init_method="env://")',
    'dist.init_process_group("gloo", "env://")',
    'torch.distributed.init_process_group("nccl", timeout=t)',
])
def test_a_rank_that_joins_over_env_and_spawns_helpers_is_left_alone(tmp_path: Path, init: str) -> None:
    source = ENV_INIT_THEN_SPAWN.replace('dist.init_process_group("gloo")', init)
    assert self_launch(source) is None
    (tmp_path / "s.py").write_text(source)
    assert self_launch_note("s.py", tmp_path, launcher="torchrun", nproc=2) is None


@pytest.mark.parametrize("init", [
    'dist.init_process_group("gloo", rank=0, world_size=2)',  # the tutorial's own rank
    'dist.init_process_group("gloo", init_method="tcp://localhost:12355")',
])
def test_init_with_its_own_rank_or_address_still_counts_as_self_launch(init: str) -> None:
    assert self_launch(ENV_INIT_THEN_SPAWN.replace('dist.init_process_group("gloo")', init)) is not None


# -- the torch.distributed.launch style: --local_rank and nothing else -----

#: The old pytorch/examples and many repositories: the launcher passed
#: --local_rank, -1 meant "not distributed".
LOCAL_RANK_ONLY = """
import argparse
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
if args.local_rank != -1:
    dist.init_process_group("gloo")
print("distributed" if dist.is_initialized() else "alone")
"""


def test_a_script_that_takes_its_rank_only_from_local_rank_is_found() -> None:
    assert local_rank_only(LOCAL_RANK_ONLY) == 7
    assert local_rank_only(LOCAL_RANK_ONLY.replace('"--local_rank"', '"--local-rank", "--local_rank"')) == 7


@pytest.mark.parametrize("change", [
    ('args = parser.parse_args()', 'args = parser.parse_args()\nargs.local_rank = int(os.environ["LOCAL_RANK"])'),
    ('import torch\n', 'import torch\nimport deepspeed\n'),  # deepspeed.init_distributed reads the env
    ('if args.local_rank != -1:\n    dist', 'if True:\n    dist'),  # joins over env:// anyway
    ('parser.add_argument("--local_rank", type=int, default=-1)\n', ''),  # no --local_rank at all
])
def test_scripts_that_read_the_environment_are_not_local_rank_only(change: tuple[str, str]) -> None:
    assert change[0] in LOCAL_RANK_ONLY
    assert local_rank_only(LOCAL_RANK_ONLY.replace(*change)) is None


def test_local_rank_problem_only_where_the_launcher_passes_no_local_rank(tmp_path: Path) -> None:
    (tmp_path / "old.py").write_text(LOCAL_RANK_ONLY)
    message, hint = local_rank_problem("old.py", tmp_path, launcher="torchrun", world_size=4, args=("--lr", "1"))
    assert message.startswith("old.py:7 takes its rank only from a --local_rank argument")
    assert "train alone" in message and "LOCAL_RANK" in hint
    assert "`corral run --launcher deepspeed old.py --lr 1`" in hint
    assert local_rank_problem("old.py", tmp_path, launcher="accelerate", world_size=2) is not None
    assert local_rank_problem("old.py", tmp_path, launcher="deepspeed", world_size=4) is None
    assert local_rank_problem("old.py", tmp_path, launcher="torchrun", world_size=1) is None


def test_run_refuses_a_local_rank_only_script_before_it_starts(tmp_path: Path) -> None:
    """Under torchrun the script would print "alone" twice and succeed."""
    (tmp_path / "old.py").write_text(LOCAL_RANK_ONLY)
    res = subprocess.run(CORRAL + ["run", "-n", "2", "old.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "old.py:7 takes its rank only from a --local_rank argument" in " ".join(res.stderr.split())
    assert "alone" not in res.stdout
    res = subprocess.run(CORRAL + ["run", "--dry-run", "-n", "2", "old.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 2 and "takes its rank only from a --local_rank" in " ".join(res.stderr.split())


# -- Lightning: the processes the Trainer starts ----------------------------


@pytest.mark.parametrize(("call", "args", "devices", "auto", "nodes"), [
    ("L.Trainer(devices=1, num_nodes=3)", (), 1, False, 3),
    ("Trainer(devices='2')", (), 2, False, 1),
    ("pl.Trainer(devices=[0, 1, 2])", (), 3, False, 1),
    ("Trainer(devices='0,1')", (), 2, False, 1),
    ("Trainer(max_epochs=1)", (), None, True, 1),  # devices left out: auto
    ("Trainer(devices=-1)", (), None, True, 1),
    ("L.Fabric(devices=args.devices, num_nodes=args.num_nodes)", ("--devices", "4", "--num-nodes=2"), 4, False, 2),
    ("Trainer(devices=args.devices)", (), 1, False, 1),  # the option's default
    ("Trainer(devices=n, num_nodes=k)", (), None, False, None),  # cannot tell
])
def test_the_trainers_devices_and_num_nodes(call: str, args: tuple, devices, auto: bool, nodes) -> None:
    source = ("import argparse, lightning as L\np = argparse.ArgumentParser()\n"
              "p.add_argument('--devices', type=int, default=1)\np.add_argument('--num-nodes', type=int)\n"
              f"args = p.parse_args()\n{call}\n")
    shape = lightning_shape(source, args)
    assert shape is not None and shape.line == 6
    assert (shape.devices, shape.auto, shape.num_nodes) == (devices, auto, nodes)


def test_a_trainer_corral_cannot_read_is_said(tmp_path: Path) -> None:
    (tmp_path / "fit.py").write_text("import lightning as L\nL.Trainer(devices=cfg.n)\n")
    note = lightning_note("fit.py", tmp_path, args=(), nproc=2, told=False)
    assert note and note.startswith("fit.py:2 L.Trainer(devices=...) is not a number corral can read")
    assert lightning_note("fit.py", tmp_path, args=(), nproc=2, told=True) is None  # -n said it
    (tmp_path / "fit.py").write_text("import lightning as L\nL.Trainer(devices=2)\n")
    assert lightning_note("fit.py", tmp_path, args=(), nproc=2, told=False) is None
