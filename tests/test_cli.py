"""The CLI surface: every subcommand listed, and every flag frozen on purpose.

A new or renamed option changes tests/fixtures/cli_surface.json; regenerate
it with `UPDATE_CLI_SURFACE=1 pytest tests/test_cli.py` and review the diff
(README and docs must follow).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from corral import __version__
from corral.cli import COMMANDS, cli

SURFACE = Path(__file__).parent / "fixtures" / "cli_surface.json"


def surface() -> dict:
    out = {}

    def walk(cmd: click.Command, path: str) -> None:
        out[path] = sorted(
            "/".join(sorted(p.opts + p.secondary_opts)) if isinstance(p, click.Option) else f"<{p.name}>"
            for p in cmd.params
        )
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), f"{path} {name}")

    walk(cli, "corral")
    return out


def test_help_lists_every_subcommand_with_one_line() -> None:
    res = CliRunner().invoke(cli, ["--help"])
    assert res.exit_code == 0
    for name in COMMANDS:
        assert f"  {name} " in res.output


def test_version() -> None:
    res = CliRunner().invoke(cli, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output


def test_every_command_has_help() -> None:
    for path in surface():
        args = path.split()[1:] + ["--help"]
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 0, (path, res.output)
        assert "Not implemented" not in res.output, path


def test_cli_surface_is_frozen() -> None:
    now = surface()
    if os.environ.get("UPDATE_CLI_SURFACE"):
        SURFACE.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    assert now == json.loads(SURFACE.read_text())


def _run_cli(tmp_path: Path, *args: str):
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        return CliRunner().invoke(cli, ["run", *args])
    finally:
        os.chdir(old)


def test_run_refuses_a_launcher_typed_as_the_program(tmp_path: Path) -> None:
    # `corral run python train.py` / `torchrun ... train.py`: told what to type
    # at once, not "python not found on node1 -- sync the project" later.
    for argv, says in ((["python3", "train.py", "--lr", "1"], "corral run train.py"),
                       (["torchrun", "--nproc_per_node", "2", "train.py"], "corral run train.py"),
                       (["accelerate", "launch", "train.py"], "--launcher accelerate"),
                       (["deepspeed", "train.py"], "--launcher deepspeed")):
        res = _run_cli(tmp_path, *argv)
        assert res.exit_code == 2, res.output
        assert "give the training script itself" in res.output and says in res.output
    # ... but a local file of that name, a path, -m, or the command launcher is taken as given.
    (tmp_path / "python").write_text("print(1)\n")
    res = _run_cli(tmp_path, "--dry-run", "python")
    assert res.exit_code == 0, res.output
    assert _run_cli(tmp_path, "--dry-run", "--launcher", "command", "python3", "x.py").exit_code == 0


def test_run_refuses_a_package_module_run_as_a_file(tmp_path: Path) -> None:
    # `corral run pkg/train.py` where train.py does `from .data import X`: every
    # rank would fail with "attempted relative import with no known parent
    # package"; told to run the module instead, before anything connects.
    pkg = tmp_path / "my pkg" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data.py").write_text("X = 1\n")
    (pkg / "train.py").write_text("import os\nfrom .data import X\nprint(X)\n")
    res = _run_cli(tmp_path / "my pkg", "--dry-run", "mypkg/train.py", "--lr", "3e-4")
    assert res.exit_code == 2, res.output
    assert "mypkg/train.py:2 imports relative to its package (from .data import X)" in res.output
    assert "corral run -m mypkg.train --lr 3e-4" in res.output
    # from elsewhere: the directory to run it from is named too
    res = _run_cli(tmp_path, "--dry-run", str(pkg / "train.py"))
    assert res.exit_code == 2 and f"--workdir '{tmp_path / 'my pkg'}' -m mypkg.train" in res.output, res.output
    # a --workdir that exists on the nodes only (--sync): this directory's copy is read
    res = _run_cli(tmp_path / "my pkg", "--dry-run", "--workdir", "/srv/nowhere", "mypkg/train.py")
    assert res.exit_code == 2 and "`corral run -m mypkg.train`" in res.output, res.output
    # -m, or a relative import the script guards itself, is left alone
    assert _run_cli(tmp_path / "my pkg", "--dry-run", "-m", "mypkg.train").exit_code == 0
    (pkg / "train.py").write_text("try:\n    from .data import X\nexcept ImportError:\n    from data import X\n")
    assert _run_cli(tmp_path / "my pkg", "--dry-run", "mypkg/train.py").exit_code == 0


def test_dry_run_names_each_nodes_ranks(tmp_path: Path) -> None:
    # one process per node read "ranks 0-0"
    res = _run_cli(tmp_path, "--dry-run", "-H", "nodea:1,nodeb:1", "t.py")
    assert res.exit_code == 0, res.output
    assert "nodea  rank 0  cwd" in res.output and "nodeb  rank 1  cwd" in res.output
    res = _run_cli(tmp_path, "--dry-run", "-H", "nodea:2,nodeb:2", "t.py")
    assert "nodea  ranks 0-1  cwd" in res.output and "nodeb  ranks 2-3  cwd" in res.output


def test_dry_run_masks_what_the_environment_rule_calls_a_secret(tmp_path: Path) -> None:
    """--dry-run used its own older rule: NCCL_AUTH's value was printed, and
    TOKENIZERS_PARALLELISM (a setting) was masked."""
    res = _run_cli(tmp_path, "--dry-run", "--json", "-H", "nodea:1", "--env", "NCCL_AUTH=hunter2",
                   "--env", "TOKENIZERS_PARALLELISM=false", "t.py")
    assert res.exit_code == 0, res.output
    [node] = json.loads(res.stdout)["nodes"]
    assert node["env"]["NCCL_AUTH"] == "***" and node["env"]["TOKENIZERS_PARALLELISM"] == "false"
    assert "hunter2" not in res.output


def test_run_refuses_launcher_args_corral_sets_itself(tmp_path: Path) -> None:
    """--standalone on a multi-node cluster waited 10 minutes for nodes that never came."""
    for launcher, arg, says in (("torchrun", "--standalone", "static rendezvous"),
                                ("torchrun", "--rdzv-backend=c10d", "static rendezvous"),
                                ("torchrun", "--nnodes=2", "cluster's hosts"),
                                ("torchrun", "--max_restarts=3", "--max-restarts N"),
                                ("accelerate", "--num-processes=3", "--nproc-per-node"),
                                ("deepspeed", "--master_port=1234", "--master-port")):
        res = _run_cli(tmp_path, "--dry-run", "--launcher", launcher, f"--launcher-arg={arg}", "t.py")
        assert res.exit_code == 2, res.output
        assert f"--launcher-arg {arg} conflicts" in res.output and says in res.output, res.output
    ok = _run_cli(tmp_path, "--dry-run", "--launcher-arg=--log-dir=/tmp/x", "t.py")
    assert ok.exit_code == 0, ok.output


def test_run_checks_env_flags_before_syncing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CORRAL_TEST_UNSET", raising=False)
    res = _run_cli(tmp_path, "--sync", "-e", "CORRAL_TEST_UNSET", "t.py")
    assert res.exit_code == 2 and "CORRAL_TEST_UNSET is not set" in res.output
    assert "sync" not in res.output.split("error")[0], res.output


def test_run_refuses_bad_workdir_ranks_and_directory_cluster(tmp_path: Path) -> None:
    res = _run_cli(tmp_path, "--workdir", "data", "t.py")
    assert res.exit_code == 2 and "is relative" in res.output and str(tmp_path / "data") in res.output
    res = _run_cli(tmp_path, "--ranks", "9-2", "t.py")
    assert res.exit_code == 2 and "empty range" in res.output
    (tmp_path / "cl").mkdir()
    (tmp_path / "cl" / "hostfile").write_text("localhost\n")
    res = _run_cli(tmp_path, "-c", str(tmp_path / "cl"), "t.py")
    assert res.exit_code == 2 and "is a directory" in res.output
    assert f"-c {tmp_path / 'cl' / 'hostfile'}" in res.output


def test_an_error_under_json_is_json_on_stdout_too(tmp_path: Path) -> None:
    """`corral ... --json | jq` gets the reason, not a parse error on empty input."""
    res = CliRunner().invoke(cli, ["stacks", "--json", "--runs-dir", str(tmp_path / "runs")])
    assert res.exit_code == 2
    err = json.loads(res.stdout)["error"]
    assert "no running run" in err["message"] and err["exit_code"] == 2 and err["hint"]
    res = _run_cli(tmp_path, "--json", "--launcher-arg=--standalone", "t.py")
    assert json.loads(res.stdout)["error"]["category"] == "user"
    # without --json, stdout stays empty
    res = CliRunner().invoke(cli, ["stacks", "--runs-dir", str(tmp_path / "runs")])
    assert res.exit_code == 2 and not res.stdout.strip()


def test_a_terminal_that_is_not_utf8_gets_escapes_not_a_traceback(tmp_path) -> None:
    # A head in a latin-1 locale (or PYTHONIOENCODING=ascii): `corral exec`
    # ended in a UnicodeEncodeError traceback on a node's CJK output, and
    # `corral run` dropped the ranks' lines with "failed to handle an event".
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    res = subprocess.run([sys.executable, "-m", "corral", "exec", "--", "echo '日本 é'"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, encoding="ascii", errors="strict", timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert "\\u65e5\\u672c \\xe9" in res.stdout and "Traceback" not in res.stderr


def test_a_usage_error_from_click_under_json_is_json_on_stdout(tmp_path: Path) -> None:
    """click's own parsing errors (missing PROGRAM, an option without its value)
    were text on stderr only: `corral run --json | jq` read empty input."""
    for argv, says in ((["run", "--json"], "Missing argument 'PROGRAM'"),
                       (["runs", "--json", "--limit"], "--limit"),
                       (["exec", "--json", "--timeout", "soon", "--", "true"], "soon"),
                       (["ssh", "check", "--json", "--bogus"], "--bogus")):
        res = CliRunner().invoke(cli, argv)
        assert res.exit_code == 2, (argv, res.output)
        err = json.loads(res.stdout)["error"]
        assert says in err["message"] and err["exit_code"] == 2 and err["category"] == "user", argv
        assert "--help" in err["hint"] and says in res.stderr, argv
    # without --json (or with it only after `--`, where it is not corral's), stdout stays empty
    for argv in (["run"], ["exec", "--timeout", "soon", "--", "echo", "--json"]):
        res = CliRunner().invoke(cli, argv)
        assert res.exit_code == 2 and not res.stdout.strip(), res.output
    # the console script too (not only CliRunner)
    res = subprocess.run([sys.executable, "-m", "corral", "run", "--json"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 2 and json.loads(res.stdout)["error"]["exit_code"] == 2, res.stderr


def _short_flags() -> dict[str, dict[str, str]]:
    """short flag -> {command: the long option it means}, hidden ones left out."""
    out: dict[str, dict[str, str]] = {}

    def walk(cmd: click.Command, path: str) -> None:
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                shorts = [o for o in p.opts + p.secondary_opts if not o.startswith("--")]
                longs = [o for o in p.opts + p.secondary_opts if o.startswith("--")]
                for s in shorts:
                    out.setdefault(s, {})[path] = longs[0] if longs else s
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), f"{path} {name}".strip())

    walk(cli, "")
    return out


def test_a_short_flag_means_one_thing_in_every_command() -> None:
    # -n was --nproc-per-node in run and bench, --dry-run in sync, --limit in runs.
    # One exception, each side the habit of its own tools: `exec -f` is pdsh's
    # fan-out, `logs -f` is tail's, journalctl's and kubectl's follow.
    flags = _short_flags()
    assert flags["-f"] == {"exec": "--fanout", "logs": "--follow"}
    for short, meanings in flags.items():
        assert short == "-f" or len(set(meanings.values())) == 1, (short, meanings)
    from corral.export import FORMATS

    assert _short_flags()["-n"] == {"run": "--nproc-per-node", "bench": "--nproc-per-node",
                                    "submit": "--nproc-per-node",
                                    **{f"export {n}": "--nproc-per-node" for n, f in FORMATS.items()
                                       if f.program != "none"}}
    # the old ones are refused with the long name to type, not taken for something else
    for argv, says in ((["sync", "-n"], "say --dry-run"), (["runs", "-n", "3"], "say --limit N")):
        res = CliRunner().invoke(cli, argv)
        assert res.exit_code == 2 and says in res.output, res.output


def test_ssh_check_and_teardown_help_describe_only_what_they_use() -> None:
    check = CliRunner().invoke(cli, ["ssh", "check", "--help"]).output
    assert "password" not in check.replace("wants a password", "")  # check never logs in by password
    assert "to install" not in check
    teardown = CliRunner().invoke(cli, ["ssh", "teardown", "--help"]).output
    assert "to install" not in teardown and "--password-stdin" in teardown
    assert "to install" in CliRunner().invoke(cli, ["ssh", "setup", "--help"]).output


def test_an_error_quoting_a_node_reaches_the_terminal_without_its_controls(monkeypatch) -> None:
    # ssh's stderr (or a node's fatal message) is quoted in the error; an
    # OSC 52 there wrote the user's clipboard through print_error (rich
    # drops BEL but not ESC).
    import io

    from corral import ui
    from corral.model import Host
    from corral.transport.ssh import classify_ssh_failure

    err = classify_ssh_failure(Host(name="gpu2"), 255,
                               "ssh: \x1b]52;c;cHduZWQ=\x07\x1b]0;owned\x1b\\\x1b[31mboom\x1b[0m")
    shown = io.StringIO()
    monkeypatch.setattr(sys, "stderr", shown)
    ui.print_error(err)
    text = shown.getvalue()
    assert "gpu2: ssh failed: " in text and "boom" in text
    assert "\x1b]" not in text and "owned" not in text and "cHduZWQ" not in text


def test_a_notice_quoting_a_node_reaches_the_terminal_without_its_controls(monkeypatch) -> None:
    # `corral bench --json` says a finding (which may quote a node) as a notice.
    import io

    from corral import ui

    shown = io.StringIO()
    monkeypatch.setattr(sys, "stderr", shown)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    ui.notice("error: gpu2: \x1b]0;owned\x07\x1b]52;c;cHduZWQ=\x1b\\\x1b[31mlink down\x1b[0m")
    assert shown.getvalue() == "corral: error: gpu2: \x1b[31mlink down\x1b[0m\n"


# ---------------------------------------------------------------------------
# Versioned --json documents (docs/json.md)

#: One cheap invocation per command with --json (run in an empty directory
#: holding t.py and log.txt, on this machine).  A new --json command must be
#: added here: the test below fails until it is.
_JSON_RUNS: dict[str, list[str]] = {
    "corral hosts": ["hosts", "--json"],
    "corral run": ["run", "--json", "--launcher", "command", "true"],
    "corral exec": ["exec", "--json", "--", "true"],
    "corral runs": ["runs", "--json"],
    "corral doctor": ["doctor", "--json", "--no-smoke", "--no-torch", "--no-ssh", "--no-links"],
    "corral bench": ["bench", "--json", "--no-links", "--no-allreduce"],  # an error document
    "corral diagnose": ["diagnose", "--json", "log.txt"],
    "corral stacks": ["stacks", "--json"],  # no running run: an error document
    "corral ssh setup": ["ssh", "setup", "--json"],  # this machine: an error document
    "corral ssh check": ["ssh", "check", "--json"],
    "corral ssh teardown": ["ssh", "teardown", "--json"],
    "corral sync": ["sync", "--json", "--dry-run"],
    "corral sandbox up": ["sandbox", "up", "--json", "0"],  # an error document
    "corral sandbox status": ["sandbox", "status", "--json", "--name", "ghost", "--state-dir", "st"],
    "corral sandbox down": ["sandbox", "down", "--json", "--name", "ghost", "--state-dir", "st"],
    "corral sandbox list": ["sandbox", "list", "--json"],
    "corral check": ["check", "--json", "job.sbatch"],
    "corral ps": ["ps", "--json"],
    "corral top": ["top", "--json"],  # no run here: an error document
    **{f"corral export {f}": ["export", f, "--json", "-H", "localhost:2", "t.py"]
       for f in ("accelerate", "deepspeed", "torchrun", "mpi")},
    **{f"corral export {f}": ["export", f, "--json", "-H", "localhost:2"] for f in ("pdsh", "ssh-config")},
}


def test_every_json_document_carries_its_schema_version(tmp_path: Path, monkeypatch) -> None:
    """`--json` output is an interface: each document says which one it is
    (`corral.hosts/1`), so a script can check what it reads.  Every command
    with --json is run and its document checked, errors included."""
    from corral.cli.common import JSON_SCHEMAS

    with_json = {path for path, params in surface().items() if "--json" in params}
    assert with_json == set(_JSON_RUNS), "add the new --json command to _JSON_RUNS"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print(1)\n")
    (tmp_path / "log.txt").write_text("RuntimeError: NCCL error: unhandled system error\n")
    (tmp_path / "job.sbatch").write_text("#!/bin/bash\n#SBATCH --nodes=2\nsrun python t.py\n")
    known = {f"corral.{name}/{version}" for name, version in JSON_SCHEMAS.items()}
    seen = set()
    for path, argv in _JSON_RUNS.items():
        res = CliRunner().invoke(cli, argv)
        doc = json.loads(res.stdout)
        assert isinstance(doc, dict) and doc.get("schema") in known, (path, res.stdout[:300])
        assert (doc["schema"] == "corral.error/1") == (res.exit_code == 2), (path, res.output[-500:])
        seen.add(doc["schema"])
    assert {"corral.hosts/1", "corral.run/1", "corral.exec/1", "corral.export/1", "corral.error/1"} <= seen
    res = CliRunner().invoke(cli, ["run", "--dry-run", "--json", "t.py"])
    assert json.loads(res.stdout)["schema"] == "corral.run.plan/1"


def test_json_goes_out_through_one_helper_and_is_documented() -> None:
    """No command prints JSON of its own (it would lack the schema field), and
    docs/json.md has a section for every document."""

    from corral.cli.common import JSON_SCHEMAS

    cli_dir = Path(__file__).resolve().parents[1] / "src" / "corral" / "cli"
    own = [p.name for p in cli_dir.glob("*.py")
           if p.name != "common.py" and re.search(r"(echo|print)\(\s*json\.dumps", p.read_text())]
    assert own == [], f"print --json documents with common.emit_json: {own}"
    doc = (Path(__file__).resolve().parents[1] / "docs" / "json.md").read_text()
    for name, version in JSON_SCHEMAS.items():
        assert re.search(rf"^#+ .*`corral\.{re.escape(name)}/{version}`", doc, re.M), name


def test_shell_completion_scripts_for_bash_zsh_and_fish() -> None:
    """README's completion lines: `_CORRAL_COMPLETE=<shell>_source corral`
    prints the script, and completing a word lists corral's commands
    (export's formats too)."""
    corral = [sys.executable, "-m", "corral"]
    for shell, marker in (("bash", "complete -o nosort -F _corral_completion corral"),
                          ("zsh", "#compdef corral"), ("fish", "complete --no-files --command corral")):
        res = subprocess.run(corral, env=dict(os.environ, _CORRAL_COMPLETE=f"{shell}_source"),
                             capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 0 and marker in res.stdout, (shell, res.stdout[-500:], res.stderr[-500:])
    env = dict(os.environ, _CORRAL_COMPLETE="bash_complete", COMP_WORDS="corral export d", COMP_CWORD="2")
    res = subprocess.run(corral, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert res.stdout.split() == ["plain,deepspeed"], res.stdout
