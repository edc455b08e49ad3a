"""The CLI surface: every subcommand listed, and every flag frozen on purpose.

A new or renamed option changes tests/fixtures/cli_surface.json; regenerate
it with `UPDATE_CLI_SURFACE=1 pytest tests/test_cli.py` and review the diff
(README and docs must follow).
"""

from __future__ import annotations

import json
import os
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
