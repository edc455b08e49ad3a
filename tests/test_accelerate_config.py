"""accelerate config files: read with their lines, checked against the cluster,
and what corral follows from them applied to the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from corral.errors import ForeignConfigError, UsageError
from corral.interop.accelerate_config import follow, parse
from corral.model import Cluster, Host
from corral.run.imports import apply_imports
from corral.run.plan import RunSpec

GOOD = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
machine_rank: 0
main_process_ip: node1
main_process_port: 29555
mixed_precision: bf16
num_machines: 2
num_processes: 8
rdzv_backend: static
same_network: true
gpu_ids: all
"""


def hosts(n: int = 2, slots: int | None = None) -> tuple[Host, ...]:
    return tuple(Host(name=f"node{i + 1}", address=f"10.9.0.{i + 1}", slots=slots) for i in range(n))


def followed(text: str, n: int = 2, nproc: int | None = None, port: int | None = None):
    return follow(parse(textwrap.dedent(text), "acc.yaml"), hosts=hosts(n), nproc_per_node=nproc, master_port=port)


def test_a_correct_config_gives_the_processes_per_node_and_the_port() -> None:
    f = followed(GOOD)
    assert (f.nproc_per_node, f.master_port) == (4, 29555)
    assert any("machine_rank 0 is one node's" in n for n in f.notes)


@pytest.mark.parametrize("change, line, said, fix", [
    # num_processes is a total across machines: 3 does not divide among 2
    ("num_processes: 3", 8, "num_processes: 3 processes (a total across machines) do not divide", "multiple of 2"),
    ("num_machines: 3", 7, "num_machines: 3, but the cluster has 2 host(s)", "set num_machines: 2"),
    ("main_process_port: 22", 5, "main_process_port: 22 is an ssh port", "remove main_process_port"),
    ("main_process_ip: 10.9.0.2", 4, "main_process_ip: 10.9.0.2 is node2, node 1, not the first host node1",
     "list node2 first"),
    ("mixed_precision: bf32", 6, "mixed_precision: 'bf32' is not one of", "write one of those"),
    ("gpu_ids: 0,1", 11, "gpu_ids: 0,1 is 2 GPU(s), but each node starts 4", "list 4 GPU ids"),
])
def test_each_mistake_is_named_with_file_line_and_fix(change: str, line: int, said: str, fix: str) -> None:
    key = change.split(":")[0]
    text = "".join(change + "\n" if l.startswith(key + ":") else l + "\n" for l in GOOD.splitlines())
    with pytest.raises(ForeignConfigError) as e:
        followed(text)
    assert e.value.message.startswith(f"acc.yaml:{line}: {said}"), e.value.message
    assert fix in e.value.hint


def test_num_processes_against_the_runs_own_processes_per_node() -> None:
    with pytest.raises(ForeignConfigError, match="8 is 4 per node on 2 host.*starts 2 per node") as e:
        followed(GOOD, nproc=2)
    assert "num_processes: 4" in e.value.hint and "-n 4" in e.value.hint
    assert followed(GOOD, nproc=4).nproc_per_node is None  # agrees: nothing to add


def test_what_corral_must_set_itself_is_set() -> None:
    f = followed("distributed_type: DEEPSPEED\nrdzv_backend: c10d\ndeepspeed_config:\n"
                 "  deepspeed_multinode_launcher: pdsh\n  deepspeed_config_file: ds.json\n")
    assert any("rdzv_backend c10d -> static" in n for n in f.notes) and f.fans_out
    assert f.deepspeed_config_file == "ds.json"
    assert not followed("distributed_type: DEEPSPEED\n", n=1).fans_out  # one node: nothing fans out


def test_yaml_errors_are_named_with_their_line() -> None:
    with pytest.raises(ForeignConfigError, match=r"acc.yaml:3: is not valid YAML: mapping values"):
        parse("a: 1\nb: 2\n  c: 3\nd: 4\n", "acc.yaml")


def test_apply_imports_config_file_flag(tmp_path: Path) -> None:
    (tmp_path / "acc.yaml").write_text(GOOD)
    c = Cluster(hosts=hosts(2))
    spec, notes = apply_imports(RunSpec(program="t.py", launcher="accelerate", run_id="r"), c, config_file="acc.yaml",
                                cwd=str(tmp_path), environ={}, home=tmp_path)
    assert spec.nproc_per_node == 4 and spec.master_port == 29555
    assert spec.launcher_args == ("--config_file", "acc.yaml")
    assert notes[0].startswith("accelerate config acc.yaml: distributed_type MULTI_GPU")
    with pytest.raises(UsageError, match="accelerate's config file"):
        apply_imports(RunSpec(program="t.py", run_id="r"), c, config_file="acc.yaml", cwd=str(tmp_path),
                      environ={}, home=tmp_path)


def test_pdsh_deepspeed_config_applies_the_deepspeed_env_as_its_runner_would(tmp_path: Path) -> None:
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n")
    (tmp_path / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\n")
    spec, notes = apply_imports(
        RunSpec(program="t.py", launcher="accelerate", launcher_args=("--config_file=acc.yaml",), run_id="r"),
        Cluster(hosts=hosts(2)), config_file=None, cwd=str(tmp_path), environ={}, home=tmp_path / "h")
    assert spec.ds_env and [v.name for v in spec.ds_env.values] == ["NCCL_DEBUG"]
    assert any("deepspeed_multinode_launcher pdsh (its default)" in n for n in notes)


def test_run_names_the_mistake_before_connecting(tmp_path: Path) -> None:
    (tmp_path / "acc.yaml").write_text(GOOD.replace("num_processes: 8", "num_processes: 6"))
    (tmp_path / "t.py").write_text("raise SystemExit('started')\n")
    res = subprocess.run([sys.executable, "-m", "corral", "run", "-H", "unreachable-a:2,unreachable-b:2",
                          "--launcher", "accelerate", "--config-file", "acc.yaml", "t.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, env=os.environ)
    assert res.returncode == 2 and "acc.yaml:8: num_processes: 6 is 3 per node on 2 host(s)" in res.stderr, res.stderr


def _facts(texts: dict[str, str | None]) -> dict:
    from corral.run.plan import NodeFacts

    path = "~/.cache/huggingface/accelerate/default_config.yaml"
    return {h: NodeFacts(accelerate_config=None if t is None else (path, t)) for h, t in texts.items()}


def test_nodes_default_configs_both_at_machine_rank_0_are_named() -> None:
    from corral.run.imports import node_accelerate_notes

    spec = RunSpec(program="t.py", launcher="accelerate", run_id="r")
    copied = GOOD.replace("num_processes: 8", "num_processes: 4")
    with pytest.raises(ForeignConfigError) as e:
        node_accelerate_notes(spec, hosts(2), _facts({"node1": copied, "node2": copied}), nproc=2)
    assert e.value.message.startswith(
        "node2:~/.cache/huggingface/accelerate/default_config.yaml:3: machine_rank: 0, and node1's is 0 too")
    assert "set machine_rank: 1 on node2" in e.value.hint
    right = copied.replace("machine_rank: 0", "machine_rank: 1")
    assert node_accelerate_notes(spec, hosts(2), _facts({"node1": copied, "node2": right}), nproc=2) == []
    with pytest.raises(ForeignConfigError, match="node1:.*:3: machine_rank: 1, but node1 is node 0"):
        node_accelerate_notes(spec, hosts(2), _facts({"node1": right, "node2": None}), nproc=2)
    # the same checks as a given file: num_processes against the run's processes
    with pytest.raises(ForeignConfigError, match="num_processes: 4 is 2 per node.*starts 4 per node"):
        node_accelerate_notes(spec, hosts(2), _facts({"node1": copied, "node2": right}), nproc=4)


def test_single_machine_default_configs_are_said_to_be_overruled() -> None:
    from corral.run.imports import node_accelerate_notes

    one = "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 8\nmachine_rank: 0\n"
    spec = RunSpec(program="t.py", launcher="accelerate", run_id="r")
    notes = node_accelerate_notes(spec, hosts(2), _facts({"node1": one, "node2": one}), nproc=2)
    assert len(notes) == 1 and "on node[1-2] is for one machine" in notes[0]
    given = RunSpec(program="t.py", launcher="accelerate", run_id="r", launcher_args=("--config_file=a.yaml",))
    assert node_accelerate_notes(given, hosts(2), _facts({"node1": one, "node2": one}), nproc=2) == []


def test_the_probe_reads_the_default_config_where_accelerate_does(tmp_path: Path, monkeypatch) -> None:
    from corral.agent.probes import accelerate_default_config

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert accelerate_default_config() is None
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text(GOOD)
    assert accelerate_default_config() == [str(tmp_path / "accelerate" / "default_config.yaml"), GOOD]


def test_a_yaml_alias_is_refused() -> None:
    with pytest.raises(ForeignConfigError, match="acc.yaml:2: uses a YAML alias"):
        parse("a: &x [1, 2]\nb: [*x, *x]\n", "acc.yaml")


def test_a_config_only_on_the_nodes_is_said_not_refused(tmp_path: Path) -> None:
    spec, notes = apply_imports(RunSpec(program="t.py", launcher="accelerate", run_id="r", workdir="/srv/p"),
                                Cluster(hosts=hosts(2)), config_file="acc.yaml", cwd=str(tmp_path), environ={},
                                home=tmp_path)
    assert spec.launcher_args == ("--config_file", "acc.yaml") and "not here, so not checked" in notes[0]
