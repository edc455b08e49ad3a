"""`corral sandbox` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="sandbox", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def sandbox() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral sandbox` is not implemented yet in this version of corral.")
