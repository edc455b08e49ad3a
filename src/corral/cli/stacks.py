"""`corral stacks` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="stacks", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def stacks() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral stacks` is not implemented yet in this version of corral.")
