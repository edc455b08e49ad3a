"""`corral run` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="run", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def run() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral run` is not implemented yet in this version of corral.")
