"""`corral hosts` through click's CliRunner, and the shared -c/-H options."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from corral.cli import cli
from corral.cli.common import ClusterOptions, cluster_options

FIX = Path(__file__).parent / "fixtures" / "inventory"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_hosts_json_from_hostfile(runner: CliRunner) -> None:
    result = runner.invoke(
        cli, ["hosts", "-c", str(FIX / "openmpi_hostfile"), "--no-resolve", "--json"]
    )
    data = _json(result)
    assert data["source"].startswith("hostfile ")
    assert [h["name"] for h in data["hosts"]] == ["node01", "node02", "node03", "node04", "node05"]
    assert [h["node_rank"] for h in data["hosts"]] == [0, 1, 2, 3, 4]
    node04 = data["hosts"][3]
    assert (node04["user"], node04["port"], node04["slots"]) == ("bob", 2222, None)
    assert result.stderr == ""  # hosts prints the source itself, no notice


def test_hosts_json_from_toml_keeps_env_values_out(runner: CliRunner) -> None:
    data = _json(runner.invoke(cli, ["hosts", "-c", str(FIX / "corral.toml"), "--no-resolve",
                                     "--json"]))
    assert data["name"] == "lab"
    gpu03 = data["hosts"][2]
    assert gpu03["address"] == "10.0.0.3"
    assert gpu03["workdir"] == "/data/proj" and data["hosts"][0]["workdir"] == "/srv/project"
    assert gpu03["env_keys"] == ["NCCL_DEBUG", "NCCL_SOCKET_IFNAME"]
    assert "WARN" not in json.dumps(data) and "eth0" not in json.dumps(data)


def test_hosts_table(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["hosts", "-H", "alice@gpu[1-2]:4,gpu3", "--no-resolve"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for word in ("rank", "host", "slots", "gpu1", "gpu2", "gpu3", "alice", "1/GPU"):
        assert word in out
    assert "source: --hosts alice@gpu[1-2]:4,gpu3" in out


def test_hosts_resolves_ssh_aliases(runner: CliRunner, tmp_path: Path) -> None:
    if shutil.which("ssh") is None:
        pytest.skip("needs the OpenSSH client")
    (tmp_path / "ssh_cfg").write_text("Host gpu1\n  HostName 10.9.8.7\n  Port 2022\n  User eve\n")
    (tmp_path / "lab.toml").write_text(
        '[cluster]\nssh_config = "ssh_cfg"\n[[hosts]]\nname = "gpu1"\n'
    )
    data = _json(runner.invoke(cli, ["hosts", "-c", str(tmp_path / "lab.toml"), "--json"]))
    assert data["ssh_config"] == str(tmp_path / "ssh_cfg")
    host = data["hosts"][0]
    assert (host["address"], host["port"], host["user"]) == ("10.9.8.7", 2022, "eve")
    unresolved = _json(runner.invoke(cli, ["hosts", "-c", str(tmp_path / "lab.toml"),
                                           "--no-resolve", "--json"]))["hosts"][0]
    assert (unresolved["address"], unresolved["port"], unresolved["user"]) == (None, None, None)


def test_hosts_defaults_to_this_machine(runner: CliRunner, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no nvidia-smi, no ssh needed
    data = _json(runner.invoke(cli, ["hosts", "--json"]))
    (host,) = data["hosts"]
    assert host["local"] is True and host["slots"] == 2 and host["address"] == "127.0.0.1"
    assert data["source"].startswith("this machine")


def test_hosts_reads_corral_cluster_env(runner: CliRunner, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CORRAL_CLUSTER", str(FIX / "deepspeed_hostfile"))
    data = _json(runner.invoke(cli, ["hosts", "--no-resolve", "--json"]))
    assert [h["name"] for h in data["hosts"]] == ["worker-1", "worker-2"]


def test_hosts_errors_are_reported_without_traceback(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["hosts", "-c", str(FIX / "bad_duplicate"), "--no-resolve"])
    assert result.exit_code == 2
    assert "bad_duplicate:5: duplicate host 'gpu1' (first defined on line 2)" in result.stderr
    assert "HINT:" in result.stderr
    assert "Traceback" not in result.output

    result = runner.invoke(cli, ["hosts", "-c", "x", "-H", "a"])
    assert result.exit_code == 2
    assert "cannot be used together" in result.stderr


def test_cluster_options_decorator_passes_options_and_notice(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[ClusterOptions] = []

    @click.command()
    @cluster_options
    @click.option("--flag", is_flag=True)
    def probe(cluster_opts: ClusterOptions, flag: bool) -> None:
        seen.append(cluster_opts)
        cluster = cluster_opts.load(resolve=False)
        click.echo(",".join(cluster.names))

    result = runner.invoke(probe, ["-H", "a,b", "--flag"])
    assert result.exit_code == 0, result.output
    assert seen == [ClusterOptions(cluster=None, hosts="a,b")]
    assert result.stdout == "a,b\n"
    assert "cluster: 2 hosts a,b from --hosts" in result.stderr  # the notice, on stderr
    help_text = runner.invoke(probe, ["--help"]).output
    assert "-c, --cluster FILE" in help_text and "-H, --hosts LIST" in help_text


def test_a_cloned_corral_toml_runs_no_command_until_trusted(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: `git clone` brings a corral.toml whose ProxyCommand would run
    here on the first plain `corral exec`/`run`.  Refused with the line; after
    `corral hosts --trust`, it is the user's choice."""
    marker = tmp_path / "proxycommand-ran"
    (tmp_path / "corral.toml").write_text(
        '[[hosts]]\nname = "gpu1"\n'
        f'ssh_options = ["ProxyCommand=touch {marker}", "ConnectTimeout=2"]\n'
    )
    monkeypatch.chdir(tmp_path)
    refused = runner.invoke(cli, ["exec", "--", "true"])
    assert refused.exit_code == 2, refused.output
    assert f'corral.toml:3: ssh_options = ["ProxyCommand=touch {marker}"' in refused.stderr
    assert "corral hosts --trust" in refused.stderr
    assert not marker.exists()
    trusted = runner.invoke(cli, ["hosts", "--trust", "--no-resolve"])
    assert trusted.exit_code == 0, trusted.output
    assert "trusted corral.toml as it is now" in trusted.stderr and "gpu1" in trusted.stdout
    runner.invoke(cli, ["exec", "--", "true"])
    assert marker.exists()  # trusted: ssh ran the user's ProxyCommand


def test_a_spare_host_has_no_node_rank(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[[hosts]]\nname = "g1"\nspare = true\n\n[[hosts]]\nname = "g[2-3]"\n')
    data = _json(runner.invoke(cli, ["hosts", "-c", str(tmp_path / "c.toml"), "--no-resolve", "--json"]))
    assert [(h["name"], h["node_rank"], h["spare"]) for h in data["hosts"]] == [
        ("g1", None, True), ("g2", 0, False), ("g3", 1, False)]
    table = runner.invoke(cli, ["hosts", "-c", str(tmp_path / "c.toml"), "--no-resolve"])
    assert re.search(r"spare\W+g1", table.output) and re.search(r"0\W+g2", table.output), table.output
