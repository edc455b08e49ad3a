"""`corral hosts` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="hosts", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def hosts() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral hosts` is not implemented yet in this version of corral.")
