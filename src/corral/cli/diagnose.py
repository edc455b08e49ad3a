"""`corral diagnose` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="diagnose", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def diagnose() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral diagnose` is not implemented yet in this version of corral.")
