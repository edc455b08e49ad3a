"""`corral ssh` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="ssh", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def ssh() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral ssh` is not implemented yet in this version of corral.")
