"""`corral doctor` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="doctor", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def doctor() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral doctor` is not implemented yet in this version of corral.")
