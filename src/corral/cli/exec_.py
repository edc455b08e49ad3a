"""`corral exec` (not implemented yet in this version)."""

import click

from corral.errors import NotImplementedYet


@click.command(name="exec", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def exec_() -> None:
    """Not implemented yet in this version of corral."""
    raise NotImplementedYet("`corral exec` is not implemented yet in this version of corral.")
