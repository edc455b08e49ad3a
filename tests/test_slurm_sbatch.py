"""corral export sbatch: a plain batch script that `corral check` finds nothing in, and that runs as meant."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from corral.cli import cli
from corral.errors import UsageError
from corral.slurm.check import check_file, check_text
from corral.slurm.sbatch import LAUNCHERS, SbatchSpec, render


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("nodes, gpus, cpus, time, requeue", [
    (1, 1, None, None, False),
    (4, 8, 64, "24:00:00", True),
    (2, 4, 16, "2-00:00:00", False),
])
def test_every_exported_script_passes_corral_check(launcher, nodes, gpus, cpus, time, requeue):
    text = render(SbatchSpec(program="train.py", args=("--lr", "3e-4"), launcher=launcher, nodes=nodes,
                             gpus_per_node=gpus, cpus_per_task=cpus, time=time, requeue=requeue,
                             partition="gpu", sbatch_options=("--constraint=a100", "--exclusive")))
    assert check_text(text).findings == ()
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert f"#SBATCH --nodes={nodes}" in text and "#SBATCH --constraint=a100" in text


def test_exported_lightning_script_matches_the_trainer_it_runs(tmp_path):
    train = tmp_path / "train.py"
    train.write_text("import lightning as L\nL.Trainer(devices=8, num_nodes=4).fit(None)\n")
    job = tmp_path / "job.sbatch"
    job.write_text(render(SbatchSpec(program="train.py", launcher="lightning", nodes=4, gpus_per_node=8,
                                     time="24:00:00")))
    assert check_file(job).findings == ()
    job.write_text(render(SbatchSpec(program="train.py", launcher="lightning", nodes=4, gpus_per_node=4)))
    assert [f.code for f in check_file(job).findings] == ["lightning-devices"]


@pytest.mark.parametrize("field, value, flag", [
    ("partition", "gpu\nsrun rm -rf ~", "--partition"),
    ("job_name", "a b", "--job-name"),
    ("time", "forever", "--time"),
    ("sbatch_options", ("--comment=x; rm -rf ~",), "--sbatch"),
    ("launcher", "deepspeed", "--launcher"),
])
def test_values_that_would_change_the_script_are_refused(field, value, flag):
    with pytest.raises(UsageError) as err:
        render(SbatchSpec(program="train.py", **{field: value}))
    assert flag in err.value.message


def test_program_arguments_are_quoted_for_the_shell():
    text = render(SbatchSpec(program="train.py", args=("--name", "$(reboot)", "a b")))
    assert "'$(reboot)' 'a b'" in text


def _stand_ins(bin_dir: Path, hosts: list[str]) -> None:
    """Stand-ins for the cluster's tools: srun runs its command once per node, as
    each node's task would (its own SLURM_NODEID), scontrol lists the hosts,
    torchrun and python print what they were given."""
    scripts = {
        "scontrol": f"#!/bin/bash\n[ \"$1 $2\" = 'show hostnames' ] && printf '%s\\n' {' '.join(hosts)}\n",
        "srun": ("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                 f"for i in $(seq 0 {len(hosts) - 1}); do SLURM_NODEID=$i SLURM_STEP_NUM_NODES={len(hosts)} "
                 "\"$@\" || exit $?; done\n"),
        "torchrun": "#!/bin/bash\necho \"torchrun $MASTER_ADDR:$MASTER_PORT $(printf '<%s>' \"$@\")\"\n",
        "accelerate": "#!/bin/bash\necho \"accelerate $(printf '<%s>' \"$@\")\"\n",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_each_node_gets_its_own_rank_and_the_first_host(tmp_path, launcher):
    """Run in bash: the per-task quoting really gives node i its rank i, every
    node the first host as MASTER_ADDR, and the arguments unchanged."""
    _stand_ins(tmp_path, ["gpu07", "gpu08", "gpu09"])
    job = tmp_path / "job.sbatch"
    job.write_text(render(SbatchSpec(program="train.py", args=("--tag", "a b", "$HOME"), launcher=launcher,
                                     nodes=3, gpus_per_node=2)))
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_CPUS_PER_TASK": "8"}
    out = subprocess.run([shutil.which("bash"), str(job)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        if launcher == "torchrun":
            assert line.startswith(f"torchrun gpu07:{20000 + 4242 % 20000} ")
            assert f"<--node-rank={rank}>" in line and "<--nnodes=3>" in line
        else:
            assert f"<--machine_rank><{rank}>" in line and "<--main_process_ip><gpu07>" in line
            assert "<--num_processes><6>" in line
        assert line.endswith("<train.py><--tag><a b><$HOME>")


def test_cli_prints_the_script():
    res = CliRunner().invoke(cli, ["export", "sbatch", "-N", "2", "--gpus-per-node", "4", "-t", "1:00:00",
                                   "train.py", "--epochs", "3"])
    assert res.exit_code == 0, res.output
    assert res.output == render(SbatchSpec(program="train.py", args=("--epochs", "3"), nodes=2, gpus_per_node=4,
                                           time="1:00:00"))
    res = CliRunner().invoke(cli, ["export", "sbatch", "-p", "a b", "train.py"])
    assert res.exit_code == 2 and "--partition" in res.output
