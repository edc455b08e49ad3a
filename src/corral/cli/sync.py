"""`corral sync` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="sync", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def sync() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral sync` is not implemented yet in this version of corral.")
