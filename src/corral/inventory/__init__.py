"""Read what users already have into one ``corral.model.Cluster``.

Formats (one module each): DeepSpeed/OpenMPI/MPICH hostfiles and Horovod-style
``-H`` lists (``hostfile``), ``corral.toml`` (``tomlfile``), a Slurm
allocation (``slurm``), ssh_config aliases (``sshconfig``) and this machine
(``local``).  ``load_cluster`` picks one by the documented precedence and
says which, so a run never silently lands on the wrong machines.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.errors import UsageError
from corral.hostrange import fold
from corral.inventory._common import display_path, read_text
from corral.model import Cluster

if TYPE_CHECKING:
    from corral.inventory.hostfile import parse_hostfile, parse_hosts_arg, read_hostfile
    from corral.inventory.local import count_gpus, local_cluster
    from corral.inventory.slurm import read_slurm
    from corral.inventory.sshconfig import resolve_ssh, ssh_g_argv
    from corral.inventory.tomlfile import read_corral_toml

# The readers are imported when first used, not with this package: `corral
# exec -c hostfile` needs neither tomllib, nor ssh -G's thread pool, nor
# nvidia-smi detection (PEP 562 module __getattr__ keeps the names importable).
_LAZY = {
    "parse_hostfile": "hostfile",
    "parse_hosts_arg": "hostfile",
    "read_hostfile": "hostfile",
    "count_gpus": "local",
    "local_cluster": "local",
    "in_slurm_allocation": "slurm",
    "read_slurm": "slurm",
    "resolve_ssh": "sshconfig",
    "ssh_g_argv": "sshconfig",
    "read_corral_toml": "tomlfile",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CLUSTER_ENV",
    "DEFAULT_FILE",
    "count_gpus",
    "describe",
    "load_cluster",
    "local_cluster",
    "parse_hostfile",
    "parse_hosts_arg",
    "read_cluster_file",
    "read_corral_toml",
    "read_hostfile",
    "read_slurm",
    "resolve_ssh",
    "ssh_g_argv",
]

#: Environment variable naming a default cluster file (like ``-c``).
CLUSTER_ENV = "CORRAL_CLUSTER"
#: Cluster file picked up from the current directory.
DEFAULT_FILE = "corral.toml"

# A line that only TOML would write: a [table] header or key = value.
_TOML_LINE = re.compile(
    r"""^\s*(\[\[?\s*[A-Za-z_][\w.-]*\s*\]\]?"""  # [table] or [[array]]
    r"""|[A-Za-z_][\w-]*\s*=\s*["'\[{\dtf])"""  # key = "str" / [..] / {..} / 1 / true
)


def load_cluster(
    *,
    cluster: str | None,
    hosts: str | None,
    cwd: Path,
    environ: Mapping[str, str],
) -> tuple[Cluster, str]:
    """Find the cluster the user means, and a one-line notice saying where from.

    Precedence: ``-H/--hosts``, then ``-c/--cluster FILE`` (default
    ``$CORRAL_CLUSTER``), then ``./corral.toml``, then the Slurm allocation
    this runs in, then this machine.  Giving both ``-H`` and ``-c`` is an
    error: silently preferring one would run on machines the user did not
    expect.
    """
    if hosts is not None and cluster is not None:
        raise UsageError(
            "-H/--hosts and -c/--cluster cannot be used together",
            hint="give the hosts one way: a list with -H, or a file with -c",
        )
    if hosts is not None:
        from corral.inventory.hostfile import parse_hosts_arg

        found = parse_hosts_arg(hosts)
        return found, _notice(found, "--hosts")
    if cluster is None and environ.get(CLUSTER_ENV):
        path = Path(environ[CLUSTER_ENV]).expanduser()
        found = read_cluster_file(path if path.is_absolute() else cwd / path, cwd=cwd)
        return found, _notice(found, f"{found.source} (from ${CLUSTER_ENV})")
    if cluster is not None:
        path = Path(cluster).expanduser()
        found = read_cluster_file(path if path.is_absolute() else cwd / path, cwd=cwd)
        return found, _notice(found, found.source)
    default = cwd / DEFAULT_FILE
    if default.exists() or default.is_symlink():  # not a file: named, never skipped
        from corral.inventory.tomlfile import read_corral_toml

        found = read_corral_toml(default, label=display_path(default, cwd), implicit=True)
        return found, _notice(found, f"{found.source} (found in the current directory)")
    from corral.inventory.slurm import in_slurm_allocation, read_slurm

    if in_slurm_allocation(environ):
        found = read_slurm(environ)
        return found, _notice(found, found.source)
    from corral.inventory.local import local_cluster

    found = local_cluster()
    return found, "no cluster given; using " + found.source


def read_cluster_file(path: Path, *, cwd: Path | None = None) -> Cluster:
    """Read ``path`` as a corral.toml (``.toml``, or TOML-looking) or a hostfile."""
    label = display_path(path, cwd)
    if path.suffix == ".toml":
        from corral.inventory.tomlfile import read_corral_toml

        return read_corral_toml(path, label=label)
    text = read_text(path, label=label, what="cluster file")
    if _looks_like_toml(text):
        from corral.inventory.tomlfile import read_corral_toml

        return read_corral_toml(path, label=label)
    from corral.inventory.hostfile import read_hostfile

    return read_hostfile(path, label=label)


def _looks_like_toml(text: str) -> bool:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return bool(_TOML_LINE.match(line))
    return False


def describe(cluster: Cluster) -> str:
    """``4 hosts gpu[01-04]``: a cluster's size and folded names."""
    n = len(cluster.hosts)
    return f"{n} host{'s' if n != 1 else ''} {fold(cluster.names)}"


def _notice(cluster: Cluster, where: str) -> str:
    return f"cluster: {describe(cluster)} from {where}"
