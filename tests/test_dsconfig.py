"""DeepSpeed JSON configs checked before launch: keys (with the near one as the
fix), batch arithmetic, the file and line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.errors import ForeignConfigError
from corral.interop import dsconfig
from corral.interop.dskeys import installed_keys, shipped_keys

ZERO3 = """{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 1,
  "zero_optimization": {
    "stage": 3,
    "stage3_gather_16bit_weights_on_mode_save": true
  }
}
"""


def check(tmp_path: Path, text: str, world: int | None = 4, keys=None) -> list[str]:
    (tmp_path / "ds.json").write_text(text)
    return dsconfig.check(str(tmp_path / "ds.json"), "ds.json", world_size=world, keys=keys or shipped_keys())


def test_misspelled_zero3_key_is_named_with_its_line_and_the_near_key(tmp_path: Path) -> None:
    with pytest.raises(ForeignConfigError) as e:
        check(tmp_path, ZERO3)
    assert e.value.message.startswith("ds.json:6: zero_optimization.stage3_gather_16bit_weights_on_mode_save")
    assert f"DeepSpeed {shipped_keys().version}" in e.value.message
    assert "'stage3_gather_16bit_weights_on_model_save'" in e.value.hint


@pytest.mark.skipif(installed_keys() is None, reason="needs DeepSpeed installed here")
def test_the_installed_deepspeeds_keys_are_used_where_there_is_one(tmp_path: Path) -> None:
    with pytest.raises(ForeignConfigError) as e:
        check(tmp_path, ZERO3, keys=installed_keys())
    assert "installed here" in e.value.message and "on_model_save" in e.value.hint


def test_a_misspelled_top_level_key_would_be_ignored_and_is_named(tmp_path: Path) -> None:
    with pytest.raises(ForeignConfigError) as e:
        check(tmp_path, '{"train_micro_batch_size_per_gpu": 2,\n "gradient_acumulation_steps": 4}')
    assert e.value.message.startswith("ds.json:2: gradient_acumulation_steps:")
    assert "ignored without a word" in e.value.message and "gradient_accumulation_steps" in e.value.hint


def test_a_correct_config_passes_and_free_form_sections_are_not_judged(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    example = (repo / "examples/launchers/ds_config_zero2.json").read_text()
    assert check(tmp_path, example) == []
    if installed_keys() is not None:
        assert check(tmp_path, example, keys=installed_keys()) == []
    assert check(tmp_path, json.dumps({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {
        "lr": "auto", "betas": [0.9, 0.95], "anything": 1}}, "fp16": {"enabled": "auto"}})) == []


@pytest.mark.parametrize("values, world, fix", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, 4, 8),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2}, 4, 8),  # 10 / (2 x 4) is not whole
    ({"train_batch_size": 6, "gradient_accumulation_steps": 2}, 4, 8),
])
def test_batch_arithmetic_that_cannot_hold_is_named_with_the_value_that_would(tmp_path, values, world, fix) -> None:
    with pytest.raises(ForeignConfigError) as e:
        check(tmp_path, json.dumps(values, indent=1), world)
    assert e.value.message.startswith("ds.json:2: train_batch_size") and f"= {fix}:" in e.value.message
    assert e.value.hint.startswith(f"set train_batch_size to {fix}")


@pytest.mark.parametrize("values", [
    {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
    {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2},  # accumulation 2 derived
    {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2},
])
def test_batch_arithmetic_that_holds_passes(tmp_path: Path, values: dict) -> None:
    assert check(tmp_path, json.dumps(values), 4) == []


def test_model_parallel_groups_are_said_not_refused(tmp_path: Path) -> None:
    notes = check(tmp_path, json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                        "gradient_accumulation_steps": 1}), 8)
    assert len(notes) == 1 and "groups of 4 of the 8 ranks" in notes[0]


def test_duplicate_key_and_bad_json_are_named(tmp_path: Path) -> None:
    with pytest.raises(ForeignConfigError, match=r"ds.json:3: 'fp16' is given twice"):
        check(tmp_path, '{"fp16": {},\n "bf16": {},\n "fp16": {}}')
    with pytest.raises(ForeignConfigError, match=r"ds.json:2: is not valid JSON"):
        check(tmp_path, '{"fp16": {},\n }')


def test_configs_a_run_names() -> None:
    args = ["--deepspeed_config", "a.json", "--deepspeed=b.json", "--deepspeed", "--lr", "1"]
    assert [n for _, n in dsconfig.configs_of_run(args, ["--deepspeed_config_file=c.json"], "/p")] == \
        ["a.json", "b.json", "c.json"]


def test_run_names_the_misspelled_zero3_key_before_launch(tmp_path: Path) -> None:
    """`corral run` stops before connecting to any node (exit 2, nothing started)."""
    (tmp_path / "ds.json").write_text(ZERO3)
    (tmp_path / "train.py").write_text("raise SystemExit('started')\n")
    res = subprocess.run([sys.executable, "-m", "corral", "run", "-H", "localhost:2", "--launcher", "deepspeed",
                          "train.py", "--deepspeed", "--deepspeed_config", "ds.json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=os.environ)
    assert res.returncode == 2, res.stderr
    assert "ds.json:6: zero_optimization.stage3_gather_16bit_weights_on_mode_save" in res.stderr
    assert "stage3_gather_16bit_weights_on_model_save" in res.stderr and "started" not in res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
