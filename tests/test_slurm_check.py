"""corral check: the mistakes of real-world-style Slurm batch scripts, by line.

Each script in tests/fixtures/sbatch/ is written the way people post them
(torchrun under srun, accelerate's Slurm example, Lightning's SLURM submit
script, DeepSpeed with a hostfile from `scontrol show hostnames`, Princeton's
DDP example); the mistakes each one holds are listed here with their lines,
and the correct ones must give no finding at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from corral.cli import cli
from corral.slurm.check import check_file, check_text
from corral.slurm.script import read_script, scan_commands

FIXTURES = Path(__file__).parent / "fixtures" / "sbatch"

#: script -> the (line, code) of every mistake in it
BAD = {
    "torchrun_bad.sbatch": {
        (7, "no-signal"),  # 48 h, no --signal
        (14, "fixed-port"),  # MASTER_PORT=29500
        (16, "kill-on-bad-exit"),
        (16, "srun-cpus-per-task"),  # --cpus-per-task=32, no SRUN_CPUS_PER_TASK
        (18, "launcher-count-mismatch"),  # --nproc_per_node=4 on 8 GPUs
        (19, "per-task-variable-expanded-early"),  # --node_rank=$SLURM_NODEID, unquoted
    },
    "accelerate_bad.sbatch": {
        (10, "signal-kills-launcher"),  # USR1 to accelerate, which dies of it
        (29, "fixed-port"),  # --main_process_port 29500 (inside $LAUNCHER)
        (29, "launcher-count-mismatch"),  # --num_processes 8 on 4 nodes x 8 GPUs
    },
    "deepspeed_hostfile.sbatch": {
        (7, "signal-batch-untrapped"),  # B:USR1, no trap: bash dies of it
        (14, "fixed-port"),
    },
    "heredoc_wrapper.sbatch": {
        (12, "per-task-variable-expanded-early"),  # <<EOF: RANK=$SLURM_PROCID written as 0
        (13, "per-task-variable-expanded-early"),
    },
    "lightning_bad.sbatch": {
        (10, "kill-on-bad-exit"),
        (10, "lightning-devices"),  # ntasks-per-node=1, Trainer(devices=4)
    },
    "lightning_gpus_per_task.sbatch": {(4, "gpus-per-task")},
    "lightning_no_srun.sbatch": {(7, "lightning-without-srun")},
    "lightning_num_nodes.sbatch": {(7, "lightning-num-nodes")},  # --nodes=4, num_nodes=2
    "python_srun_bad.sbatch": {
        (5, "gpus-per-task"),  # 4 tasks per node, one GPU each: invalid device ordinal
        (11, "master-addr"),  # hard-coded 10.10.0.12
        (13, "kill-on-bad-exit"),
        (13, "srun-cpus-per-task"),
        (16, "job-variable-in-step"),  # $SLURM_NTASKS (8) in a 4-task step
        (16, "srun-cpus-per-task"),
    },
    "torchrun_per_task_host.sbatch": {
        (9, "several-launchers-per-node"),  # 8 tasks per node, each a torchrun
        (9, "signal-trap-foreground"),  # the trap waits for the foreground srun
        (9, "torchrun-node-rank"),  # 4 nodes, static rendezvous, no --node-rank
        (10, "master-addr"),  # $(hostname) in every task
        (11, "launcher-count-mismatch"),  # --nnodes=2 on 4 nodes
    },
    "torchrun_no_srun.sbatch": {(7, "launcher-without-srun")},
}
GOOD = ["torchrun_good.sbatch", "torchrun_c10d_good.sbatch", "accelerate_good.sbatch", "lightning_good.sbatch",
        "deepspeed_good.sbatch", "heredoc_wrapper_good.sbatch", "python_srun_good.sbatch"]


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_mistake_is_named_at_its_line(name):
    report = check_file(FIXTURES / name)
    assert {(f.line, f.code) for f in report.findings} == BAD[name]
    for f in report.findings:
        assert f.message and f.fix and f.severity in ("error", "warning")


@pytest.mark.parametrize("name", GOOD)
def test_correct_scripts_give_no_finding(name):
    assert check_file(FIXTURES / name).findings == ()


def test_every_fixture_is_listed():
    assert {p.name for p in FIXTURES.glob("*.sbatch")} == set(BAD) | set(GOOD)


def test_lightning_is_read_from_the_training_script_it_runs(tmp_path):
    """The same batch script is right or wrong by the Trainer it starts."""
    batch = tmp_path / "job.sbatch"
    batch.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --gres=gpu:2\n"
                     "srun --kill-on-bad-exit=1 python train.py\n")
    trainer = ("import lightning as L\nL.Trainer(devices={}, num_nodes=2).fit(None)\n")
    (tmp_path / "train.py").write_text(trainer.format(2))
    assert check_file(batch).findings == ()
    (tmp_path / "train.py").write_text(trainer.format(8))
    [finding] = check_file(batch).findings
    assert finding.code == "lightning-devices" and finding.line == 5 and "devices=8" in finding.message
    other = tmp_path / "other.py"
    other.write_text(trainer.format(2))
    assert check_file(batch, training_script=other).findings == ()  # --script wins


def test_hugging_face_trainer_is_not_lightning(tmp_path):
    batch = tmp_path / "job.sbatch"
    batch.write_text("#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:8\nsrun python train.py\n")
    (tmp_path / "train.py").write_text("from transformers import Trainer\nTrainer(model=None).train()\n")
    assert check_file(batch).findings == ()


@pytest.mark.parametrize("line, early", [
    ("srun python t.py --rank $SLURM_PROCID", True),
    ('srun bash -c "python t.py --rank $SLURM_PROCID"', True),
    ("srun bash -c 'python t.py --rank $SLURM_PROCID'", False),
    ('srun bash -c "python t.py --rank \\$SLURM_PROCID"', False),
    ("srun bash -c 'python t.py' --rank ${SLURM_PROCID}", True),
])
def test_which_shell_expands_a_variable(line, early):
    report = check_text(f"#SBATCH --nodes=2\n{line}\n")
    assert any(f.code == "per-task-variable-expanded-early" for f in report.findings) is early


def test_a_per_task_wrapper_script_is_not_a_batch_script():
    """A script srun runs on each task (no #SBATCH, no srun) reads its own variables."""
    assert check_text("#!/bin/bash\nexport RANK=$SLURM_PROCID\nexec python train.py\n").findings == ()


def test_directives_stop_at_the_first_command():
    """sbatch ignores #SBATCH lines after the first command; so does corral."""
    script = read_script("#!/bin/bash\n#SBATCH --nodes=2\necho hi\n#SBATCH --nodes=8\n")
    assert [(d.line, d.name, d.value) for d in script.directives] == [(2, "nodes", "2")]


def test_commands_keep_their_lines_across_continuations_and_quotes():
    commands = scan_commands("a \\\n  b; c && d\nsrun bash -c '\n x\n' &\n# comment\ne 2>&1\n")
    assert [(c.line, c.words[0], c.background) for c in commands] == [
        (1, "a", False), (2, "c", False), (2, "d", False), (3, "srun", True), (7, "e", False)]
    # quotes inside $(...) inside quotes open a context of their own
    commands = scan_commands('export A="$(scontrol show hostnames "$X" | head -n 1)"\nsrun b\n')
    assert [(c.line, c.words[0]) for c in commands] == [(1, "export"), (2, "srun")]


def _invoke(*args: str):
    return CliRunner().invoke(cli, ["check", *args])


def test_cli_exit_status_and_json(tmp_path):
    res = _invoke(str(FIXTURES / "torchrun_bad.sbatch"))
    assert res.exit_code == 1
    assert "torchrun_bad.sbatch:19: error: $SLURM_NODEID" in res.output
    assert "fix: let each task's shell expand it" in res.output
    res = _invoke("--json", str(FIXTURES / "torchrun_bad.sbatch"))
    data = json.loads(res.output)
    assert res.exit_code == 1 and data["errors"] == 2 and data["warnings"] == 4
    assert {"line", "code", "severity", "message", "fix"} <= set(data["findings"][0])
    res = _invoke(str(FIXTURES / "torchrun_good.sbatch"))
    assert res.exit_code == 0 and res.stdout == ""
    warnings_only = tmp_path / "w.sbatch"
    warnings_only.write_text("#SBATCH --nodes=2\n#SBATCH --time=10:00:00\nsrun --kill-on-bad-exit=1 python t.py\n")
    res = _invoke(str(warnings_only))
    assert res.exit_code == 0 and "warning:" in res.output


def test_cli_missing_script_is_bad_input(tmp_path):
    res = _invoke(str(tmp_path / "nope.sbatch"))
    assert res.exit_code == 2 and "nope.sbatch: no such file" in res.output
    res = _invoke(str(tmp_path))
    assert res.exit_code == 2 and "is a directory" in res.output


def test_what_is_not_a_batch_script_is_refused_and_never_blocks(tmp_path):
    """A FIFO would block a reader forever; a huge file is no batch script."""
    fifo = tmp_path / "job.sbatch"
    os.mkfifo(fifo)
    res = _invoke(str(fifo))
    assert res.exit_code == 2 and "not a regular file" in res.output
    big = tmp_path / "big.sbatch"
    big.write_bytes(b"#" * (5 * 1024 * 1024))
    res = _invoke(str(big))
    assert res.exit_code == 2 and "bigger than a batch script" in res.output
    # a training script that is a FIFO is skipped, not read
    batch = tmp_path / "ok.sbatch"
    batch.write_text("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\nsrun --kill-on-bad-exit=1 python train.py\n")
    os.mkfifo(tmp_path / "train.py")
    assert check_file(batch).findings == ()


@pytest.mark.parametrize("extra, flagged", [
    ("", True),
    ("export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGUSR1\n", False),
])
def test_a_signal_torchrun_is_told_to_handle_does_not_kill_it(extra, flagged):
    script = ("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --time=10:00:00\n#SBATCH --signal=USR1@120\n"
              f"{extra}srun --kill-on-bad-exit=1 bash -c 'torchrun --nnodes=2 --node-rank=$SLURM_NODEID t.py'\n")
    codes = [f.code for f in check_text(script).findings]
    assert ("signal-kills-launcher" in codes) is flagged
    told = script.replace("torchrun --nnodes", "torchrun --signals-to-handle=SIGTERM,SIGUSR1 --nnodes")
    assert "signal-kills-launcher" not in [f.code for f in check_text(told).findings]


@pytest.mark.parametrize("shell", ["bash -c", "sh -xeuc", "bash -l -c", "bash -lc"])
def test_the_per_task_string_is_read_whatever_the_shell_flags(shell):
    script = ("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:4\n"
              f"srun --kill-on-bad-exit=1 {shell} 'torchrun --nnodes=3 --node-rank=$SLURM_NODEID t.py'\n")
    assert [(f.line, f.code) for f in check_text(script).findings] == [(4, "launcher-count-mismatch")]
