"""`corral export`: what corral knows, written out for tools that run without it.

Minimal group (issue 19's batch scripts): its only format here is `sbatch`,
from :mod:`corral.cli.export_sbatch`.
"""

from __future__ import annotations

import click

from corral.cli.export_sbatch import sbatch


@click.group(name="export")
def export() -> None:
    """Write what corral would run as files for tools without corral."""


export.add_command(sbatch)
