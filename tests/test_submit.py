"""corral submit's batch script and command line (the real cluster: tests/test_slurm.py)."""

from __future__ import annotations

import subprocess

from click.testing import CliRunner

from corral.cli import cli
from corral.slurm.submit import SubmitSpec, batch_script, check_signal, split_leading_options


def test_print_shows_the_script_and_submits_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere: --print must not need one
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    res = CliRunner().invoke(cli, ["submit", "--print", "-N", "4", "--gpus-per-node", "a100:8", "-t", "1:00:00",
                                   "-p", "gpu", "--requeue", "--account=proj", "--exclusive",
                                   "train.py", "--lr", "3e-4", "--name", "it's"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=a100:8", "#SBATCH --time=1:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --requeue", "#SBATCH --account=proj",
                 "#SBATCH --exclusive", "#SBATCH --job-name=corral-train"):
        assert want in lines, want
    assert any(ln.startswith("#SBATCH --ntasks-per-node=1") for ln in lines)
    assert any(ln.startswith("#SBATCH --signal=B:USR1@120") for ln in lines)
    assert "scontrol requeue \"$SLURM_JOB_ID\"" in res.output
    # The command line survives the shell: run it through bash -n and echo it back.
    command = next(ln for ln in lines if " -m corral run " in ln)
    echoed = subprocess.run(["/bin/bash", "-c", "printf '%s\\n' " + command.removesuffix(" &")],
                            capture_output=True, text=True).stdout.splitlines()
    assert echoed[-6:] == ["--", "train.py", "--lr", "3e-4", "--name", "it's"]
    assert subprocess.run(["/bin/bash", "-n"], input=res.output, text=True).returncode == 0


def test_no_requeue_and_no_signal() -> None:
    text = batch_script(SubmitSpec(script="t.py", signal=None, workdir="/w", python="/p/python"))
    assert "#SBATCH --no-requeue" in text and "#SBATCH --signal" not in text and "trap '" not in text
    assert "cd /w || exit 2" in text


def test_bad_signal_and_split_sbatch_options_are_named() -> None:
    res = CliRunner().invoke(cli, ["submit", "--print", "--signal", "TERM@10", "t.py"])
    assert res.exit_code == 2 and "--signal 'TERM@10'" in res.output
    assert check_signal("SIGUSR2@30") == "USR2@30" and check_signal("B:USR1") == "USR1@60"
    res = CliRunner().invoke(cli, ["submit", "--print", "--account", "proj", "t.py"])
    assert res.exit_code == 2 and "--account=proj" in res.output  # 'proj' would be the script
    assert split_leading_options(["--mem=0", "--", "t.py", "-x"]) == (("--mem=0",), "t.py", ("-x",))
    res = CliRunner().invoke(cli, ["submit", "--print", "--mem=0"])
    assert res.exit_code == 2 and "needs a script" in res.output
