"""`corral bench` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def bench() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral bench` is not implemented yet in this version of corral.")
