"""`corral runs` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="runs", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def runs() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral runs` is not implemented yet in this version of corral.")
