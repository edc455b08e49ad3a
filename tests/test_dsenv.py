"""``.deepspeed_env``: DeepSpeed's runner's files, lines and quoting, applied by corral."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.agent.jobenv import fill_env_refs
from corral.errors import ForeignConfigError
from corral.interop.dsenv import load, parse
from corral.model import Cluster, Host
from corral.run.plan import NodeFacts, RunSpec, build_plan


def values(text: str) -> dict:
    return {v.name: v for v in parse(text, ".deepspeed_env")}


def test_lines_split_at_the_first_equals_and_stripped_as_deepspeed_does() -> None:
    v = values("NCCL_DEBUG=INFO\n  NCCL_SOCKET_IFNAME = eth0 \nXLA_FLAGS=--a=b\n\n# a comment\n")
    assert {k: x.literal for k, x in v.items()} == {
        "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "XLA_FLAGS": "--a=b"}
    assert v["NCCL_SOCKET_IFNAME"].source == ".deepspeed_env:2"


@pytest.mark.parametrize("line, parts", [
    # DeepSpeed double-quotes these; the node's shell fills in its own variables
    ("LD_LIBRARY_PATH=/opt/ds:$LD_LIBRARY_PATH", (("lit", "/opt/ds:"), ("var", "LD_LIBRARY_PATH"))),
    ("P=${HOME}/x", (("var", "HOME"), ("lit", "/x"))),
    # quotes in the file: `export HF_HOME=""/data/hf""` is /data/hf
    ('HF_HOME="/data/hf"', (("lit", "/data/hf"),)),
    ("NAME=a b", (("lit", "a b"),)),  # `export NAME="a b"`: spaces kept
    ("X='$HOME'", (("lit", "'"), ("var", "HOME"), ("lit", "'"))),  # inside DeepSpeed's "...": literal '
    ("PRICE=5$", (("lit", "5$"),)),
    (r"E=a\$b", (("lit", "a$b"),)),
])
def test_values_are_what_the_nodes_shell_makes_of_deepspeeds_quoting(line: str, parts: tuple) -> None:
    assert values(line)[line.split("=")[0]].parts == parts


@pytest.mark.parametrize("line, said", [
    ("X=$(hostname)", "run a command"),
    ("X=`id`", "run a command"),
    ('HF_HOME="/data/hf cache"', "outside quotes"),  # DeepSpeed exports HF_HOME=/data/hf and `cache`
    ('X="a', "unclosed"),
    ("X=${HOME:-/root}", "only $NAME"),
    ("export X=1", "is not NAME=VALUE"),
    ("just a line", "is not NAME=VALUE"),
])
def test_what_a_shell_would_do_beyond_filling_in_is_named_with_its_line(line: str, said: str) -> None:
    with pytest.raises(ForeignConfigError) as e:
        parse("OK=1\n" + line + "\n", ".deepspeed_env")
    assert e.value.message.startswith(".deepspeed_env:2: ") and said in e.value.message


def test_quoted_value_with_a_space_gets_the_unquoted_line_as_its_fix() -> None:
    with pytest.raises(ForeignConfigError) as e:
        parse('HF_HOME="/data/hf cache"\n', "f")
    assert e.value.hint.startswith("write HF_HOME=/data/hf cache")


def test_home_then_current_directory_the_later_file_wins(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "proj"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=WARN\nA=1\n")
    (cwd / ".deepspeed_env").write_text("B=2\nNCCL_DEBUG=INFO\n")
    env = load({}, home, cwd)
    assert env.files == ("~/.deepspeed_env", "./.deepspeed_env")
    assert [(v.name, v.literal) for v in env.values] == [("NCCL_DEBUG", "INFO"), ("A", "1"), ("B", "2")]
    assert "NCCL_DEBUG, A, B" in env.summary()


def test_ds_env_file_names_another_file(tmp_path: Path) -> None:
    (tmp_path / "mine.env").write_text("A=1\n")
    (tmp_path / ".deepspeed_env").write_text("B=2\n")
    env = load({"DS_ENV_FILE": str(tmp_path / "mine.env")}, tmp_path / "nohome", tmp_path)
    assert [v.name for v in env.values] == ["A"] and len(env.files) == 1
    assert not load({}, tmp_path / "nohome", tmp_path / "nowhere")


def _plan(ds_env, cluster_env=None, env=None, head_env=None):
    c = Cluster(hosts=(Host(name="n1", slots=1), Host(name="n2", slots=1)), env=cluster_env or {})
    spec = RunSpec(program="t.py", launcher="deepspeed", ds_env=ds_env, env=env or {}, run_id="r")
    return build_plan(c, spec, {h.name: NodeFacts() for h in c.hosts}, master_addr="10.0.0.1",
                      master_port=29500, head_env=head_env or {}, head_cwd="/p")


def test_precedence_allow_list_then_file_then_cluster_file_then_env_flag(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text(
        "NCCL_DEBUG=INFO\nNCCL_IB_DISABLE=1\nNCCL_SOCKET_IFNAME=eth0\nLD_LIBRARY_PATH=/opt/ds:$LD_LIBRARY_PATH\n"
        "NCCL_ALGO=$NCCL_PROTO\n")
    ds = load({}, tmp_path / "h", tmp_path)
    p = _plan(ds, cluster_env={"NCCL_IB_DISABLE": "0"}, env={"NCCL_SOCKET_IFNAME": "ib0", "NCCL_ALGO": "Ring"},
              head_env={"NCCL_DEBUG": "WARN", "LD_LIBRARY_PATH": "/head/lib", "NCCL_P2P_DISABLE": "1"})
    env = p.nodes[1].env
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_P2P_DISABLE"] == "1"
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_SOCKET_IFNAME"] == "ib0" and env["NCCL_ALGO"] == "Ring"
    # the head's LD_LIBRARY_PATH is not the node's: the node fills in its own
    assert "LD_LIBRARY_PATH" not in env
    assert p.nodes[1].env_refs == (("LD_LIBRARY_PATH", (("lit", "/opt/ds:"), ("var", "LD_LIBRARY_PATH"))),)
    node = {"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}
    fill_env_refs(node, [[k, [list(x) for x in parts]] for k, parts in p.nodes[1].env_refs])
    assert node["LD_LIBRARY_PATH"] == "/opt/ds:/usr/local/cuda/lib64"


def test_dry_run_says_and_shows_it(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    (tmp_path / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\nLD_LIBRARY_PATH=/opt/ds:$LD_LIBRARY_PATH\n"
                                             "WANDB_API_KEY=abc\n")
    (tmp_path / "t.py").write_text("print(1)\n")
    argv = [sys.executable, "-m", "corral", "run", "--dry-run", "-H", "localhost:2", "--launcher", "deepspeed"]
    res = subprocess.run([*argv, "--json", "t.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=os.environ)
    assert res.returncode == 0, res.stderr
    assert "applying ./.deepspeed_env to every node, as DeepSpeed's runner does: NCCL_DEBUG, LD_LIBRARY_PATH, " \
           "WANDB_API_KEY" in res.stderr
    node = json.loads(res.stdout)["nodes"][0]
    assert node["env"]["NCCL_DEBUG"] == "INFO" and node["env"]["WANDB_API_KEY"] == "***"
    assert node["env_from_node"] == {"LD_LIBRARY_PATH": "/opt/ds:${LD_LIBRARY_PATH}"}
    res = subprocess.run([*argv, "t.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=os.environ)
    shown = " ".join(res.stdout.split())  # (the table wraps at 80 columns)
    assert "LD_LIBRARY_PATH /opt/ds:${LD_LIBRARY_PATH} (filled in on the node)" in shown and "abc" not in shown
    # torchrun does not read it (DeepSpeed's runner is what applies it)
    res = subprocess.run([*argv[:-2], "--json", "t.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env=os.environ)
    assert "NCCL_DEBUG" not in json.loads(res.stdout)["nodes"][0]["env"]


def test_contract_variables_in_the_file_are_said_not_applied(tmp_path: Path) -> None:
    from corral.run.imports import apply_imports

    (tmp_path / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\nMASTER_PORT=29999\n")
    c = Cluster(hosts=(Host(name="n1", slots=1), Host(name="n2", slots=1)))
    spec, notes = apply_imports(RunSpec(program="t.py", launcher="deepspeed", run_id="r"), c, config_file=None,
                                cwd=str(tmp_path), environ={}, home=tmp_path / "h")
    assert notes[1].startswith("MASTER_PORT (./.deepspeed_env:2): set by corral for every node, so not applied")
    p = build_plan(c, spec, {h.name: NodeFacts() for h in c.hosts}, master_addr="10.0.0.1", master_port=29500,
                   head_env={}, head_cwd=str(tmp_path))
    assert p.nodes[0].env["MASTER_PORT"] == "29500" and p.nodes[0].env["NCCL_DEBUG"] == "INFO"
